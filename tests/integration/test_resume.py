"""Nothing lost: exact resume after a SIGKILL, a kill during a save, resharding across world sizes
and stages, elastic restarts, and the non-finite policy. Real 2-rank jobs on CPU (gloo), fp32.

Runs that `resume=true` must find live in Hydra's `<root>/<date>/<time>` layout, as under outputs/runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import TINY, Run, assert_nothing_left, run_trainer, wandb_records
from trainer.saves.dcp import list_saves, read_progress

# 12 steps saving every 4 (keep 2); warmup 2 so that the schedule turns within the run.
RUN = ("nproc=2", "precision=fp32", "steps=12", "optim.warmup_steps=2", "save.every=4", "save.keep=2")
STAGE = "zero=stage1"  # ZeRO-1: each rank saves only its partition of the optimizer state
KILL_RANK1_AT_7 = ("fault.kind=kill", "fault.step=7", "fault.rank=1")  # after step 6 is logged


def job(out_dir: Path, *overrides: str, check: bool = True) -> Run:
    return run_trainer(out_dir, *TINY, *overrides, check=check)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The uninterrupted run every resumed run is compared with."""
    return job(tmp_path_factory.mktemp("ref") / "runs" / "day" / "t0", *RUN, STAGE)


def test_a_killed_run_resumes_with_bitwise_equal_losses(tmp_path: Path, reference: Run) -> None:
    day = tmp_path / "runs" / "day"
    killed = job(day / "t1", *RUN, STAGE, *KILL_RANK1_AT_7, "logger=wandb", check=False)
    assert (
        killed.returncode == 1
        and killed.summary["status"] == "crashed"
        and killed.summary["failed_rank"] == 1
    )
    assert killed.losses == reference.losses[:6]
    assert [save_step(p) for p in list_saves(killed.out_dir)] == [4]
    assert_nothing_left(killed.marker)  # the surviving rank was stopped, nothing outlived the job

    # A new invocation, as a user types it: Hydra gives it a new directory; resume=true finds the
    # newest save of this config (the fault.* keys aside) and continues the killed run's directory.
    resumed = job(day / "t2", *RUN, STAGE, "resume=true", "logger=wandb")
    assert f"resume: from step 4 of {killed.out_dir / 'checkpoints' / 'step_00000004'}" in resumed.stdout
    assert not (resumed.out_dir / "metrics.jsonl").exists()
    assert [r["step"] for r in killed.records] == list(range(1, 13))  # rewound to step 4, then 5-12
    assert killed.losses == reference.losses  # bitwise, steps 7-12 included
    assert killed.summary["status"] == "ok"
    # Both jobs logged into one W&B run: two offline run directories with the same run id.
    offline_runs = sorted((killed.out_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and len({p.name.rsplit("-", 1)[1] for p in offline_runs}) == 1
    assert wandb_history_steps(offline_runs[1]) == list(range(5, 13))


def test_a_kill_during_a_save_leaves_the_previous_save_to_resume_from(tmp_path: Path, reference: Run) -> None:
    """Rank 0 is SIGKILLed after writing the step-8 save, before renaming it into place."""
    run_dir = tmp_path / "runs" / "day" / "t1"
    killed = job(
        run_dir, *RUN, STAGE, "fault.kind=kill_during_save", "fault.step=8", "fault.rank=0", check=False
    )
    assert killed.returncode == 1 and killed.summary["status"] == "crashed"
    half_written = run_dir / "checkpoints" / ".tmp_step_00000008"
    assert (half_written / ".metadata").is_file()  # every byte written, yet not a save
    assert [save_step(p) for p in list_saves(run_dir)] == [4]

    job(tmp_path / "runs" / "day" / "t2", *RUN, STAGE, f"resume={run_dir}")
    assert killed.losses == reference.losses
    assert [save_step(p) for p in list_saves(run_dir)] == [8, 12] and not half_written.exists()


def test_an_elastic_restart_finishes_the_run_by_itself(tmp_path: Path, reference: Run) -> None:
    run = job(tmp_path / "runs" / "day" / "t1", *RUN, STAGE, *KILL_RANK1_AT_7, "max_restarts=1")
    assert run.summary["status"] == "ok" and run.summary["restarts"] == 1
    assert_nothing_left(run.marker)  # neither attempt's ranks outlived the job
    assert "restart 1: the launcher restarted all ranks; resuming from" in run.stdout
    assert [r["step"] for r in run.records] == list(range(1, 13))
    assert run.summary["loss/final"] == reference.summary["loss/final"]
    assert run.losses == reference.losses


# ----------------------------------------------------------------------------- resharding

RESHARD = ("precision=fp32", "steps=6", "optim.warmup_steps=2", "save.every=3")


@pytest.fixture(scope="module")
def stage3_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Uninterrupted, 2 ranks at stage3; its step-3 save is the one resumed elsewhere."""
    return job(tmp_path_factory.mktemp("s3") / "run", *RESHARD, "nproc=2", "zero=stage3")


@pytest.mark.parametrize(
    "target",
    [("nproc=1", "micro_batch=4", "zero=stage0"), ("nproc=2", "micro_batch=2", "zero=stage1")],
    ids=["1 rank stage0", "2 ranks stage1"],
)
def test_a_stage3_save_resumes_on_another_world_size_and_stage(
    tmp_path: Path, stage3_run: Run, target: tuple[str, ...]
) -> None:
    """Step 4 checks the weights, steps 5-6 the optimizer state and the schedule as well;
    the global batch (4 sequences) is the same, so the data stream goes on at sample 12."""
    save = stage3_run.out_dir / "checkpoints" / "step_00000003"
    resumed = job(tmp_path / "run", *RESHARD, *target, f"resume={save}")
    assert [r["step"] for r in resumed.records] == [4, 5, 6]
    for record, expected in zip(resumed.records, stage3_run.records[3:]):
        assert math.isclose(record["loss/train"], expected["loss/train"], rel_tol=1e-5), (
            record["step"],
            record["loss/train"],
            expected["loss/train"],
        )


# ----------------------------------------------------------------------------- non-finite policy

NAN_ON_RANK1_AT_3 = ("fault.kind=nan_loss", "fault.step=3", "fault.rank=1")
SHORT = ("nproc=2", "precision=fp32", "steps=5", "save.every=1", "save.keep=5")


@pytest.fixture(scope="module")
def skipping_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return job(tmp_path_factory.mktemp("skip") / "run", *SHORT, "nonfinite=skip", *NAN_ON_RANK1_AT_3)


def test_nonfinite_raise_stops_naming_the_step_rank_and_loss(tmp_path: Path, skipping_run: Run) -> None:
    run = job(tmp_path / "run", *SHORT, *NAN_ON_RANK1_AT_3, check=False)
    assert run.returncode == 1
    assert (
        one_error_line(run)
        == "error: non-finite loss at step 3 on rank 1 (nonfinite=raise; nonfinite=skip skips such steps)"
    )
    assert run.summary["status"] == "diverged" and run.summary["steps_done"] == 2
    # The last good state is saved: bitwise the state after step 2 (the same as the skipping run's).
    assert [save_step(p) for p in list_saves(run.out_dir)] == [1, 2]
    last_good, reference = (
        saved_state(run.out_dir, 2, tmp_path),
        saved_state(skipping_run.out_dir, 2, tmp_path),
    )
    assert read_progress(run.out_dir / "checkpoints" / "step_00000002")["step"] == 2
    assert_states_equal(last_good, reference, prefixes=("model.", "optim."))


def test_nonfinite_skip_skips_one_step_and_finishes(tmp_path: Path, skipping_run: Run) -> None:
    run = skipping_run
    assert run.summary["status"] == "ok" and run.summary["train/nonfinite_skipped"] == 1
    assert [r["train/nonfinite_skipped"] for r in run.records] == [0, 0, 1, 1, 1]
    assert [math.isfinite(loss) for loss in run.losses] == [True, True, False, True, True]
    # The skipped step left weights and optimizer state bitwise untouched; the next one did not.
    after_2, after_3, after_4 = (saved_state(run.out_dir, step, tmp_path) for step in (2, 3, 4))
    assert_states_equal(after_2, after_3, prefixes=("model.", "optim."))
    assert not torch.equal(after_3["model"]["output.weight"], after_4["model"]["output.weight"])


def test_a_diverging_learning_rate_ends_in_one_line_not_a_traceback(tmp_path: Path) -> None:
    run = job(
        tmp_path / "run", "nproc=2", "precision=fp32", "steps=4", "optim.lr=1e30", "save.every=0", check=False
    )
    assert run.returncode == 1 and run.summary["status"] == "diverged"
    assert (
        one_error_line(run)
        == "error: non-finite loss at step 2 on ranks 0, 1 (nonfinite=raise; nonfinite=skip skips such steps)"
    )


# ----------------------------------------------------------------------------- helpers


def save_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def one_error_line(run: Run) -> str:
    """The job's stderr must be exactly one line, with no traceback anywhere."""
    assert "Traceback" not in run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    return lines[0]


def saved_state(run_dir: Path, step: int, scratch: Path) -> dict[str, Any]:
    """A DCP save as one nested dict, through DCP's own converter to a torch.save file."""
    target = scratch / f"{run_dir.name}_{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:08d}", target)
    return torch.load(target, weights_only=False)


def flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat_tensors(value, f"{prefix}{key}."))
        elif torch.is_tensor(value):
            out[f"{prefix}{key}"] = value
    return out


def assert_states_equal(a: dict[str, Any], b: dict[str, Any], prefixes: tuple[str, ...]) -> None:
    ta = {k: v for k, v in flat_tensors(a).items() if k.startswith(prefixes)}
    tb = {k: v for k, v in flat_tensors(b).items() if k.startswith(prefixes)}
    assert ta.keys() == tb.keys() and len(ta) > 0
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, different[:5]


def wandb_history_steps(offline_run: Path) -> list[int]:
    """The steps of an offline run's history records, read back with `wandb leet inspect --json`."""
    records = wandb_records(next(offline_run.glob("run-*.wandb")))
    return sorted(int(r["history"]["item"]["_step"]) for r in records if r.get("type") == "history")
