"""trainer/plan/headroom.py: a GPU plan compares reserved memory (tensors + headroom) with what the allocator may use."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_plan import compose_config
from trainer.devices import find_accelerator
from trainer.plan import build_plan
from trainer.plan.headroom import HEADROOM
from trainer.telemetry.metrics import memory_fields
from trainer.units import GIB


def test_a_gpu_rank_may_reserve_the_device_less_context_and_nccl() -> None:
    h100 = find_accelerator("h100").memory_mib * 2**20
    one = build_plan(compose_config("plan.accelerator=h100"), "cuda", 1)
    eight = build_plan(compose_config("plan.accelerator=h100"), "cuda", 8)
    assert one.memory.per_rank_bytes == h100 - int(HEADROOM.context_gib * GIB)
    assert eight.memory.per_rank_bytes == h100 - int((HEADROOM.context_gib + HEADROOM.nccl_gib) * GIB)
    capped = build_plan(compose_config("plan.accelerator=h100", "device_memory_gib=10"), "cuda", 8)
    assert capped.memory.per_rank_bytes == 10 * GIB  # the cap bounds the allocator itself


def test_gpu_plans_predict_reserved_and_cpu_plans_do_not() -> None:
    config = compose_config("model=125m", "precision=bf16")
    gpu, cpu = build_plan(config, "cuda", 8), build_plan(config, "cpu", 2)
    fixed = HEADROOM.cublas_workspace_gib + HEADROOM.stream_cache_gib
    expected = gpu.peak_bytes * (1 + HEADROOM.fragmentation) + fixed * GIB
    assert gpu.to_json()["predicted_reserved_gib"] * GIB == pytest.approx(expected, abs=1)
    assert gpu.to_json()["headroom"]["fragmentation"] == HEADROOM.fragmentation
    # The fitted figures (benchmarks/plan_vs_published.py): reserved = 1.1733 x allocated + 1.28125 GiB.
    assert (
        HEADROOM.reserved(10 * GIB) == int(10 * GIB * 1.1733 + (1 / 32 + 1.25) * GIB) == 13_973_944_532
    )  # 10 GiB x 1.1733 + 1.28125 GiB
    assert "predicted_reserved_gib" not in cpu.to_json() and cpu.required_bytes(cpu.worst) == cpu.peak_bytes


def test_a_plan_whose_tensors_fit_but_reserved_does_not_is_refused() -> None:
    base = compose_config("model=125m", "precision=bf16")
    peak = build_plan(base, "cuda", 1).peak_bytes
    between = (peak + HEADROOM.reserved(peak)) / 2 / GIB  # above the tensor peak, below the reserved peak
    plan = build_plan(
        compose_config("model=125m", "precision=bf16", f"device_memory_gib={between}"), "cuda", 1
    )
    assert plan.peak_bytes < plan.memory.per_rank_bytes and plan.fits is False


def test_reserved_is_reported_against_its_prediction() -> None:
    fields = ("peak_allocated", "peak_reserved", "peak_active", "alloc_retries", "num_ooms", "peak_rss")
    per_rank = torch.tensor(
        [
            [1.0 * GIB, 1.25 * GIB, 1.0 * GIB, 0, 0, 2.0 * GIB],
            [1.0 * GIB, 1.0 * GIB, 1.0 * GIB, 0, 0, 2.0 * GIB],
        ],
        dtype=torch.float64,
    )
    record = memory_fields(fields, per_rank, predicted_gib=1.1, predicted_reserved_gib=1.5)
    assert record["memory/prediction_error_pct"] == pytest.approx(10.0)
    assert record["memory/predicted_reserved_gib"] == 1.5
    assert record["memory/reserved_prediction_error_pct"] == pytest.approx(
        20.0
    )  # against the worst rank's 1.25 GiB
