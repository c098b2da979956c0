"""parallel.ep > 1: expert parallelism, each rank of the ep group holding n_experts / ep whole experts.

The ep group here is the data-parallel group FSDP2 shards over (parallel.ep equal to its ranks: the
composition table refuses the rest for now). So each expert weight becomes a DTensor sharded on dim 0 (the
expert dim) over that one mesh dim, as torchtitan's ExpertParallel makes it, and FSDP2 is told to leave it
alone (`ignored_params`): it is sharded already, each rank holding whole experts, and every rank's tokens
reach it through the all-to-all (trainer/model/moe.py `dispatch_to_experts`). Because the mesh is FSDP2's,
the optimizer, gradient clipping and torch.distributed.checkpoint see one kind of DTensor over one mesh.

What FSDP2 would have done for those parameters is done in the model (trainer/model/moe.py `MeanOverRanks`):
their gradient is the sum of every rank's contribution (each rank's loss is its own tokens' mean), so it is
divided by the data-parallel ranks, as FSDP2's reduce-scatter averages the others' (torchtitan sets FSDP2's
gradient divide factor for the same reason).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.model.moe import ExpertGroup, moe_layers


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Shard every MoE layer's experts over `mesh` (1-D, the ep group) on their expert dim, on the meta
    device; returns the expert parameters, which FSDP2 must ignore."""
    group = ExpertGroup(mesh.get_group(), mesh.size(), mesh.get_local_rank())
    experts: set[nn.Parameter] = set()
    for layer in moe_layers(model):
        for name, param in list(layer.experts.named_parameters()):
            sharded = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None))
            setattr(layer.experts, name, sharded)
            experts.add(sharded)
        layer.experts.ranks = group.size  # their gradients averaged as FSDP2 averages the others'
        layer.ep = group
    return experts
