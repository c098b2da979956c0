"""Nothing left behind (trainer/faults/leftovers.py): a job whose ranks' fork server is SIGKILLed ends
in one line naming it, and no process of the job outlives it; a job process SIGKILLed takes every
process it started with it at once, and its run resumes. (A rank SIGKILLed, with and without an
elastic restart: tests/integration/test_resume.py; Ctrl-C and SIGTERM: test_stop.py.)"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import (
    REPO,
    TINY,
    assert_nothing_left,
    error_lines,
    job_env,
    left_in,
    run_trainer,
    short_tmpdir,
    trainer_args,
)
from trainer.faults.leftovers import JOB_MARKER, describe, marked
from trainer.jsonl import read_jsonl
from trainer.saves.dcp import list_saves

pytestmark = pytest.mark.timeout(240)


def wait_for_step(proc: subprocess.Popen[str], out_dir: Path, step: int, timeout_s: float = 180) -> None:
    """Until the job has logged `step` (every step is logged: TINY's log_every=1)."""
    metrics, deadline = out_dir / "metrics.jsonl", time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)


def test_a_killed_fork_server_takes_its_ranks_with_it_and_is_named(tmp_path: Path) -> None:
    with short_tmpdir() as scratch:  # the job's TMPDIR, where the fork server's socket lives
        killed_fork_server(tmp_path, scratch)


def killed_fork_server(tmp_path: Path, scratch: Path) -> None:
    out_dir, env = tmp_path / "run", {**job_env(), "TMPDIR": str(scratch)}
    args = trainer_args(*TINY, "nproc=2", "steps=400", "save=off", f"hydra.run.dir={out_dir}")
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_step(proc, out_dir, 2)
    (server,) = (
        child
        for child in psutil.Process(proc.pid).children()
        if "multiprocessing.forkserver" in " ".join(child.cmdline())
    )
    ranks = server.children()
    assert len(ranks) == 2
    server.kill()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert error_lines(stderr)[-1] == (
        f"error: the ranks' fork server (pid {server.pid}) failed: killed from outside (the OOM killer, "
        "or kill); every rank died with it"
    )
    assert "Traceback" not in stderr
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["status"] == "crashed" and "failed_rank" not in summary
    assert summary["failed_process"] == f"the ranks' fork server (pid {server.pid})"
    assert_nothing_left(env[JOB_MARKER])
    assert left_in(scratch) == []  # the launcher's directory of error files went with the job


# ----------------------------------------------------------------------------- the job process killed

KILLED = ("nproc=2", "steps=8")
# Each a job killed at step 3; with saves on, every step saves. save=off with save.async_mode=process is not a
# case of its own: without saves no save process starts, so it is the save_off job.
SAVES = {
    "save_off": ("save=off",),
    "save_on": ("save.every=1",),
    "save_on_process": ("save.every=1", "save.async_mode=process"),
}


def files_in(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file under `run_dir` with its size and modification time (ns)."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*")}


@pytest.mark.parametrize(
    "save",
    [
        pytest.param(v, id=k, marks=pytest.mark.slow) if k == "save_on" else pytest.param(v, id=k)
        for k, v in SAVES.items()
    ],
)  # save_on (a thread's save) in the slow tier: the default run's 20 minutes (README)
def test_a_job_process_killed_takes_every_process_of_the_job_with_it_and_resumes(
    tmp_path: Path, save: tuple[str, ...]
) -> None:
    """`kill -9` of the job process at step 3 (a scheduler killing a job's main process, the OOM
    killer): before, the fork server and the ranks trained on, reparented to init, saving into the
    run directory. Now every process of the job is gone within 10 s (0.5 s by hand), nothing writes
    into the run directory, and `resume=true` continues from the newest save the job completed."""
    day, env = tmp_path / "runs" / "day", job_env()
    killed = day / "t1"
    with (tmp_path / "stdout").open("w") as out, (tmp_path / "stderr").open("w") as err:
        args = trainer_args(*TINY, *KILLED, *save, f"hydra.run.dir={killed}")
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
    wait_for_step(proc, killed, 3)
    save_processes = [p for p in marked(env[JOB_MARKER]) if describe(p) == "a background save process"]
    assert len(save_processes) == (2 if save == SAVES["save_on_process"] else 0)  # one per rank
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while (left := marked(env[JOB_MARKER])) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = ", ".join(f"{describe(p)} ({p.pid})" for p in left)
    for leftover in left:  # ended here, or they outlive the test (before the fix, they did)
        leftover.kill()
    assert not left, f"alive 10 s after the job process: {alive}"
    written = files_in(killed)
    time.sleep(1)  # a writer the job's mark does not find would show here
    assert files_in(killed) == written
    assert not (killed / "summary.json").exists()
    if save[0] == "save=off":
        return

    newest = list_saves(killed)[-1]  # listed only once whole; a `.tmp_step_*` may be beside it
    before = read_jsonl(killed / "metrics.jsonl")
    # The save mode is no part of the run's identity (trainer/saves/resume.py); saving in place, the
    # resumed job starts no save process (a fresh Python importing torch: ~10 s more to step 3 here).
    resumed = run_trainer(day / "t2", *TINY, *KILLED, "save.every=1", "resume=true")
    assert f"resume: from step {int(newest.name.removeprefix('step_'))} of {newest}" in resumed.stdout
    records = read_jsonl(killed / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    # Bitwise: the steps the killed job logged, those after its newest save (trained again) included.
    assert [r["loss/train"] for r in records[: len(before)]] == [r["loss/train"] for r in before]
    assert json.loads((killed / "summary.json").read_text())["status"] == "ok"
