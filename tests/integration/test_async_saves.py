"""Saves written in the background (save.async_mode, trainer/saves/background.py): the same saves as
written in place, never listed before they are whole, drained before a job ends, and timed.
Real 2-rank jobs on CPU (gloo), fp32, tiny; the runs are shared by the tests of this module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import TINY, Run, assert_nothing_left, run_trainer
from trainer.saves.dcp import list_saves, save_step
from trainer.saves.integrity import save_problem

pytestmark = pytest.mark.timeout(400)

RUN = ("nproc=2", "precision=fp32", "steps=8", "optim.warmup_steps=2", "save.every=4", "save.keep=3")


def job(out_dir: Path, *overrides: str, check: bool = True) -> Run:
    return run_trainer(out_dir, *TINY, *RUN, *overrides, check=check)


@pytest.fixture(scope="module")
def in_place(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Saved in place (save.async_mode=off): the saves and losses the background ones must equal."""
    return job(tmp_path_factory.mktemp("off") / "run")


@pytest.fixture(scope="module")
def threaded(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return job(tmp_path_factory.mktemp("thread") / "run", "save.async_mode=thread")


def saved(run_dir: Path, step: int, scratch: Path) -> dict[str, Any]:
    """A save as one nested dict, through DCP's own converter."""
    target = scratch / f"{run_dir.parent.name}_{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:08d}", target)
    return torch.load(target, weights_only=False)


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """Every entry equal; Python's and NumPy's global generators aside: each job seeds them from the
    OS's entropy (random reseeds in every forked process, NumPy at import), so they differ between
    any two runs, and training never draws from them."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            if not (where.startswith(".rng.") and key in ("python", "numpy")):
                assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert repr(a) == repr(b), where


def test_a_background_save_is_bitwise_the_save_written_in_place(
    in_place: Run, threaded: Run, tmp_path: Path
) -> None:
    assert threaded.losses == in_place.losses  # the write beside the steps changed nothing they compute
    assert [save_step(p) for p in list_saves(threaded.out_dir)] == [4, 8]
    for step in (4, 8):  # model, optimizer, scheduler, every rank's generators, progress
        assert_bitwise_equal(saved(threaded.out_dir, step, tmp_path), saved(in_place.out_dir, step, tmp_path))
    assert list((threaded.out_dir / "checkpoints").glob(".tmp_*")) == []
    assert_nothing_left(threaded.marker)


def test_every_save_is_timed_in_metrics_and_summary(in_place: Run, threaded: Run) -> None:
    for run in (in_place, threaded):
        saves = run.summary["saves"]
        assert [s["step"] for s in saves] == [4, 8]
        assert all(s["total_s"] >= s["blocking_s"] for s in saves)
        timed = [r for r in run.records if "save/step" in r]
        # The step-4 save's figures in a record after it; the last save's come after the last record.
        # A background write that outlasts steps 5-8 (tiny steps on a quiet host) is drained by the
        # step-8 save, after the last record: its figures are then in summary.json alone.
        assert [r["save/step"] for r in timed] == [4] or (run is threaded and timed == [])
        assert [(r["step"] > 4, r["time/save_blocking_s"]) for r in timed] == [
            (True, saves[0]["blocking_s"])
        ] * len(timed)
        assert run.summary["time/save_blocking_s"] == sum(s["blocking_s"] for s in saves) / 2
    assert in_place.summary["saves"][0]["blocking_s"] == in_place.summary["saves"][0]["total_s"]
    assert "save/writing" not in in_place.records[0] and threaded.records[4]["save/writing"] == 1


PREPARE = ("time/save_prepare_blocking_s", "time/save_prepare_total_s")


def test_the_staging_copy_is_prepared_after_the_first_step_and_timed(in_place: Run, threaded: Run) -> None:
    """Started at step 2's boundary, complete by the step-4 save at the latest (whose record is step 5's)."""
    prepared = [r for r in threaded.records if PREPARE[0] in r]
    assert len(prepared) == 1 and 2 <= prepared[0]["step"] <= 5
    assert {key: threaded.summary[key] for key in PREPARE} == {key: prepared[0][key] for key in PREPARE}
    # the steps it ran beside (2 up to the one before the step that noticed it done) count as writing
    assert [r["save/writing"] for r in threaded.records[1 : prepared[0]["step"] - 1]] == [1] * (
        prepared[0]["step"] - 2
    )
    assert (
        not any(key in r for r in in_place.records for key in PREPARE) and PREPARE[0] not in in_place.summary
    )


def test_a_kill_during_the_background_write_resumes_from_the_save_before(
    tmp_path: Path, in_place: Run
) -> None:
    """Process mode: rank 0 is SIGKILLed while the step-8 save is written by its save process."""
    day = tmp_path / "runs" / "day"
    kill = ("fault.kind=kill_during_save", "fault.step=8", "fault.rank=0")
    killed = job(day / "t1", "save.async_mode=process", *kill, check=False)
    assert killed.returncode == 1 and killed.summary["status"] == "crashed"
    assert [save_step(p) for p in list_saves(killed.out_dir)] == [4]  # step 8's is not listed
    assert all(save_problem(p) is None for p in list_saves(killed.out_dir))
    assert_nothing_left(killed.marker)  # the ranks and both save processes

    job(day / "t2", "save.async_mode=process", "resume=true")  # continues in killed's directory
    assert killed.losses == in_place.losses  # resumed from the background save of step 4: bitwise
    assert [save_step(p) for p in list_saves(killed.out_dir)] == [4, 8]
    # the killed save's directory pruned, the empty save that started the save process removed
    assert list((killed.out_dir / "checkpoints").glob(".tmp_*")) == []
    # its figures in summary.json through rank 0 (the step-8 save waited for the save process's start)
    assert set(PREPARE) <= killed.summary.keys()


def test_sigterm_during_the_background_write_ends_preempted_with_that_save_listed(tmp_path: Path) -> None:
    """Rank 1 receives SIGTERM while the step-4 save is written in the background."""
    run = job(
        tmp_path / "run",
        "save.async_mode=thread",
        "fault.kind=term_during_save",
        "fault.step=4",
        "fault.rank=1",
        check=False,
    )
    assert run.returncode == 143 and run.summary["status"] == "preempted", run.stderr
    assert run.summary["stopped_step"] == 5
    assert [save_step(p) for p in list_saves(run.out_dir)] == [4, 5]  # the one in flight, and the stop's
    assert all(save_problem(p) is None for p in list_saves(run.out_dir))
    assert list((run.out_dir / "checkpoints").glob(".tmp_*")) == []
    assert_nothing_left(run.marker)
