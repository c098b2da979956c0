"""checkpointing=op on 2 CPU ranks: every rank's measured peak against the plan's, within 0.5%,
at every ZeRO stage in fp32 and bf16 (one sweep of 8 tiny jobs, shared by the tests)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import run_sweep
from trainer.jsonl import read_jsonl

GIB = 2**30
STAGES = ("stage0", "stage1", "stage2", "stage3")
JOB = (
    "model=tiny",
    "nproc=2",
    "device=cpu",
    "logger=none",
    "save=off",
    "seq_len=64",
    "micro_batch=2",
    "steps=2",
    "log_every=1",
    "telemetry.memory_every=0",  # step 2 alone is tracked: the test reads its record
    "checkpointing=op",
)


@pytest.fixture(scope="module")
def points(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """(stage, precision) -> the job's plan.json and its last metrics record (step 2: Adam's state exists)."""
    sweep = tmp_path_factory.mktemp("op_sweep")
    proc = run_sweep(sweep, *JOB, f"zero={','.join(STAGES)}", "precision=fp32,bf16", timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for job in (p for p in sweep.iterdir() if (p / "plan.json").is_file()):
        plan = json.loads((job / "plan.json").read_text())
        out[(plan["zero"], plan["precision"])] = {
            "plan": plan,
            "record": read_jsonl(job / "metrics.jsonl")[-1],
        }
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_each_ranks_peak_is_the_plans_within_half_a_percent(points, stage: str, precision: str) -> None:
    point = points[(stage, precision)]
    assert point["plan"]["checkpointing"] == "op"
    for rank in point["plan"]["ranks"]:
        measured = point["record"][f"memory/rank{rank['rank']}/peak_allocated_gib"]
        assert abs(rank["peak_gib"] - measured) / measured < 0.005, (
            rank["peak_moment"],
            rank["peak_gib"],
            measured,
        )
