"""`telemetry.trace_steps` and `telemetry.trace_ranks`: torch.profiler's chrome trace of chosen steps on chosen
ranks, as torchtitan (`profiling.profile_freq`, every rank) and Megatron (`--profile-step-start/end`,
`--profile-ranks`) write them (docs/stability.md, "Traces").

Rank half: each chosen rank records each chosen optimizer step with torch.profiler (CPU activities, and
CUDA on a GPU) and exports its chrome trace to `traces/rank{r}_step{s}.json` right after the step. torch
writes the rank, world size and process groups into the trace itself (`distributedInfo`, from
`torch.distributed` when it is initialised); the rank and the step are added as `zerolab` (the profiler's
`add_metadata_json`). Tracing off makes no profiler: the step runs under a null context.

One profiler session per step: torch.profiler cannot run two at once, and the communication probe
profiles a step of its own (trainer/telemetry/comm.py, step 3 by default). `profiled_step` opens the
session, or hands out the one already open, and gives the profiler to each user's callback once it has
stopped: a traced step that the probe also profiles is recorded once, exported here and read there.

Job-process half: `run_files` lists the traces and the memory snapshots (trainer/telemetry/snapshot.py)
that the W&B logger attaches to the run as artifacts and the sweep report links.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.config import TelemetryConfig
from trainer.console import warn
from trainer.telemetry.snapshot import SNAPSHOT_DIR

TRACE_DIR = "traces"
VIEW = "open it in https://ui.perfetto.dev or chrome://tracing"


def trace_path(out_dir: Path, rank: int, step: int) -> Path:
    return out_dir / TRACE_DIR / f"rank{rank}_step{step}.json"


@dataclass
class StepSession:
    """The profiler over one step, and what its users do with it once it has stopped."""

    profiler: Any  # torch.profiler.profile
    after: list[Callable[[Any], None]] = field(default_factory=list)


OPEN: list[StepSession] = []
"""The session open in this process (at most one)."""


@contextlib.contextmanager
def profiled_step(device: torch.device) -> Iterator[StepSession]:
    """torch.profiler over the body, or the session already open around it; when the session that
    this call opened stops, each `after` callback gets the stopped profiler (its events are readable
    only then)."""
    if OPEN:
        yield OPEN[0]
        return
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints `USDT: ... profiler_start/stop` on stderr for every profiled step; level 6
    # (above its highest, USDT = 5) keeps a job's console to its own lines. A user's setting wins.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        session = StepSession(profiler)
        OPEN.append(session)
        try:
            yield session
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the step's kernels inside the trace
        finally:
            OPEN.clear()
    for callback in session.after:
        callback(profiler)


class Traces:
    """One rank's traces: the steps it records (none unless it is one of `trace_ranks`)."""

    def __init__(self, config: TelemetryConfig, device: torch.device, out_dir: Path, rank: int) -> None:
        self.steps = frozenset(config.trace_steps) if rank in config.trace_ranks else frozenset()
        self.device, self.out_dir, self.rank = device, out_dir, rank

    def record(self, step: int) -> AbstractContextManager:
        """Wrap a training step: its trace on a chosen step, nothing at all on any other."""
        return self._record(step) if step in self.steps else contextlib.nullcontext()

    @contextlib.contextmanager
    def _record(self, step: int) -> Iterator[None]:
        with profiled_step(self.device) as session:
            session.profiler.add_metadata_json("zerolab", json.dumps({"rank": self.rank, "step": step}))
            yield
            session.after.append(functools.partial(self.export, step))

    def export(self, step: int, profiler: Any) -> Path | None:
        """The step's trace, written; a trace that cannot be written (a full disk) is warned about, and
        training goes on: it is a diagnostic, not the run's state."""
        path = trace_path(self.out_dir, self.rank, step)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
        except OSError as err:
            warn(f"rank {self.rank} could not write its trace of step {step} to {path}: {err}")
            return None
        print(f"trace of rank {self.rank}, step {step}: {path}; {VIEW}", flush=True)
        return path


@dataclass(frozen=True)
class RunFiles:
    """Files of one kind that a run wrote, attached to its W&B run as one artifact."""

    kind: str
    """The artifact's type, and its name's prefix."""
    description: str
    paths: list[Path]


def run_files(out_dir: Path) -> list[RunFiles]:
    """The traces and the memory snapshots in a run directory, each kind that has any."""
    kinds = [
        RunFiles("profiler-traces", "torch.profiler chrome traces (telemetry.trace_steps)", traces(out_dir)),
        RunFiles(
            "memory-snapshots",
            "memory snapshots on OOM or named steps (memory.snapshot)",
            sorted((out_dir / SNAPSHOT_DIR).glob("rank*")),
        ),
    ]
    return [kind for kind in kinds if kind.paths]


def traces(out_dir: Path) -> list[Path]:
    """A run's traces, by rank and then step."""

    def order(path: Path) -> tuple[int, int]:
        rank, step = path.stem.removeprefix("rank").split("_step")
        return int(rank), int(step)

    return sorted((out_dir / TRACE_DIR).glob("rank*_step*.json"), key=order)
