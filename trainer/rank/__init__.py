"""One rank's training, top to bottom (each rank runs this; the job process never does):

- main.py: the entry point of every rank (`rank_main`) and how ranks start (the fork server);
- loop.py: the training loop;
- experts.py: `parallel.ep`: each rank's experts sharded over the data-parallel group, left alone by FSDP2;
- trainee.py: what the rank trains with (model, optimizer, schedule, scaler);
- mesh.py: the job's one device mesh, built from its layout (trainer/layout.py); each technique's sub-mesh;
- parallelize.py: the one ordered sequence of transforms (fp8, TP, kernels, checkpointing, compile, ZeRO) applied
  to the whole model or to each pipeline stage;
- sharding.py: the ZeRO stages on DDP, ZeroRedundancyOptimizer and FSDP2; offload;
- tensor_parallel.py: tensor and sequence parallelism (parallel.tp, parallel.sp) on the mesh's tp dim;
- pipeline.py: pipeline parallelism (parallel.pp): each rank's stages, the schedule, idle time and bytes sent;
- compression.py: DDP's gradient compression hooks (PowerSGD, TopK) and local SGD;
- precision.py: autocast, FSDP2's MixedPrecisionPolicy, the loss scaler;
- refusals.py: what the ranks would refuse (DDP's bf16 hook off CUDA, fp8's limits), checked in the job process;
- optim.py: AdamW, its ZeRO-1 sharding, the schedule, clipping;
- nvme.py: offload=nvme's AdamW, its moments in a file per rank streamed through a bounded buffer;
- evaluate.py: the held-out loss (`loss/val`) every eval.every steps;
- nonfinite.py: the non-finite policy, agreed by every rank before each step;
- spikes.py: loss spikes (stability.spike), folded into that agreement: log, skip or roll back to the last save;
- preload.py: what the fork server imports before it forks the ranks.
"""
