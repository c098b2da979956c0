"""hydra/launcher=local (submitit's local executor, the SLURM path on one host): a sweep ends like one
under Hydra's basic launcher (every point ok, the sweep report, one W&B group), and a preempted point
is requeued through submitit and resumes by itself."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import (
    REPO,
    TINY,
    point_dirs,
    read_csv,
    run_sweep,
    run_trainer,
    settings,
    summary,
    table_rows,
    trainer_args,
    wandb_run,
)
from trainer.telemetry.wandb_logger import sweep_group

# Two points whose processes submitit starts together: tiny and short (steps=3).
POINT = (
    "nproc=2",
    "device=cpu",
    "model=tiny",
    "steps=3",
    "seq_len=64",
    "log_every=1",
    "save=off",
    "logger=wandb",
)


@pytest.mark.slow  # the default tier's time (README)
@pytest.mark.timeout(480)
def test_a_local_launcher_sweep_reports_every_point_and_one_wandb_group(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(sweep_dir, "hydra/launcher=local", "micro_batch=1,2", *POINT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = point_dirs(sweep_dir)
    assert [settings(p)["micro_batch"] for p in points] == ["1", "2"]
    assert [(summary(p)["status"], summary(p)["steps_done"]) for p in points] == [("ok", 3)] * 2
    # Each point ran in a submitit job of its own, not in the submitting process.
    assert len(list((sweep_dir / ".submitit").glob("*/*_result.pkl"))) == 2
    # The sweep's end (on_multirun_end, in the submitting process): the report and its W&B run.
    rows = read_csv(sweep_dir / "results.csv")
    assert [(row["dir"], row["status"]) for row in rows] == [(p.name, "ok") for p in points]
    assert len(table_rows(sweep_dir / "report.md")) == 2
    group = sweep_group(sweep_dir)
    runs = [wandb_run(next(p.glob("wandb/offline-run-*/run-*.wandb"))) for p in points]
    assert [run["run_group"] for run in runs] == [group, group]
    report_run = wandb_run(next(sweep_dir.glob("wandb/offline-run-*/run-report-*.wandb")))
    assert (report_run["run_group"], report_run["job_type"]) == (group, "report")


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen[str], timeout_s: float) -> None:
    """Until rank 0 has logged `step` (the sweep's process still running)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and any(
            json.loads(line)["step"] >= step for line in metrics.read_text().splitlines() if line.strip()
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} never logged in {metrics}")


def submitit_task(submitter: int) -> psutil.Process:
    """The point's job process: what submitit's local controller started for it (`submitit.core._submit`)."""
    for proc in psutil.Process(submitter).children(recursive=True):
        if "submitit.core._submit" in " ".join(proc.cmdline()):
            return proc
    raise AssertionError("no submitit job process")


@pytest.mark.slow  # ~40 s of a preemption, a requeue and a resume: .ci/run runs the slow tier
@pytest.mark.timeout(480)
def test_a_preempted_point_is_requeued_and_resumes_by_itself(tmp_path: Path) -> None:
    """Acceptance 3 (requeue): submitit's signal (USR2, what SLURM's --signal and the local controller
    send) stops the point with a save; submitit requeues it with resume=<its directory>, and the
    requeued job goes on from the save to the last step, bitwise like a run never stopped."""
    point = (*TINY, "nproc=2", "steps=8", "save.every=100", "logger=wandb")
    sweep_dir = tmp_path / "sweep"
    args = trainer_args("hydra/launcher=local", *point, f"hydra.sweep.dir={sweep_dir}", multirun=True)
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = None
        deadline = time.monotonic() + 240
        while metrics is None and time.monotonic() < deadline and proc.poll() is None:
            metrics = next(sweep_dir.glob("0_*/metrics.jsonl"), None)
            time.sleep(0.2)
        assert metrics is not None, "the point never started training"
        wait_for_step(metrics, 2, proc, timeout_s=240)
        first_job = submitit_task(proc.pid)
        first_job.send_signal(signal.SIGUSR2)
        stdout, stderr = proc.communicate(timeout=360)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    run_dir = metrics.parent
    assert point_dirs(sweep_dir) == [run_dir]  # requeued into its own directory, no second one
    logs = "".join(p.read_text() for p in (sweep_dir / ".submitit").glob("*/*_log.*"))
    stopped = int(re.search(r"stopped the job after step (\d+)", logs).group(1))  # type: ignore[union-attr]
    assert (
        "Requeued job" in logs
        and f"resume: from step {stopped} of {run_dir}/checkpoints/step_{stopped:08d}" in logs
    )
    assert 2 <= stopped < 8 and summary(run_dir)["status"] == "ok"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(
        range(1, 9)
    )  # one history, the requeued job's steps after the save
    straight = run_trainer(tmp_path / "straight", *TINY, "nproc=2", "steps=8", "save=off")
    assert [r["loss/train"] for r in records] == straight.losses  # bitwise: the save holds everything
    runs = {wandb_run(f)["run_id"] for f in run_dir.glob("wandb/offline-run-*/run-*.wandb")}
    assert runs == {(run_dir / "wandb_run_id").read_text().strip()}  # both jobs logged into one W&B run
