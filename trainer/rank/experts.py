"""parallel.ep > 1: expert parallelism, each rank of the ep group holding n_experts / ep whole experts.

The ep group here is ZeRO's data-parallel group (parallel.ep equal to its ranks, dp x cp under parallel.cp;
trainer/layout.py): the one FSDP2 shards over (zero=stage2/3), or DDP's replicas (zero=stage0; stage1 is refused
by the composition table: ZeroRedundancyOptimizer would partition and broadcast the experts). So each expert weight becomes a DTensor
sharded on dim 0 (the expert dim) over that one mesh dim, as torchtitan's ExpertParallel makes it, and every
rank's tokens reach it through the all-to-all (trainer/model/moe.py `dispatch_to_experts`). The experts are
sharded already, each rank holding whole experts of its own, so ZeRO is told to leave them alone: FSDP2's
`ignored_params`, or DDP's list of parameters to ignore (trainer/rank/sharding.py, through
trainer/private_apis/of_torch.py `ddp_ignore_params`), which keeps them out of its init broadcast, its buckets and
its all-reduce. Under FSDP2 the optimizer, gradient clipping and torch.distributed.checkpoint see one kind of
DTensor over one mesh; under DDP the experts are DTensors beside plain tensors, which torch's foreach norm
refuses in one list, so trainer/rank/optim.py `clip_gradients` norms the two kinds apart (the experts' over
every rank) and adds them.

What ZeRO would have done for those parameters is done in the model (trainer/model/moe.py `MeanOverRanks`):
their gradient is the sum of every rank's contribution (each rank's loss is its own tokens' mean), so it is
divided by the data-parallel ranks, as FSDP2's reduce-scatter and DDP's all-reduce average the others'
(torchtitan sets FSDP2's gradient divide factor for the same reason).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.model.moe import ExpertGroup, moe_layers


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Shard every MoE layer's experts over `mesh` (1-D, the ep group) on their expert dim, on the meta
    device; returns the expert parameters, which FSDP2 or DDP must ignore."""
    group = ExpertGroup(mesh.get_group(), mesh.size(), mesh.get_local_rank())
    experts: set[nn.Parameter] = set()
    for layer in moe_layers(model):
        for name, param in list(layer.experts.named_parameters()):
            sharded = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None))
            setattr(layer.experts, name, sharded)
            experts.add(sharded)
        layer.experts.ranks = group.size  # their gradients averaged as ZeRO averages the others'
        layer.ep = group
    return experts
