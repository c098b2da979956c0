"""trainer/plan/headroom.py: a GPU plan compares reserved memory (tensors + headroom) with what the allocator may use.

The expected figures are literal bytes worked out by hand from the module docstring's figures
(CUDA context 0.75 GiB and NCCL 688 MiB per communicator, measured and published; reserved = 1.1733 x
allocated + 32 MiB cuBLAS workspace + 1.25 GiB stream cache, fitted by checks/plan_vs_published.py),
not read back from HEADROOM: a change to a figure must change these tests too.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import compose_config
from trainer.devices import find_accelerator
from trainer.plan import build_plan
from trainer.plan.headroom import HEADROOM
from trainer.telemetry.metrics import memory_fields
from trainer.units import GIB

CONTEXT_BYTES = 805_306_368  # 0.75 GiB: the CUDA context, per process
NCCL_BYTES = 721_420_288  # 688 MiB: NCCL's buffers per communicator
CONTEXT_AND_NCCL_BYTES = 1_526_726_656  # 0.75 GiB + 688 MiB for one communicator
CONTEXT_AND_ONE_RANK_NCCL_BYTES = 1_390_495_662  # (0.75 + 0.545) GiB, truncated
WORKSPACE_BYTES = 33_554_432  # cuBLAS's 32 MiB, inside the allocator
STREAM_CACHE_BYTES = 1_342_177_280  # 1.25 GiB cached on FSDP2's collective streams (fitted)
FRAGMENTATION = 1.1733  # reserved grows by 17.33% of allocated (fitted)


def test_the_headroom_is_the_stated_bytes() -> None:
    assert HEADROOM.outside_allocator(0) == CONTEXT_BYTES
    assert HEADROOM.outside_allocator(1) == CONTEXT_AND_NCCL_BYTES
    assert HEADROOM.outside_allocator(3) == 2_969_567_232 == CONTEXT_BYTES + 3 * NCCL_BYTES
    assert HEADROOM.outside_allocator(1, world_size=1) == CONTEXT_AND_ONE_RANK_NCCL_BYTES
    # 1 GiB of tensors: 1,073,741,824 x 1.1733 = 1,259,821,282.1, plus 32 MiB + 1.25 GiB = 1,375,731,712, truncated.
    assert HEADROOM.reserved(1_073_741_824) == 2_635_552_994
    assert HEADROOM.reserved(0) == WORKSPACE_BYTES + STREAM_CACHE_BYTES == 1_375_731_712
    assert HEADROOM.reserved(10 * GIB) == 13_973_944_532  # 10 GiB x 1.1733 + 1.28125 GiB


def test_a_gpu_rank_may_reserve_the_device_less_context_and_nccl() -> None:
    h100 = find_accelerator("h100").memory_mib * 2**20
    one = build_plan(compose_config("plan.accelerator=h100"), "cuda", 1)
    eight = build_plan(compose_config("plan.accelerator=h100"), "cuda", 8)
    # one rank: the default group's communicator, made at init (device_id) though idle, 0.545 GiB measured
    assert one.memory.per_rank_bytes == h100 - CONTEXT_AND_ONE_RANK_NCCL_BYTES
    assert one.memory.source.endswith("and 1 NCCL communicator")
    assert eight.memory.per_rank_bytes == h100 - CONTEXT_AND_NCCL_BYTES
    capped = build_plan(compose_config("plan.accelerator=h100", "device_memory_gib=10"), "cuda", 8)
    assert capped.memory.per_rank_bytes == 10 * GIB  # the cap bounds the allocator itself


def test_nccl_memory_is_planned_per_communicator_that_carries_traffic() -> None:
    """HSDP's mesh adds its shard and replicate groups to the default one; hpZ one group per
    block (FSDP2 gives each hpZ module its own post-forward mesh; model=tiny has 4 blocks)."""
    h100 = find_accelerator("h100").memory_mib * 2**20
    hsdp = build_plan(compose_config("plan.accelerator=h100", "zero=stage3", "zero.shard_ranks=4"), "cuda", 8)
    assert hsdp.memory.per_rank_bytes == h100 - 2_969_567_232  # 0.75 GiB context + 3 x 688 MiB
    assert "3 NCCL communicators" in hsdp.memory.source
    hpz = build_plan(compose_config("plan.accelerator=h100", "zero=stage3", "zero.hpz_ranks=2"), "cuda", 8)
    assert hpz.memory.per_rank_bytes == h100 - 4_412_407_808  # 0.75 GiB + (1 + 4 blocks) x 688 MiB
    both = build_plan(
        compose_config("plan.accelerator=h100", "zero=stage3", "zero.shard_ranks=4", "zero.hpz_ranks=2"),
        "cuda",
        8,
    )
    assert both.memory.per_rank_bytes == h100 - 5_855_248_384  # 0.75 GiB + (3 + 4) x 688 MiB


def test_gpu_plans_predict_reserved_and_cpu_plans_do_not() -> None:
    config = compose_config("model=125m", "precision=bf16")
    gpu, cpu = build_plan(config, "cuda", 8), build_plan(config, "cpu", 2)
    expected = gpu.peak_bytes * FRAGMENTATION + WORKSPACE_BYTES + STREAM_CACHE_BYTES
    assert gpu.to_json()["predicted_reserved_gib"] * GIB == pytest.approx(expected, abs=1)
    assert gpu.to_json()["headroom"]["fragmentation"] == 0.1733
    assert "predicted_reserved_gib" not in cpu.to_json() and cpu.required_bytes(cpu.worst) == cpu.peak_bytes


def test_a_plan_whose_tensors_fit_but_reserved_does_not_is_refused() -> None:
    base = compose_config("model=125m", "precision=bf16")
    peak = build_plan(base, "cuda", 1).peak_bytes
    between = (
        (peak + peak * FRAGMENTATION + WORKSPACE_BYTES + STREAM_CACHE_BYTES) / 2 / GIB
    )  # above the tensor peak, below reserved
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
