"""Telemetry on a GPU: the CUDA allocator's counters and MFU against the device's peak.

Every test here needs CUDA (the `gpu` marker; tests/conftest.py skips them without one):
`python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_trainer

pytestmark = pytest.mark.gpu


def test_gpu_counters_cover_the_model_states_and_mfu_uses_the_device_peak(tmp_path: Path) -> None:
    job = (
        "model=tiny",
        "device=cuda",
        "nproc=1",
        "seq_len=64",
        "micro_batch=2",
        "log_every=1",
        "steps=3",
        "precision=bf16",
        "logger=none",
    )
    record = run_trainer(tmp_path, *job).records[-1]
    states = sum(record[f"memory/rank0/{k}_gib"] for k in ("params", "grads", "optimizer"))
    assert record["memory/rank0/peak_allocated_gib"] >= states
    assert record["memory/rank0/peak_reserved_gib"] >= record["memory/rank0/peak_allocated_gib"]
    assert record["memory/rank0/peak_active_gib"] >= record["memory/rank0/peak_allocated_gib"]
    assert (record["memory/rank0/num_ooms"], record["memory/rank0/alloc_retries"]) == (0, 0)
    assert record["memory/max_rank_peak_gib"] == record["memory/rank0/peak_allocated_gib"]
    if "throughput/mfu_pct" in record:  # a device in the peak table
        assert 0 < record["throughput/mfu_pct"] < 100
