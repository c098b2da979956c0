"""Memory that creeps (trainer/telemetry/creep.py): a rank that keeps one 8 MiB tensor per step
(trainer/rank/loop.py LEAK_ENV, a test-only hook) is reported as growth per step in the console and
summary.json; the same run without it reports none."""

from __future__ import annotations

import math
import os

import pytest

from tests.helpers import TINY, Run, run_trainer
from trainer.rank.loop import LEAK_ENV

pytestmark = pytest.mark.timeout(300)

ARGS = (*TINY, "nproc=2", "steps=8", "save=off")
LEAK_MIB = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    base = tmp_path_factory.mktemp("creep")
    leaking = run_trainer(base / "leak", *ARGS, env={**os.environ, LEAK_ENV: str(LEAK_MIB)})
    normal = run_trainer(base / "normal", *ARGS)
    return leaking, normal


def test_a_leak_is_reported_as_growth_per_step(runs: tuple[Run, Run]) -> None:
    leaking, _ = runs
    creep = leaking.summary["memory/creep"]
    assert (creep["figure"], creep["first_step"], creep["at_step"]) == (
        "peak_rss",
        5,
        8,
    )  # steps 2-8's later half
    assert (
        abs(creep["gib_per_step"] * 1024 - LEAK_MIB) < 0.5
    )  # the host peak grows by the tensor kept: 8.17 seen
    room = leaking.summary["plan"]["device_memory_gib"] - leaking.summary["memory/predicted_peak_gib"]
    assert creep["reaches_limit_at_step"] == 5 + math.ceil(room / creep["gib_per_step"])
    assert f"memory creeps on rank {creep['rank']}: peak_rss grows" in leaking.stdout


def test_a_normal_run_reports_none(runs: tuple[Run, Run]) -> None:
    _, normal = runs
    assert "memory/creep" not in normal.summary
    assert "memory creeps" not in normal.stdout
