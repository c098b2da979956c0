"""precision=fp8 on 2 CPU ranks (torchao's emulated Float8Linear): every rank's measured peak against the plan's,
within 0.5%, at zero stages 0-3, both recipes (tensorwise, rowwise), checkpointing none and full (one sweep of 16
tiny jobs shared by the file; a token file, so that no synthetic-data tables, which the plan counts and a tracked
step never touches, stand between the two)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.helpers import TINY, point_dirs, run_sweep, settings
from trainer.jsonl import read_jsonl

pytest.importorskip("torchao")
PLAN_BOUND = 0.005
EXCLUDED = ("sweeps", "fail_fast", "logger", "logger.project", "logger.entity", "resume", "data.path")
STAGES = ("stage0", "stage1", "stage2", "stage3")
POINTS = [
    (stage, recipe, mode)
    for stage in STAGES
    for recipe in ("tensorwise", "rowwise")
    for mode in ("none", "full")
]


@pytest.fixture(scope="module")
def points(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(zero, precision.fp8_recipe, checkpointing) -> the job's plan.json and its last metrics record (step 2:
    Adam's state exists)."""
    tmp = tmp_path_factory.mktemp("fp8_plan")
    tokens = tmp / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    proc = run_sweep(
        tmp / "sweep",
        *TINY,
        "nproc=2",
        "precision=fp8",
        "save=off",
        "steps=2",
        "telemetry.memory_every=1",
        "data=tokens",
        f"data.path={tokens}",
        f"zero={','.join(STAGES)}",
        "precision.fp8_recipe=tensorwise,rowwise",
        "checkpointing=none,full",
        # the token file's path stays out of the points' directory names (it holds slashes)
        f"hydra.job.config.override_dirname.exclude_keys=[{','.join(EXCLUDED)}]",
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for point in point_dirs(tmp / "sweep"):
        s = settings(point)
        out[(s["zero"], s["precision.fp8_recipe"], s["checkpointing"])] = {
            "plan": json.loads((point / "plan.json").read_text()),
            "record": read_jsonl(point / "metrics.jsonl")[-1],
        }
    return out


@pytest.mark.parametrize(("stage", "recipe", "mode"), POINTS)
def test_each_ranks_peak_is_the_plans_within_half_a_percent(
    points: dict[tuple[str, str, str], dict[str, Any]], stage: str, recipe: str, mode: str
) -> None:
    point = points[(stage, recipe, mode)]
    assert (point["plan"]["fp8"]["recipe"], point["plan"]["checkpointing"]) == (recipe, mode)
    for rank in point["plan"]["ranks"]:
        measured = point["record"][f"memory/rank{rank['rank']}/peak_allocated_gib"]
        assert abs(rank["peak_gib"] - measured) / measured < PLAN_BOUND, (
            rank["peak_moment"],
            rank["peak_gib"],
            measured,
        )
