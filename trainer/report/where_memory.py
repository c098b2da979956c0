"""Where the memory went: every point's ranks, the plan against what was measured, by category (a table in
report.md and `where_memory.png`).

The plan's figure is plan.json's row of the rank (model states at rest, activations at the end of
forward, temporaries and other at the peak); the measured one is the split of the rank's largest
tracked peak in metrics.jsonl (`memory/rank{r}/at_peak/*`: torch's MemTracker on CPU). For the rank
that ran out of memory both come from summary.json's `oom` (trainer/faults/oom.py): the plan's nearest
moment and what the rank held when its allocation failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot's import
import matplotlib.pyplot as plt  # noqa: E402

from trainer.faults.oom import CATEGORIES  # noqa: E402
from trainer.report.run_dirs import Point, Report  # noqa: E402
from trainer.telemetry import keys  # noqa: E402

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def memory_rows(points: list[Point]) -> list[dict[str, Any]]:
    """One row per point and rank: where (`peak` or the OOM's moment), plan and measured GiB by category."""
    rows = []
    for point in points:
        oom = point.summary.get("oom") or {}
        for rank_plan in (point.plan or {}).get("ranks", []):
            rank = rank_plan["rank"]
            if oom.get("rank") == rank:
                at, plan, measured = f"oom, {oom['moment']}", oom["plan_gib"], oom.get("measured_gib")
            elif all(f"{part}_gib" in rank_plan for part in CATEGORIES):
                at, plan = "peak", {part: rank_plan[f"{part}_gib"] for part in CATEGORIES}
                measured = tracked_split(point.records, rank)
            else:  # a plan.json of an older version, without the split
                continue
            rows.append({"point": point.num, "rank": rank, "at": at, "plan": plan, "measured": measured})
    return rows


def tracked_split(records: list[dict[str, Any]], rank: int) -> dict[str, float] | None:
    """The rank's largest tracked peak, by the plan's categories (None: no step was tracked)."""
    peak_key = keys.memory_key(rank, "at_peak/activations_gib")
    tracked = [r for r in records if peak_key in r]
    if not tracked:
        return None
    worst = max(tracked, key=lambda r: r.get(keys.memory_key(rank, "peak_allocated_gib"), 0.0))
    return {
        part: worst[keys.memory_key(rank, f"at_peak/{name}_gib")] for part, (_, name) in CATEGORIES.items()
    }


def markdown_where(rows: list[dict[str, Any]], chart: Path | None) -> list[str]:
    """report.md's section: plan / measured GiB per category, one line per point and rank."""
    if not rows:
        return []
    head = " | ".join(words for words, _ in CATEGORIES.values())
    lines = [
        "",
        "## Where the memory went",
        "",
        "Plan / measured GiB by category (measured: the largest tracked peak; for a rank that ran out, what it "
        "held then beside the plan's nearest moment).",
        "",
        f"| point | rank | at | {head} |",
        "|---" * (3 + len(CATEGORIES)) + "|",
    ]
    for row in rows:
        measured = row["measured"]
        cells = " | ".join(
            f"{row['plan'][part]:.4f} / {'-' if measured is None else f'{measured[part]:.4f}'}"
            for part in CATEGORIES
        )
        lines.append(f"| {row['point']} | {row['rank']} | {row['at']} | {cells} |")
    if chart is not None:
        lines += ["", f"![Where the memory went]({chart.name})"]
    return lines


def plot_where(report: Report, rows: list[dict[str, Any]]) -> Path | None:
    """Two stacked bars per point and rank, plan (P) and measured (M), one colour per category."""
    path = report.sweep_dir / "where_memory.png"
    if not rows:
        path.unlink(missing_ok=True)
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(rows)), 5.5), dpi=100)
    ticks, labels = [], []
    for index, row in enumerate(rows):
        for offset, (tag, split) in enumerate((("P", row["plan"]), ("M", row["measured"]))):
            x = 3 * index + offset
            bottom = 0.0
            for color, (part, (words, _)) in zip(COLORS, CATEGORIES.items()):
                value = 0.0 if split is None else split[part]
                ax.bar(x, value, bottom=bottom, color=color, label=words if index == offset == 0 else None)
                bottom += value
            ticks.append(x)
            labels.append(
                f"#{row['point']} r{row['rank']} {tag}"
                + (" oom" if row["at"] != "peak" and tag == "M" else "")
            )
    ax.set_xticks(ticks, labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("GiB")
    ax.set_title("Where the memory went: plan (P), measured (M)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
