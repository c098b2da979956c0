"""Where the memory went (trainer/report/where_memory.py): plan against measured by category, per point and
rank, from points as their directories tell them (no job)."""

from __future__ import annotations

from pathlib import Path

from trainer.report.run_dirs import Point
from trainer.report.where_memory import markdown_where, memory_rows

PLAN_ROW = {"params_gib": 1.0, "grads_gib": 1.0, "optimizer_gib": 2.0, "activations_gib": 3.0,
            "temporary_gib": 0.5, "other_gib": 0.25}  # fmt: skip
TRACKED = {"params": 1.0, "grads": 0.5, "optimizer": 2.0, "activations": 3.5, "temp": 0.25, "buffers": 0.0}


def tracked_record(rank: int, step: int, peak: float, scale: float) -> dict:
    record = {"step": step, f"memory/rank{rank}/peak_allocated_gib": peak}
    record.update({f"memory/rank{rank}/at_peak/{name}_gib": value * scale for name, value in TRACKED.items()})
    return record


def test_a_run_and_an_oom_point_each_give_plan_and_measured_per_rank() -> None:
    oom = {"rank": 1, "moment": "step 1 (forward, block 0, micro-batch 0)", "plan_gib": {"params": 9.0},
           "measured_gib": {"params": 8.0}}  # fmt: skip
    plan = {"ranks": [{"rank": 0, **PLAN_ROW}, {"rank": 1, **PLAN_ROW}]}
    ran = Point(
        0,
        Path("a"),
        {},
        {"status": "ok"},
        [tracked_record(0, 2, 7.0, 1.0), tracked_record(0, 4, 9.0, 2.0)],
        plan,
    )
    failed = Point(1, Path("b"), {}, {"status": "oom", "oom": oom}, [], plan)
    rows = memory_rows([ran, failed])
    assert rows[0] == {
        "point": 0,
        "rank": 0,
        "at": "peak",
        "plan": {
            "params": 1.0,
            "grads": 1.0,
            "optimizer": 2.0,
            "activations": 3.0,
            "temporary": 0.5,
            "other": 0.25,
        },
        "measured": {
            "params": 2.0,
            "grads": 1.0,
            "optimizer": 4.0,
            "activations": 7.0,
            "temporary": 0.5,
            "other": 0.0,
        },
    }  # fmt: skip  (the window with the larger peak, step 4)
    assert (rows[1]["measured"], rows[2]["rank"], rows[2]["measured"]) == (
        None,
        0,
        None,
    )  # rank 1 untracked; point 1 rank 0
    assert rows[3] == {"point": 1, "rank": 1, "at": f"oom, {oom['moment']}", "plan": oom["plan_gib"],
                       "measured": oom["measured_gib"]}  # fmt: skip


def test_the_markdown_table_has_a_row_per_point_and_rank() -> None:
    plan = {"ranks": [{"rank": 0, **PLAN_ROW}]}
    lines = markdown_where(
        memory_rows([Point(0, Path("a"), {}, {}, [tracked_record(0, 2, 7.0, 1.0)], plan)]), None
    )
    assert (
        lines[-1]
        == "| 0 | 0 | peak | 1.0000 / 1.0000 | 1.0000 / 0.5000 | 2.0000 / 2.0000 | 3.0000 / 3.5000 | 0.5000 / 0.2500 | 0.2500 / 0.0000 |"
    )
    assert markdown_where([], None) == []
