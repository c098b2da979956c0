"""A sweep's fit table: every point's plan (its plan.json) and how the point ended, as
plan_table.md, a part of the end-of-sweep report (trainer/report/sweep_report.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.telemetry.summary import read_summary


def sweep_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per sweep point that wrote a plan.json, in job order."""
    rows = []
    for job_dir in sorted(sweep_dir.iterdir(), key=_job_order):
        plan_path = job_dir / "plan.json"
        if not plan_path.is_file():
            continue
        plan = json.loads(plan_path.read_text())
        status = read_summary(job_dir).get("status", "planned")
        rows.append({"point": job_dir.name, "status": status, **plan})
    return rows


def _job_order(path: Path) -> tuple[int, str]:
    number = path.name.split("_", 1)[0]
    return (int(number) if number.isdigit() else 1 << 30, path.name)


def varying_overrides(names: list[str]) -> list[str]:
    """Each point's `N_key=value,...` directory name cut to the overrides that differ between points."""
    items = [
        dict(pair.partition("=")[::2] for pair in name.split("_", 1)[-1].split(",") if "=" in pair)
        for name in names
    ]
    varying = [
        key
        for key in dict.fromkeys(k for point in items for k in point)
        if len({p.get(key) for p in items}) > 1
    ]
    return [
        " ".join(f"{key}={point[key]}" for key in varying if key in point) or name
        for name, point in zip(names, items)
    ]


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the sweep's plans: worst-rank peak, when, the memory, fits, status."""
    lines = [
        "| point | peak GiB (worst rank) | at | memory GiB per rank | fits | status |",
        "|---|---:|---|---:|---|---|",
    ]
    for row, label in zip(rows, varying_overrides([row["point"] for row in rows])):
        memory = "?" if row["device_memory_gib"] is None else f"{row['device_memory_gib']:.2f}"
        fits = {True: "yes", False: "no", None: "?"}[row["fits"]]
        peak = f"{row['peak_gib']:.2f} (rank {row['peak_rank']})"
        lines.append(
            f"| {row['point'].split('_')[0]}: {label} | {peak} | {row['peak_moment']} | {memory} | {fits} | {row['status']} |"
        )
    return "\n".join(lines)


def write_fit_table(sweep_dir: Path) -> str | None:
    """Write plan_table.md, the fit table of every point of a sweep, and return it as the console
    shows it; None when no point wrote a plan.json. Part of the end-of-sweep report
    (trainer/report/sweep_report.py write_sweep_report)."""
    if not sweep_dir.is_dir():
        return None
    rows = sweep_rows(sweep_dir)
    if not rows:
        return None
    table = format_sweep(rows)
    (sweep_dir / "plan_table.md").write_text(f"# Memory plan of {sweep_dir}\n\n{table}\n")
    return f"memory plan of the sweep ({len(rows)} points):\n{table}"
