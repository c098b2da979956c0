"""memory.snapshot on a real CUDA allocator: a capped job that runs out leaves a loadable snapshot per rank
(`python -m pytest -q tests/gpu`; skipped without CUDA)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from tests.helpers import run_trainer
from trainer.config import MemoryConfig, SnapshotMode
from trainer.private_apis.of_torch import stop_memory_history
from trainer.telemetry.snapshot import ACTIVE, Snapshots

pytestmark = pytest.mark.gpu


def test_a_named_step_dumps_a_snapshot_with_the_allocations_and_their_stacks(tmp_path: Path) -> None:
    snaps = Snapshots(
        MemoryConfig(snapshot=SnapshotMode.steps, snapshot_steps=[1]), torch.device("cuda"), tmp_path, 0
    )
    try:
        held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        path = snaps.after_step(1, None)
    finally:
        stop_memory_history()
        ACTIVE.clear()
    snapshot = pickle.loads(path.read_bytes())
    sizes = [
        block["size"]
        for segment in snapshot["segments"]
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    ]
    assert held.numel() in sizes
    allocs = [event for trace in snapshot["device_traces"] for event in trace if event["action"] == "alloc"]
    assert any(event["size"] == held.numel() and event["frames"] for event in allocs)  # python stacks kept


def test_a_capped_job_that_runs_out_leaves_a_loadable_snapshot(tmp_path: Path) -> None:
    # The plan: 5.90 GiB of tensors at this shape, in a 1 GiB cap.
    run = run_trainer(
        tmp_path / "run",
        "model=tiny", "device=cuda", "nproc=1", "seq_len=512", "micro_batch=256", "steps=2", "logger=none",
        "save=off", "device_memory_gib=1", "plan.enforce=false", "memory.snapshot=oom",
        check=False,
    )  # fmt: skip
    assert (run.out_dir / "summary.json").exists(), run.stdout[-2000:] + run.stderr[-2000:]
    assert run.summary["status"] == "oom"
    path = run.out_dir / "memory_snapshots" / "rank0_oom.pickle"
    assert "segments" in pickle.loads(path.read_bytes())
    assert "pytorch.org/memory_viz" in run.stdout
