"""Writing what was measured: the job's W&B run, fed from metrics.jsonl by the job process.

A launched rank never imports wandb (under torchrun, where no job process stands above the
ranks, rank 0's process plays its part and imports it; the other ranks never do). Rank 0 appends one JSON line per log step to metrics.jsonl; the job
process tails that file while the ranks run and logs each record at its step, then writes the
summary and finishes the run with the job's status, even when a rank died. W&B is a mirror:
when it cannot start or fails midway, a warning is printed once and training goes on; the
local files are complete on their own.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from trainer.config import LoggerBackend, LoggerConfig
from trainer.console import warn
from trainer.jsonl import parse_line
from trainer.private_apis.of_wandb import generate_run_id, service_lost_errors
from trainer.telemetry.keys import MICRO_BATCH_AUTO, Status
from trainer.telemetry.summary import redact_secrets
from trainer.telemetry.traces import run_files
from trainer.telemetry.wandb_run import SUMMARIZED_BY_WANDB, define_metrics, describe_job, steady_figures

PROVENANCE_KEYS = (
    "world_size",
    "device",
    "torch_version",
    "git_revision",
)  # summary.provenance's, besides config


class Logger(Protocol):
    def follow(self, path: Path) -> AbstractContextManager[None]: ...
    def finish(self, summary: dict[str, Any], exit_code: int) -> None: ...


class NullLogger:
    """logger=none, or W&B could not start: metrics.jsonl and summary.json only."""

    def follow(self, path: Path) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        pass


class WandbLogger:
    """One W&B run: history from metrics.jsonl, summary and final state from summary.json's figures."""

    def __init__(self, run: Any, out_dir: Path | None = None) -> None:
        self.run = run
        self.out_dir = out_dir
        """The job's directory, whose traces and memory snapshots the run gets as artifacts (None: none)."""
        self.last_step = -1
        self.failed = False

    def log_record(self, record: dict[str, Any]) -> None:
        # W&B drops (with a warning) a step at or below one already logged; a resumed job's
        # file can repeat steps, so they are skipped here instead.
        if record["step"] <= self.last_step:
            return
        # The record as it is, `step` included: W&B's step and the charts' x-axis (wandb_run.define_metrics).
        self.guard(lambda: self.run.log(record, step=record["step"], commit=True))
        self.last_step = record["step"]

    @contextlib.contextmanager
    def follow(self, path: Path) -> Iterator[None]:
        """Stream the records appended to `path` while the body runs, then the rest."""
        tail = MetricsTail(path, self.log_record)
        tail.start()
        try:
            yield
        finally:
            tail.stop()

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        """Write the summary and end the run with the job's exit code (0 when ok: state `finished`,
        else `failed`), which the job decides (trainer/faults/stop.py exit_code_for)."""
        # W&B keeps its own min and last of the held-out loss (define_metrics): summary.json's last
        # value would replace them.
        left_out = ("config", "overrides", *SUMMARIZED_BY_WANDB)
        figures = {k: v for k, v in summary.items() if k not in left_out} | steady_figures(summary)
        self.guard(lambda: self.run.summary.update(redact_secrets(figures)))
        if summary["status"] == Status.preempted:
            self.guard(self.run.mark_preempting)  # W&B's own mark of a run a scheduler stopped
        if self.out_dir is not None:
            self.guard(lambda: log_run_files(self.run, self.out_dir))
        self.guard(lambda: self.run.finish(exit_code=exit_code))

    def guard(self, action: Callable[[], Any]) -> None:
        """Run a W&B call; on the first failure warn once and stop using W&B for this job."""
        if self.failed:
            return
        try:
            action()
        except Exception as err:  # any W&B failure must leave training and local files alone
            self.failed = True
            warn(
                redact_secrets(
                    f"W&B stopped working ({describe_failure(err)}); metrics.jsonl and summary.json are complete"
                )
            )


def log_run_files(run: Any, out_dir: Path) -> None:
    """The run directory's profiler traces and memory snapshots (trainer/telemetry/traces.py), one W&B artifact
    of each kind named after the run; also offline, where `wandb sync` uploads them with the run.
    `immutable`: W&B reads the files where they are rather than copying them first (they are not written again)."""
    import wandb

    for files in run_files(out_dir):
        artifact = wandb.Artifact(f"{files.kind}-{run.id}", type=files.kind, description=files.description)
        for path in files.paths:
            artifact.add_file(str(path), name=path.name, policy="immutable")
        run.log_artifact(artifact)


def describe_failure(err: Exception) -> str:
    """A failed W&B call in words. A dead service process fails whichever call meets it first, with
    whichever error that call's path raises (service_lost_errors): one sentence for them all, so
    the warning says what happened, not where the call was when it found out."""
    if isinstance(err, service_lost_errors()):
        return "ConnectionError: lost the connection to the W&B service process"
    return f"{type(err).__name__}: {err}"


class MetricsTail(threading.Thread):
    """Hands every complete line appended to a JSONL file to `on_record`, polling in the background.

    Starts at the file's current end: records of an earlier job in the same directory (a
    resumed run) belong to that job's W&B run.
    """

    def __init__(self, path: Path, on_record: Callable[[dict[str, Any]], None], poll_s: float = 0.5) -> None:
        super().__init__(name="metrics-tail", daemon=True)
        self.path, self.on_record, self.poll_s = path, on_record, poll_s
        self.offset = path.stat().st_size if path.exists() else 0
        self.inode = path.stat().st_ino if path.exists() else None
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.poll_s):
            self.poll()

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.poll()  # what rank 0 wrote after the last poll

    def poll(self) -> None:
        if not self.path.exists():
            return
        if (inode := self.path.stat().st_ino) != self.inode:
            # A new file: rewound after an elastic restart (resume.rewind_metrics replaces it).
            # Read it from the start; the logger skips the steps it has logged already.
            self.inode, self.offset = inode, 0
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            if (
                record := parse_line(line)
            ) is not None:  # a torn line (a rank killed mid-write) is not a record
                self.on_record(record)


@contextlib.contextmanager
def open_logger(
    logger: LoggerConfig,
    out_dir: Path,
    meta: dict[str, Any],
    name: str,
    group: str,
    job_type: str,
    resume: str,
) -> Iterator[Logger]:
    """The job's logger: a W&B run (`with wandb.init(...)`, one per job) or a NullLogger.

    `job_type` is the run's W&B job type (the ZeRO stage); `resume` is the job's resolved
    `resume` (false or a save), which decides whether the directory's W&B run goes on.
    """
    if logger.backend != LoggerBackend.wandb:
        yield NullLogger()
        return
    run = start_wandb(logger, out_dir, meta, name, group, job_type, resume)
    if run is None:
        yield NullLogger()
        return
    # Finished when the job ends, also when it raised (failed), so the next job of a sweep (same
    # process under Hydra's basic launcher) gets a run of its own; finish() is a no-op once ended.
    logger = WandbLogger(run, out_dir)
    try:
        yield logger
    finally:
        logger.guard(lambda: run.finish(exit_code=1))
        if (
            logger.failed
        ):  # its service died: tear down now, quietly, not in an atexit hook that prints the broken pipe
            import wandb

            with contextlib.suppress(Exception):
                wandb.teardown()
    if run.settings.mode == "offline" and not logger.failed:
        print(f"W&B run saved offline; upload it with: wandb sync {run.settings.sync_dir}", flush=True)


def start_wandb(
    logger: LoggerConfig,
    out_dir: Path,
    meta: dict[str, Any],
    name: str,
    group: str,
    job_type: str,
    resume: str,
) -> Any:
    """wandb.init for this job, or None (after one warning) when W&B cannot start."""
    try:
        import wandb

        labels = describe_job(meta["config"])
        run = wandb.init(
            project=logger.project,
            entity=logger.entity,
            dir=str(out_dir),  # the run lives inside the job's output directory
            mode=wandb_mode(),
            name=name,
            group=group,
            job_type=job_type,
            id=wandb_run_id(resume, out_dir),
            resume="allow",  # a resumed job continues its directory's run; a new id starts a new one
            tags=labels.tags,
            config=redact_secrets({**wandb_config(meta), "swept": labels.swept}),
        )
        define_metrics(run)
    except Exception as err:  # unreachable server, bad credentials, bad settings: training goes on
        warn(
            redact_secrets(
                f"W&B could not start ({type(err).__name__}: {err}); training goes on, metrics in {out_dir}"
            )
        )
        return None
    yield_cpu_to_ranks()
    return run


def yield_cpu_to_ranks() -> None:
    """Give W&B's service process (wandb-core, and what it starts later) the lowest CPU priority.

    It runs beside the ranks for the whole job. On a CPU host the ranks keep every core busy, so
    whatever the service does at normal priority comes straight out of training throughput;
    at nice 19 it runs in the ranks' gaps instead. Its work (writing records, sampling system
    stats) can wait milliseconds; a rank waiting holds up every other rank.
    """
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone already, or not ours to renice
            if child.name().startswith("wandb"):
                child.nice(19)


def wandb_run_id(resume: str, out_dir: Path) -> str:
    """The W&B run id, kept in the output directory: a resumed job (which continues the directory of
    the run it resumes, see resume.resolve_resume) logs into the same W&B run; any other job
    gets a new id, even in a reused directory."""
    path = out_dir / "wandb_run_id"
    if resume != "false" and path.exists():
        return path.read_text().strip()
    run_id = generate_run_id()
    path.write_text(run_id + "\n")
    return run_id


def wandb_mode() -> str | None:
    """None (wandb decides: online) when credentials or WANDB_MODE are configured, else offline.

    wandb.login(prompt=False, verify=False) is wandb's own check of WANDB_API_KEY, its settings
    files and .netrc; it neither prompts nor contacts the server.
    """
    if os.environ.get("WANDB_MODE"):
        return None
    import wandb

    try:
        return None if wandb.login(prompt=False, verify=False) else "offline"
    except Exception:  # a malformed key: offline rather than no run at all
        return "offline"


def wandb_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The whole resolved config at the top level, the overrides and the provenance beside it.

    Provenance gets a key of its own: its `device` (the device's name) would otherwise
    overwrite the config's `device` (auto, cpu or cuda).
    """
    provenance = {k: meta[k] for k in PROVENANCE_KEYS if k in meta}  # the plan's figures go to the summary
    auto = {MICRO_BATCH_AUTO: meta[MICRO_BATCH_AUTO]} if MICRO_BATCH_AUTO in meta else {}
    return {**meta["config"], "overrides": meta["overrides"], "provenance": provenance, **auto}


def run_name() -> str:
    """The W&B run's name: the job's overrides (`zero=stage3,micro_batch=4`), as Hydra joins them."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().job.override_dirname or "defaults"


def run_group() -> str:
    """The sweep (`<date>/<time>` of its directory) for multirun jobs, else the run's date."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_config = HydraConfig.get()
    if hydra_config.mode == RunMode.MULTIRUN:
        return sweep_group(Path(hydra_config.sweep.dir))
    return datetime.date.today().isoformat()


def sweep_group(sweep_dir: Path) -> str:
    """A sweep's W&B group, shared by its jobs' runs and its report's run: `<date>/<time>` of its directory."""
    return f"{sweep_dir.parent.name}/{sweep_dir.name}"
