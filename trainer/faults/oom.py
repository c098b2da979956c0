"""An out-of-memory failure explained: the rank's moment, the plan's figure there by category beside
what the rank held, and the category most over its plan (the remedies that fit are the advisor's:
trainer/advise/fit.py).

The plan's categories (trainer/plan/moments.py) are parameters, gradients, optimizer state,
activations, temporaries and `other` (rotary and data tables, Adam's step counters). Communication
buffers are inside the temporaries: FSDP2's unsharded copies and its all-gather and reduce-scatter
buffers (trainer/plan/fsdp_buffers.py), DDP's buckets are the gradients themselves
(`gradient_as_bucket_view`). What a CPU rank held comes from torch's MemTracker on the tracked step
(trainer/telemetry/memory.py), in its own categories, mapped here onto the plan's; a CUDA rank's
record has the allocator's figures without a split (its snapshot has the rest: docs/faults.md).
"""

from __future__ import annotations

import re
from typing import Any

from trainer.faults.failures import where
from trainer.plan import Plan, RankPlan
from trainer.units import GIB

# The plan's part -> (its name in words, MemTracker's category of trainer/telemetry/memory.py).
CATEGORIES = {
    "params": ("parameters", "params"),
    "grads": ("gradients", "grads"),
    "optimizer": ("optimizer state", "optimizer"),
    "activations": ("activations", "activations"),
    "temporary": ("temporaries (incl. communication buffers)", "temp"),
    "other": ("other (tables, buffers)", "buffers"),
}
# "you tried to allocate 524288 bytes" (CPU) / "Tried to allocate 2.00 GiB" (CUDA)
_CPU_TRIED = re.compile(r"tried to allocate (\d+) bytes")
_CUDA_TRIED = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB)")
_UNITS = {"GiB": GIB, "MiB": 2**20, "KiB": 2**10}


def plan_moment(rank: RankPlan, phase: str | None, block: int | None) -> str:
    """The plan's moment nearest a failure's position: the largest of the moments of its phase, of
    the failing block where the walk names it (FSDP2's per-block backward), else of the blocks (the
    forward's last block holds the most), else outside the blocks (loss, output head, embedding)."""
    prefix = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}.get(phase or "")
    moments = [m for m in rank.moments if prefix and m.name.startswith(prefix)]
    if not moments:
        return rank.peak.name  # setup, or an unknown step: the step's peak
    named = [m for m in moments if block is not None and re.search(rf"\bblock {block}\b", m.name)]
    blocks = [m for m in moments if "block" in m.name]
    if block is not None:
        chosen = named or blocks or moments
    else:
        chosen = [m for m in moments if "block" not in m.name] or moments
    return max(chosen, key=lambda m: m.total).name


def failed_allocation_bytes(message: str) -> int | None:
    """The allocation that failed, as the allocator's message states it."""
    if match := _CPU_TRIED.search(message):
        return int(match.group(1))
    if match := _CUDA_TRIED.search(message):
        return int(float(match.group(1)) * _UNITS[match.group(2)])
    return None


def explain_oom(plan: Plan, record: dict[str, Any]) -> dict[str, Any]:
    """What summary.json and the failure record carry about an out-of-memory failure (GiB)."""
    rank = plan.ranks[record["rank"]] if 0 <= record.get("rank", -1) < len(plan.ranks) else plan.worst
    name = plan_moment(rank, record.get("phase"), record.get("block"))
    parts = next(m for m in rank.moments if m.name == name).parts
    held = record.get("measured_bytes") or {}
    explained: dict[str, Any] = {
        "rank": record.get("rank"),
        "moment": where(record),
        "plan_moment": name,
        "plan_gib": {part: parts[part] / GIB for part in CATEGORIES},
        "plan_total_gib": sum(parts.values()) / GIB,
        "limit_gib": None if plan.memory.per_rank_bytes is None else plan.memory.per_rank_bytes / GIB,
        "limit_source": plan.memory.source,
    }
    if "held" in held:
        explained["held_gib"] = held["held"] / GIB
    if all(tracked in held for _, tracked in CATEGORIES.values()):
        measured = {part: held[tracked] / GIB for part, (_, tracked) in CATEGORIES.items()}
        over = {part: measured[part] - explained["plan_gib"][part] for part in CATEGORIES}
        explained["measured_gib"] = measured
        explained["most_over"] = max(over, key=lambda part: over[part])
        explained["most_over_gib"] = over[explained["most_over"]]
    tried = failed_allocation_bytes(record.get("message", ""))
    if tried is not None:
        explained["failed_allocation_gib"] = tried / GIB
    if "cap" in held:  # the CPU cap (trainer/faults/tensor_cap.py): tensor bytes, the plan's own quantity
        explained["cap_gib"] = held["cap"] / GIB
    return explained


def explanation_lines(explained: dict[str, Any]) -> list[str]:
    """The console's account: the moment, plan beside measured by category, the category most over."""
    lines = [
        f"out of memory on rank {explained['rank']} at {explained['moment']}; "
        f"the plan's nearest moment: {explained['plan_moment']}"
    ]
    measured = explained.get("measured_gib")
    lines.append(f"  {'category':<44}{'plan GiB':>10}{'held GiB':>10}{'over GiB':>10}")
    for part, (words, _) in CATEGORIES.items():
        plan = explained["plan_gib"][part]
        cells = (
            f"{measured[part]:>10.4f}{measured[part] - plan:>+10.4f}" if measured else f"{'-':>10}{'-':>10}"
        )
        lines.append(f"  {words:<44}{plan:>10.4f}{cells}")
    held = explained.get("held_gib")
    lines.append(
        f"  {'total':<44}{explained['plan_total_gib']:>10.4f}{'-' if held is None else f'{held:.4f}':>10}"
    )
    if measured and explained["most_over_gib"] > 0:
        words = CATEGORIES[explained["most_over"]][0]
        lines.append(f"  most over its plan: {words} ({explained['most_over_gib']:+.4f} GiB)")
    elif measured:
        lines.append("  no category over its plan: the plan's own figure does not fit (see the remedies)")
    else:
        lines.append(
            "  held by category: not measured at this step (CPU: the tracked steps; CUDA: the snapshot)"
        )
    tail = []
    if "failed_allocation_gib" in explained:
        tail.append(f"the allocation that failed: {explained['failed_allocation_gib']:.4f} GiB")
    if explained["limit_gib"] is not None:
        tail.append(f"each rank may use {explained['limit_gib']:.4f} GiB ({explained['limit_source']})")
    if "cap_gib" in explained and held is not None:
        tail.append(
            f"the cap counts tensor bytes: {held:.4f} GiB held + the allocation > the cap's {explained['cap_gib']:.4f} GiB"
        )
    if tail:
        lines.append("  " + "; ".join(tail))
    return lines
