"""The W&B side of a report: with logger=wandb, one summary run in the sweep's group (the results
table and every chart) and, online, the W&B Report saved and linked from report.md.

W&B is a mirror: each failure costs one warning line, and the local report stays complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainer.console import warn
from trainer.report.markdown import set_wandb_url
from trainer.report.rows import COLUMNS
from trainer.report.run_dirs import Report
from trainer.telemetry.summary import redact_secrets
from trainer.telemetry.wandb_logger import sweep_group


def log_to_wandb(report: Report, project: str, entity: str | None) -> tuple[str, bool]:
    """One summary run in the sweep's group: the results table and every chart. Returns its id and
    whether it went to the server (online) rather than to an offline run directory.

    The run's id is derived from the report's directory, so writing the report again (a re-run of
    the sweep, or `python -m trainer.report`) continues the same W&B run instead of adding one.
    """
    import wandb

    from trainer.report.wandb_report import report_run_id
    from trainer.telemetry.wandb_logger import wandb_mode

    group = sweep_group(report.sweep_dir)
    with wandb.init(
        project=project,
        entity=entity,
        group=group,
        name=f"{report.title.split(':')[0].lower()} {group}",
        job_type="report",
        id=report_run_id(report.sweep_dir),
        resume="allow",
        dir=str(report.sweep_dir),
        mode=wandb_mode(),
        config={"sweep_dir": str(report.sweep_dir), "swept": report.swept, "points": len(report.rows)},
    ) as run:
        log_results(run, report)
        online = run.settings.mode == "online"
    return run.id, online


def log_results(run: Any, report: Report) -> None:
    """The results table and every chart as one log step; the fastest point and the count of each
    status in the run's summary."""
    import wandb

    from trainer.report.wandb_report import RESULTS_TABLE

    table = wandb.Table(columns=COLUMNS, data=[[row[c] for c in COLUMNS] for row in report.rows])
    charts = {f"sweep/{name}": wandb.Image(str(path)) for name, path in report.charts.items()}
    run.log({RESULTS_TABLE: table, **charts})
    if (best := report.fastest) is not None:
        run.summary.update(
            {"fastest/overrides": best["overrides"], "fastest/tokens_per_s": best["tokens_per_s"]}
        )
    statuses = {r["status"] for r in report.rows}
    run.summary.update({f"points/{s}": sum(r["status"] == s for r in report.rows) for s in statuses})


def mirror_to_wandb(report: Report) -> None:
    """With logger=wandb: the report run, and online the W&B Report saved and its URL in report.md.

    W&B is a mirror: each failure is one warning line, and the local report stays complete.
    """
    from trainer.report.wandb_report import REPORT_FILE

    logger = report_logger(report)
    if logger.get("backend") != "wandb":
        return
    try:
        run_id, online = log_to_wandb(report, logger.get("project") or "zerolab", logger.get("entity"))
    except Exception as err:  # unreachable, misconfigured: the local report is complete without it
        warn(
            redact_secrets(
                f"the report could not go to W&B ({type(err).__name__}: {err}); the local report is complete"
            )
        )
        return
    print(f"W&B: report run {run_id} in group {sweep_group(report.sweep_dir)}", flush=True)
    if online and (report.sweep_dir / REPORT_FILE).exists():
        publish_and_link(report.sweep_dir)


def publish_and_link(report_dir: Path) -> str | None:
    """Save the W&B Report in `report_dir` and write its URL into report.md; None (one warning) on failure."""
    from trainer.report.wandb_report import REPORT_FILE, publish

    try:
        url = publish(report_dir / REPORT_FILE)
    except Exception as err:  # the library, the server or the credentials: report.md keeps how to publish
        warn(
            redact_secrets(
                f"the W&B Report could not be saved ({type(err).__name__}: {err}); it is in {report_dir / REPORT_FILE}"
            )
        )
        return None
    set_wandb_url(report_dir, url)
    print(f"W&B Report: {url}", flush=True)
    return url


def report_logger(report: Report) -> dict[str, Any]:
    """The `logger` settings the report's runs used: the sweep's multirun.yaml, else the first
    point's config that names one (a comparison)."""
    if report.is_sweep and (logger := sweep_logger(report.sweep_dir)) is not None:
        return logger
    return next((p.config["logger"] for p in report.points if isinstance(p.config.get("logger"), dict)), {})


def sweep_logger(sweep_dir: Path) -> dict[str, Any] | None:
    """The sweep's `logger` settings, from the multirun.yaml Hydra saved in the sweep directory."""
    path = sweep_dir / "multirun.yaml"
    if not path.exists():
        return None
    logger = OmegaConf.load(path).get("logger")
    return OmegaConf.to_container(logger) if logger is not None else None  # type: ignore[return-value]
