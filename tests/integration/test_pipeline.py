"""Pipeline parallelism (parallel.pp=2) on CPU ranks, composed with ZeRO over dp.

One job per configuration, shared by the module: the three schedules on 2 ranks (dp 1, zero=stage0), and 1F1B
on 4 ranks (dp 2) at stage0 and stage3, each against one 1-rank run of the same global batch (8 sequences:
grad_accum=4 micro-batches), fp32, 8 steps: per-step losses within 1e-5. The 1F1B run's step-4 save resumes
at pp=1. Its records carry each stage's measured idle share and the bytes its stages sent each other.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import TINY, Run, run_trainer
from trainer.config import ModelConfig
from trainer.telemetry import keys

STEPS = ("steps=8", "precision=fp32", "optim.warmup_steps=2", "grad_accum=4")
PP2 = ("parallel.pp=2", "zero.reduce_every=step")
CONFIGS = {
    "1f1b dp1 stage0": ("nproc=2", "micro_batch=2", "zero=stage0", "save.every=4"),
    "gpipe dp1 stage0": ("nproc=2", "micro_batch=2", "zero=stage0", "parallel.pp_schedule=gpipe", "save=off"),
    "interleaved dp1 stage0": (
        "nproc=2",
        "micro_batch=2",
        "zero=stage0",
        "parallel.pp_schedule=interleaved_1f1b",
        "save=off",
    ),
    "1f1b dp2 stage0": ("nproc=4", "micro_batch=1", "zero=stage0", "save=off"),
    "1f1b dp2 stage3": ("nproc=4", "micro_batch=1", "zero=stage3", "save=off"),
}
SEQ_LEN = 64  # TINY's


def job(out_dir: Path, *overrides: str) -> Run:
    return run_trainer(out_dir, *TINY, *STEPS, *overrides, timeout=900)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return job(tmp_path_factory.mktemp("ref") / "run", "nproc=1", "micro_batch=2", "save=off")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Run]:
    out = tmp_path_factory.mktemp("pp") / "run"
    return request.param, job(out, *PP2, *CONFIGS[request.param])


def test_losses_equal_one_rank_of_the_same_global_batch(pp_run: tuple[str, Run], reference: Run) -> None:
    name, run = pp_run
    assert len(run.losses) == len(reference.losses) == 8
    worst = max(abs(a - b) for a, b in zip(run.losses, reference.losses))
    assert worst < 1e-5, (name, run.losses, reference.losses)


def test_the_split_is_printed(pp_run: tuple[str, Run]) -> None:
    name, run = pp_run
    if "interleaved" in name:
        expected = (
            "pipeline: 4 stages over parallel.pp=2 ranks; stage 0 (rank 0): blocks 0-0 + embedding; "
            "stage 1 (rank 1): blocks 1-1; stage 2 (rank 0): blocks 2-2; stage 3 (rank 1): blocks 3-3 + norm, head, loss"
        )
    else:
        expected = (
            "pipeline: 2 stages over parallel.pp=2 ranks; stage 0 (rank 0): blocks 0-1 + embedding; "
            "stage 1 (rank 1): blocks 2-3 + norm, head, loss"
        )
    assert expected in run.stdout.splitlines(), (name, run.stdout)


def test_bytes_between_stages_are_the_activations_and_their_gradients(pp_run: tuple[str, Run]) -> None:
    """Each boundary between consecutive stages carries every micro-batch's hidden states forward and their
    gradient back, fp32: grad_accum * micro_batch * seq_len * dim * 4 bytes each way, per replica."""
    name, run = pp_run
    micro_batch = 1 if "dp2" in name else 2
    boundaries = 3 if "interleaved" in name else 1
    one_way = 4 * micro_batch * SEQ_LEN * ModelConfig().dim * 4
    for record in run.records:
        assert record[keys.PP_MEASURED_BYTES] == 2 * boundaries * one_way, (name, record)
        if boundaries == 1:  # stage 0 sends activations, stage 1 their gradients
            assert record[keys.pp_sent_key(0)] == record[keys.pp_sent_key(1)] == one_way


def test_each_stage_reports_its_idle_share(pp_run: tuple[str, Run]) -> None:
    """Per rank in every record; per stage the mean over the replicas; per stage in summary.json."""
    name, run = pp_run
    world = int(CONFIGS[name][0].removeprefix("nproc="))
    summary = json.loads((run.out_dir / "summary.json").read_text())
    for record in run.records:
        ranks = [record[keys.pp_rank_idle_key(rank)] for rank in range(world)]
        assert all(0.0 <= share < 1.0 for share in ranks), (name, ranks)
        for stage in (0, 1):
            mine = ranks[stage::2]
            assert math.isclose(record[keys.pp_idle_key(stage)], sum(mine) / len(mine)), (name, record)
    for stage in (0, 1):
        assert 0.0 <= summary[keys.pp_idle_key(stage)] < 1.0, (name, summary)


def test_a_pipelined_save_resumes_at_pp1(tmp_path: Path, pp_run: tuple[str, Run], reference: Run) -> None:
    """The step-4 save of pp=2 (each rank wrote its stage's parameters under the decoder's own names) goes on at
    pp=1 on one rank, the same global batch: DCP reshards; steps 5-8 as the uninterrupted run's, within
    test_resume.py's reshard tolerance (rel 1e-5)."""
    name, run = pp_run
    if name != "1f1b dp1 stage0":
        pytest.skip("the 1f1b run saves")
    save = run.out_dir / "checkpoints" / "step_00000004"
    resumed = job(tmp_path / "run", "nproc=1", "micro_batch=2", "save=off", f"resume={save}")
    assert [r["step"] for r in resumed.records] == [5, 6, 7, 8]
    for record, expected in zip(resumed.records, reference.records[4:]):
        assert math.isclose(record["loss/train"], expected["loss/train"], rel_tol=1e-5), (record, expected)
