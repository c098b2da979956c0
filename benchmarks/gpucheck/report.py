"""results.json and results.md, rewritten after every row, so a check cut short still reports what it reached."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from benchmarks.gpucheck.rows import Row, RowSpec


class Report:
    """results.json and results.md, rewritten after every row."""

    def __init__(self, out: Path, dry_run: bool) -> None:
        self.out, self.dry_run, self.rows = out, dry_run, []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"{row.check:34s} {row.status:5s} {json.dumps(row.figures)} {row.note}", flush=True)
        (self.out / "results.json").write_text(
            json.dumps({"dry_run": self.dry_run, "rows": [asdict(r) for r in self.rows]}, indent=2) + "\n"
        )
        (self.out / "results.md").write_text(self.markdown())

    def markdown(self) -> str:
        lines = [f"# GPU check{' (dry run on CPU, tiny model)' if self.dry_run else ''}", "",
                 "| check | status | figures | note | s |", "|---|---|---|---|---|"]  # fmt: skip
        for r in self.rows:
            figures = ", ".join(f"{k}={v}" for k, v in r.figures.items())
            lines.append(
                f"| {r.check} | {r.status} | {figures} | {r.note.replace('|', '/')} | {r.seconds:.0f} |"
            )
        return "\n".join(lines) + "\n"


def timed(report: Report, spec: RowSpec, make: Callable[[], Row]) -> None:
    """Run one row; an exception in the check itself is that row's error (under its own name),
    and the check goes on."""
    start = time.perf_counter()
    try:
        row = make()
    except Exception as err:  # noqa: BLE001 - a broken row must not cost the rows after it
        row = Row(spec.name, "error", {}, f"{type(err).__name__}: {err}")
    row.seconds = time.perf_counter() - start
    report.add(row)
