"""The sweep report's rows: one per point, its figures exactly as in the point's summary.json.

What every other stage reads: the markdown table (trainer/report/markdown.py), the charts
(trainer/report/charts.py), results.csv (written here) and the W&B summary run's table
(trainer/report/summary_run.py).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from trainer.report.run_dirs import Point
from trainer.telemetry import keys
from trainer.telemetry.keys import Status
from trainer.units import MIB

COLUMNS = [
    "point",
    "overrides",
    "status",
    "tokens_per_s",
    "mfu_pct",
    "max_rank_peak_gib",
    "argmax_rank",
    "predicted_peak_gib",
    "comm_bytes_per_step",
    "predicted_comm_bytes_per_step",
    "comm_by_group",
    "skipped_steps",
    "final_loss",
    "val_loss",
    "fastest",
    "failed_rank",
    "failed_step",
    "failed_phase",
    "reason",
    "dir",
]
SUMMARY_KEYS = {
    "tokens_per_s": keys.TOKENS_PER_S,
    "mfu_pct": keys.MFU_PCT,
    "max_rank_peak_gib": keys.MAX_RANK_PEAK,
    "argmax_rank": keys.ARGMAX_RANK,
    "final_loss": keys.LOSS_FINAL,
    "val_loss": keys.LOSS_VAL,
    "failed_rank": "failed_rank",
    "failed_step": "failed_step",
    "failed_phase": "failed_phase",
}


def swept_keys(points: list[Point]) -> list[str]:
    """The override keys whose value differs between points, in the order they were given."""
    settings = list(dict.fromkeys(key for point in points for key in point.settings))
    return [key for key in settings if len({point.settings.get(key) for point in points}) > 1]


def label(point: Point, swept: list[str]) -> str:
    """What tells this point apart: its swept overrides (`micro_batch=4 zero=stage3`)."""
    return (
        " ".join(f"{key}={point.settings[key]}" for key in swept if key in point.settings) or f"#{point.num}"
    )


def build_rows(points: list[Point], swept: list[str]) -> list[dict[str, Any]]:
    rows = [build_row(point, swept) for point in points]
    candidates = [row for row in rows if row["status"] == Status.ok and row["tokens_per_s"] is not None]
    if candidates:
        max(candidates, key=lambda row: row["tokens_per_s"])["fastest"] = True
    return rows


def build_row(point: Point, swept: list[str]) -> dict[str, Any]:
    summary = point.summary
    row: dict[str, Any] = {key: summary.get(source) for key, source in SUMMARY_KEYS.items()}
    row.update(
        point=point.num,
        overrides=label(point, swept),
        status=point.status,
        predicted_peak_gib=predicted_peak_gib(point),
        comm_bytes_per_step=max((v for k, v in summary.items() if keys.COMM_KEY.fullmatch(k)), default=None),
        predicted_comm_bytes_per_step=predicted_comm_bytes(point),
        comm_by_group=comm_by_group(point),
        skipped_steps=skipped_steps(summary),
        fastest=False,
        reason=summary.get("reason") or summary.get("error"),
        dir=point.path.name,
    )
    return {key: row[key] for key in COLUMNS}


def predicted_peak_gib(point: Point) -> float | None:
    """The plan's worst-rank peak: in the summary of a job that trained, else in plan.json."""
    if keys.PREDICTED_PEAK in point.summary:
        return point.summary[keys.PREDICTED_PEAK]
    return point.plan.get("peak_gib") if point.plan is not None else None


def comm_by_group(point: Point) -> str | None:
    """Both tiers where a job had more than one process group (HSDP, hpZ; trainer/plan/groups.py): each
    group's worst-rank MiB per step, measured / planned, and the link it crossed (from plan.json)."""
    groups = (point.plan or {}).get("comm", {}).get("groups") or {}
    if len(groups) < 2:
        return None
    cells = []
    for name, group in groups.items():
        measured = [
            v
            for k, v in point.summary.items()
            if (m := keys.COMM_GROUP_KEY.fullmatch(k)) and m.group(1) == name
        ]
        shown = f"{max(measured) / MIB:.2f}" if measured else "-"
        cells.append(f"{name} ({group['link']}) {shown} / {group['bytes_per_step'] / MIB:.2f}")
    return "; ".join(cells)


def predicted_comm_bytes(point: Point) -> int | None:
    """The plan's bytes per rank per step (trainer/plan/comm.py): in the summary, else in plan.json."""
    if keys.COMM_PREDICTED_BYTES in point.summary:
        return point.summary[keys.COMM_PREDICTED_BYTES]
    return (point.plan.get("comm") or {}).get("bytes_per_step") if point.plan is not None else None


def skipped_steps(summary: dict[str, Any]) -> int | None:
    """Optimizer steps skipped: fp16 overflows plus non-finite steps skipped by nonfinite=skip."""
    counts = [summary[k] for k in (keys.SKIPPED_STEPS, keys.NONFINITE_SKIPPED) if k in summary]
    return int(sum(counts)) if counts else None


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)  # floats as repr: they read back equal to summary.json's
