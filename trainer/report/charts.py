"""The sweep report's charts (PNG files beside report.md): throughput, every rank's peak memory, what
each stage saves against what it moves, losses, the fp16 loss scale."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot's import
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from trainer.report.rows import label  # noqa: E402
from trainer.report.run_dirs import Point, Report, per_rank_peaks  # noqa: E402
from trainer.telemetry import keys  # noqa: E402
from trainer.telemetry.keys import Status  # noqa: E402
from trainer.units import MIB  # noqa: E402

FAILED_COLOR = "#d62728"
LINE_STYLES = ["-", (0, (6, 3)), (0, (2, 2)), (0, (8, 3, 2, 3))]  # solid, dashed, dotted, dash-dot


def write_charts(report: Report) -> dict[str, Path]:
    """Draw every chart that has something to show; returns name -> file."""
    charts: dict[str, Path] = {}
    drawers = {
        "throughput": plot_throughput,
        "memory": plot_memory,
        "comm": plot_comm,
        "losses": plot_losses,
        "val_losses": plot_val_losses,
        "loss_scale": plot_loss_scale,
    }
    for name, draw in drawers.items():
        path = report.sweep_dir / f"{name}.png"
        fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
        drawn = draw(ax, report)
        if drawn:
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(path)
            charts[name] = path
        else:
            path.unlink(missing_ok=True)  # e.g. no fp16 point any more
        plt.close(fig)
    return charts


def failure_note(row: dict[str, Any]) -> str:
    """A short label for a failed point on a chart: `oom: rank 1, step 1, forward`, `refused`."""
    if row["status"] == Status.oom and row["failed_rank"] is not None:
        where = (
            f", step {row['failed_step']}, {row['failed_phase']}" if row["failed_step"] is not None else ""
        )
        return f"oom: rank {row['failed_rank']}{where}"
    return row["status"]


def micro_batch_of(point: Point) -> int | None:
    """The point's micro-batch: its override, else its config's (a run compared with a sweep that kept
    the default); None for a point that left neither."""
    value = point.settings.get("micro_batch", point.config.get("micro_batch"))
    return int(value) if value is not None else None


def plot_throughput(ax: plt.Axes, report: Report) -> bool:
    """Tokens/s against micro-batch, one line per combination of the other swept keys; a point that
    did not end ok is an ✕ on the axis with its status. Without a micro-batch axis: one bar per point."""
    if all(not point.summary for point in report.points):
        return False  # a mode=plan sweep: nothing ran
    if "micro_batch" not in report.swept or any(micro_batch_of(p) is None for p in report.points):
        return plot_throughput_bars(ax, report)
    others = [key for key in report.swept if key != "micro_batch"]
    series: dict[str, list[tuple[Point, dict[str, Any]]]] = defaultdict(list)
    for point, row in zip(report.points, report.rows):
        series[label(point, others) if others else "all points"].append((point, row))
    for index, (name, members) in enumerate(series.items()):
        members.sort(key=lambda m: micro_batch_of(m[0]))  # type: ignore[arg-type, return-value]
        ok = [
            (micro_batch_of(p), r["tokens_per_s"])
            for p, r in members
            if r["status"] == Status.ok and r["tokens_per_s"] is not None
        ]
        line = ax.plot([x for x, _ in ok], [y for _, y in ok], marker="o", label=name)[0]
        for point, row in members:
            if row["status"] != Status.ok:
                mark_failure(ax, micro_batch_of(point), row, line.get_color(), index)  # type: ignore[arg-type]
    sizes = sorted({micro_batch_of(p) for p in report.points})  # type: ignore[type-var]
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("micro_batch (sequences per rank per step)")
    finish_throughput(ax, report.rows, legend_title=", ".join(others) if others else None)
    return True


def plot_throughput_bars(ax: plt.Axes, report: Report) -> bool:
    labels = [label(p, report.swept) for p in report.points]
    heights = [row["tokens_per_s"] or 0 if row["status"] == Status.ok else 0 for row in report.rows]
    colors = ["#2ca02c" if row["fastest"] else "#1f77b4" for row in report.rows]
    ax.bar(range(len(labels)), heights, color=colors)
    for x, row in enumerate(report.rows):
        if row["status"] != Status.ok:
            mark_failure(ax, x, row, FAILED_COLOR, 0)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    finish_throughput(ax, report.rows, legend_title=None)
    return True


def mark_failure(ax: plt.Axes, x: float, row: dict[str, Any], color: str, index: int) -> None:
    ax.scatter(
        [x],
        [0],
        marker="X",
        s=140,
        color=color,
        edgecolors=FAILED_COLOR,
        linewidths=1.5,
        zorder=3,
        clip_on=False,
    )
    ax.annotate(
        failure_note(row),
        (x, 0),
        xytext=(6, 8 + 13 * index),
        textcoords="offset points",
        fontsize=8,
        color=FAILED_COLOR,
    )


def finish_throughput(ax: plt.Axes, rows: list[dict[str, Any]], legend_title: str | None) -> None:
    ax.set_ylim(bottom=0)
    ax.set_ylabel("steady tokens/s (all ranks)")
    failed = any(row["status"] != Status.ok for row in rows)
    ax.set_title("Throughput per point" + (" (✕ at 0: did not end ok)" if failed else ""))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(title=legend_title, fontsize=8)


def plot_memory(ax: plt.Axes, report: Report) -> bool:
    """Grouped bars: each rank's peak tensor memory per point; a black tick at the plan's predicted
    peak, a dashed red tick at the device_memory_gib cap; failed points named at the axis."""
    peaks = [per_rank_peaks(point) for point in report.points]
    ranks = sorted({rank for p in peaks for rank in p})
    width = 0.8 / max(1, len(ranks))
    for i, rank in enumerate(ranks):
        xs = [x + (i - (len(ranks) - 1) / 2) * width for x, p in enumerate(peaks) if rank in p]
        ax.bar(xs, [p[rank] for p in peaks if rank in p], width=width, label=f"rank {rank}")
    for x, (point, row) in enumerate(zip(report.points, report.rows)):
        mark_plan_and_cap(ax, x, point, row)
        if not peaks[x]:
            ax.annotate(
                failure_note(row) if row["status"] != Status.ok else "not measured",
                (x, 0),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color=FAILED_COLOR,
            )
    labels = [label(p, report.swept) for p in report.points]
    ax.set_xticks(range(len(report.points)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("peak tensor memory per rank (GiB)")
    ax.set_title("Peak memory of every rank (tensor-level; worst window of the run)")
    handles, names = ax.get_legend_handles_labels()
    by_name = dict(zip(names, handles))
    ax.legend(by_name.values(), by_name.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return True


def mark_plan_and_cap(ax: plt.Axes, x: int, point: Point, row: dict[str, Any]) -> None:
    """The point's predicted peak (a black tick) and its device_memory_gib cap (a dashed red one);
    each labelled once, at the first point, for the legend."""
    if row["predicted_peak_gib"] is not None:
        ax.hlines(row["predicted_peak_gib"], x - 0.45, x + 0.45, colors="black", linewidth=2,
                  label="predicted peak (plan)" if x == 0 else None)  # fmt: skip
    cap = point.config.get("device_memory_gib")
    if cap is not None:
        ax.hlines(cap, x - 0.45, x + 0.45, colors=FAILED_COLOR, linestyles="dashed",
                  label="device_memory_gib cap" if x == 0 else None)  # fmt: skip


def stage_of(point: Point) -> str | None:
    """The point's zero stage: from summary.json's config, or plan.json's `zero` (a mode=plan point)."""
    zero = point.config.get("zero")
    return zero.get("stage") if isinstance(zero, dict) else zero


def plot_comm(ax: plt.Axes, report: Report) -> bool:
    """ZeRO's trade, one point per configuration: the worst rank's measured bytes per step against the
    memory its stage saved over stage0 at the same other settings (worst-rank peak, tensor-level)."""
    rows = {point.num: row for point, row in zip(report.points, report.rows)}
    others = [key for key in report.swept if key != "zero"]

    def same(point: Point) -> tuple[str | None, ...]:  # the settings a stage0 reference must share
        return tuple(point.settings.get(key) for key in others)

    reference = {same(p): rows[p.num]["max_rank_peak_gib"] for p in report.points if stage_of(p) == "stage0"}
    drawn = False
    for stage in ("stage0", "stage1", "stage2", "stage3"):
        xs, ys, names = [], [], []
        for point in report.points:
            row, base = rows[point.num], reference.get(same(point))
            if stage_of(point) != stage or None in (
                row["comm_bytes_per_step"],
                row["max_rank_peak_gib"],
                base,
            ):
                continue
            xs.append(row["comm_bytes_per_step"] / MIB)
            ys.append((base - row["max_rank_peak_gib"]) * 1024)
            names.append(label(point, others) if others else "")
        if xs:
            ax.scatter(xs, ys, s=60, label=stage, zorder=3)
            for index, (x, y, name) in enumerate(zip(xs, ys, names)):  # stacked: equal points share a spot
                ax.annotate(name, (x, y), xytext=(6, 4 - 10 * index), textcoords="offset points", fontsize=7)
            drawn = True
    ax.set_xlabel("bytes moved per rank per optimizer step (MiB, measured)")
    ax.set_ylabel("peak memory saved vs stage0 (MiB, worst rank)")
    ax.set_title("What each stage saves and what it moves (one point per configuration)")
    if drawn:
        ax.legend(title="zero", fontsize=8)
    return drawn


def plot_losses(ax: plt.Axes, report: Report) -> bool:
    """Loss against step; points that train identically (the ZeRO stages do) draw the same curve, so
    every line gets its own dash pattern and the curves beneath stay visible."""
    drawn = False
    for index, point in enumerate(report.points):
        records = [r for r in point.records if r.get(keys.LOSS) is not None]
        if records:
            style = LINE_STYLES[index % len(LINE_STYLES)]
            ax.plot(
                [r["step"] for r in records],
                [r[keys.LOSS] for r in records],
                linestyle=style,
                marker=".",
                label=label(point, report.swept),
            )
            drawn = True
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss per point (identical runs overlap: dashes show each line)")
    if drawn:
        ax.legend(
            fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=2 if len(report.points) > 12 else 1
        )
    return drawn


def plot_val_losses(ax: plt.Axes, report: Report) -> bool:
    """The held-out loss at every evaluation (eval.every), where points evaluated."""
    drawn = False
    for index, point in enumerate(report.points):
        records = [r for r in point.records if keys.LOSS_VAL in r]
        if records:
            ax.plot(
                [r["step"] for r in records],
                [r[keys.LOSS_VAL] for r in records],
                linestyle=LINE_STYLES[index % len(LINE_STYLES)],
                marker="o",
                label=label(point, report.swept),
            )
            drawn = True
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss (loss/val)")
    ax.set_title("Held-out loss per point, on the same batches at every evaluation")
    if drawn:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return drawn


def plot_loss_scale(ax: plt.Axes, report: Report) -> bool:
    """The fp16 scaler's scale after every logged step: a back-off is a step down, growth a step up."""
    drawn = False
    for point in report.points:
        records = [r for r in point.records if keys.LOSS_SCALE in r]
        if records:
            steps = [r["step"] for r in records]
            style = LINE_STYLES[len(ax.lines) % len(LINE_STYLES)]
            ax.step(
                steps,
                [r[keys.LOSS_SCALE] for r in records],
                where="post",
                linestyle=style,
                marker=".",
                label=label(point, report.swept),
            )
            drawn = True
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale (log2)")
    ax.set_title("fp16 loss scale per fp16 point")
    if drawn:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return drawn
