"""Nothing left behind: every process a job starts ends with the job, however the job ends.

The processes of a launched job: the job process (Hydra's, which runs torch's elastic agent), the
fork server it starts the ranks from (trainer/rank/main.py), the ranks (children of the fork
server, not of the job process), and what a rank starts itself (DCP's background save process
under `save.async_mode=process`, data loader workers). Four mechanisms, each for a way a job can end:

- A rank dies with its parent (`die_with_parent`: Linux's PR_SET_PDEATHSIG). A rank's parent is the
  fork server; when the fork server is killed (the OOM killer may pick any process) nothing else
  would stop the ranks: the agent only loses its line to them, and they train on, reparented to
  init, beside whatever the next job writes into the same directory.
- A rank dies with the job process, however the job process ends (`kill -9` too): a thread of the
  rank waits on a pidfd of the job process (`watch_job_process`), and the fork server ends when the
  job process does (`release_fork_server`: each rank closes the copy of the server's "alive" pipe it
  was handed, which kept the server, and so the ranks, alive after a killed job). The thread kills
  the rank's own processes first (a `save.async_mode=process` save process, data loader workers);
  one that outlives its rank otherwise (the fork server killed) ends when its rank's pipe closes,
  after the write it may be in the middle of (into a `.tmp_step_*` directory, which is never a save).
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
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainer.private_apis.of_python import close_inherited_fork_server_alive_fd

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
    """SIGKILL this rank when its parent ends: the fork server, its parent process (Linux's
    PR_SET_PDEATHSIG), or the job process, multiprocessing's parent of it (`watch_job_process`).
    Linux only; elsewhere nothing.

    Python has no call for PR_SET_PDEATHSIG, so libc's prctl through ctypes. The setting survives
    no fork, so each rank sets it itself. A parent that ended before the call is caught after it:
    this process has been reparented by then.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    release_fork_server()  # before the check below: the server may end of it at once
    watch_job_process()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the job's reap is still there
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def watch_job_process() -> None:
    """SIGKILL this process as soon as the job process ends: a daemon thread waits on a pidfd of it.

    The job process is multiprocessing's parent of a rank (`parent_process()`: the process that asked
    the fork server for it), not its parent process, the fork server. The fork server ends when the
    job process does (`release_fork_server`), and PR_SET_PDEATHSIG then ends the ranks, but only once
    the server's interpreter, torch imported, has shut down: over half a second on a 2-core host, in
    which a tiny job's ranks trained, saved and pruned a step more in the run directory. A pidfd is
    readable as soon as its process has ended, before its parent has reaped it. Where there is no
    pidfd (before Linux 5.3, or a sandbox that refuses it), the fork server's end still ends the
    rank, later.
    """
    job = multiprocessing.parent_process()
    if job is None or not hasattr(os, "pidfd_open"):
        return
    try:
        pidfd = os.pidfd_open(job.pid)
    except ProcessLookupError:  # ended and reaped already
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except OSError:
        return
    threading.Thread(target=die_when_readable, args=(pidfd,), name="zerolab-job-watch", daemon=True).start()


def die_when_readable(fd: int) -> None:
    """Once `fd`, a pidfd, is readable (its process has ended): SIGKILL this process's children, then
    this process. Its children first: a save process (`save.async_mode=process`) left to itself ends
    only once it has finished the write it is in, into the run directory of a job that is gone."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll()  # no timeout: returns once the process has ended (a signal only restarts it, PEP 475)
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            continue
    os.kill(os.getpid(), signal.SIGKILL)


def release_fork_server() -> None:
    """Close this process's copy of the write end of the fork server's "alive" pipe, so that the
    server ends when the job process does.

    multiprocessing's fork server (Lib/multiprocessing/forkserver.py, `main`) exits when it reads
    end-of-file on the read end of that pipe, that is once every copy of the write end is closed.
    The job process holds one, and the server hands another to every process it forks (`_serve_one`
    stores it as `forkserver._forkserver._forkserver_alive_fd`). While a rank lives, its copy keeps
    the server alive, and the server, its parent, keeps the rank's parent-death signal from firing:
    a job process killed with SIGKILL left its fork server, reparented to init, and its ranks training
    on into the run directory. With the ranks' copies closed, the kernel's closing of the job
    process's copy, however it ends, ends the server and then (PR_SET_PDEATHSIG) the ranks. Nothing
    in a rank needs its copy: the forkserver module sends it only with a request to the server, and
    a rank that made one would start a server of its own first (a forked child's `_forkserver_pid`
    is None), with a pipe of its own.

    The copy is a private attribute of the standard library's forkserver module
    (trainer/private_apis/of_python.py); nothing to close in a process that no fork server forked (the
    job process, torchrun's ranks).
    """
    close_inherited_fork_server_alive_fd()


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
