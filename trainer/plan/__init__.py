"""The memory plan: what each rank will hold, and when, known before any rank starts.

The plan walks one optimizer step as a list of moments (the last block's forward, the loss,
the output head's backward, the start, end and reduce-scatter of each block's backward, the
optimizer step), adds up the tensors alive at each, and calls the largest the peak. Every
figure is exact arithmetic on the parameter shapes of the model built on the meta device;
nothing is allocated. checks/plan_accuracy.py checks it against real runs.

The planner is this package; each module's docstring is its part of the design note:

- states.py: model states per rank, the ZeRO arithmetic as PyTorch keeps it (FSDP2's padded
  shards, ZeroRedundancyOptimizer's greedy split), from the model's shapes;
- the walk of one step, one technique per module (the design: docs/memory_plan.md, "What is
  modelled"):
  - activations.py: the activation table, what autograd saves per block and after the blocks, by
    precision, attention kernel, checkpointing mode and device kind;
  - moments.py: a moment and what it is computed from, and the temporaries both walks count
    alike (a block's backward, Adam's step, accumulation, the tensors outside the model);
  - loss.py: the loss's moments and temporaries, full and chunked;
  - fp8_backward.py: precision=fp8's float8 casts in w2's backward (torchao's eager casts);
  - ddp_walk.py: the DDP step (stages 0-1);
  - replica_walk.py: a step without DDP, one data-parallel replica (a tensor-parallel model at dp = 1, a
    one-rank job): plain gradients made block by block;
  - tp_walk.py: what tensor parallelism adds to it: loss_parallel's and sequence parallelism's temporaries;
  - fsdp_walk.py: the FSDP2 step (stages 2-3): forward, loss, the root's backward, the kinds of
    micro-batch zero.reshard_after_backward=false makes;
  - fsdp_blocks.py: FSDP2's block backward, one function per moment over a per-block record;
  - fsdp_buffers.py: FSDP2's buffers (unsharded copies, all-gather and reduce-scatter buffers,
    hpZ's secondary shards) and what gradient accumulation holds beside them;
- build.py: the plan of a job, every rank's moments and its peak, the memory a rank may use,
  what plan.json and summary.json carry;
- headroom.py: a CUDA rank's memory beyond its tensors (context, NCCL, allocator), assumed
  until the GPU check measures it;
- comm.py: the bytes each rank's collectives move per optimizer step (docs/communication.md);
- tensor_parallel.py: parallel.tp in the plan: the layers one TP rank holds, the tp group's bytes;
- pipeline.py: parallel.pp in the plan: the split into stages, what each schedule holds in flight (torch's
  own orders), the send/recv buffers, the bubble, the bytes between stages;
- pipeline_walk.py: the walk of one pipeline rank's step, its stage's moments;
- context_parallel.py: parallel.cp in the plan: ZeRO over dp x cp, one rank's step at T / cp positions, what
  each exchange (ulysses, allgather) adds to a block's saved set, the rows, rotary tables and masks it holds;
- moe.py: a mixture of experts in the plan (model.n_experts > 0): the rows each expert takes under moe.imbalance,
  what an MoE layer saves (router, dispatched rows, each expert's hidden tensors, combine) and the peak of its
  experts' backward (the stacked weights' whole gradients, summed expert by expert);
- groups.py: the process groups a job's collectives run in (HSDP's shard and replicate groups),
  and which link each one crosses;
- target.py: the device kind and world size a plan is for;
- schedule.py: the plan of each step where steps differ (PowerSGD before its start step, local SGD's
  averaging and quiet steps), and which steps the memory plan's peak describes;
- host.py: the host memory of a node: its ranks' runtime, CPU ranks' tensors, offloaded states;
- disk.py: offload=nvme: Adam's moments in a file per rank, the files' size, the bytes a step reads and
  writes, the stall at the disk's bandwidth (plan.disk_gbps or measured), and the refusals of offload.path;
- refusal.py: the refusal of a plan that does not fit (a rank's device, a node's host), and its way out;
- table.py: what the user reads, the console report (a sweep's fit table is a report:
  trainer/report/fit_table.py).

The names other modules use are imported from `trainer.plan` itself.
"""

from trainer.plan.build import (
    COMPILE_NOTE,
    PREDICTED_GROUP_KEYS,
    RANK_FIGURES,
    DeviceMemory,
    Plan,
    RankPlan,
    build_plan,
    describe,
    device_memory,
    summary_fields,
    write_plan,
)
from trainer.plan.comm import (
    COLLECTIVES,
    MIN_COMPRESSION_RATE,
    PARAM_BYTES,
    REDUCE_BYTES,
    CommPlan,
    forward_gathers,
    plan_comm,
    reductions,
    topk_count,
)
from trainer.plan.disk import DiskPlan, check_offload_path, measure_disk
from trainer.plan.groups import GROUPS, INTRA_NODE, LINKS, NETWORK, ShardGroups, shard_groups
from trainer.plan.headroom import HEADROOM
from trainer.plan.host import HostPlan, cores_warning
from trainer.plan.moe import expert_shard_dim  # the dim FSDP2 shards experts on, run and plan alike
from trainer.plan.pipeline import bubble as pipeline_bubble
from trainer.plan.pipeline import stage_blocks  # trainer/model/pipeline_split.py's, the ranks' own split
from trainer.plan.refusal import cause_of, host_refusal, refusal, way_out
from trainer.plan.schedule import StepSchedule
from trainer.plan.states import model_shape
from trainer.plan.table import format_plan, verdict
from trainer.plan.target import planned_device_kind, planned_world_size
from trainer.plan.tensor_parallel import tp_local_model  # one TP rank's decoder: the plan's and the advisor's

__all__ = [
    "COLLECTIVES",
    "COMPILE_NOTE",
    "HEADROOM",
    "PREDICTED_GROUP_KEYS",
    "GROUPS",
    "INTRA_NODE",
    "LINKS",
    "NETWORK",
    "shard_groups",
    "ShardGroups",
    "forward_gathers",
    "reductions",
    "RANK_FIGURES",
    "CommPlan",
    "DeviceMemory",
    "DiskPlan",
    "Plan",
    "RankPlan",
    "build_plan",
    "check_offload_path",
    "cores_warning",
    "describe",
    "device_memory",
    "expert_shard_dim",
    "format_plan",
    "HostPlan",
    "host_refusal",
    "measure_disk",
    "model_shape",
    "plan_comm",
    "topk_count",
    "tp_local_model",
    "MIN_COMPRESSION_RATE",
    "PARAM_BYTES",
    "REDUCE_BYTES",
    "cause_of",
    "planned_device_kind",
    "planned_world_size",
    "pipeline_bubble",
    "stage_blocks",
    "refusal",
    "summary_fields",
    "verdict",
    "way_out",
    "write_plan",
    "StepSchedule",
]
