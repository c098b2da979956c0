"""The routing watch of a mixture of experts: the plan's imbalance past which a rank runs out of memory
(trainer/job.py `routing_limit`), and the one line a forward past it prints (trainer/model/moe.py RoutingWatch)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import compose_config
from trainer.job import routing_limit
from trainer.model.moe import RoutingWatch
from trainer.plan import build_plan
from trainer.telemetry import keys
from trainer.units import GIB

SHAPE = ("model=tiny-moe", "device=cpu", "nproc=1", "seq_len=256", "micro_batch=4", "model.moe_ffn_dim=512")


def planned_peak(imbalance: float, *overrides: str) -> int:
    config = compose_config(*SHAPE, f"moe.imbalance={imbalance}", *overrides)
    return build_plan(config, "cpu", 1).peak_bytes


def test_the_limit_is_where_the_plans_peak_reaches_the_ranks_memory() -> None:
    """The memory between the plans at imbalance 2 and 4 (every token on one expert of 8, top 2): the imbalance
    found is between them, and the plan there reaches that memory (within a byte per row of rounding)."""
    low, high = planned_peak(2.0), planned_peak(4.0)
    assert high > low
    cap_gib = (low + 0.6 * (high - low)) / GIB
    config = compose_config(*SHAPE, "moe.imbalance=2.0", f"device_memory_gib={cap_gib!r}")
    limit = routing_limit(config, build_plan(config, "cpu", 1), "cpu", 1)
    at = limit[keys.MOE_OOM_IMBALANCE]
    assert 2.0 < at < 4.0 and limit[keys.MOE_OOM_LIMIT_GIB] == pytest.approx(cap_gib)
    there = planned_peak(at, f"device_memory_gib={cap_gib!r}")
    assert abs(there - cap_gib * GIB) / (high - low) < 0.02


def test_no_limit_where_no_routing_can_run_out_or_nothing_fits() -> None:
    roomy = compose_config(*SHAPE, "device_memory_gib=8")
    assert routing_limit(roomy, build_plan(roomy, "cpu", 1), "cpu", 1) == {}
    tight = compose_config(*SHAPE, "device_memory_gib=0.01", "plan.enforce=false")
    assert routing_limit(tight, build_plan(tight, "cpu", 1), "cpu", 1) == {}
    dense = compose_config(
        "model=tiny", "device=cpu", "nproc=1", "device_memory_gib=0.01", "plan.enforce=false"
    )
    assert routing_limit(dense, build_plan(dense, "cpu", 1), "cpu", 1) == {}


def test_a_forward_past_the_limit_warns_once_with_its_step(capsys: pytest.CaptureFixture[str]) -> None:
    watch = RoutingWatch(oom_imbalance=3.0, planned=2.0, limit_gib=0.104, rank=1)
    watch.step = 5
    watch.check(0, [40, 40, 40, 40, 40, 40, 40, 40])  # balanced: 1.0
    watch.check(1, [110, 30, 30, 30, 30, 30, 30, 30])  # 2.75
    assert capsys.readouterr().err == ""
    watch.check(1, [128, 64, 16, 16, 16, 16, 32, 32])  # 128 of 320 over 8 experts: 3.2
    watch.step = 6
    watch.check(0, [320, 0, 0, 0, 0, 0, 0, 0])
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "warning: rank 1 step 5: block 1 sent 128 of 320 assignments to one expert, imbalance 3.20 (planned: "
        "moe.imbalance=2); past 3.00 the plan's peak passes the 0.104 GiB a rank has: routing like this runs out "
        "of memory; plan with moe.imbalance=3.20"
    ]
    assert dataclasses.asdict(watch)["warned"] is True
