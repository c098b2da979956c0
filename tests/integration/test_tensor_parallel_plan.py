"""parallel.tp=2: every rank's measured peak against the plan's, within 0.5%, with and without sequence parallelism,
checkpointing none and full: on 2 CPU ranks (zero=stage0, one data-parallel replica) fp32 and bf16 (one sweep of 8
tiny jobs), and on 4 (dp 2, zero=stage3, FSDP2 over the dp dimension) bf16, where a block's ffn_norm backward can
be the peak (one sweep of 4; tests/helpers.py plan_sweep). Without sequence parallelism, the same sweeps' bytes of
every collective in the tp and shard groups as planned (test_tensor_parallel.py holds them with it)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import assert_plan_holds_peaks, layer_norms_bytes, plan_sweep
from trainer.config import ModelConfig
from trainer.plan.states import model_shape
from trainer.telemetry.comm import FIELDS as COMM_FIELDS
from trainer.telemetry.memory import CPU_FIELDS
from trainer.telemetry.metrics import BASE_FIELDS
from trainer.units import GIB

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
    assert_plan_under_peaks_by_at_most(point, 16)  # docs/memory_plan.md: "the measured peak to 16 bytes"


def assert_plan_under_peaks_by_at_most(point: dict[str, Any], most: int) -> None:
    """Every rank's plan at or under its measured peak (the lower of steps 2 and 3, as assert_plan_holds_peaks) by
    at most `most` bytes (token data: no synthetic-data tables in the plan)."""
    for rank in point["plan"]["ranks"]:
        measured = min(r[f"memory/rank{rank['rank']}/peak_allocated_gib"] for r in point["records"])
        gap = round((measured - rank["peak_gib"]) * GIB)
        assert 0 <= gap <= most, (rank["rank"], rank["peak_moment"], gap)


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


@pytest.mark.slow  # a 4-rank sweep of four jobs: the default tier's time (README)
@pytest.mark.parametrize(("sp", "mode"), DP2_POINTS)
def test_each_ranks_peak_is_the_plans_at_dp2_stage3_bf16(
    dp2_points: dict[tuple[str, ...], dict[str, Any]], sp: str, mode: str
) -> None:
    point = dp2_points[(sp, mode)]
    assert (point["plan"]["checkpointing"], len(point["plan"]["ranks"])) == (mode, 4)
    assert_plan_holds_peaks(point, PLAN_BOUND)
    assert_plan_under_peaks_by_at_most(point, 12_560)  # docs/memory_plan.md: "8,208 to 12,560 bytes under"


def loop_bytes(group: str, kind: str, world: int) -> int:
    """The loop's own collectives in a step-2 window (docs/communication.md), by group: on the default group
    (tp's on 2 ranks, every rank's `world` on 4) the non-finite agreement (world + 2 fp32 flags), the per-layer
    norms (layer_norms_bytes) and step 1's
    metric gather (world float64 rows: the loop's, the memory probe's and the comm probe's columns); clipping's
    fp32 norm per parameter tensor in each group the DTensor parameters are sharded over (tp, and shard)."""
    default_group = "tp" if world == 2 else "world"
    if kind == "all_gather":
        columns = len(BASE_FIELDS) + len(CPU_FIELDS) + len(COMM_FIELDS)
        return 8 * world * columns if group == default_group else 0
    if kind != "all_reduce":
        return 0
    clipping = 4 * len(model_shape(ModelConfig()).order) if group in ("tp", "shard") else 0
    return clipping + (4 * (world + 2) + layer_norms_bytes() if group == default_group else 0)


def assert_bytes_per_collective_are_the_plans(point: dict[str, Any], world: int) -> None:
    groups = point["plan"]["comm"]["groups"]
    assert set(groups) == ({"tp"} if world == 2 else {"tp", "shard"}), groups
    record = point["records"][0]
    assert record["step"] == 2
    for rank in range(world):
        for group, planned in groups.items():
            for kind, payload in planned["bytes_by_collective"].items():
                measured = record.get(f"comm/rank{rank}/{group}/{kind}_bytes_per_step", 0)
                extra = loop_bytes(group, kind, world)
                assert measured == payload + extra, (rank, group, kind, measured, payload, extra)


# checkpointing=none only: under checkpointing=full the plan counts one B·T·D all-reduce (gloo's reduce-scatter) per
# block more than is measured (4 x 65,536 bytes in fp32 on the tiny model, SP or not): not yet traced (docs/testing.md)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bytes_per_collective_without_sp_equal_the_plan(
    points: dict[tuple[str, ...], dict[str, Any]], precision: str
) -> None:
    """parallel.sp=false on 2 ranks (dp 1, zero=stage0): the tp group's all-reduces of the row-wise layers'
    outputs (forward), of the column-wise layers' input gradients (backward) and loss_parallel's, as planned."""
    assert_bytes_per_collective_are_the_plans(points[("false", precision, "none")], world=2)


@pytest.mark.slow  # the 4-rank sweep above
def test_bytes_per_collective_without_sp_equal_the_plan_at_dp2_stage3_bf16(
    dp2_points: dict[tuple[str, ...], dict[str, Any]],
) -> None:
    """parallel.sp=false on 4 ranks (dp 2, zero=stage3, bf16): the tp group's and FSDP2's shard group's."""
    assert_bytes_per_collective_are_the_plans(dp2_points[("false", "none")], world=4)
