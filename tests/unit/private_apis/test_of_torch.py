"""Every wrapper of trainer/private_apis/of_torch.py against the torch it runs on: each returns what
its docstring says. Marked `torch_versions`: CI runs it under every torch the project claims, since
a private API is what a torch release changes without notice."""

from __future__ import annotations

import getpass
import json
import math
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.amp import GradScaler

from trainer.private_apis.of_torch import (
    CheckpointImpl,
    HigherOrderOperator,
    OpOverload,
    OpOverloadPacket,
    all_gather_autograd,
    all_to_all_autograd,
    caller_name,
    checkpoint_wrapper,
    comm_hook_states,
    concatenate_meshes,
    ddp_bucket_assignment,
    ddp_default_bucket_cap_mb,
    ddp_ignore_params,
    flatten_mesh,
    flight_recorder_dumps,
    flight_recorder_json,
    found_inf_per_device,
    inductor_cache_dir,
    interleaved_1f1b_order,
    name_rendezvous_events_cheaply,
    new_mem_tracker,
    powersgd_hook_in_this_thread,
    scale_on_device,
    set_last_lr,
)

pytestmark = pytest.mark.torch_versions


def test_the_flight_recorder_lists_an_all_reduce_with_its_bytes(process_group: None) -> None:
    assert "_dump_fr_trace_json" in flight_recorder_dumps()  # gloo's recorder, in every build
    dist.all_reduce(torch.ones(3, 5))  # 60 bytes of fp32
    entries = json.loads(flight_recorder_json())["entries"]
    last = entries[-1]
    assert last["profiling_name"].endswith("all_reduce") and last["input_sizes"] == [[3, 5]]
    assert last["input_dtypes"] == ["Float"]
    assert flight_recorder_json("_no_such_dump") is None


def test_the_scaler_records_an_overflow_and_its_scale_without_a_sync() -> None:
    weight = nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = GradScaler("cpu", init_scale=1024.0)
    scaler.scale(weight.sum() * torch.tensor(float("inf"))).backward()
    scaler.unscale_(optimizer)
    assert sum(found_inf_per_device(scaler, optimizer).values()).item() == 1.0
    assert scale_on_device(scaler).item() == 1024.0
    scaler.step(optimizer)
    scaler.update()
    assert scale_on_device(scaler).item() == 512.0  # backed off by the default factor 0.5
    assert torch.equal(weight.detach(), torch.ones(4))  # the step was skipped


def test_set_last_lr_is_what_the_scheduler_reports() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    set_last_lr(scheduler, [0.125])
    assert scheduler.get_last_lr() == [0.125]


def test_the_mem_tracker_counts_a_parameter_and_its_gradient() -> None:
    layer = nn.Linear(256, 256, bias=False)  # 256 KiB of fp32 weight, as much gradient
    tracker = new_mem_tracker()
    tracker.track_external(layer)
    with tracker:
        layer(torch.ones(1, 256)).sum().backward()
    weight = 256 * 256 * 4
    after = {getattr(k, "name", k): v for k, v in tracker.get_tracker_snapshot()[torch.device("cpu")].items()}
    assert (after["PARAM"], after["GRAD"], after["Total"]) == (weight, weight, 2 * weight)
    # The peak is inside backward: the weight's gradient is made (a temporary) before it is stored.
    peak = {
        getattr(k, "name", k): v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()
    }
    assert (peak["PARAM"], peak["TEMP"], peak["GRAD"]) == (weight, weight, 0)
    assert peak["Total"] == sum(v for k, v in peak.items() if k != "Total")


def test_the_global_peak_tracker_peaks_where_torchs_mem_tracker_does() -> None:
    """Hiding the module table from `_update_peak_stats` leaves every global figure as torch's
    MemTracker has it: the peak snapshot, byte for byte and by category, over a decoder's forward,
    backward and AdamW step (two forwards of the same modules, as with grad_accum 2)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from tests.helpers import materialized, tiny_config

    def peak(tracker: MemTracker) -> dict[str, int]:
        model = materialized(tiny_config(model__n_layers=1).model)
        optimizer = torch.optim.AdamW(model.parameters())
        tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
        tracker.track_external(model, optimizer)
        with tracker:
            for _ in range(2):
                model(tokens).float().sum().backward()
                tracker.reset_mod_stats()
            optimizer.step()
        snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        return {getattr(k, "name", k): v for k, v in snapshot.items()}

    ours, torchs = peak(new_mem_tracker()), peak(MemTracker())
    assert type(new_mem_tracker()).__mro__[1] is MemTracker
    assert ours == torchs and ours["Total"] == sum(v for k, v in ours.items() if k != "Total")


def test_the_checkpoint_wrapper_recomputes_to_the_same_gradient() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    block(x).square().sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    wrapped(x).square().sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(block.parameters(), expected))


def test_the_operator_types_are_those_of_torch_ops() -> None:
    assert isinstance(torch.ops.aten.mm, OpOverloadPacket) and isinstance(
        torch.ops.aten.mm.default, OpOverload
    )
    assert isinstance(torch.ops.higher_order.cond, HigherOrderOperator)


def test_ddps_default_bucket_cap_is_25_mib() -> None:
    assert ddp_default_bucket_cap_mb() == 25


def test_comm_hook_states_are_what_register_comm_hook_was_given(process_group: None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(nn.Linear(4, 4))
    assert comm_hook_states(ddp) == [] and comm_hook_states(nn.Linear(4, 4)) == []
    state = object()
    ddp.register_comm_hook(state, allreduce_hook)
    assert len(comm_hook_states(ddp)) == 1 and comm_hook_states(ddp)[0] is state


def test_ddp_leaves_the_ignored_parameters_out_of_its_buckets(process_group: None) -> None:
    """The second layer's weight, named before DDP wraps the model, is in none of the buckets DDP's hook is
    given, and keeps the gradient autograd gave it (a tensor of its own, not a bucket view)."""
    from torch.nn.parallel import DistributedDataParallel

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    ddp_ignore_params(model, ["1.weight"])
    sizes: list[int] = []

    def record(_, bucket):  # noqa: ANN001, ANN202 (as the bucket test's hook)
        sizes.append(bucket.buffer().numel())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, record)
    ddp(torch.ones(1, 8)).sum().backward()
    assert sum(sizes) == 8 * 8 + 8 + 8  # the first layer's weight and bias, the second's bias
    assert model[1].weight.grad is not None and model[1].weight.grad.shape == (8, 8)


def test_the_bucket_assignment_is_ddps_after_its_rebuild(process_group: None) -> None:
    """Three 512 x 512 fp32 weights (1 MiB each) and their biases, ready in reverse order: the buckets
    DDP's hook is given after its rebuild, at a 1.5 MiB cap and at the default (a 1 MiB first one)."""
    from torch.nn.parallel import DistributedDataParallel

    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(3)))
    ready = [tuple(p.shape) for p in reversed(list(model.parameters()))]
    sizes: list[int] = []

    # Unannotated: register_comm_hook compares annotations with objects, and this module's are strings.
    def record(_, bucket):  # noqa: ANN001, ANN202
        sizes.append(bucket.buffer().numel())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    for cap in (1.5, None):
        ddp = DistributedDataParallel(model, **({} if cap is None else {"bucket_cap_mb": cap}))
        ddp.register_comm_hook(None, record)
        for _ in range(2):  # the reducer rebuilds its buckets after the first backward
            sizes.clear()
            ddp(torch.ones(1, 512)).sum().backward()
        planned = [sum(math.prod(ready[i]) for i in b) for b in ddp_bucket_assignment(ready, cap)]
        assert sizes == planned == ([525312, 262656] if cap else [262656, 525312])


def test_the_powersgd_hooks_callbacks_run_under_the_callers_dispatch_mode(process_group: None) -> None:
    """The error feedback, made in the hook's last callback (`input_tensor_cp - input_tensor`), is an op
    that a dispatch mode entered around backward sees, in this thread."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.seen.append((str(func), threading.get_ident()))
            return func(*args, **(kwargs or {}))

    ddp = DistributedDataParallel(nn.Linear(32, 64))
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, lambda state, bucket: powersgd_hook_in_this_thread(state, bucket))
    for _ in range(2):  # two exact reductions, then PowerSGD
        ddp(torch.ones(1, 32)).sum().backward()
    with Ops() as ops:
        ddp(torch.ones(1, 32)).sum().backward()
    assert ("aten.sub.Tensor", threading.get_ident()) in ops.seen
    assert state.error_dict[0].numel() == 64 * 32 + 64


def test_interleaved_order_is_torchs_warm_up_then_one_forward_one_backward() -> None:
    """pp=4, 2 stages per rank, 8 micro-batches, rank 0: `_get_warmup_ops` forwards ((2 - 1)·4 + 2·3 = 10: four of
    stage 0, four of stage 4, two more of stage 0), then a forward before each backward, every action once."""
    order = interleaved_1f1b_order(4, 2, 8, 0)
    assert order[:10] == [(0, True)] * 4 + [(4, True)] * 4 + [(0, True)] * 2
    assert order[10:12] == [(0, True), (4, False)]
    assert sorted(order) == sorted([(s, f) for s in (0, 4) for f in (True, False)] * 8)


def test_rendezvous_events_are_named_as_torchs_get_method_name_names_them() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torchs = dynamic_rendezvous.get_method_name
    assert torchs is not caller_name  # torch's own: no job was launched in this process

    def record() -> tuple[str, str]:  # as DynamicRendezvousHandler._record calls it
        return torchs(), caller_name()

    def next_rendezvous() -> tuple[str, str]:
        return record()

    assert next_rendezvous() == ("next_rendezvous", "next_rendezvous")
    assert caller_name(10_000) == torchs(10_000) == "no_method_name"
    name_rendezvous_events_cheaply()
    try:
        assert dynamic_rendezvous.get_method_name is caller_name
    finally:
        dynamic_rendezvous.get_method_name = torchs


def test_the_inductor_cache_dir_is_the_variable_else_torchinductor_user_in_the_temporary_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert inductor_cache_dir() == str(tmp_path / "cache")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert inductor_cache_dir() == str(tmp_path / f"torchinductor_{getpass.getuser()}")
    assert not (tmp_path / f"torchinductor_{getpass.getuser()}").exists()  # read, not created


def test_a_flattened_mesh_is_one_dim_over_the_ranks_of_its_dims(process_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))
    flat = flatten_mesh(mesh["b", "c"], "b_c")
    assert flat.mesh_dim_names == ("b_c",) and flat.size() == 1
    assert dist.get_world_size(flat.get_group()) == 1  # a process group of its own dim's ranks


def test_concatenated_meshes_are_one_mesh_of_their_dims_groups(process_group: None) -> None:
    """HSDP under cp: the replicate dim beside the flattened shard dim, over the groups those dims already hold."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))
    flat = flatten_mesh(mesh["b", "c"], "b_c")
    both = concatenate_meshes(mesh, [mesh["a"], flat])
    assert both.mesh_dim_names == ("a", "b_c") and both.size() == 1
    assert both.get_group("b_c") is flat.get_group() and both.get_group("a") is mesh["a"].get_group()


def test_the_autograd_collectives_pass_values_and_gradients_through(process_group: None) -> None:
    """On one rank both are the identity, forward and backward: what a torch release renaming them breaks. The
    sum's gradient is expanded ones, not contiguous: torch 2.11's all-gather backward refused it (ContiguousGradient)."""
    x = torch.arange(6.0).reshape(3, 2).requires_grad_()
    gathered = all_gather_autograd(x, dist.group.WORLD)
    exchanged = all_to_all_autograd(x * 2, dist.group.WORLD)
    assert torch.equal(gathered, x.detach()) and torch.equal(exchanged, 2 * x.detach())
    (gathered.sum() + exchanged.sum()).backward()
    assert torch.equal(x.grad, torch.full((3, 2), 3.0))
