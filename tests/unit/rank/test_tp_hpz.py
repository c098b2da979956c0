"""Why parallel.tp refuses zero.hpz_ranks (trainer/config/composition.py): torch's FSDP2 keeps no secondary
shard of a DTensor parameter. fully_shard(reshard_after_forward=<int>) accepts the tensor-parallel layers'
DTensor weights, then raises at the first block's forward reshard (FSDPParam.to_sharded_post_forward);
the same blocks without tensor parallelism keep their secondary shards and train. When a torch lifts the
limit this test fails, and the row can go once the job meets the plan (tests/integration/test_hsdp.py's bar).

8 ranks (dp_shard 4 x tp 2, hpz 2) on torch's fake process group: collectives are no-ops, one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.helpers import compose_config
from trainer.plan import shard_groups
from trainer.rank.sharding import block_reshard

pytestmark = pytest.mark.torch_versions  # a limit of torch's FSDP2, checked under 2.11 and 2.13


@pytest.fixture
def mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    yield init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    dist.destroy_process_group()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32, bias=False), nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def sharded(mesh: DeviceMesh, tp: bool) -> nn.Module:
    """Two blocks, tensor-parallel or not, each fully_shard as trainer/rank/sharding.py does under hpZ."""
    zero = compose_config("zero=stage3", "zero.hpz_ranks=2").zero
    reshard = block_reshard(zero, shard_groups(zero, mesh["dp_shard"].size()))
    assert reshard == 2
    model = nn.Sequential(Block(), Block())
    for block in model:
        if tp:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp_shard"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp_shard"], reshard_after_forward=False)
    return model


def test_fsdp2_keeps_no_secondary_shard_of_a_tensor_parallel_weight(mesh: DeviceMesh) -> None:
    model = sharded(mesh, tp=True)
    assert isinstance(model[0].up.weight, DTensor) and model[0].up.weight.device_mesh.ndim == 2  # (dp, tp)
    with pytest.raises(NotImplementedError) as raised:  # its words differ between torch versions
        model(torch.randn(4, 16))
    assert raised.traceback[-1].name == "to_sharded_post_forward"


def test_the_same_blocks_without_tensor_parallelism_keep_secondary_shards(mesh: DeviceMesh) -> None:
    model = sharded(mesh, tp=False)
    loss = model(torch.randn(4, 16)).sum()
    assert all(block._get_fsdp_state()._fsdp_param_group.is_sharded_post_forward for block in model)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
