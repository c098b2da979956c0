"""Running the catalog's jobs: each under its budget and the deadline, up to a few at once, an
exclusive one alone (a dry run's sweep: several jobs as the points of one multirun); what each left
(its status, summary.json, metrics.jsonl, its console's tail)."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from checks.gpucheck.catalog import JobSpec, Setup, job_dir
from checks.gpucheck.runner import REPO, run_process, session_env, trainer_command

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


HANG = ("steps=1000000", "log_every=1", "fault.kind=hang", "fault.step=2")
"""--inject-hang's job does not end by itself: only the kill ends it. Its rank logs step 1, then hangs
in step 2 asleep (fault.kind=hang), so the drill's wait costs no CPU."""
POINT_GROUP = "gpucheck"
"""The config group a dry run's sweep picks its points from (one generated file per point)."""


def trainer_args(setup: Setup, spec: JobSpec, overrides: list[str]) -> list[str]:
    if spec.name == setup.hang:
        overrides += HANG
    saves = ["save=off"] if not any(o.startswith("save.") for o in overrides) else []
    return trainer_command(f"device={spec.device or setup.device}", "nproc=1", "logger=none", *saves,
                           *overrides, f"hydra.run.dir={job_dir(setup, spec.name)}")  # fmt: skip


def point_config(overrides: tuple[str, ...]) -> str:
    """A job's command-line overrides as a config file that one sweep point picks: `group=option`
    as a defaults-list override, any other key as a value (the last of a key's overrides wins, as on
    the command line), both applied after conf/train.yaml's as the command line's are."""
    from omegaconf import OmegaConf

    groups: dict[str, str] = {}
    values: list[str] = []
    for override in overrides:
        key, value = override.split("=", 1)
        if (REPO / "conf" / key).is_dir():
            groups[key] = value
        else:
            values.append(override)
    defaults = [f"  - override /{key}: {value}" for key, value in groups.items()]
    return "\n".join(
        ["# @package _global_", "defaults:", *defaults, OmegaConf.to_yaml(OmegaConf.from_dotlist(values))]
    )


def sweep_args(setup: Setup, spec: JobSpec) -> list[str]:
    """`python -m trainer -m` over the points of `spec`, each from a file under jobs/<spec>_points/
    and run into jobs/<spec>/<point>/."""
    configs = job_dir(setup, f"{spec.name}_points")
    (configs / POINT_GROUP).mkdir(parents=True, exist_ok=True)
    for point in spec.points:
        overrides = (*point.overrides, *(HANG if point.name == setup.hang else ()))
        (configs / POINT_GROUP / f"{point.name}.yaml").write_text(point_config(overrides))
    return trainer_command("-m", f"device={setup.device}", "nproc=1", "logger=none", "save=off",
                           f"hydra.searchpath=[file://{configs}]",
                           f"+{POINT_GROUP}={','.join(point.name for point in spec.points)}",
                           f"hydra.sweep.dir={job_dir(setup, spec.name)}",
                           f"hydra.sweep.subdir=${{hydra:runtime.choices.{POINT_GROUP}}}")  # fmt: skip


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
    code, killed, survivors = run_process(
        args, log, timeout, session_env(WANDB_MODE="disabled", **dict(spec.env))
    )
    summary, records = read_job(setup, spec.name) if not spec.command else ({}, [])
    if code is None:
        status = "timeout"
    elif spec.command:
        status = "ok" if code == 0 else f"exit {code}"
    else:
        status = summary.get("status", f"exit {code}")
    seconds = time.perf_counter() - start
    return Job(spec.name, status, summary, records, tail(log), seconds, killed, survivors, tuple(overrides))


def run_sweep(setup: Setup, spec: JobSpec) -> list[Job]:
    """A dry run's sweep, cut at the deadline; each point's Job as if it had run alone: jobs/<point>
    links to its directory, logs/<point>.log holds its part of the sweep's console."""
    remaining = setup.deadline - time.monotonic()
    if remaining <= 0:
        return [Job(point.name, "skipped") for point in spec.points]
    log = setup.out / "logs" / f"{spec.name}.log"
    start = time.perf_counter()
    code, killed, survivors = run_process(
        sweep_args(setup, spec), log, remaining, session_env(WANDB_MODE="disabled")
    )
    seconds, consoles = time.perf_counter() - start, point_consoles(log)
    jobs = []
    for point in spec.points:
        if (job_dir(setup, spec.name) / point.name).exists():
            job_dir(setup, point.name).symlink_to(Path(spec.name) / point.name)
        point_log = setup.out / "logs" / f"{point.name}.log"
        point_log.write_text(consoles.get(point.name, ""))
        summary, records = read_job(setup, point.name)
        status = summary.get("status") or ("timeout" if code is None else f"exit {code}")
        jobs.append(Job(point.name, status, summary, records, tail(point_log), seconds, killed, survivors,
                        point.overrides))  # fmt: skip
    return jobs


def run_alone(setup: Setup, spec: JobSpec) -> list[Job]:
    return [run_job(setup, spec)]


def point_consoles(log: Path) -> dict[str, str]:
    """The sweep's console cut where Hydra announces each point (`#3 : ... +gpucheck=NAME`)."""
    consoles: dict[str, str] = {}
    name = None
    for line in log.read_text(errors="replace").splitlines(keepends=True):
        if (announced := re.search(rf"\[HYDRA\]\s+#\d+ : .*\+{POINT_GROUP}=(\S+)", line)) is not None:
            name = announced.group(1)
        if name is not None:
            consoles[name] = consoles.get(name, "") + line
    return consoles


class Scheduler:
    """Runs the jobs in order on a thread of its own; rows wait for theirs with `get`.

    On the GPU up to `workers` jobs run at once, but an exclusive job (a timing, a device-wide
    memory figure) runs alone. A dry run ignores exclusivity: on a shared CPU nothing is a timing.
    """

    def __init__(self, setup: Setup, specs: list[JobSpec], workers: int) -> None:
        self.setup, self.workers = setup, workers
        self.futures: dict[str, Future[Job]] = {
            s.name: Future() for spec in specs for s in spec.points or (spec,)
        }
        # A dry run gives 125m and 1b the same tiny model: a job equal to an earlier one (a sweep's
        # point too) is run once.
        first: dict[Any, str] = {}
        self.specs, self.aliases = [], {}

        def first_of_its_kind(spec: JobSpec) -> bool:
            key = (
                (spec.command, spec.overrides, spec.device)
                if not spec.unique and spec.resolve is None
                else spec.name
            )
            if key in first:
                self.aliases[spec.name] = first[key]
                return False
            first[key] = spec.name
            return True

        for spec in specs:
            if spec.points:
                points = tuple(point for point in spec.points if first_of_its_kind(point))
                self.specs += [replace(spec, points=points)] if points else []
            elif first_of_its_kind(spec):
                self.specs.append(spec)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def get(self, name: str) -> Job:
        return self.futures[self.aliases.get(name, name)].result()

    def _run(self) -> None:
        running: dict[Future[list[Job]], bool] = {}  # future -> exclusive
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for spec in self.specs:
                exclusive = spec.exclusive and not self.setup.dry_run
                while running and (exclusive or any(running.values()) or len(running) >= self.workers):
                    done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                    for future in done:
                        running.pop(future)
                if spec.after is not None:
                    self.get(spec.after)
                future = pool.submit(run_sweep if spec.points else run_alone, self.setup, spec)
                future.add_done_callback(lambda f, spec=spec: self._settle(spec, f))
                running[future] = exclusive

    def _settle(self, spec: JobSpec, future: Future[list[Job]]) -> None:
        if (error := future.exception()) is None:
            jobs = future.result()
        else:
            names = [point.name for point in spec.points] or [spec.name]
            jobs = [Job(name, f"error: {type(error).__name__}: {error}") for name in names]
        for job in jobs:
            self.futures[job.name].set_result(job)


def failed(job: Job) -> str:
    """The job's own error line, for a row whose job did not end as the row expects."""
    lines = job.console.splitlines()
    return f"{job.name}: status {job.status}: {job.summary.get('error') or (lines[-1] if lines else 'no output')}"
