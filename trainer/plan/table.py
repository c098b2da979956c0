"""What the user reads of a plan: the console report and the fit table of a sweep.

format_plan is what mode=plan prints (and every job before it launches, where a refusal comes
as the job's error line); write_fit_table writes the fit table of every point of a sweep as
plan_table.md, a part of the end-of-sweep report (trainer/report/sweep_report.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.devices import accelerator_names
from trainer.plan.build import COMPILE_NOTE, Plan, describe
from trainer.plan.refusal import host_refusal, refusal
from trainer.telemetry.summary import read_summary
from trainer.units import GIB, KIB, MIB

# ----------------------------------------------------------------------------- what the user reads


def format_table(plan: Plan) -> str:
    """Per-rank table (GiB, or MiB for small jobs); ranks with the same figures share a row."""
    columns = ("params", "grads", "optimizer", "activations", "temporary", "other", "peak")
    unit, scale = ("GiB", 1.0) if plan.peak_bytes >= GIB else ("MiB", 1024.0)
    header = f"{'rank':>9} " + " ".join(f"{name:>11}" for name in columns) + f"  fits   ({unit})"
    rows: list[tuple[list[int], tuple[str, ...], str]] = []
    for rank in plan.ranks:
        figures = rank.figures()
        cells = tuple(f"{figures[name + '_gib'] * scale:11.2f}" for name in columns)
        fits = {True: "yes", False: "NO", None: "?"}[plan.rank_fits(rank)]
        if rows and rows[-1][1] == cells and rows[-1][2] == fits:
            rows[-1][0].append(rank.rank)
        else:
            rows.append(([rank.rank], cells, fits))
    lines = [header]
    for ranks, cells, fits in rows:
        label = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        lines.append(f"{label:>9} " + " ".join(cells) + f"  {fits}")
    return "\n".join(lines)


def format_plan(plan: Plan, way_out: bool = True) -> str:
    """The console report of mode=plan (and of every job before it launches: there a refusal
    comes as the job's error line, so the table ends with the short verdict)."""
    worst = plan.worst
    offloaded = (
        f"; {worst.offloaded / GIB:.2f} GiB of model states per rank in host memory"
        if worst.offloaded
        else ""
    )
    lines = [
        f"memory plan: {describe(plan.config, plan.world_size, plan.device_kind)}, {plan.num_params:,} parameters",
        format_table(plan),
        f"peak on rank {worst.rank} at {worst.peak.name}; model states at rest, activations at the end "
        f"of forward, temporary and other at the peak{offloaded}",
        comm_line(plan),
        plan.host.describe(),
        verdict(plan, way_out),
    ]
    host_verdict = host_refusal(plan, way_out)
    if host_verdict is not None:  # the device may fit while the node's host does not
        lines.append(host_verdict)
    if plan.config.compile:
        lines.append(f"note: {COMPILE_NOTE}")
    return "\n".join(lines)


def comm_line(plan: Plan) -> str:
    """What each rank's collectives move per optimizer step (trainer/plan/comm.py): total and by kind."""
    comm = plan.comm
    parts = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in comm.bytes_by_collective.items() if n)
    line = (
        f"communication: {format_bytes(comm.total)} ({comm.total:,} bytes) per rank per optimizer step"
        f"{f' ({parts})' if parts else ''}; payloads on {comm.backend}, see docs/communication.md"
    )
    return "\n".join([line, *group_lines(plan)])


def group_lines(plan: Plan) -> list[str]:
    """Per process group (trainer/plan/groups.py), where a job has more than one: its ranks, its link, its bytes."""
    groups = plan.comm.groups
    if len(groups) < 2:
        return []
    lines = []
    for name, group in groups.items():
        parts = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in group.bytes_by_collective.items() if n)
        lines.append(
            f"  {name} group ({group.ranks} ranks, {group.link}): {format_bytes(group.total)} per rank per step ({parts})"
        )
    return lines


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def verdict(plan: Plan, way_out: bool = True) -> str:
    if plan.fits is None:
        return (
            f"fits: unknown ({plan.memory.source}); set plan.accelerator="
            f"{'|'.join(accelerator_names())} or device_memory_gib=N to compare"
        )
    reserved = (
        f" ({plan.required_bytes(plan.worst) / GIB:.3g} GiB reserved with headroom)"
        if plan.device_kind == "cuda"
        else ""
    )
    figures = f"peak {plan.peak_bytes / GIB:.3g} GiB{reserved} of {plan.memory.per_rank_bytes / GIB:.3g} GiB per rank ({plan.memory.source})"
    if plan.fits:
        return f"fits: {figures}"
    return (refusal(plan) or "") if way_out else f"does not fit: {figures}"


# ----------------------------------------------------------------------------- sweeps


def sweep_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per sweep point that wrote a plan.json, in job order."""
    rows = []
    for job_dir in sorted(sweep_dir.iterdir(), key=_job_order):
        plan_path = job_dir / "plan.json"
        if not plan_path.is_file():
            continue
        plan = json.loads(plan_path.read_text())
        status = read_summary(job_dir).get("status", "planned")
        rows.append({"point": job_dir.name, "status": status, **plan})
    return rows


def _job_order(path: Path) -> tuple[int, str]:
    number = path.name.split("_", 1)[0]
    return (int(number) if number.isdigit() else 1 << 30, path.name)


def varying_overrides(names: list[str]) -> list[str]:
    """Each point's `N_key=value,...` directory name cut to the overrides that differ between points."""
    items = [
        dict(pair.partition("=")[::2] for pair in name.split("_", 1)[-1].split(",") if "=" in pair)
        for name in names
    ]
    varying = [
        key
        for key in dict.fromkeys(k for point in items for k in point)
        if len({p.get(key) for p in items}) > 1
    ]
    return [
        " ".join(f"{key}={point[key]}" for key in varying if key in point) or name
        for name, point in zip(names, items)
    ]


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the sweep's plans: worst-rank peak, when, the memory, fits, status."""
    lines = [
        "| point | peak GiB (worst rank) | at | memory GiB per rank | fits | status |",
        "|---|---:|---|---:|---|---|",
    ]
    for row, label in zip(rows, varying_overrides([row["point"] for row in rows])):
        memory = "?" if row["device_memory_gib"] is None else f"{row['device_memory_gib']:.2f}"
        fits = {True: "yes", False: "no", None: "?"}[row["fits"]]
        peak = f"{row['peak_gib']:.2f} (rank {row['peak_rank']})"
        lines.append(
            f"| {row['point'].split('_')[0]}: {label} | {peak} | {row['peak_moment']} | {memory} | {fits} | {row['status']} |"
        )
    return "\n".join(lines)


def write_fit_table(sweep_dir: Path) -> str | None:
    """Write plan_table.md, the fit table of every point of a sweep, and return it as the console
    shows it; None when no point wrote a plan.json. Part of the end-of-sweep report
    (trainer/report/sweep_report.py write_sweep_report)."""
    if not sweep_dir.is_dir():
        return None
    rows = sweep_rows(sweep_dir)
    if not rows:
        return None
    table = format_sweep(rows)
    (sweep_dir / "plan_table.md").write_text(f"# Memory plan of {sweep_dir}\n\n{table}\n")
    return f"memory plan of the sweep ({len(rows)} points):\n{table}"
