"""A sweep under hydra/launcher=local (submitit's local executor, the SLURM path on one host) ends
like one under Hydra's basic launcher: every point ok, the sweep report, one W&B group."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_sweeps import point_dirs, read_csv, run_sweep, settings, summary, table_rows, wandb_run
from trainer.loggers import sweep_group

# Two points whose processes submitit starts together: tiny and short (steps=3).
POINT = ("nproc=2", "device=cpu", "model=tiny", "steps=3", "seq_len=64", "log_every=1", "save=off", "logger=wandb")


@pytest.mark.timeout(480)
def test_a_local_launcher_sweep_reports_every_point_and_one_wandb_group(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(sweep_dir, "hydra/launcher=local", "micro_batch=1,2", *POINT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = point_dirs(sweep_dir)
    assert [settings(p)["micro_batch"] for p in points] == ["1", "2"]
    assert [(summary(p)["status"], summary(p)["steps_done"]) for p in points] == [("ok", 3)] * 2
    # Each point ran in a submitit job of its own, not in the submitting process.
    assert len(list((sweep_dir / ".submitit").glob("*/*_result.pkl"))) == 2
    # The sweep's end (on_multirun_end, in the submitting process): the report and its W&B run.
    rows = read_csv(sweep_dir / "results.csv")
    assert [(row["dir"], row["status"]) for row in rows] == [(p.name, "ok") for p in points]
    assert len(table_rows(sweep_dir / "report.md")) == 2
    group = sweep_group(sweep_dir)
    runs = [wandb_run(next(p.glob("wandb/offline-run-*/run-*.wandb"))) for p in points]
    assert [run["run_group"] for run in runs] == [group, group]
    report_run = wandb_run(next(sweep_dir.glob("wandb/offline-run-*/run-report-*.wandb")))
    assert (report_run["run_group"], report_run["job_type"]) == (group, "report")
