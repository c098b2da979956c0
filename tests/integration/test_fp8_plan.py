"""precision=fp8 on 2 CPU ranks (torchao's emulated Float8Linear): every rank's measured peak against the plan's,
within 0.5%, and the plan at or under it by less than 0.05% at stages 0-1 and 0.2% at stages 2-3, at zero stages
0-3, both recipes (tensorwise, rowwise), checkpointing none and full.

The 16 configurations are tests/helpers.py plan_sweep's points (tiny 3-step jobs on a token file, steps 2 and 3
tracked), composed from the same overrides; one 2-rank process group trains them in turn, as a job's ranks
would (a fresh trainee each, step 1 untracked, steps 2 and 3 each under the MemoryProbe a job's Meter uses), so
the grid costs one process group where the sweep started a job, a fork server and two ranks per point. Each
point is read back as plan_sweep gives it: the plan.json its job would write, and its records of steps 2 and 3.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import (
    assert_plan_holds_peaks,
    compose_config,
    free_port,
    freeze_imports,
    plan_sweep_point,
    torchrun_env,
    tracked_peaks,
)
from trainer.config import TrainConfig
from trainer.plan import build_plan
from trainer.units import GIB

pytest.importorskip("torchao")
# 16 points in one 2-rank process group, about 80 s (measured in a clean-clone CI run, 2026-12-06): the slow tier's,
# which keeps the default run under its 20 minutes (.ci/run runs both); tests/integration/test_fp8.py keeps fp8's
# losses in the default run.
pytestmark = pytest.mark.slow
PLAN_BOUND = 0.005
UNDER_BOUND = {"stage0": 0.0005, "stage1": 0.0005, "stage2": 0.002, "stage3": 0.002}
"""How far under the measured peak a plan may be, relative: 0.032% and 0.165% at most measured (2 runs, 2026-12-05)."""
STAGES = ("stage0", "stage1", "stage2", "stage3")
POINTS = [
    (stage, recipe, mode)
    for stage in STAGES
    for recipe in ("tensorwise", "rowwise")
    for mode in ("none", "full")
]
WORLD = 2
TRACKED = (
    2,
    3,
)  # plan_sweep's: Adam's state exists from step 2, and the lower of two identical steps is held


def point_config(tokens: Path, stage: str, recipe: str, mode: str) -> TrainConfig:
    """The TrainConfig plan_sweep's point runs: its overrides, then this point's."""
    return compose_config(
        *plan_sweep_point(tokens),
        "nproc=2",
        "precision=fp8",
        "precision.fp8_filter=all",  # auto would convert none of tiny's small GEMMs
        f"zero={stage}",
        f"precision.fp8_recipe={recipe}",
        f"checkpointing={mode}",
    )


def worker(rank: int, port: int, out_dir: str, configs: dict[str, TrainConfig]) -> None:
    os.environ.update(torchrun_env(rank, WORLD, port))
    from trainer.world import init_world, shutdown_world

    world = init_world("cpu")
    torch.set_num_threads(1)
    freeze_imports()
    peaks = {name: tracked_peaks(config, world, TRACKED) for name, config in configs.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(peaks))
    shutdown_world()


@pytest.fixture(scope="module")
def points(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], dict[str, Any]]:
    """(zero, precision.fp8_recipe, checkpointing) -> the plan.json its job writes (trainer/job.py plan_job)
    and its records of steps 2 and 3, each rank's `memory/rank{r}/peak_allocated_gib`."""
    out = tmp_path_factory.mktemp("fp8_plan")
    tokens = out / "tokens.npy"  # plan_sweep's token file
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    configs = {" ".join(point): point_config(tokens, *point) for point in POINTS}
    mp.spawn(worker, args=(free_port(), str(out), configs), nprocs=WORLD)
    peaks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {
        point: {
            "plan": build_plan(configs[" ".join(point)], "cpu", WORLD).to_json(),
            "records": [
                {"step": step}
                | {
                    f"memory/rank{r}/peak_allocated_gib": peaks[r][" ".join(point)][i] / GIB
                    for r in range(WORLD)
                }
                for i, step in enumerate(TRACKED)
            ],
        }
        for point in POINTS
    }


@pytest.mark.parametrize(("stage", "recipe", "mode"), POINTS)
def test_each_ranks_peak_is_the_plans_within_half_a_percent(
    points: dict[tuple[str, ...], dict[str, Any]], stage: str, recipe: str, mode: str
) -> None:
    point = points[(stage, recipe, mode)]
    assert (point["plan"]["fp8"]["recipe"], point["plan"]["checkpointing"]) == (recipe, mode)
    assert_plan_holds_peaks(point, PLAN_BOUND)
    # docs/memory_plan.md, "fp8": every plan at or under its measured peak, stages 0-1 by 0.00% to 0.03%, stages 2-3
    # by 0.08% to 0.17% (what the plan does not model: rowwise's per-row scales, FSDP2's fp8 buffers)
    for rank in point["plan"]["ranks"]:
        measured = min(r[f"memory/rank{rank['rank']}/peak_allocated_gib"] for r in point["records"])
        under = (measured - rank["peak_gib"]) / measured
        assert 0 <= under < UNDER_BOUND[stage], (rank["rank"], rank["peak_moment"], under)
