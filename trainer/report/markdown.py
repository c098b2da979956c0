"""report.md: the rows as a table for people, the points that did not end ok, the charts, the W&B line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainer.report.run_dirs import Report, count_statuses, plural
from trainer.telemetry.keys import Status
from trainer.telemetry.traces import run_files
from trainer.units import MIB


def markdown(report: Report, wandb_json: Path | None) -> str:
    lines = [f"# {report.title}", "", report.description]
    if (best := report.fastest) is not None:
        lines.append(
            f"Fastest point that fits: #{best['point']} `{best['overrides']}`, {best['tokens_per_s']:,.0f} tokens/s."
        )
    lines += [
        "",
        *markdown_table(report.rows),
        *markdown_failures(report.rows),
        *markdown_charts(report.charts),
        *markdown_run_files(report),
    ]
    if wandb_json is not None:
        lines += ["", "## W&B", "", wandb_line(None, report.sweep_dir)]
    return "\n".join(lines) + "\n"


WANDB_LINE = "W&B Report: "


def wandb_line(url: str | None, report_dir: Path) -> str:
    """report.md's line about the W&B Report: its URL once published, else how to publish it."""
    if url is not None:
        return f"{WANDB_LINE}{url}"
    return (
        f"{WANDB_LINE}built offline in `wandb_report.json`; to publish it, upload the runs (`wandb sync`) "
        f"and run `python -m trainer.report --wandb {report_dir}`."
    )


def set_wandb_url(report_dir: Path, url: str) -> None:
    """Put the published Report's URL into report.md, in place of how to publish it."""
    path = report_dir / "report.md"
    lines = [
        wandb_line(url, report_dir) if line.startswith(WANDB_LINE) else line
        for line in path.read_text().splitlines()
    ]
    path.write_text("\n".join(lines) + "\n")


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    header = [
        "#",
        "overrides",
        "status",
        "tokens/s (steady)",
        "MFU %",
        "worst-rank peak GiB (rank)",
        "predicted peak GiB",
        "comm MiB/step (worst rank)",
        "plan MiB/step",
        "by group MiB/step (measured / plan)",
        "skipped steps",
        "final loss",
        "val loss",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        peak = gib(row["max_rank_peak_gib"])
        if row["argmax_rank"] is not None and row["max_rank_peak_gib"] is not None:
            peak += f" (rank {row['argmax_rank']})"
        cells = [
            str(row["point"]),
            f"`{row['overrides']}`",
            status_cell(row),
            number(row["tokens_per_s"], "{:,.0f}"),
            number(row["mfu_pct"], "{:.1f}"),
            peak,
            gib(row["predicted_peak_gib"]),
            mib(row["comm_bytes_per_step"]),
            mib(row["predicted_comm_bytes_per_step"]),
            row["comm_by_group"] or "-",
            number(row["skipped_steps"], "{}"),
            number(row["final_loss"], "{:.4f}"),
            number(row["val_loss"], "{:.4f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def status_cell(row: dict[str, Any]) -> str:
    if row["fastest"]:
        return "**ok, fastest**"
    if row["status"] == Status.oom and row["failed_rank"] is not None:
        where = f"rank {row['failed_rank']}"
        if row["failed_step"] is not None:
            where += f", step {row['failed_step']}, {row['failed_phase']}"
        return f"**oom** ({where})"
    return row["status"] if row["status"] == Status.ok else f"**{row['status']}**"


def markdown_failures(rows: list[dict[str, Any]]) -> list[str]:
    failed = [row for row in rows if row["reason"]]
    if not failed:
        return []
    return ["", "Points that did not end ok:", ""] + [
        f"- #{row['point']} `{row['overrides']}`: {row['status']}: {row['reason']}" for row in failed
    ]


def markdown_charts(charts: dict[str, Path]) -> list[str]:
    titles = {
        "throughput": "Throughput",
        "memory": "Peak tensor memory per rank",
        "losses": "Training loss",
        "val_losses": "Held-out loss",
        "loss_scale": "fp16 loss scale",
        "comm": "Memory saved against bytes moved",
    }
    lines: list[str] = []
    for name, path in charts.items():
        lines += ["", f"## {titles[name]}", "", f"![{titles[name]}]({path.name})"]
    return lines


def markdown_run_files(report: Report) -> list[str]:
    """Each point's profiler traces and memory snapshots (trainer/telemetry/traces.py), linked relative to the
    report; the same files are artifacts of the point's W&B run."""
    lines: list[str] = []
    for point in report.points:
        for files in run_files(point.path):
            links = ", ".join(f"[{p.name}]({os.path.relpath(p, report.sweep_dir)})" for p in files.paths)
            lines.append(f"- `{point.path.name}` {files.kind}: {links}")
    return ["", "## Traces and memory snapshots", "", *lines] if lines else []


def mib(value: float | None) -> str:
    return "–" if value is None else f"{value / MIB:,.2f}"


def number(value: Any, pattern: str) -> str:
    return "–" if value is None else pattern.format(value)


def gib(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.4f}" if value < 1 else f"{value:.2f}"


def summary_line(report: Report) -> str:
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(count_statuses(report.rows).items()))
    return f"report: {report.sweep_dir / 'report.md'} ({plural(len(report.rows), 'point')}: {statuses})"
