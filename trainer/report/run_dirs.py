"""Run and sweep directories read back as points, and the Report made of them.

Shared by the report's stages (rows.py, markdown.py, charts.py, wandb_report.py, summary_run.py),
which therefore import this module, and each other only in the order the report is written.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainer.jsonl import read_jsonl
from trainer.overrides import split_override
from trainer.telemetry import keys
from trainer.telemetry.summary import read_summary
from trainer.telemetry.wandb_logger import sweep_group


@dataclass
class Point:
    """One sweep point as its output directory tells it."""

    num: int
    path: Path
    settings: dict[str, str]  # its command-line overrides, key -> value
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    plan: dict[str, Any] | None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """summary.json's status; for a mode=plan point the plan's verdict; `missing` when the job left neither."""
        if "status" in self.summary:
            return self.summary["status"]
        if self.plan is not None:
            return "fits (plan)" if self.plan.get("fits") else "does not fit (plan)"
        return "missing"


@dataclass
class Report:
    """What write_report wrote: the points, the keys that differ between them, the rows, the charts."""

    sweep_dir: Path  # where the report is written: the sweep directory, or a comparison's --out
    points: list[Point]
    swept: list[str]
    rows: list[dict[str, Any]]
    charts: dict[str, Path]
    is_sweep: bool = True  # False: a comparison of run and sweep directories (trainer/report/command.py)

    @property
    def title(self) -> str:
        return f"{'Sweep report' if self.is_sweep else 'Comparison'}: {sweep_group(self.sweep_dir)}"

    @property
    def description(self) -> str:
        tally = ", ".join(f"{n} {status}" for status, n in count_statuses(self.rows).items())
        return f"{plural(len(self.rows), 'point')} ({tally}); swept: {', '.join(self.swept) or 'nothing'}."

    @property
    def fastest(self) -> dict[str, Any] | None:
        return next((row for row in self.rows if row["fastest"]), None)


def load_points(sweep_dir: Path) -> list[Point]:
    """Every point directory (one with Hydra's .hydra/ record) of the sweep, in job order."""
    points = [load_point(d) for d in sweep_dir.iterdir() if (d / ".hydra" / "hydra.yaml").is_file()]
    return sorted(points, key=lambda p: p.num)


def load_point(path: Path) -> Point:
    hydra = OmegaConf.load(path / ".hydra" / "hydra.yaml").hydra
    overrides = OmegaConf.to_container(OmegaConf.load(path / ".hydra" / "overrides.yaml"))
    assert isinstance(overrides, list)
    summary = read_summary(path)
    return Point(
        num=int(hydra.job.num) if hydra.job.get("num") is not None else 0,
        path=path,
        settings=dict(split_override(o) for o in overrides),
        summary=summary,
        records=read_jsonl(path / "metrics.jsonl"),
        plan=(plan := read_json(path / "plan.json")),
        config=summary.get("config")
        or plan
        or {},  # plan.json names device_memory_gib too (mode=plan points)
    )


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def per_rank_peaks(point: Point) -> dict[int, float]:
    """Each rank's highest peak tensor memory over the run (GiB)."""
    peaks: dict[int, float] = {}
    for record in point.records:
        for key, value in record.items():
            if (match := keys.PEAK_ALLOCATED_KEY.fullmatch(key)) and value is not None:
                rank = int(match.group(1))
                peaks[rank] = max(peaks.get(rank, 0.0), value)
    return dict(sorted(peaks.items()))


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def count_statuses(rows: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for row in rows:
        counts[row["status"]] += 1
    return dict(counts)
