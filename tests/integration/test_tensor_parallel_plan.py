"""parallel.tp=2: every rank's measured peak against the plan's, within 0.5%, with and without sequence parallelism,
checkpointing none and full: on 2 CPU ranks (zero=stage0, one data-parallel replica) fp32 and bf16 (one sweep of 8
tiny jobs), and on 4 (dp 2, zero=stage3, FSDP2 over the dp dimension) bf16, where a block's ffn_norm backward can
be the peak (one sweep of 4; tests/helpers.py plan_sweep)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import assert_plan_holds_peaks, plan_sweep

PLAN_BOUND = 0.005
POINTS = [
    (sp, precision, mode)
    for sp in ("true", "false")
    for precision in ("fp32", "bf16")
    for mode in ("none", "full")
]


@pytest.fixture(scope="module")
def points(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], dict[str, Any]]:
    """(parallel.sp, precision, checkpointing) -> the job's plan.json and last metrics record."""
    return plan_sweep(
        tmp_path_factory.mktemp("tp_plan"),
        ("parallel.sp", "precision", "checkpointing"),
        "nproc=2",
        "parallel.tp=2",
        "zero=stage0",
        "parallel.sp=true,false",
        "precision=fp32,bf16",
        "checkpointing=none,full",
    )


@pytest.mark.parametrize(("sp", "precision", "mode"), POINTS)
def test_each_ranks_peak_is_the_plans_within_half_a_percent(
    points: dict[tuple[str, ...], dict[str, Any]], sp: str, precision: str, mode: str
) -> None:
    point = points[(sp, precision, mode)]
    assert (point["plan"]["checkpointing"], len(point["plan"]["ranks"])) == (mode, 2)
    assert_plan_holds_peaks(point, PLAN_BOUND)


DP2_POINTS = [(sp, mode) for sp in ("true", "false") for mode in ("none", "full")]


@pytest.fixture(scope="module")
def dp2_points(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], dict[str, Any]]:
    """(parallel.sp, checkpointing) -> the 4-rank stage3 bf16 job's plan.json and last metrics record."""
    return plan_sweep(
        tmp_path_factory.mktemp("tp_dp2_plan"),
        ("parallel.sp", "checkpointing"),
        "nproc=4",
        "parallel.tp=2",
        "zero=stage3",
        "precision=bf16",
        "parallel.sp=true,false",
        "checkpointing=none,full",
    )


@pytest.mark.parametrize(("sp", "mode"), DP2_POINTS)
def test_each_ranks_peak_is_the_plans_at_dp2_stage3_bf16(
    dp2_points: dict[tuple[str, ...], dict[str, Any]], sp: str, mode: str
) -> None:
    point = dp2_points[(sp, mode)]
    assert (point["plan"]["checkpointing"], len(point["plan"]["ranks"])) == (mode, 4)
    assert_plan_holds_peaks(point, PLAN_BOUND)
