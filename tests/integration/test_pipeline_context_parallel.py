"""Context parallelism per pipeline stage: parallel.pp=2 x parallel.cp=2 (Ulysses) on 4 CPU ranks, fp32, Schedule1F1B,
ScheduleGPipe and ScheduleInterleaved1F1B over grad_accum=4 micro-batches of one row of 128 positions, 3 steps: 1F1B at
zero=stage0 (DDP over each stage's 2 cp ranks) and zero=stage2 (FSDP2 over them), GPipe and interleaved at stage2.

Each stage's forward runs on its cp rank's 64 positions of every row, with their rotary angles
(trainer/model/pipeline_split.py `StageModel.forward`), the first stage fed those positions and the loss_fn the whole
rows' targets (trainer/rank/pipeline.py `cp_feed`, `PipelineLoss.cp_terms`). Against pp=2 x cp=1 on 2 ranks: losses
within 1e-5 (the order of fp32 sums differs). Every rank's measured peak within 0.5% of its plan; the cp group's
all-to-all bytes on every rank equal to its pipeline rank's plan (`bytes_by_collective_per_stage`, step 2: step 1
also runs PipelineStage's shape inference, whose forward exchanges too). Five 12 s jobs on this host's 2 cores.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import Run, run_trainer
from trainer.units import GIB

pytestmark = pytest.mark.slow

JOB = ("model=tiny", "device=cpu", "logger=none", "log_every=1", "save=off", "steps=3", "precision=fp32",
       "optim.warmup_steps=2", "seq_len=128", "micro_batch=1", "grad_accum=4", "parallel.pp=2")  # fmt: skip
"""seq_len=128: at 64 (32 positions a cp rank) the last stage's plan misses by 1.2-1.3%, as it does at pp=2 x dp=2
and seq_len=32 without cp: a pipeline plan's gap at small activations, not context parallelism's."""
CP = ("nproc=4", "parallel.cp=2", "parallel.cp_impl=ulysses")
POINTS = {
    "stage0 1f1b": ("zero=stage0",),
    "stage2 1f1b": ("zero=stage2",),
    "stage2 gpipe": ("zero=stage2", "parallel.pp_schedule=gpipe"),
    "stage2 interleaved": ("zero=stage2", "parallel.pp_schedule=interleaved_1f1b"),
}
"""Interleaved, each rank runs two stages of one block, each stage module with its own rotary table: telemetry tells
MemTracker of both (trainer/model/decoder.py `rope_cache` reads the rank module's `stage_modules`); it once saw
neither, and this point measured 1.5% under its plan."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """A point's name, or "reference" (pp=2 x cp=1 on 2 ranks, zero=stage2, 1F1B) -> the job, run once on first use."""

    @functools.cache
    def run(name: str) -> Run:
        out = tmp_path_factory.mktemp(name.replace(" ", "-")) / "run"
        point = ("nproc=2", "zero=stage2") if name == "reference" else (*CP, *POINTS[name])
        return run_trainer(out, *JOB, *point, timeout=600)

    return run


def plan_of(run: Run) -> dict[str, Any]:
    return json.loads((run.out_dir / "plan.json").read_text())


@pytest.mark.parametrize("name", list(POINTS))
def test_losses_equal_the_pipeline_without_cp(name: str, runs: Callable[[str], Run]) -> None:
    reference, losses = runs("reference").losses, runs(name).losses
    assert len(losses) == len(reference) == 3
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5, (name, losses, reference)


@pytest.mark.parametrize("name", list(POINTS))
def test_every_rank_within_half_a_percent_of_its_plan(name: str, runs: Callable[[str], Run]) -> None:
    """The lower of steps 2 and 3 (tests/helpers.py plan_sweep says why two)."""
    run = runs(name)
    for rank in plan_of(run)["ranks"]:
        key = f"memory/rank{rank['rank']}/peak_allocated_gib"
        measured = min(r[key] * GIB for r in run.records[1:] if key in r)
        planned = rank["peak_gib"] * GIB
        assert abs(planned - measured) / measured < 0.005, (name, rank["rank"], planned, measured)


@pytest.mark.parametrize("name", list(POINTS))
def test_cp_bytes_are_each_stages_plan(name: str, runs: Callable[[str], Run]) -> None:
    run = runs(name)
    cp = plan_of(run)["comm"]["groups"]["cp"]
    assert cp["ranks"] == 2 and len(cp["bytes_by_collective_per_stage"]) == 2
    record = run.records[1]
    assert record["step"] == 2
    for rank in range(4):
        stage = rank // 2  # pp outermost (trainer/layout.py): stage 0 is ranks 0-1
        for kind, payload in cp["bytes_by_collective_per_stage"][stage].items():
            measured = record.get(f"comm/rank{rank}/cp/{kind}_bytes_per_step", 0)
            assert measured == payload, (name, rank, kind, measured, payload)
        assert cp["bytes_by_collective_per_stage"][stage]["all_to_all"] > 0
