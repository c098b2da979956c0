"""Running the catalog's jobs: each under its budget and the deadline, up to a few at once, an
exclusive one alone; what each left (its status, summary.json, metrics.jsonl, its console's tail)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpucheck.catalog import JobSpec, Setup, job_dir
from benchmarks.gpucheck.runner import run_process, session_env, trainer_command

TAIL_LINES = 15


@dataclass
class Job:
    """What one process left: its status, its files' contents, the tail of its console."""

    name: str
    status: str
    summary: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    console: str = ""
    seconds: float = 0.0
    killed: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    overrides: tuple[str, ...] = ()

    @property
    def losses(self) -> list[float]:
        return [r["loss/train"] for r in self.records if "loss/train" in r]

    def last(self, key: str) -> Any:
        values = [r[key] for r in self.records if key in r]
        return values[-1] if values else None

    def most(self, key: str) -> float | None:
        values = [r[key] for r in self.records if key in r]
        return max(values) if values else None


def trainer_args(setup: Setup, spec: JobSpec, overrides: list[str]) -> list[str]:
    if spec.name == setup.hang:  # a job that does not end by itself: only the kill ends it
        overrides += ["steps=1000000", "log_every=1"]
    saves = ["save=off"] if not any(o.startswith("save.") for o in overrides) else []
    return trainer_command(f"device={spec.device or setup.device}", "nproc=1", "logger=none", *saves,
                           *overrides, f"hydra.run.dir={job_dir(setup, spec.name)}")  # fmt: skip


def read_job(setup: Setup, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    out = job_dir(setup, name)
    summary_path, metrics_path = out / "summary.json", out / "metrics.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    return summary, [json.loads(line) for line in lines if line.strip()]


def tail(log: Path) -> str:
    lines = (
        [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if log.exists()
        else []
    )
    return "\n".join(lines[-TAIL_LINES:])


def run_job(setup: Setup, spec: JobSpec) -> Job:
    """One job under its budget, cut at the deadline; never raises for a failed job."""
    remaining = setup.deadline - time.monotonic()
    timeout = remaining if setup.dry_run else min(spec.budget_s, remaining)
    if timeout <= 0:
        return Job(spec.name, "skipped")
    overrides = spec.resolve(setup) if spec.resolve is not None else spec.overrides
    args = list(spec.command) if spec.command else trainer_args(setup, spec, list(overrides))
    log = setup.out / "logs" / f"{spec.name}.log"
    start = time.perf_counter()
    code, killed, survivors = run_process(args, log, timeout, session_env(WANDB_MODE="disabled"))
    summary, records = read_job(setup, spec.name) if not spec.command else ({}, [])
    if code is None:
        status = "timeout"
    elif spec.command:
        status = "ok" if code == 0 else f"exit {code}"
    else:
        status = summary.get("status", f"exit {code}")
    seconds = time.perf_counter() - start
    return Job(spec.name, status, summary, records, tail(log), seconds, killed, survivors, tuple(overrides))


class Scheduler:
    """Runs the jobs in order on a thread of its own; rows wait for theirs with `get`.

    On the GPU up to `workers` jobs run at once, but an exclusive job (a timing, a device-wide
    memory figure) runs alone. A dry run ignores exclusivity: on a shared CPU nothing is a timing.
    """

    def __init__(self, setup: Setup, specs: list[JobSpec], workers: int) -> None:
        self.setup, self.workers = setup, workers
        self.futures: dict[str, Future[Job]] = {spec.name: Future() for spec in specs}
        # A dry run gives 125m and 1b the same tiny model: a job equal to an earlier one is run once.
        first: dict[Any, str] = {}
        self.specs, self.aliases = [], {}
        for spec in specs:
            key = (
                (spec.command, spec.overrides, spec.device)
                if not spec.unique and spec.resolve is None
                else spec.name
            )
            if key in first:
                self.aliases[spec.name] = first[key]
            else:
                first[key] = spec.name
                self.specs.append(spec)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def get(self, name: str) -> Job:
        return self.futures[self.aliases.get(name, name)].result()

    def _run(self) -> None:
        running: dict[Future[Job], bool] = {}  # future -> exclusive
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for spec in self.specs:
                exclusive = spec.exclusive and not self.setup.dry_run
                while running and (exclusive or any(running.values()) or len(running) >= self.workers):
                    done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                    for future in done:
                        running.pop(future)
                if spec.after is not None:
                    self.get(spec.after)
                future = pool.submit(run_job, self.setup, spec)
                future.add_done_callback(lambda f, name=spec.name: self._settle(name, f))
                running[future] = exclusive

    def _settle(self, name: str, future: Future[Job]) -> None:
        error = future.exception()
        if error is not None:
            self.futures[name].set_result(Job(name, f"error: {type(error).__name__}: {error}"))
        else:
            self.futures[name].set_result(future.result())


def failed(job: Job) -> str:
    """The job's own error line, for a row whose job did not end as the row expects."""
    lines = job.console.splitlines()
    return f"{job.name}: status {job.status}: {job.summary.get('error') or (lines[-1] if lines else 'no output')}"
