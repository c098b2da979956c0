"""The ZeRO arithmetic, measured: the bytes of parameters, gradients and optimizer state each rank holds."""

from __future__ import annotations

import pytest

from trainer.config import ModelConfig
from trainer.model.decoder import build_model, num_params

GIB = 2**30
TINY = ModelConfig()  # conf/model/tiny.yaml has the dataclass defaults


def held_bytes(record: dict, rank: int) -> dict[str, int]:
    """Exact byte counts (the GiB figures are bytes / 2**30 in float64, so this is lossless)."""
    return {
        kind: round(record[f"memory/rank{rank}/{kind}_gib"] * GIB)
        for kind in ("params", "grads", "optimizer")
    }


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, int]]]:
    from tests.helpers import TINY as SETTINGS
    from tests.helpers import sweep_runs

    runs = sweep_runs(  # one job per stage, as the points of one sweep
        tmp_path_factory.mktemp("stages"),
        *SETTINGS,
        "nproc=2",
        "steps=1",
        "zero=stage0,stage1,stage2,stage3",
        by=("zero",),
    )
    return {stage: [held_bytes(run.records[-1], rank) for rank in (0, 1)] for (stage,), run in runs.items()}


def test_stage0_replicates_everything(states: dict) -> None:
    p = num_params(TINY)
    for rank in (0, 1):
        assert states["stage0"][rank] == {"params": 4 * p, "grads": 4 * p, "optimizer": 8 * p}


def test_stage1_shards_only_the_optimizer_state(states: dict) -> None:
    full = states["stage0"][0]
    ranks = states["stage1"]
    for rank in (0, 1):
        assert ranks[rank]["params"] == full["params"] and ranks[rank]["grads"] == full["grads"]
    assert ranks[0]["optimizer"] + ranks[1]["optimizer"] == full["optimizer"]
    # ZeroRedundancyOptimizer partitions whole parameters, so a rank is off half by less than the largest one.
    largest = max(p.numel() for p in build_model(TINY, device="meta").parameters()) * 8
    for rank in (0, 1):
        assert abs(ranks[rank]["optimizer"] - full["optimizer"] / 2) < largest
    assert max(r["optimizer"] for r in ranks) < 0.55 * full["optimizer"]


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_fsdp_stages_hold_exactly_half_of_everything_at_rest(states: dict, stage: str) -> None:
    full = states["stage0"][0]
    for rank in (0, 1):
        assert states[stage][rank] == {kind: full[kind] // 2 for kind in full}


def test_three_ranks_hold_fsdp2s_padded_shard_as_the_plan_says(tmp_path) -> None:
    """With 3 ranks the tiny model's dims do not divide: FSDP2 rounds each dim 0 up to a multiple of 3,
    so the last rank's view is shorter than the padded shard it holds. Telemetry counts what memory
    holds, and equals the plan to the byte on every rank."""
    import json

    from tests.helpers import TINY as SETTINGS
    from tests.helpers import run_trainer

    run = run_trainer(tmp_path, *SETTINGS, "nproc=3", "steps=1", "zero=stage3")
    plan = json.loads((run.out_dir / "plan.json").read_text())
    measured = [held_bytes(run.records[-1], rank) for rank in range(3)]
    planned = [
        {kind: round(r[f"{kind}_gib"] * GIB) for kind in ("params", "grads", "optimizer")}
        for r in plan["ranks"]
    ]
    assert measured == planned
    # The padding is real: the last rank's optimizer state (Adam's moments, made like the unpadded
    # view) is less than twice its parameters' bytes, the other ranks' exactly twice.
    assert [m["optimizer"] == 2 * m["params"] for m in measured] == [True, True, False]
