"""The launcher restarts a run recorded, counted by the job process after its ranks end (trainer/job.py).

Apart from resume.py, which the ranks write restarts.jsonl from (log_restart), because resume.py
imports torch.distributed.checkpoint, which a job that does not resume never needs.
"""

from __future__ import annotations

from pathlib import Path

from trainer.jsonl import read_jsonl

RESTARTS_FILE = "restarts.jsonl"
"""One line per launcher restart, in the run's directory: written by rank 0 (resume.py's log_restart)."""


def count_restarts(run_dir: Path) -> int:
    """Launcher restarts recorded in the run's restarts.jsonl (resume.py's log_restart writes one line each)."""
    return len(read_jsonl(run_dir / RESTARTS_FILE))
