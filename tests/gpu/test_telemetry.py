"""Telemetry on a GPU: the CUDA allocator's counters and MFU against the device's peak.

Every test here needs CUDA (the `gpu` marker; tests/conftest.py skips them without one):
`python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import run_trainer
from trainer.config import ModelConfig
from trainer.devices import find_device
from trainer.model.decoder import flops_per_token

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
    # MFU = F · tokens/s / (peak · ranks), F = 6N + 12·L·H·Q·T for the tiny model at seq_len 64, the
    # peak the device table's bf16 dense figure for this exact device (tests/gpu/test_cuda_paths.py
    # checks that it is listed).
    spec = find_device(torch.cuda.get_device_name(0))
    assert spec is not None and spec.bf16 is not None, torch.cuda.get_device_name(0)
    flops = flops_per_token(ModelConfig(), 64)
    expected = 100 * flops * record["throughput/tokens_per_s"] / (spec.bf16 * 1e12 * 1)
    assert record["throughput/mfu_pct"] == pytest.approx(expected, rel=1e-9)
