"""A rank that raises ends the job non-zero with one line naming the rank and the cause, never a hang."""

from __future__ import annotations

import json


def test_a_raising_rank_is_named_in_one_line(trainer) -> None:
    run = trainer("nproc=2", "steps=4", "fault.kind=raise_error", "fault.step=2", "fault.rank=1", check=False)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 1
    assert lines == [line for line in lines if not line.startswith(("W", "E", " "))], (
        run.stderr
    )  # no log walls
    assert lines[-1].startswith(
        "error: rank 1 failed at step 2 (forward): RuntimeError: injected fault at step 2"
    )
    assert "Traceback" not in run.stderr
    record = json.loads((run.out_dir / "failures" / "rank1.json").read_text())
    assert (record["rank"], record["step"], record["phase"], record["oom"]) == (1, 2, "forward", False)
    assert "Traceback" in record["traceback"]  # the whole story is kept on disk
    assert (run.summary["status"], run.summary["failed_rank"]) == ("crashed", 1)
