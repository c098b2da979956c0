"""HSDP (zero.shard_ranks) per pipeline stage: parallel.pp=2 over 8 CPU ranks, each stage's 4 data-parallel ranks two
shard groups of 2 (FSDP2 over the mesh's `(dp_replicate, dp_shard)` sub-mesh, trainer/rank/mesh.py), at zero=stage2
and stage3, fp32, Schedule1F1B over grad_accum=4 micro-batches of one sequence, 4 steps.

Each against the same pipeline without HSDP (its 4 dp ranks one shard group): per-step losses within 1e-5; every
rank's measured tensor peak within 0.5% of its stage's plan; every rank's bytes by collective in each group (shard,
replicate, pp) equal to its pipeline rank's plan, the loop's own collectives aside. Marked slow: 8 ranks of gloo on
CI's cores (about 20 s a job, four jobs).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import TINY, Run, layer_norms_bytes, run_trainer
from trainer.layout import Layout
from trainer.plan import GROUPS
from trainer.telemetry.comm import FIELDS as COMM_FIELDS
from trainer.telemetry.memory import CPU_FIELDS
from trainer.telemetry.metrics import BASE_FIELDS, PIPELINE_FIELDS
from trainer.units import GIB

pytestmark = pytest.mark.slow

WORLD = 8
JOB = ("nproc=8", "micro_batch=1", "parallel.pp=2", "grad_accum=4", "zero.reduce_every=step", "save=off",
       "steps=4", "precision=fp32", "optim.warmup_steps=2")  # fmt: skip
HSDP = "zero.shard_ranks=2"
ZEROS = ("stage2", "stage3")
LAYOUT = Layout(pp=2, dp_replicate=2, dp_shard=2)
"""The HSDP job's layout (trainer/layout.py): stage 0 ranks 0-3, stage 1 ranks 4-7; shard groups {0,1}, {2,3}, ..."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Run]:
    """Each (zero stage, HSDP or not) job, run once on first use (one multi-rank job at a time)."""

    @functools.cache
    def run(zero: str, hsdp: bool) -> Run:
        out = tmp_path_factory.mktemp(f"pp-{zero}-{'hsdp' if hsdp else 'fsdp'}") / "run"
        return run_trainer(out, *TINY, *JOB, f"zero={zero}", *((HSDP,) if hsdp else ()), timeout=900)

    return run


def plan_of(run: Run) -> dict[str, Any]:
    return json.loads((run.out_dir / "plan.json").read_text())


@pytest.mark.parametrize("zero", ZEROS)
def test_losses_equal_the_same_pipeline_without_hsdp(zero: str, runs: Callable[[str, bool], Run]) -> None:
    hsdp, plain = runs(zero, True), runs(zero, False)
    assert len(hsdp.losses) == len(plain.losses) == 4
    worst = max(abs(a - b) for a, b in zip(hsdp.losses, plain.losses))
    assert worst < 1e-5, (zero, hsdp.losses, plain.losses)


@pytest.mark.parametrize("zero", ZEROS)
def test_every_rank_within_half_a_percent_of_its_stage_plan(
    zero: str, runs: Callable[[str, bool], Run]
) -> None:
    """Each stage's ranks (plan.json's `global_ranks`), their peak the largest MemTracker measured."""
    run = runs(zero, True)
    stages = plan_of(run)["pipeline"]["stages"]
    assert sorted(rank for stage in stages for rank in stage["global_ranks"]) == list(range(WORLD))
    for stage in stages:
        for rank in stage["global_ranks"]:
            key = f"memory/rank{rank}/peak_allocated_gib"
            measured = max(r[key] * GIB for r in run.records if key in r)
            assert abs(stage["peak_bytes"] - measured) / measured < 0.005, (
                zero,
                rank,
                stage["peak_bytes"],
                measured,
            )


def loop_extra(group: str, kind: str, stage_tensors: int) -> int:
    """The loop's own collectives the plan leaves out (docs/communication.md), in the step-2 window: on the default
    group (`world`: no plan group spans every rank) the non-finite and stop agreement (world + 2 fp32 flags), the
    per-layer norms and step 1's metric gather (a float64 row per rank); on the shard group, clipping's fp32 norm
    per parameter tensor of the rank's stage (a DTensor over (Replicate, Shard): reduced over the shard dim only)."""
    if group == "world":
        columns = len(BASE_FIELDS) + len(PIPELINE_FIELDS) + len(CPU_FIELDS) + len(COMM_FIELDS)
        return {"all_gather": 8 * WORLD * columns, "all_reduce": 4 * (WORLD + 2) + layer_norms_bytes()}.get(
            kind, 0
        )
    return 4 * stage_tensors if group == "shard" and kind == "all_reduce" else 0


@pytest.mark.parametrize("zero", ZEROS)
def test_each_groups_bytes_are_the_plans(zero: str, runs: Callable[[str, bool], Run]) -> None:
    """Step 2 (step 1 also runs PipelineStage's shape inference): on every rank the shard group's all-gathers and
    reduce-scatters (gloo: all-reduces), the replicate group's all-reduce of each gradient shard and the pp
    group's two scalars are its pipeline rank's plan (`bytes_by_collective_per_stage`), to the byte."""
    run = runs(zero, True)
    groups = plan_of(run)["comm"]["groups"]
    assert set(groups) == {"shard", "replicate", "pp"}, groups
    assert groups["shard"]["ranks"] == groups["replicate"]["ranks"] == 2
    record = run.records[1]
    assert record["step"] == 2
    stages = plan_of(run)["pipeline"]["stages"]
    for rank in range(WORLD):
        measured = {g for g in GROUPS if f"comm/rank{rank}/{g}/bytes_per_step" in record}
        assert measured == set(groups) | {"world"}, (zero, rank, measured)
        stage = LAYOUT.coords(rank)["pp"]
        blocks = sum(stop - start for start, stop in stages[stage]["blocks"])
        tensors = (
            9 * blocks + (stage == 0) + 2 * (stage == 1)
        )  # tiny's 9 a block, the embedding, norm and head
        for group, planned in groups.items():
            figures = (
                planned["bytes_by_collective"]
                if group == "pp"
                else planned["bytes_by_collective_per_stage"][stage]
            )
            for kind, payload in figures.items():
                got = record.get(f"comm/rank{rank}/{group}/{kind}_bytes_per_step", 0)
                assert got == payload + loop_extra(group, kind, tensors), (
                    zero,
                    rank,
                    group,
                    kind,
                    got,
                    payload,
                )
    assert groups["replicate"]["bytes_by_collective"]["all_reduce"] > 0
