"""Sweeps as Hydra runs them: fresh output directories, points already done skipped, fail-fast, the report.

`SweepCallback` is registered under `hydra.callbacks` in conf/train.yaml, so Hydra calls it in
the process that runs `python -m trainer` (the ranks never see it):

- on_run_start / on_multirun_start: a timestamped output directory (`${now:...}` in
  hydra.run.dir or hydra.sweep.dir) has a one-second resolution; two jobs or sweeps started in
  the same second would share it. The callback creates the directory atomically and, when it
  exists already, takes `<dir>_1`, `<dir>_2`, ... instead.
- on_job_end: a point stopped by a signal (Ctrl-C: `interrupted`; SIGTERM/SIGUSR1: `preempted`,
  trainer/faults/stop.py) stops the sweep with that signal's exit status, and with `fail_fast=true` the
  first point that does not end `ok` stops it (exit status 1), each after writing the report of
  the points so far.
- on_multirun_end: the end-of-sweep report (trainer/report/ write_sweep_report: the memory
  plan's fit table and how each point ran) with its W&B Report, and with logger=wandb its W&B
  run (online: the W&B Report saved, its URL in report.md).

`finished_ok` is the job's check (trainer/job.py) that lets a re-run of a sweep into the same
directory (`hydra.sweep.dir=<dir>`) skip the points that already ended `ok`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from trainer.console import error, say
from trainer.faults.stop import sweep_stop
from trainer.files import claim_directory
from trainer.telemetry.keys import Status
from trainer.telemetry.summary import read_summary


def read_status(out_dir: Path) -> str | None:
    """The status in a job's summary.json, None when it wrote none (or it cannot be read)."""
    return read_summary(out_dir).get("status")


def finished_ok(out_dir: Path) -> bool:
    """Whether this multirun point already ended `ok` in an earlier run of the same sweep."""
    return HydraConfig.get().mode == RunMode.MULTIRUN and read_status(out_dir) == Status.ok


def claim_fresh_dir(config: DictConfig, kind: str) -> Path | None:
    """Make `hydra.<kind>.dir` a directory no other job has, when it is a timestamped one.

    mkdir is atomic: of two jobs asking for one name, one gets it and the other the next
    `_N`. A directory without `${now:` was chosen on purpose (a re-run of a sweep, a resume)
    and is left as it is. Returns the directory taken, or None.
    """
    node = config.hydra[kind]
    if "${now:" not in str(OmegaConf.to_container(node, resolve=False).get("dir")):  # type: ignore[union-attr]
        return None
    claimed = claim_directory(Path(str(node.dir)))
    with read_write(config.hydra), open_dict(config.hydra):
        node.dir = str(claimed)
    return claimed


def hydra_quote(value: str) -> str:
    """A value for a Hydra command-line override, quoted so that any path parses as one string."""
    return "'" + value.replace("'", "\\'") + "'"


class SweepCallback(Callback):
    """Hydra's hooks for zerolab's runs and sweeps (see the module docstring)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from trainer.world import is_under_torchrun

        # Under torchrun every rank runs Hydra and rank 0's directory is used (trainer/job.py):
        # claiming would leave one empty directory per rank.
        # mode=plan and mode=advise start no rank on any node: one directory here, like one node's.
        one_place = config.get("nodes", 1) == 1 or config.get("mode", "train") != "train"
        if not is_under_torchrun() and one_place:
            claim_fresh_dir(config, "run")
        elif not is_under_torchrun() and "${now:" in str(
            OmegaConf.to_container(config.hydra.run, resolve=False).get("dir")
        ):
            # The nodes of one job share its directory; each node's own clock would name another.
            error(f"nodes={config.nodes} needs hydra.run.dir=<a directory every node shares>")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        claimed = claim_fresh_dir(config, "sweep")
        if claimed is not None:
            # Hydra composes every point's config again from the recorded overrides (and copies
            # the `now` cache), so the claimed directory must be one of them to reach the points.
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.overrides.hydra.append(f"hydra.sweep.dir={hydra_quote(str(claimed))}")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        out_dir = Path(config.hydra.runtime.output_dir)
        status = read_status(out_dir)
        if (
            stop := sweep_stop(status)
        ) is not None:  # Ctrl-C (or a preemption) ends the sweep after this point
            self.end_early(config, stop.status, f"the sweep stops after {out_dir.name}", stop.exit_code)
        if not config.get("fail_fast", False):
            return
        # No summary.json and no exception: a mode=plan point, which ends without one.
        if job_return.status == JobStatus.COMPLETED and status in (Status.ok, None):
            return
        self.end_early(
            config,
            "error",
            f"fail_fast: {out_dir.name} ended {status or 'with an exception'}; the sweep stops here",
            1,
        )

    def end_early(self, config: DictConfig, kind: str, line: str, code: int) -> None:
        """Stop the sweep after this point: the report of the points that ran, `kind: line`, `code`."""
        from trainer.report import summary_line, write_sweep_report

        report = write_sweep_report(Path(config.hydra.sweep.dir))
        print(summary_line(report), flush=True)
        say(kind, line)
        raise SystemExit(code)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from trainer.report import mirror_to_wandb, summary_line, write_sweep_report

        report = write_sweep_report(Path(config.hydra.sweep.dir))
        print(summary_line(report), flush=True)
        mirror_to_wandb(report)  # with logger=wandb; failures are warnings, the local report is complete
