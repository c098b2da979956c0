"""Faults found before a rank starts or survived while ranks run: a host too small for its CPU ranks,
a token file that is not one, a broken newest save, a save that cannot be written, W&B dying."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, TINY, Run, error_lines, run_trainer, trainer_args
from trainer.saves.dcp import list_saves, save_step
from trainer.saves.integrity import save_problem

pytestmark = pytest.mark.timeout(300)


def refused(out_dir: Path, *overrides: str) -> tuple[Run, float]:
    start = time.monotonic()
    proc = run_trainer(out_dir, "device=cpu", "logger=none", *overrides, check=False, timeout=120)
    return proc, time.monotonic() - start


def started_no_rank(out_dir: Path) -> bool:
    """A rank writes metrics.jsonl (rank 0) or a failure record; a refused job has neither."""
    return not (out_dir / "metrics.jsonl").exists() and not (out_dir / "failures").exists()


def test_more_cpu_ranks_than_the_host_holds_are_refused_in_one_line(tmp_path: Path) -> None:
    proc, seconds = refused(tmp_path / "run", "nproc=64")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "error: does not fit this host: 64 CPU ranks each hold 0.40 GiB of process runtime"
    )
    assert "(available on this host now). Try nproc=" in lines[0]
    assert "warning: 64 CPU ranks share" in proc.stdout
    assert "host: 64 ranks per node, each up to 0.4 GiB process runtime" in proc.stdout
    assert started_no_rank(tmp_path / "run")
    assert seconds < 60  # about 5 s on an idle 2-core host; the bound leaves room for a loaded CI runner


def test_a_text_file_as_token_file_is_refused_in_one_line(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("not token ids\n" * 100)
    proc, _ = refused(tmp_path / "run", "nproc=2", "data=tokens", f"data.path={text}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: data.path: {text} is not a .npy file of token ids; make one with `python -m trainer.data make-tokens INPUT.txt OUTPUT.npy`"
    ]
    assert not (tmp_path / "run" / "plan.json").exists() and started_no_rank(tmp_path / "run")


SAVING = ("nproc=2", "precision=fp32", "steps=12", "optim.warmup_steps=2", "save.every=4", "save.keep=3")


def test_a_truncated_shard_in_the_newest_save_is_skipped_and_the_previous_save_resumed(
    tmp_path: Path,
) -> None:
    day = tmp_path / "runs" / "day"
    run = run_trainer(day / "t1", *TINY, *SAVING)
    uninterrupted = run.losses
    assert [save_step(p) for p in list_saves(run.out_dir)] == [4, 8, 12]
    newest = run.out_dir / "checkpoints" / "step_00000012"
    shard = newest / "__1_0.distcp"
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)

    resumed = run_trainer(day / "t2", *TINY, *SAVING, "resume=true")
    assert (
        f"resume: skipping {newest}: __1_0.distcp is {size // 2} bytes; .metadata says {size}"
        in resumed.stdout
    )
    assert f"resume: from step 8 of {run.out_dir / 'checkpoints' / 'step_00000008'}" in resumed.stdout
    assert [r["step"] for r in run.records] == list(range(1, 13))  # rewound to step 8, then 9-12 again
    assert run.losses == uninterrupted  # bitwise, steps 9-12 included
    assert save_problem(newest) is None  # the step-12 save written again, whole


def test_a_save_that_cannot_be_written_ends_crashed_naming_the_path_with_earlier_saves_intact(
    tmp_path: Path,
) -> None:
    out_dir = tmp_path / "run"
    blocked = (
        out_dir / "checkpoints" / ".tmp_step_00000008"
    )  # a file where the step-8 save must make its directory
    blocked.parent.mkdir(parents=True)
    blocked.write_text("")
    run = run_trainer(out_dir, *TINY, *SAVING, check=False)
    assert run.returncode == 1 and run.summary["status"] == "crashed"
    line = run.stderr.strip().splitlines()[-1]
    assert (
        f"at step 8 (save): SaveError: could not write the save of step 8 under {out_dir / 'checkpoints'}"
        in line
    )
    assert str(blocked) in line and "Traceback" not in run.stderr
    assert [save_step(p) for p in list_saves(out_dir)] == [4] and save_problem(
        out_dir / "checkpoints" / "step_00000004"
    ) is None


def test_wandb_dying_mid_run_leaves_one_warning_and_an_ok_job(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    args = trainer_args(
        *TINY,
        "nproc=2",
        "steps=20",
        "save=off",
        "logger=wandb",
        f"hydra.run.dir={out_dir}",
    )
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = out_dir / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    service = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("wandb")]
    assert service
    for p in service:
        p.kill()
    stdout, stderr = proc.communicate(timeout=240)
    run = Run(proc.returncode, stdout, stderr, out_dir)
    assert run.returncode == 0 and run.summary["status"] == "ok", stderr
    assert error_lines(stderr) == [
        "warning: W&B stopped working (ConnectionError: lost the connection to the W&B service process); metrics.jsonl and summary.json are complete"
    ]
    assert [r["step"] for r in run.records] == list(range(1, 21))
