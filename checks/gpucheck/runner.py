"""Running a `python -m trainer` job (or any command) as a process the caller can always end: in a
session of its own, so that its fork server and ranks can be killed with it, and counted after.

Shared by checks/gpu_check.py (every job under a timeout) and checks/fault_drills.py (a
fault done to a running job, then what was left running).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
KILL_WAIT_S = 10.0
"""How long a killed job's processes get to disappear before they are reported as survivors."""


def trainer_command(*overrides: str) -> list[str]:
    """`python -m trainer` with these overrides, as a user types it."""
    return [sys.executable, "-m", "trainer", *overrides]


def session_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (the job imports this checkout's
    trainer from any working directory) and `extra` set."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def start_session(args: list[str], env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    """Start `args` in the repository as the leader of a new session (its own process group)."""
    return subprocess.Popen(args, cwd=REPO, env=env or session_env(), start_new_session=True, **popen)


def kill_group(proc: subprocess.Popen) -> tuple[list[int], list[int]]:
    """SIGKILL the job's process group and every descendant (one that left the group too);
    returns the pids killed and those still alive after KILL_WAIT_S (zombies count as gone)."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the job is its group's leader: start_new_session
    except ProcessLookupError:
        pass
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    _, alive = psutil.wait_procs(descendants, timeout=KILL_WAIT_S)
    survivors = []
    for child in alive:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                survivors.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return [proc.pid, *(child.pid for child in descendants)], survivors


def run_process(
    args: list[str], log: Path, timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, list[int], list[int]]:
    """Run in a new session (its own process group), console into `log`; (exit code or None
    when killed at the timeout, pids killed, survivors).

    The job gets a TMPDIR of its own, removed when it ends: one killed at its timeout runs no cleanup,
    and would leave its launcher's log directory, its fork server's listener and W&B's socket behind.
    torch's compile cache stays where it was, shared by the jobs (`inductor_cache_dir`)."""
    from trainer.private_apis.of_torch import inductor_cache_dir  # torch, imported once a job runs

    log.parent.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="job_")  # short: the fork server's socket path lies in it
    env = {**(env or session_env()), "TMPDIR": scratch, "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()}
    try:
        with log.open("w") as console:
            proc = start_session(args, env, stdout=console, stderr=subprocess.STDOUT)
            try:
                return proc.wait(timeout=max(timeout, 0.1)), [], []
            except subprocess.TimeoutExpired:
                return None, *kill_group(proc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def left_running(sid: int) -> int:
    """Live processes (zombies aside) still in session `sid`: what a job left behind."""
    count = 0
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                count += 1
        except (psutil.Error, OSError):
            continue
    return count
