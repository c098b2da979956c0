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
