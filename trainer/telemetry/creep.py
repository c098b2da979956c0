"""Memory that creeps: the per-window peak of every rank, after warm-up, growing step over step where
the plan's steady state stays flat (the plan is one figure for every step; a leak, a cache or
fragmentation is not in it).

The figure is what a rank's window measured on every log step at no cost: on a GPU the allocator's
peak allocated bytes, on a CPU the process's peak resident set (host memory: the tensor tracker runs
on chosen steps only). The first windows after warm-up still carry the process's own growth (a normal
tiny CPU run's host peak rose 18 MiB over steps 2-4, then 0.3 MiB a step), so only the later half of
the post-warm-up windows is judged: a rank creeps when its figure rises from each of them to the next
by at least CREEP_MIN_BYTES per step of its figure. summary.json then carries the growth per step
(the least-squares slope over those windows) and the step at which it would reach the rank's memory
(the cap, else the device).
"""

from __future__ import annotations

import math
import re
from typing import Any

from trainer.units import GIB

CREEP_MIN_BYTES = {"peak_allocated": 2**20, "peak_rss": 4 * 2**20}
"""The least rise per step, window after window, that counts as creeping. The allocator's peak counts
tensors alone: 1 MiB. The host peak also holds the process's own growth (malloc's arenas, the CPU
kernels' caches): a normal 6-step tiny CPU run's rose by 2.5 MiB a step over steps 4-6, and 1 MiB
called it a creep. 4 MiB: half the 8 MiB a step that tests/integration/test_memory_creep.py's leak keeps."""
MIN_WINDOWS = 3
"""Windows judged (the later half of those after warm-up) needed before a slope means anything."""


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def rank_series(
    records: list[dict[str, Any]], after: int, figure: str
) -> dict[int, tuple[list[int], list[float]]]:
    """Every rank's (steps, GiB) of `figure` over the log windows after step `after`."""
    key = re.compile(rf"memory/rank(\d+)/{figure}_gib")
    series: dict[int, tuple[list[int], list[float]]] = {}
    for record in records:
        if record["step"] <= after:
            continue
        for name, value in record.items():
            if match := key.fullmatch(name):
                steps, values = series.setdefault(int(match.group(1)), ([], []))
                steps.append(record["step"])
                values.append(value)
    return series


def rises_steadily(steps: list[int], values: list[float], min_bytes: int) -> bool:
    """Whether every window's figure (GiB) is above the one before by `min_bytes` per step between them:
    one jump among flat windows (a cache filled once) is not a creep, whatever the slope it makes."""
    pairs = zip(zip(steps, values), zip(steps[1:], values[1:]))
    return all((b - a) * GIB >= min_bytes * (t - s) for (s, a), (t, b) in pairs)


def find_creep(
    records: list[dict[str, Any]],
    after: int,
    limit_gib: float | None,
    planned_gib: float | None,
    device_kind: str,
) -> dict[str, Any] | None:
    """The worst creeping rank's growth (GiB per step) and when it would reach `limit_gib`; None: none creeps.

    On a GPU the allocator's peak is the limit's own figure, so the growth runs on from the last window's
    peak; on a CPU the host peak holds the runtime too, which the cap does not count, so the growth eats
    the room the plan's peak (`planned_gib`) leaves under the limit from the first window on.
    """
    figure = "peak_allocated" if device_kind == "cuda" else "peak_rss"
    worst = None
    for rank, (all_steps, all_values) in rank_series(records, after, figure).items():
        half = len(all_values) // 2
        steps, values = all_steps[half:], all_values[half:]  # the later half: past the process's own growth
        if len(values) < MIN_WINDOWS or not rises_steadily(steps, values, CREEP_MIN_BYTES[figure]):
            continue
        per_step = slope([float(s) for s in steps], values)
        if worst is None or per_step > worst["gib_per_step"]:
            worst = {"rank": rank, "figure": figure, "gib_per_step": per_step, "last_gib": values[-1]}
            worst.update(at_step=steps[-1], first_step=steps[0])
    if worst is None or limit_gib is None:
        return worst
    if device_kind == "cuda":
        start, room = worst["at_step"], limit_gib - worst["last_gib"]
    else:
        start, room = worst["first_step"], limit_gib - (planned_gib or 0.0)
    worst["limit_gib"] = limit_gib
    worst["reaches_limit_at_step"] = start + max(0, math.ceil(room / worst["gib_per_step"]))
    return worst


def creep_line(creep: dict[str, Any]) -> str:
    """The console's one line."""
    line = (
        f"memory creeps on rank {creep['rank']}: {creep['figure']} grows {creep['gib_per_step'] * 1024:.2f} MiB per step "
        f"({creep['last_gib']:.3f} GiB at step {creep['at_step']}) beyond the plan's steady state"
    )
    if "reaches_limit_at_step" in creep:
        line += f"; it would reach {creep['limit_gib']:.3f} GiB at step {creep['reaches_limit_at_step']}"
    return line
