"""The W&B Report of a sweep or of any runs compared: a ready dashboard built from what was swept.

Built with W&B's own reports library (`wandb-workspaces`, imported lazily: without it a report
costs one warning, never the sweep) from the local report (trainer/report/sweep_report.py), offline: nothing
here asks W&B's server anything until `publish`. Its serialised form, the library's own
ReportViewspec JSON, is always written next to report.md as wandb_report.json; `publish` loads
it back, points its run sets at the project on the server and saves it.

Blocks (docs/telemetry.md describes each panel and the question it answers):

    the runs           parallel coordinates: every swept key -> steady tokens/s, MFU, worst-rank
                       and predicted peak; the runs table with those columns pinned
    throughput         steady tokens/s against micro_batch, runs grouped by the other swept keys
                       (a bar per run, grouped the same way, when micro_batch was not swept)
    memory             the worst rank's peak with the plan's prediction; every rank's peak
    training           loss/train against step; precision/loss_scale where fp16 ran; bytes moved
                       per step by every rank with the plan's, where the runs recorded them
    results            the results table the report run logged (`sweep/results`, = results.csv)

A sweep's run sets are its W&B group without the report run; a comparison's are the runs'
own ids (each job keeps its id in `wandb_run_id`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from trainer.console import warn
from trainer.private_apis.of_wandb import report_from_json, report_json
from trainer.report.run_dirs import Report, per_rank_peaks
from trainer.telemetry import keys
from trainer.telemetry.summary import redact_secrets
from trainer.telemetry.wandb_run import STEADY_KEYS, STEP_KEY, config_path

REPORT_FILE = "wandb_report.json"
STEADY_TOKENS = STEADY_KEYS[keys.TOKENS_PER_S]
STEADY_MFU = STEADY_KEYS[keys.MFU_PCT]
RESULTS_TABLE = "sweep/results"  # the report run's table (trainer/report/summary_run.py log_to_wandb)


def report_run_id(out_dir: Path) -> str:
    """The report run's id, derived from the report's directory: writing the report again continues it."""
    return "report-" + hashlib.sha1(str(out_dir.resolve()).encode()).hexdigest()[:12]


def run_filter(report: Report) -> Any:
    """The run set: a sweep's group without its report run, or the compared runs by id (an
    `expr.And`: wandb-workspaces deprecates a plain list of filter expressions)."""
    from wandb_workspaces import expr

    from trainer.telemetry.wandb_logger import sweep_group

    if report.is_sweep:
        return expr.And(
            expr.Metric("Group") == sweep_group(report.sweep_dir), expr.Metric("JobType") != "report"
        )
    return expr.And(
        expr.Metric("ID").isin(
            sorted({run_id for point in report.points if (run_id := read_run_id(point.path)) is not None})
        )
    )


def read_run_id(run_dir: Path) -> str | None:
    path = run_dir / "wandb_run_id"
    return path.read_text().strip() if path.exists() else None


def build_report(report: Report, project: str, entity: str | None) -> Any:
    """The W&B Report of `report`, built offline (run sets name no project: the report's own is used)."""
    import wandb_workspaces.reports.v2 as wr
    from wandb_workspaces import expr

    swept = [wr.Config(config_path(key)) for key in report.swept]
    others = [config_path(key) for key in report.swept if key != "micro_batch"]
    filters = run_filter(report)
    blocks = [
        wr.H1("The runs"),
        wr.P(report.description),
        wr.PanelGrid(
            runsets=[runset(wr, "runs", filters, [], pinned(report))],
            panels=[parallel_coordinates(wr, swept)],
        ),
        wr.H1("Throughput"),
        wr.PanelGrid(
            runsets=[runset(wr, "runs by " + (", ".join(others) or "run"), filters, others, [])],
            panels=[throughput_panel(wr, report, others)],
        ),
        wr.H1("Memory and training"),
        wr.PanelGrid(
            runsets=[runset(wr, "runs", filters, [], [])],
            panels=memory_panels(wr, report) + training_panels(wr, report) + comm_panels(wr, report),
        ),
        wr.H1("Results"),
        wr.PanelGrid(
            runsets=[
                runset(
                    wr, "report run", expr.And(expr.Metric("ID") == report_run_id(report.sweep_dir)), [], []
                )
            ],
            panels=[wr.WeavePanelSummaryTable(table_name=RESULTS_TABLE)],
        ),
    ]
    return wr.Report(
        project=project,
        entity=entity or "",
        title=report.title[:128],
        description=report.description,
        blocks=blocks,
    )


def runset(wr: Any, name: str, filters: Any, groupby: list[str], pinned_columns: list[str]) -> Any:
    return wr.Runset(
        name=name,
        filters=filters,
        groupby=[f"config.{key}" for key in groupby],
        pinned_columns=pinned_columns,
    )


def pinned(report: Report) -> list[str]:
    """The runs table's first columns: the swept keys, then the figures the parallel coordinates end in."""
    swept = [
        f"config:{head}.value{'.' + rest if rest else ''}"
        for head, _, rest in (config_path(k).partition(".") for k in report.swept)
    ]
    return swept + [
        f"summary:{key}"
        for key in (
            STEADY_TOKENS,
            STEADY_MFU,
            keys.MAX_RANK_PEAK,
            keys.PREDICTED_PEAK,
            "status",
        )
    ]


def parallel_coordinates(wr: Any, swept: list[Any]) -> Any:
    figures = [
        (STEADY_TOKENS, "steady tokens/s"),
        (STEADY_MFU, "MFU %"),
        (keys.MAX_RANK_PEAK, "worst-rank peak GiB"),
        (keys.PREDICTED_PEAK, "predicted peak GiB"),
    ]
    columns = [wr.ParallelCoordinatesPlotColumn(metric=key) for key in swept]
    columns += [
        wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(key), display_name=name)
        for key, name in figures
    ]
    return wr.ParallelCoordinatesPlot(
        title="swept keys -> steady throughput, MFU, worst-rank and predicted peak",
        columns=columns,
        layout=wr.Layout(w=24, h=9),
    )


def throughput_panel(wr: Any, report: Report, others: list[str]) -> Any:
    """Steady tokens/s against micro_batch (the run set groups by the other keys), or a bar per run."""
    grouped = f" by {', '.join(others)}" if others else ""
    if "micro_batch" in report.swept:
        return wr.ScatterPlot(
            title=f"steady tokens/s against micro_batch{grouped}",
            x=wr.Config("micro_batch"),
            y=wr.SummaryMetric(STEADY_TOKENS),
            log_x=True,
            layout=wr.Layout(w=24, h=9),
        )
    return wr.BarPlot(
        title=f"steady tokens/s{grouped}",
        metrics=[wr.SummaryMetric(STEADY_TOKENS)],
        orientation="v",
        groupby=wr.Config(others[0]) if others else None,
        layout=wr.Layout(w=24, h=9),
    )


def memory_panels(wr: Any, report: Report) -> list[Any]:
    ranks = sorted({rank for point in report.points for rank in per_rank_peaks(point)})
    return [
        wr.LinePlot(
            title="worst-rank peak memory (GiB) and the plan's prediction",
            x=STEP_KEY,
            y=[keys.MAX_RANK_PEAK, keys.PREDICTED_PEAK],
            layout=wr.Layout(w=12, h=8),
        ),
        wr.LinePlot(
            title="peak tensor memory of every rank (GiB)",
            x=STEP_KEY,
            y=[keys.memory_key(rank, "peak_allocated_gib") for rank in ranks],
            layout=wr.Layout(w=12, h=8),
        ),
    ]


def training_panels(wr: Any, report: Report) -> list[Any]:
    panels = [wr.LinePlot(title="training loss", x=STEP_KEY, y=[keys.LOSS], layout=wr.Layout(w=12, h=8))]
    if any(keys.LOSS_VAL in record for point in report.points for record in point.records):
        panels.append(
            wr.LinePlot(title="held-out loss", x=STEP_KEY, y=[keys.LOSS_VAL], layout=wr.Layout(w=12, h=8))
        )
    if any(keys.LOSS_SCALE in record for point in report.points for record in point.records):
        panels.append(
            wr.LinePlot(
                title="fp16 loss scale",
                x=STEP_KEY,
                y=[keys.LOSS_SCALE],
                log_y=True,
                layout=wr.Layout(w=12, h=8),
            )
        )
    return panels


def comm_panels(wr: Any, report: Report) -> list[Any]:
    """Bytes each rank moved per optimizer step next to the plan's, where the runs recorded them."""
    rank_keys = sorted(
        {
            key
            for point in report.points
            for record in point.records
            for key in record
            if keys.COMM_KEY.fullmatch(key)
        }
    )
    if not rank_keys:
        return []
    rank_keys.sort(key=lambda key: int(keys.COMM_KEY.fullmatch(key).group(1)))  # type: ignore[union-attr]
    return [
        wr.LinePlot(
            title="bytes moved per step, every rank, and the plan's",
            x=STEP_KEY,
            y=[*rank_keys, keys.COMM_PREDICTED_BYTES],
            layout=wr.Layout(w=12, h=8),
        )
    ]


# ---------------------------------------------------------------------------- serialised form


def write_wandb_report(report: Report, project: str, entity: str | None) -> Path | None:
    """Build the Report and write wandb_report.json; None (after one warning) when the library is
    missing or fails: the dashboard is lost, the local report is not."""
    try:
        return write_report_json(build_report(report, project, entity), report.sweep_dir)
    except Exception as err:  # ImportError of a missing install, or any fault of a broken one
        warn(
            redact_secrets(
                f"no W&B Report ({type(err).__name__}: {err}); install wandb-workspaces for it. The local report is complete"
            )
        )
        return None


def write_report_json(wandb_report: Any, out_dir: Path) -> Path:
    """The Report's own serialised form (the ReportViewspec the library sends on save)."""
    path = out_dir / REPORT_FILE
    path.write_text(report_json(wandb_report) + "\n")
    return path


def load_report_json(path: Path) -> Any:
    """wandb_report.json back as a Report, with the library's own loader."""
    return report_from_json(path.read_text())


def publish(path: Path) -> str:
    """Save the Report in `path` to W&B (online: its runs must be synced first); returns its URL.

    The run sets get the report's entity and project now, when the server can be asked for the
    project's id; the saved Report's id is written back, so publishing again updates it.
    """
    import wandb

    wandb_report = load_report_json(path)
    if not wandb_report.entity:
        wandb_report.entity = wandb.Api().default_entity
    for block in wandb_report.blocks:
        for runset_ in getattr(block, "runsets", None) or []:
            runset_.entity, runset_.project = wandb_report.entity, wandb_report.project
    wandb_report.save()
    write_report_json(wandb_report, path.parent)
    return wandb_report.url
