"""What the check reports, rewritten after every row so that a check cut short still reports what it
reached: results.json and results.md in the output folder, and with --bundle the same two files and
one archive of every job's folder and console (checkpoints left out) in a folder of their own, the
three files a device tool brings back."""

from __future__ import annotations

import json
import os
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ARCHIVE = "gpu_check.tar.gz"
"""The bundle's archive: jobs/ and logs/ of the output folder, as they are under it."""
LEFT_OUT = ("checkpoints",)
"""Folders the archive leaves out: the save rows' checkpoints (the tiny model's, megabytes each)."""


@dataclass
class Row:
    check: str
    status: str  # pass | fail | info | skip | error
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    seconds: float = 0.0


class Report:
    """results.json and results.md, rewritten after every row (and the bundle, when there is one)."""

    def __init__(self, out: Path, dry_run: bool, bundle: Path | None = None) -> None:
        self.out, self.dry_run, self.bundle, self.rows = out, dry_run, bundle, []
        out.mkdir(parents=True, exist_ok=True)
        if bundle is not None:
            bundle.mkdir(parents=True, exist_ok=True)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"{row.check:34s} {row.status:5s} {json.dumps(row.figures)} {row.note}", flush=True)
        results = json.dumps({"dry_run": self.dry_run, "rows": [asdict(r) for r in self.rows]}, indent=2)
        for folder in (self.out, self.bundle) if self.bundle is not None else (self.out,):
            (folder / "results.json").write_text(results + "\n")
            (folder / "results.md").write_text(self.markdown())
        if self.bundle is not None:
            write_archive(self.out, self.bundle / ARCHIVE)

    def markdown(self) -> str:
        lines = [f"# GPU check{' (dry run on CPU, tiny model)' if self.dry_run else ''}", "",
                 "| check | status | figures | note | s |", "|---|---|---|---|---|"]  # fmt: skip
        for r in self.rows:
            figures = ", ".join(f"{k}={v}" for k, v in r.figures.items())
            lines.append(
                f"| {r.check} | {r.status} | {figures} | {r.note.replace('|', '/')} | {r.seconds:.0f} |"
            )
        return "\n".join(lines) + "\n"


def write_archive(out: Path, path: Path) -> None:
    """jobs/ and logs/ of `out` into one tar.gz at `path`, checkpoints left out. Written beside it
    under a dot-name and renamed over it, so the bundle never holds half an archive. Jobs still
    running write beside it: a file gone by the time it is read is left out, one still growing is
    taken as far as it was when listed."""
    partial = path.with_name(f".{path.name}.partial")
    with tarfile.open(partial, "w:gz") as archive:
        for name in ("jobs", "logs"):
            for file in sorted((out / name).rglob("*")):
                relative = file.relative_to(out)
                if file.is_dir() or any(part in LEFT_OUT for part in relative.parts):
                    continue
                try:
                    archive.add(file, arcname=str(relative), recursive=False)
                except FileNotFoundError:
                    continue
    os.replace(partial, path)


def timed(report: Report, name: str, make: Callable[[], Row]) -> None:
    """Run one row; an exception in the check itself is that row's error (under its own name),
    and the check goes on."""
    start = time.perf_counter()
    try:
        row = make()
    except Exception as err:  # noqa: BLE001 - a broken row must not cost the rows after it
        row = Row(name, "error", {}, f"{type(err).__name__}: {err}")
    row.seconds = time.perf_counter() - start
    report.add(row)
