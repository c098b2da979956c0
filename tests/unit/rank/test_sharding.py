"""trainer/rank/sharding.py's gradient-sync control: which micro-batches of a window reduce gradients (zero.reduce_every).

One-rank gloo group: DDP's and FSDP2's own flags and gradients show whether a backward reduced.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainer.rank.sharding import gradient_sync


def test_ddp_skips_the_all_reduce_until_the_last_micro_batch(process_group: None) -> None:
    """Three micro-batches of a window with real backwards: DDP's communication hook (which every
    bucket's all-reduce goes through) runs only in the last, and the window sums all three."""
    torch.manual_seed(0)
    reference = nn.Linear(2, 1)
    model = DistributedDataParallel(nn.Linear(2, 1))
    model.module.load_state_dict(reference.state_dict())
    reduced: list[int] = []  # the micro-batch index of every bucket all-reduce

    def counting_allreduce(state, bucket):  # unannotated: DDP rejects the strings `annotations` makes of them
        reduced.append(micro_batch)
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_allreduce)
    batches = [torch.randn(3, 2) for _ in range(3)]
    for micro_batch, batch in enumerate(batches):
        with gradient_sync(model, enabled=micro_batch == len(batches) - 1):
            model(batch).sum().backward()
    assert reduced == [2]  # one bucket (two small tensors), all-reduced once, in the last micro-batch
    for batch in batches:
        reference(batch).sum().backward()
    assert all(torch.allclose(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()))


def sharded_twin() -> tuple[nn.Module, nn.Module, list[torch.Tensor]]:
    """A Linear, its FSDP2-sharded copy (one rank) and two micro-batches."""
    torch.manual_seed(0)
    reference = nn.Linear(2, 1)
    model = nn.Linear(2, 1)
    model.load_state_dict(reference.state_dict())
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return reference, model, [torch.randn(3, 2) for _ in range(2)]


def assert_window_sums(model: nn.Module, reference: nn.Module, batches: list[torch.Tensor]) -> None:
    """The sharded model's gradient is the reference's summed over every micro-batch."""
    for batch in batches:
        reference(batch).sum().backward()
    got = [p.grad.full_tensor() for p in model.parameters()]
    assert all(torch.allclose(g, r.grad) for g, r in zip(got, reference.parameters()))


def test_fsdp_reduces_once_and_the_window_sums_every_micro_batch(process_group: None) -> None:
    reference, model, batches = sharded_twin()
    with gradient_sync(model, enabled=False):
        model(batches[0]).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # held unsharded, not reduced yet
    with gradient_sync(model, enabled=True):
        model(batches[1]).sum().backward()
    assert_window_sums(model, reference, batches)


def test_reduce_every_decides_which_micro_batches_reduce() -> None:
    from trainer.config import ReduceEvery, Stage, ZeroConfig
    from trainer.rank.sharding import reduces_now

    for stage in Stage:
        every = ZeroConfig(stage=stage, reduce_every=ReduceEvery.micro_batch)
        once = ZeroConfig(stage=stage, reduce_every=ReduceEvery.step)
        assert [reduces_now(every, last) for last in (False, True)] == [True, True]
        assert [reduces_now(once, last) for last in (False, True)] == [False, True]


def test_fsdp_reducing_every_micro_batch_adds_each_shard_into_the_held_one(process_group: None) -> None:
    """zero.reduce_every=micro_batch: the first backward already leaves a (sharded) gradient, the
    second adds into that same tensor, and the window still sums every micro-batch."""
    reference, model, batches = sharded_twin()
    with gradient_sync(model, enabled=True):
        model(batches[0]).sum().backward()
    first = [(p.grad.to_local().data_ptr(), p.grad.to_local().clone()) for p in model.parameters()]
    with gradient_sync(model, enabled=True):
        model(batches[1]).sum().backward()
    for p, (storage, before) in zip(model.parameters(), first):  # the same shard, added to in place
        assert p.grad.to_local().data_ptr() == storage and not torch.equal(p.grad.to_local(), before)
    assert_window_sums(model, reference, batches)
