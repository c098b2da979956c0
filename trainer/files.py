"""Directories that concurrent jobs and reports claim on a shared file system, and the run directory's
saves, named where both the ranks (trainer/saves/dcp.py) and the job process (trainer/autobatch.py) find
them."""

from __future__ import annotations

import itertools
from pathlib import Path

SAVES_DIR = "checkpoints"


def claim_directory(base: Path) -> Path:
    """Create `base`, or the first free `base_1`, `base_2`, ...: mkdir is atomic, so of two jobs
    (or reports) asking for one name, one gets it and the other the next."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        candidate = base if n == 0 else base.with_name(f"{base.name}_{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise AssertionError("unreachable")


def set_aside_metrics(run_dir: Path) -> Path | None:
    """A job that starts at step 0 (resume=false) in a directory an earlier run wrote: that run's metrics.jsonl
    moved to the first free metrics.<n>.jsonl, so that the new run's history is its own (the summary reads
    one run's windows: steps that go back, or another world's ranks, would be mixed in) and the earlier one is
    kept. A resumed run continues the file instead (trainer/saves/resume.py `rewind_metrics`)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    for n in itertools.count(1):
        kept = run_dir / f"metrics.{n}.jsonl"
        if not kept.exists():
            metrics.rename(kept)
            return kept
    raise AssertionError("unreachable")
