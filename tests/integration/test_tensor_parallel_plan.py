"""parallel.tp=2 on 2 CPU ranks (zero=stage0, one data-parallel replica): every rank's measured peak against the plan's,
within 0.5%, with and without sequence parallelism, fp32 and bf16, checkpointing none and full (one sweep of 8 tiny
jobs shared by the file, tests/helpers.py plan_sweep)."""

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
