"""Nothing left behind: every process a job starts ends with the job, however the job ends.

The processes of a launched job: the job process (Hydra's, which runs torch's elastic agent), the
fork server it starts the ranks from (trainer/rank/main.py), the ranks (children of the fork
server, not of the job process), and what a rank starts itself (DCP's background save process
under `save.async=process`, data loader workers). Three mechanisms, each for a way a job can end:

- A rank dies with its parent (`die_with_parent`: Linux's PR_SET_PDEATHSIG). A rank's parent is the
  fork server; when the fork server is killed (the OOM killer may pick any process) nothing else
  would stop the ranks: the agent only loses its line to them, and they train on, reparented to
  init, beside whatever the next job writes into the same directory. The fork server in turn ends
  by itself when the job process goes (multiprocessing closes its pipe).
- Every process of the job carries `ZEROLAB_JOB_ID` in its environment (`mark_job`: set in the job
  process before its fork server starts, so the server and every process forked or spawned below
  it inherit it). A test or a drill finds what is left of a job by it (tests/helpers.py).
- When the launcher returns, however it returns, the job process ends whatever still carries its
  mark below it (`reap`): a grace period for processes that are finishing by themselves (a
  background save process sees its rank's pipe close), then SIGKILL. Its own children stay: the
  fork server, multiprocessing's resource tracker and W&B's service serve a sweep's next job.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

JOB_MARKER = "ZEROLAB_JOB_ID"
REAP_GRACE_S = 5.0
"""How long processes that outlived the launcher get to end by themselves before SIGKILL."""
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


LAUNCH_MARKER = "ZEROLAB_LAUNCH_ID"
"""One launch's own mark, new at every launch: what the launcher reaps. JOB_MARKER is kept from the
caller (tests and drills set it to find everything a command left), so the jobs of one sweep, or a
job and the advise.verify jobs it starts, can share it, and must not reap each other."""


def mark_job() -> str:
    """This launch's mark, set for everything started below it; JOB_MARKER too, where the caller set none."""
    os.environ.setdefault(JOB_MARKER, f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.environ[LAUNCH_MARKER] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return os.environ[LAUNCH_MARKER]


def die_with_parent() -> None:
    """SIGKILL this process when its parent ends (Linux; elsewhere nothing).

    Python has no call for PR_SET_PDEATHSIG, so libc's prctl through ctypes. The setting survives
    no fork, so each rank sets it itself. A parent that ended before the call is caught after it:
    this process has been reparented by then.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the job's reap is still there
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Leftover:
    pid: int
    what: str
    """What the process is, from its command line (rank, save process, fork server...)."""


def describe(proc: psutil.Process) -> str:
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return "a process"
    if "_checkpointing_subprocess" in line or "spawn_main" in line:
        return "a background save process"
    if "multiprocessing.forkserver" in line:
        return "a rank"  # forked from the fork server: its command line is the server's
    return line[:60]


def marked(marker: str, variable: str = JOB_MARKER) -> list[psutil.Process]:
    """Live processes (zombies aside) whose environment carries `marker`, this one excluded."""
    found = []
    needle = f"{variable}={marker}".encode()
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def is_wandb_service(proc: psutil.Process) -> bool:
    """The job process's own W&B service (wandb-core): started by the job, not by the launcher, and
    reparented away from it, so not among its children; the job still writes to it after the ranks end
    (docs/design.md section 3: the job process owns the W&B run), and wandb ends it at `finish`."""
    try:
        return any(
            "wandb" in Path(arg).parts or Path(arg).name.startswith("wandb-") for arg in proc.cmdline()[:1]
        )
    except psutil.Error:
        return False


def reap(marker: str, grace_s: float = REAP_GRACE_S) -> list[Leftover]:
    """End every process of the job left below this one (its own children aside): wait up to
    `grace_s` for them to end, then SIGKILL; returns those killed."""
    # Its own children, and its ancestors: a job started by another of the same mark (mode=advise's
    # advise.verify jobs) must not end the job that started it.
    me = psutil.Process()
    own = {child.pid for child in me.children()} | {parent.pid for parent in me.parents()}
    deadline = time.monotonic() + grace_s
    while (
        left := [p for p in marked(marker, LAUNCH_MARKER) if p.pid not in own and not is_wandb_service(p)]
    ) and (time.monotonic() < deadline):
        time.sleep(0.1)
    killed = []
    for proc in left:
        what = describe(proc)
        try:
            proc.kill()
        except psutil.Error:
            continue
        killed.append(Leftover(proc.pid, what))
    psutil.wait_procs(left, timeout=grace_s)
    return killed
