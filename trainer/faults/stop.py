"""Stopping a job on a signal: every rank finishes its step, saves, and the job ends with a status.

The one table (STOPS below) maps a signal to what the job reports:

| signal  | sent by                                   | summary.json status | exit status |
|---------|-------------------------------------------|---------------------|-------------|
| SIGINT  | Ctrl-C in a terminal                      | interrupted         | 130         |
| SIGTERM | SLURM before it kills a job, `kill`       | preempted           | 143         |
| SIGUSR1 | SLURM's `--signal=USR1@<s>` warning       | preempted           | 138         |
| SIGUSR2 | submitit's warning (`--signal=USR2@<s>`)  | preempted           | 140         |

Who does what:

- The job process (trainer/job.py, `handling_stops`) takes these signals while its job runs.
  The first one is a request: it prints one line and writes `stop_request` in the run directory
  (the ranks may not have received the signal themselves: SLURM or `kill` signal one process; a
  terminal signals the whole foreground group). A second one stops at once: it raises torch's
  SignalException with SIGKILL inside the elastic agent, which kills the ranks and joins them
  before it returns, so no process is left behind. torch's agent would otherwise turn the first
  SIGINT/SIGTERM into that same SignalException and SIGTERM the ranks mid-step
  (LaunchConfig.signals_to_handle tells it to leave these signals to us).
- A rank (`RankStop`) never dies of these signals: its handler only notes the signal, and the
  node's first rank also looks for `stop_request`. The note rides on the all-reduce the ranks
  already make every step to agree on non-finite values (trainer/rank/nonfinite.py): MAX over the
  signal numbers, so every rank learns the same stop at the same step, and preemption (SIGTERM,
  SIGUSR1) outranks an interrupt. Every rank then finishes that step, logs it, saves it (when
  saving is on) and returns; the job writes summary.json with the status and exits.

Under torchrun (no job process of ours) torchrun's agent forwards SIGINT/SIGTERM to the ranks,
which stop the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from trainer.console import say
from trainer.telemetry.keys import Status

STOP_REQUEST = "stop_request"  # in the run directory: the job process's word to its ranks


@dataclass(frozen=True)
class Stop:
    """How a job stopped by a signal ends."""

    status: Status
    """summary.json's status (and the sweep report's, and the W&B summary's)."""
    exit_code: int
    """The job's exit status: 128 + the signal number, as a shell reports a process the signal ended."""


STOPS: dict[signal.Signals, Stop] = {
    signal.SIGINT: Stop(Status.interrupted, 128 + signal.SIGINT),
    signal.SIGTERM: Stop(Status.preempted, 128 + signal.SIGTERM),
    signal.SIGUSR1: Stop(Status.preempted, 128 + signal.SIGUSR1),
    # submitit's preemption and time-out signal (hydra/launcher=slurm|local, trainer/cluster.py requeues after it)
    signal.SIGUSR2: Stop(Status.preempted, 128 + signal.SIGUSR2),
}
STOP_STATUSES = frozenset(stop.status for stop in STOPS.values())


def exit_code_for(status: Status | str) -> int:
    """The exit status of a job that ended with `status` (ok 0, a stop its signal's, anything else 1)."""
    if status == Status.ok:
        return 0
    return next((stop.exit_code for stop in STOPS.values() if stop.status == status), 1)


# ----------------------------------------------------------------------------- the ranks


class RankStop:
    """A rank's view of a stop: the signal it noted, and the one every rank agreed on."""

    def __init__(self, run_dir: Path, watches_request: bool) -> None:
        self.requested = 0
        """The largest signal number noted by this rank (0: none)."""
        self.agreed = 0
        """The signal number every rank agreed to stop on (0: go on); set by the step's agreement."""
        self.request_path = run_dir / STOP_REQUEST if watches_request else None
        for signum in STOPS:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.requested = max(self.requested, signum)

    def local_request(self) -> int:
        """This rank's contribution to the step's agreement (one stat of a local file: no sync)."""
        if self.request_path is not None and not self.requested and self.request_path.exists():
            self.requested = read_request(self.request_path)
        return self.requested

    def agree(self, agreed: float) -> None:
        """The MAX over every rank's local_request() of this step (trainer/rank/nonfinite.py reduces it)."""
        self.agreed = int(agreed)

    def ending(self, step: int, save: Path | None) -> dict[str, Any]:
        """What rank 0 returns to the job process when the ranks stopped after `step`."""
        name = signal.Signals(self.agreed).name
        return {
            "status": STOPS[signal.Signals(self.agreed)].status,
            "signal": name,
            "stopped_step": step,
            "save": str(save) if save else None,
        }


def read_request(path: Path) -> int:
    """The signal number the job process wrote (a torn or empty file still means SIGINT's stop)."""
    try:
        return int(signal.Signals[path.read_text().strip()])
    except (OSError, KeyError):
        return int(signal.SIGINT)


# ----------------------------------------------------------------------------- the job process


class JobStop:
    """The job process's handler: the first signal asks the ranks to stop, the second stops at once."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.first = 0
        """The first signal received (0: none)."""
        self.running = False
        """Whether the ranks run (inside elastic_launch): a second signal there kills them through the agent."""

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.first:
            self.stop_now(signum)
            return
        self.first = signum
        (self.run_dir / STOP_REQUEST).write_text(self.signal_name + "\n")
        again = "Ctrl-C" if signum == signal.SIGINT else self.signal_name
        print(
            f"{self.signal_name}: the ranks stop after their current step ({again} again stops at once)",
            flush=True,
        )

    def stop_now(self, signum: int) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        name = signal.Signals(signum).name
        if self.running:
            # Raised in the main thread, which is inside the elastic agent's monitoring loop: the
            # agent closes the ranks with SIGKILL, waits for each to end, then re-raises it to us.
            raise SignalException(f"{name} again: stopping at once", sigval=signal.SIGKILL)
        # No rank runs (W&B is starting or finishing): nothing to wait for, nothing left behind
        # (W&B's service watches this process and ends with it).
        stop = STOPS[signal.Signals(self.first)]
        say(stop.status, f"{name} again: stopped at once")
        os._exit(stop.exit_code)

    @contextlib.contextmanager
    def ranks_running(self) -> Iterator[None]:
        self.running = True
        try:
            yield
        finally:
            self.running = False

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.first).name

    @property
    def stop(self) -> Stop | None:
        return STOPS[signal.Signals(self.first)] if self.first else None


def stopped(result: dict[str, Any], saving: bool) -> dict[str, Any]:
    """summary.json's account of ranks that stopped together after a step (rank 0's RankStop.ending)."""
    step, save = result["stopped_step"], result["save"]
    after = f"; saved {save}: resume=true continues from it" if save else ""
    if not saving:
        after = "; saving is off (save.every=0), so nothing to resume from"
    line = f"{result['signal']} stopped the job after step {step}{after}"
    return {"error": line, "stop_signal": result["signal"], "stopped_step": step, "save": save}


def stopped_at_once(job_stop: JobStop) -> tuple[str, dict[str, Any]]:
    """The status of a job whose ranks were killed on a second signal (the last save stays as it was)."""
    assert job_stop.stop is not None
    line = f"{job_stop.signal_name}, then a second signal: the ranks were killed at once (a save cut short is never a save)"
    return job_stop.stop.status, {"error": line, "stop_signal": job_stop.signal_name}


# The signals torch's elastic agent handles itself (LaunchConfig.signals_to_handle): its default
# list without those in STOPS.
AGENT_SIGNALS = ("SIGHUP", "SIGQUIT")

LAST: JobStop | None = None  # the last job's in this process (a sweep runs jobs one by one), for on_job_end


@contextlib.contextmanager
def handling_stops(run_dir: Path, owner: bool = True) -> Iterator[JobStop]:
    """While the body runs, STOPS' signals are requests to stop (JobStop); the previous handlers after.

    The `owner` of the run directory (node 0 of a multi-node job, whose nodes share it) clears a
    request left there before and after; another node's request must stay for every node to see.
    Only the main thread may set handlers; elsewhere (a test calling the job in a thread) the
    body runs with the handlers as they are.
    """
    global LAST
    job_stop, LAST = JobStop(run_dir), None
    if owner:
        (run_dir / STOP_REQUEST).unlink(missing_ok=True)  # left by an earlier job in this directory
    previous: dict[signal.Signals, Any] = {}
    try:
        with contextlib.suppress(ValueError):  # not the main thread
            for signum in STOPS:
                previous[signum] = signal.signal(signum, job_stop)
        yield job_stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        LAST = job_stop
        if owner:
            (run_dir / STOP_REQUEST).unlink(missing_ok=True)


def sweep_stop(status: str | None) -> Stop | None:
    """Whether a sweep must end after the point that just ran (on_job_end, in the job process):
    it was stopped, or a signal came while it finished (its W&B run, its summary)."""
    if LAST is not None and LAST.stop is not None:
        return LAST.stop
    return next((stop for stop in STOPS.values() if stop.status == status), None)
