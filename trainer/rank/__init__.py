"""One rank's training, top to bottom (each rank runs this; the job process never does):

- loop.py: the training loop;
- trainee.py: what the rank trains with (model, optimizer, schedule, scaler);
- sharding.py: the ZeRO stages on DDP, ZeroRedundancyOptimizer and FSDP2; offload;
- precision.py: autocast, FSDP2's MixedPrecisionPolicy, the loss scaler;
- optim.py: AdamW, its ZeRO-1 sharding, the schedule, clipping;
- nonfinite.py: the non-finite policy, agreed by every rank before each step;
- cuda.py: what a rank sets up on a CUDA device;
- preload.py: what the fork server imports before it forks the ranks.
"""
