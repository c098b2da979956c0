"""The CUDA paths the CPU tests cannot reach, on one GPU (marked gpu: skipped without CUDA).

checks/gpu_check.py runs these first (`pytest -m gpu tests/gpu`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import REPO, free_port, tiny_config
from trainer.cuda import apply_tf32, process_group_backend
from trainer.data import build_batches, to_device
from trainer.devices import find_device
from trainer.rank.loop import build_trainee, train_step
from trainer.rank.nonfinite import NonFiniteGuard
from trainer.saves.dcp import (
    Progress,
    SaveSpec,
    load_training_state,
    rng_state,
    save_training_state,
    saved_keys,
)
from trainer.world import World

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """One rank on GPU 0 in a `cuda:nccl,cpu:gloo` group, as a CPU-offloaded run gets."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    backend = process_group_backend("cuda", offload_to_cpu=True)
    store = dist.TCPStore("localhost", free_port(), 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=device)
    yield World(rank=0, world_size=1, local_rank=0, device=device)
    dist.destroy_process_group()


def cuda_config(**overrides: object):
    return tiny_config(device="cuda", **overrides)


def test_the_offload_group_reduces_host_and_device_tensors(world: World) -> None:
    host, device = torch.ones(4), torch.ones(4, device=world.device)
    dist.all_reduce(host)
    dist.all_reduce(device)
    assert host.tolist() == device.tolist() == [1.0] * 4


def test_the_fork_server_leaves_cuda_uninitialised() -> None:
    """The ranks fork from a server that imported trainer/rank/preload.py: had the imports
    initialised CUDA, no forked rank could use the GPU."""
    code = "import torch, trainer.rank.preload; print(torch.cuda.is_available(), torch.cuda.is_initialized())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split()[-2:] == ["True", "False"]


def test_this_gpu_is_in_the_device_table() -> None:
    name = torch.cuda.get_device_name(0)
    spec = find_device(name)
    assert spec is not None, f"{name!r} is not in trainer/devices.py"
    # The table's memory is nvidia-smi's total; CUDA's own total is that less what the driver keeps (<1%).
    total_mib = torch.cuda.get_device_properties(0).total_memory / 2**20
    assert 0.97 * spec.memory_mib <= total_mib <= spec.memory_mib, (total_mib, spec)


def test_tf32_switches_the_matmul_precision() -> None:
    a = torch.randn(512, 512, device="cuda")
    apply_tf32(False)
    exact = a @ a
    apply_tf32(True)
    fast = a @ a
    apply_tf32(False)
    reference = (a.double() @ a.double()).float()
    assert (exact - reference).abs().max() < (fast - reference).abs().max()  # TF32 keeps 10 mantissa bits


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("stage", ["stage0", "stage3"])
def test_a_deferred_step_never_syncs_with_the_host(world: World, stage: str, dtype: str) -> None:
    """No host sync in a step once warm (fp16: the scale's floor is clamped on the device, issue 27
    item 8). Two warm-up steps: DDP rebuilds its buckets on the second forward with a blocking
    device-to-host copy (issue 27, item 2); the first builds lazy state and rope tables."""
    config = cuda_config(
        zero__stage=stage,
        precision__compute_dtype=dtype,
        nonfinite="skip",
        fault__kind="nan_loss",
        fault__step=4,
    )
    trainee = build_trainee(config, world)
    guard = NonFiniteGuard(
        config.nonfinite, config.max_nonfinite_skips, world, fp16=config.precision.is_fp16, defer=True
    )
    assert trainee.optimizer.defaults["fused"]  # fused on CUDA by default
    batches = build_batches(config, 0, 1, start_step=0)
    for step in (1, 2):
        train_step(trainee, batches, config, world, step, guard)
    torch.cuda.set_sync_debug_mode("error")  # any host sync now raises
    try:
        for step in range(3, 6):
            train_step(trainee, batches, config, world, step, guard)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    guard.settle()
    assert guard.skipped == 1


def test_a_batch_copy_leaves_the_host_free_to_run_ahead() -> None:
    """time/data_s is host time (issue 27, item 6): the copy of a batch is only enqueued, even
    behind half a second of GPU work, because it is copied from page-locked memory."""
    device = torch.device("cuda", 0)
    batch = torch.randint(0, 1000, (8, 1024))
    to_device(batch, device)  # warm: the host allocator's first page-locked block
    torch.cuda.synchronize()
    torch.cuda._sleep(10**9)  # about 0.5 s of spinning queued ahead of the copy
    start = time.perf_counter()
    copied = to_device(batch, device)
    host_s = time.perf_counter() - start
    assert host_s < 0.05, f"the copy held the host {host_s:.3f} s"
    assert torch.equal(copied.cpu(), batch)


def test_an_offloaded_step_skips_on_a_flag_that_arrived_late(world: World, monkeypatch) -> None:
    """offload=cpu: the CPU AdamW must read the skip flag after it has arrived (issue 27, item 7).
    The flag is made behind half a second of GPU work; read early, the NaN step would be taken."""
    import trainer.rank.loop as loop
    from trainer.rank.optim import step_unless

    def late_flag(optimizer: torch.optim.Optimizer, scaler: object, skip: torch.Tensor) -> None:
        torch.cuda._sleep(10**9)
        step_unless(optimizer, scaler, skip.clone())  # the clone runs after the spin

    monkeypatch.setattr(loop, "step_unless", late_flag)
    config = cuda_config(
        zero__stage="stage3", offload__target="cpu", nonfinite="skip", fault__kind="nan_loss", fault__step=3
    )
    trainee = build_trainee(config, world)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, world, fp16=False, defer=True)
    batches = build_batches(config, 0, 1, start_step=0)
    for step in (1, 2):
        train_step(trainee, batches, config, world, step, guard)
    before = {n: p.to_local().clone() for n, p in trainee.model.named_parameters()}
    assert all(t.device.type == "cpu" for t in before.values())
    train_step(trainee, batches, config, world, 3, guard)  # a NaN loss: skipped on the device's word
    assert all(torch.equal(p.to_local(), before[n]) for n, p in trainee.model.named_parameters())
    guard.settle()
    assert guard.skipped == 1


def test_rng_state_of_a_gpu_rank_has_cuda_and_a_cpu_save_loads_and_steps_on_it(
    world: World, tmp_path: Path
) -> None:
    """A save of CPU's per-tensor AdamW, loaded under the GPU's fused one, then stepped with the
    deferred skip (issue 27, item 3: the save's fused=False used to assert at the first step)."""
    assert "cuda" in rng_state(world.device)
    cpu_world = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    config = tiny_config()
    save_training_state(
        build_trainee(config, cpu_world), SaveSpec.of(config), cpu_world, tmp_path, Progress(step=1)
    )
    path = tmp_path / "checkpoints" / "step_00000001"
    assert not any(".cuda" in key for key in saved_keys(path))
    gpu_config = cuda_config()
    trainee = build_trainee(gpu_config, world)
    assert load_training_state(trainee, SaveSpec.of(gpu_config), world, path).step == 1
    guard = NonFiniteGuard(
        gpu_config.nonfinite, gpu_config.max_nonfinite_skips, world, fp16=False, defer=True
    )
    batches = build_batches(gpu_config, 0, 1, start_step=1)
    losses = [train_step(trainee, batches, gpu_config, world, step, guard).loss.item() for step in (2, 3)]
    guard.settle()
    assert trainee.optimizer.param_groups[0]["fused"] and all(loss == loss for loss in losses)


def test_fused_and_loop_adamw_agree(world: World) -> None:
    losses = {}
    for fused in (True, False):
        config = cuda_config(optim__fused=fused)
        torch.manual_seed(config.seed)
        trainee = build_trainee(config, world)
        guard = NonFiniteGuard(
            config.nonfinite, config.max_nonfinite_skips, world, fp16=config.precision.is_fp16, defer=fused
        )
        batches = build_batches(config, 0, 1, start_step=0)
        losses[fused] = [
            train_step(trainee, batches, config, world, s, guard).loss.item() for s in range(1, 6)
        ]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
