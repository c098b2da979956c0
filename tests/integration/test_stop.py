"""Stopping on a signal (trainer/faults/stop.py): Ctrl-C and preemption end a job with a status, a save and
nothing left running; `resume=true` then continues bitwise. Real 2-rank jobs on CPU (gloo).

A terminal's Ctrl-C signals the whole foreground process group: the tests start each job in a
session of its own and signal its group (`killpg`); SLURM's SIGTERM is sent to the job process only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.helpers import (
    REPO,
    TINY,
    Run,
    assert_nothing_left,
    error_lines,
    job_env,
    run_trainer,
    trainer_args,
    wandb_file,
    wandb_records,
)
from trainer.faults.leftovers import JOB_MARKER
from trainer.saves.dcp import list_saves, save_step

pytestmark = pytest.mark.timeout(240)

JOB = ("nproc=2", "precision=fp32", "steps=30", "optim.warmup_steps=2", "save.every=1000")


@dataclass
class Signalled:
    run: Run
    signalled_after: int
    """The last step metrics.jsonl held when the first signal was sent."""
    exited_s: float
    """Seconds from the (last) signal to the job's exit."""
    left_running: list[str]
    """Processes of the job's session still alive 5 s after it exited."""


def signal_job(
    out_dir: Path, *overrides: str, sig: signal.Signals, group: bool, at_step: int = 3, again: bool = False
) -> Signalled:
    """Start `python -m trainer` in its own session, send `sig` once metrics.jsonl has `at_step`
    records (to the process group, as a terminal does, or to the job process, as SLURM does);
    with `again`, send it a second time as soon as the job says it is stopping."""
    args, env = trainer_args(*TINY, *overrides, f"hydra.run.dir={out_dir}"), job_env()
    proc = subprocess.Popen(
        args,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    send = (lambda s: os.killpg(proc.pid, s)) if group else (lambda s: os.kill(proc.pid, s))
    stdout: list[str] = []
    stopping = threading.Event()

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            stdout.append(line)
            if "stop after their current step" in line:
                stopping.set()

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= at_step):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(stdout)
        time.sleep(0.02)
    signalled_after = len(metrics.read_text().splitlines())
    send(sig)
    if again:
        assert stopping.wait(60)
        send(sig)
    sent = time.monotonic()
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    proc.wait(timeout=120)
    exited_s = time.monotonic() - sent
    reader.join(10)
    # Nothing of the job may be alive 5 s after it ended. The wait ends sooner once the session is
    # empty: nothing can join it then (a new member is forked by a live one).
    settled = time.monotonic() + 5
    while (left := session_commands(proc.pid)) and time.monotonic() < settled:
        time.sleep(0.1)
    assert_nothing_left(env[JOB_MARKER])  # also what left the session
    run = Run(proc.returncode, "".join(stdout), stderr, out_dir, env[JOB_MARKER])
    return Signalled(run, signalled_after, exited_s, left)


def session_processes(sid: int) -> list[psutil.Process]:
    """Live (not zombie) processes of a session: the job's ranks would be among them."""
    alive = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return alive


def session_commands(sid: int) -> list[str]:
    """The command lines of a session's live processes; one that dies (or turns zombie) while it is read is
    not alive (psutil raises for it, a race the suite once lost)."""
    commands = []
    for p in session_processes(sid):
        try:
            commands.append(" ".join(p.cmdline()))
        except psutil.Error:
            continue
    return commands


def wandb_end(out_dir: Path) -> dict:
    records = wandb_records(wandb_file(out_dir))
    return {r["type"]: r[r["type"]] for r in records if r["type"] in ("exit", "preempting")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The uninterrupted run the resumed ones are compared with."""
    return run_trainer(tmp_path_factory.mktemp("ref") / "runs" / "day" / "t0", *TINY, *JOB)


def test_ctrl_c_ends_interrupted_with_a_save_and_resume_is_bitwise_equal(
    tmp_path: Path, reference: Run
) -> None:
    day = tmp_path / "runs" / "day"
    stopped = signal_job(day / "t1", *JOB, "logger=wandb", sig=signal.SIGINT, group=True)
    run = stopped.run
    assert run.returncode == 130, run.stderr
    (line,) = error_lines(run.stderr)  # one line
    assert line.startswith("interrupted: SIGINT stopped the job after step")
    assert "Traceback" not in run.stdout + run.stderr
    k = run.summary["stopped_step"]
    assert run.summary["status"] == "interrupted" and run.summary["steps_done"] == k
    assert stopped.signalled_after <= k < 30
    assert [save_step(p) for p in list_saves(run.out_dir)] == [k]
    assert run.losses == reference.losses[:k]
    assert wandb_end(run.out_dir) == {
        "exit": {"exit_code": 130, "runtime": wandb_end(run.out_dir)["exit"]["runtime"]}
    }
    assert stopped.left_running == []

    resumed = run_trainer(day / "t2", *TINY, *JOB, "resume=true")
    assert f"resume: from step {k} of" in resumed.stdout
    assert run.summary["status"] == "ok"  # the resumed job continues the stopped run's directory
    assert run.losses == reference.losses  # bitwise, every step after the stop included


def test_sigterm_to_the_job_process_ends_preempted_with_a_save_and_resume_is_bitwise_equal(
    tmp_path: Path, reference: Run
) -> None:
    """SLURM's preemption: SIGTERM to the job process only; the ranks hear of it from the job."""
    day = tmp_path / "runs" / "day"
    stopped = signal_job(day / "t1", *JOB, "logger=wandb", sig=signal.SIGTERM, group=False)
    run = stopped.run
    assert run.returncode == 143 and error_lines(run.stderr) == [
        f"preempted: SIGTERM stopped the job after step {run.summary['stopped_step']}; saved {run.summary['save']}: resume=true continues from it"
    ], run.stderr
    k = run.summary["stopped_step"]
    assert (run.summary["status"], run.summary["stop_signal"], run.summary["steps_done"]) == (
        "preempted",
        "SIGTERM",
        k,
    )
    assert stopped.signalled_after <= k < 30
    assert run.summary["save"] == str(run.out_dir / "checkpoints" / f"step_{k:08d}")
    assert [save_step(p) for p in list_saves(run.out_dir)] == [k]
    end = wandb_end(run.out_dir)
    assert "preempting" in end and end["exit"]["exit_code"] == 143
    assert stopped.left_running == []

    run_trainer(day / "t2", *TINY, *JOB, "resume=true")
    assert run.summary["status"] == "ok" and run.losses == reference.losses


def test_a_second_ctrl_c_stops_at_once_leaving_no_process_and_no_partial_save(tmp_path: Path) -> None:
    """The second Ctrl-C comes while the ranks finish their step and save: they are killed."""
    stopped = signal_job(tmp_path / "run", *JOB, "logger=none", sig=signal.SIGINT, group=True, again=True)
    run = stopped.run
    assert run.returncode == 130 and "Traceback" not in run.stdout + run.stderr, run.stderr
    assert run.summary["status"] == "interrupted" and "killed at once" in run.summary["error"]
    assert list_saves(run.out_dir) == []  # a save cut short is never a save
    assert stopped.exited_s < 15
    assert stopped.left_running == []


def test_ctrl_c_stops_a_sweep_after_the_current_point_with_a_report(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    args = trainer_args(
        *TINY,
        "nproc=2",
        "steps=30",
        "save=off",
        "micro_batch=1,2",
        f"hydra.sweep.dir={sweep_dir}",
        multirun=True,
    )
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 180
    while not any(len(m.read_text().splitlines()) >= 3 for m in sweep_dir.glob("0_*/metrics.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stdout + stderr, stderr
    (first,) = sweep_dir.glob("0_*")
    assert error_lines(stderr)[-1] == f"interrupted: the sweep stops after {first.name}"
    assert list(sweep_dir.glob("1_*")) == []  # the second point never started
    report = (sweep_dir / "report.md").read_text()
    assert "1 point (1 interrupted)" in report and "interrupted: SIGINT stopped the job after step" in report
    assert "report: " in stdout and "1 point: 1 interrupted" in stdout
