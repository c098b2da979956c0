"""The sweep report, stage by stage: one row per point, report.md, charts, a W&B Report, and with
W&B on one summary run.

`python -m trainer.report <sweep dir>` (and the sweep callback, trainer/sweep.py, at the end of
every multirun) reads each point's summary.json, metrics.jsonl and plan.json and writes into the
sweep directory; `python -m trainer.report DIR [DIR ...]` does the same over any run and sweep
directories together (trainer/report/command.py), into `--out` or a new directory under outputs/reports/:

    results.csv      one row per point; figures exactly as in the point's summary.json
    report.md        the same table for people, the fastest point that fits marked, the charts
    throughput.png   steady tokens/s against micro-batch, a line per other swept setting, failures marked
    memory.png       every rank's peak tensor memory per point, with the predicted peak and the cap
    comm.png         memory each stage saved over stage0 against the bytes it moved per step, per point
    losses.png       training loss against step, per point
    val_losses.png   the held-out loss (loss/val) at every evaluation, per point that evaluated
    where_memory.png plan against measured memory by category, per point and rank (where_memory.py)
    loss_scale.png   the fp16 loss scale against step of every fp16 point (only when there is one)
    wandb_report.json  the W&B Report of the same points (trainer/report/wandb_report.py), ready to publish

The report depends only on the points' files, so writing it again gives the same bytes (the W&B
Report's panel ids aside). Its stages, each a module of trainer/report/: rows.py (the rows and
results.csv), charts.py, markdown.py (report.md), wandb_report.py (wandb_report.json) and
summary_run.py (the W&B summary run, after the local report is complete).
"""

from __future__ import annotations

from pathlib import Path

from trainer.report.charts import write_charts
from trainer.report.markdown import markdown
from trainer.report.rows import build_rows, swept_keys, write_csv
from trainer.report.run_dirs import Point, Report, load_points
from trainer.report.summary_run import report_logger
from trainer.report.where_memory import markdown_where, memory_rows, plot_where


def write_report(sweep_dir: Path, points: list[Point] | None = None) -> Report:
    """Write results.csv, the charts, wandb_report.json and report.md into `sweep_dir`: of the sweep's
    own points, or of `points` (a comparison; trainer/report/command.py)."""
    from trainer.report.wandb_report import write_wandb_report

    is_sweep = points is None
    points = load_points(sweep_dir) if points is None else points
    swept = swept_keys(points)
    report = Report(sweep_dir, points, swept, build_rows(points, swept), charts={}, is_sweep=is_sweep)
    write_csv(report.rows, sweep_dir / "results.csv")
    report.charts = write_charts(report)
    logger = report_logger(report)
    wandb_json = write_wandb_report(report, logger.get("project") or "zerolab", logger.get("entity"))
    published = wandb_json if logger.get("backend") == "wandb" else None  # no runs in W&B: nothing to publish
    split = memory_rows(points)  # where the memory went, plan against measured by category
    where = markdown_where(split, plot_where(report, split))
    (sweep_dir / "report.md").write_text(markdown(report, published) + "".join(f"{line}\n" for line in where))
    return report


def write_sweep_report(sweep_dir: Path) -> Report:
    """The end-of-sweep report: the memory plan's fit table of every point (plan_table.md, printed
    here) and the report of how each point ran (report.md, results.csv, charts; the caller prints
    its summary_line)."""
    from trainer.report.fit_table import write_fit_table

    if (fit_table := write_fit_table(sweep_dir)) is not None:
        print(fit_table, flush=True)
    return write_report(sweep_dir)
