"""The sweep report: one row per point, charts, a W&B Report, and with W&B on one summary run.

`python -m trainer.report <sweep dir>` (and the sweep callback, trainer/sweep.py, at the end of
every multirun) reads each point's summary.json, metrics.jsonl and plan.json and writes into the
sweep directory; `python -m trainer.report DIR [DIR ...]` does the same over any run and sweep
directories together (trainer/report/command.py), into `--out` or a new directory under outputs/reports/:

    results.csv      one row per point; figures exactly as in the point's summary.json
    report.md        the same table for people, the fastest point that fits marked, the charts
    throughput.png   steady tokens/s against micro-batch, a line per other swept setting, failures marked
    memory.png       every rank's peak tensor memory per point, with the predicted peak and the cap
    comm.png         memory each stage saved over stage0 against the bytes it moved per step, per point
    losses.png       training loss against step, per point
    loss_scale.png   the fp16 loss scale against step of every fp16 point (only when there is one)
    wandb_report.json  the W&B Report of the same points (trainer/report/wandb_report.py), ready to publish

The report depends only on the points' files, so writing it again gives the same bytes (the W&B
Report's panel ids aside).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot's import
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from trainer.console import warn  # noqa: E402
from trainer.report.run_dirs import Point, Report, count_statuses, load_points, per_rank_peaks, plural  # noqa: E402
from trainer.telemetry import keys
from trainer.telemetry.keys import Status
from trainer.telemetry.summary import redact_secrets  # noqa: E402
from trainer.telemetry.wandb_logger import sweep_group  # noqa: E402
from trainer.units import MIB

COLUMNS = [
    "point",
    "overrides",
    "status",
    "tokens_per_s",
    "mfu_pct",
    "max_rank_peak_gib",
    "argmax_rank",
    "predicted_peak_gib",
    "comm_bytes_per_step",
    "predicted_comm_bytes_per_step",
    "comm_by_group",
    "skipped_steps",
    "final_loss",
    "fastest",
    "failed_rank",
    "failed_step",
    "failed_phase",
    "reason",
    "dir",
]
SUMMARY_KEYS = {
    "tokens_per_s": keys.TOKENS_PER_S,
    "mfu_pct": keys.MFU_PCT,
    "max_rank_peak_gib": keys.MAX_RANK_PEAK,
    "argmax_rank": keys.ARGMAX_RANK,
    "final_loss": keys.LOSS_FINAL,
    "failed_rank": "failed_rank",
    "failed_step": "failed_step",
    "failed_phase": "failed_phase",
}
FAILED_COLOR = "#d62728"
LINE_STYLES = ["-", (0, (6, 3)), (0, (2, 2)), (0, (8, 3, 2, 3))]  # solid, dashed, dotted, dash-dot


def swept_keys(points: list[Point]) -> list[str]:
    """The override keys whose value differs between points, in the order they were given."""
    settings = list(dict.fromkeys(key for point in points for key in point.settings))
    return [key for key in settings if len({point.settings.get(key) for point in points}) > 1]


def label(point: Point, swept: list[str]) -> str:
    """What tells this point apart: its swept overrides (`micro_batch=4 zero=stage3`)."""
    return (
        " ".join(f"{key}={point.settings[key]}" for key in swept if key in point.settings) or f"#{point.num}"
    )


def build_rows(points: list[Point], swept: list[str]) -> list[dict[str, Any]]:
    rows = [build_row(point, swept) for point in points]
    candidates = [row for row in rows if row["status"] == Status.ok and row["tokens_per_s"] is not None]
    if candidates:
        max(candidates, key=lambda row: row["tokens_per_s"])["fastest"] = True
    return rows


def build_row(point: Point, swept: list[str]) -> dict[str, Any]:
    summary = point.summary
    row: dict[str, Any] = {key: summary.get(source) for key, source in SUMMARY_KEYS.items()}
    row.update(
        point=point.num,
        overrides=label(point, swept),
        status=point.status,
        predicted_peak_gib=predicted_peak_gib(point),
        comm_bytes_per_step=max((v for k, v in summary.items() if keys.COMM_KEY.fullmatch(k)), default=None),
        predicted_comm_bytes_per_step=predicted_comm_bytes(point),
        comm_by_group=comm_by_group(point),
        skipped_steps=skipped_steps(summary),
        fastest=False,
        reason=summary.get("reason") or summary.get("error"),
        dir=point.path.name,
    )
    return {key: row[key] for key in COLUMNS}


def predicted_peak_gib(point: Point) -> float | None:
    """The plan's worst-rank peak: in the summary of a job that trained, else in plan.json."""
    if keys.PREDICTED_PEAK in point.summary:
        return point.summary[keys.PREDICTED_PEAK]
    return point.plan.get("peak_gib") if point.plan is not None else None


def comm_by_group(point: Point) -> str | None:
    """Both tiers where a job had more than one process group (HSDP, hpZ; trainer/plan/groups.py): each
    group's worst-rank MiB per step, measured / planned, and the link it crossed (from plan.json)."""
    groups = (point.plan or {}).get("comm", {}).get("groups") or {}
    if len(groups) < 2:
        return None
    cells = []
    for name, group in groups.items():
        measured = [
            v
            for k, v in point.summary.items()
            if (m := keys.COMM_GROUP_KEY.fullmatch(k)) and m.group(1) == name
        ]
        shown = f"{max(measured) / MIB:.2f}" if measured else "-"
        cells.append(f"{name} ({group['link']}) {shown} / {group['bytes_per_step'] / MIB:.2f}")
    return "; ".join(cells)


def predicted_comm_bytes(point: Point) -> int | None:
    """The plan's bytes per rank per step (trainer/plan/comm.py): in the summary, else in plan.json."""
    if keys.COMM_PREDICTED_BYTES in point.summary:
        return point.summary[keys.COMM_PREDICTED_BYTES]
    return (point.plan.get("comm") or {}).get("bytes_per_step") if point.plan is not None else None


def skipped_steps(summary: dict[str, Any]) -> int | None:
    """Optimizer steps skipped: fp16 overflows plus non-finite steps skipped by nonfinite=skip."""
    counts = [summary[k] for k in (keys.SKIPPED_STEPS, keys.NONFINITE_SKIPPED) if k in summary]
    return int(sum(counts)) if counts else None


def write_report(sweep_dir: Path, points: list[Point] | None = None) -> Report:
    """Write results.csv, the charts, wandb_report.json and report.md into `sweep_dir`: of the sweep's
    own points, or of `points` (a comparison; trainer/report/command.py)."""
    from trainer.report.wandb_report import write_wandb_report

    is_sweep = points is None
    points = load_points(sweep_dir) if points is None else points
    swept = swept_keys(points)
    report = Report(sweep_dir, points, swept, build_rows(points, swept), charts={}, is_sweep=is_sweep)
    write_csv(report.rows, sweep_dir / "results.csv")
    report.charts = write_charts(report)
    logger = report_logger(report)
    wandb_json = write_wandb_report(report, logger.get("project") or "zerolab", logger.get("entity"))
    published = wandb_json if logger.get("backend") == "wandb" else None  # no runs in W&B: nothing to publish
    (sweep_dir / "report.md").write_text(markdown(report, published))
    return report


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)  # floats as repr: they read back equal to summary.json's


# ---------------------------------------------------------------------------- report.md


def markdown(report: Report, wandb_json: Path | None) -> str:
    lines = [f"# {report.title}", "", report.description]
    if (best := report.fastest) is not None:
        lines.append(
            f"Fastest point that fits: #{best['point']} `{best['overrides']}`, {best['tokens_per_s']:,.0f} tokens/s."
        )
    lines += [
        "",
        *markdown_table(report.rows),
        *markdown_failures(report.rows),
        *markdown_charts(report.charts),
    ]
    if wandb_json is not None:
        lines += ["", "## W&B", "", wandb_line(None, report.sweep_dir)]
    return "\n".join(lines) + "\n"


WANDB_LINE = "W&B Report: "


def wandb_line(url: str | None, report_dir: Path) -> str:
    """report.md's line about the W&B Report: its URL once published, else how to publish it."""
    if url is not None:
        return f"{WANDB_LINE}{url}"
    return (
        f"{WANDB_LINE}built offline in `wandb_report.json`; to publish it, upload the runs (`wandb sync`) "
        f"and run `python -m trainer.report --wandb {report_dir}`."
    )


def set_wandb_url(report_dir: Path, url: str) -> None:
    """Put the published Report's URL into report.md, in place of how to publish it."""
    path = report_dir / "report.md"
    lines = [
        wandb_line(url, report_dir) if line.startswith(WANDB_LINE) else line
        for line in path.read_text().splitlines()
    ]
    path.write_text("\n".join(lines) + "\n")


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    header = [
        "#",
        "overrides",
        "status",
        "tokens/s (steady)",
        "MFU %",
        "worst-rank peak GiB (rank)",
        "predicted peak GiB",
        "comm MiB/step (worst rank)",
        "plan MiB/step",
        "by group MiB/step (measured / plan)",
        "skipped steps",
        "final loss",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        peak = gib(row["max_rank_peak_gib"])
        if row["argmax_rank"] is not None and row["max_rank_peak_gib"] is not None:
            peak += f" (rank {row['argmax_rank']})"
        cells = [
            str(row["point"]),
            f"`{row['overrides']}`",
            status_cell(row),
            number(row["tokens_per_s"], "{:,.0f}"),
            number(row["mfu_pct"], "{:.1f}"),
            peak,
            gib(row["predicted_peak_gib"]),
            mib(row["comm_bytes_per_step"]),
            mib(row["predicted_comm_bytes_per_step"]),
            row["comm_by_group"] or "-",
            number(row["skipped_steps"], "{}"),
            number(row["final_loss"], "{:.4f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def status_cell(row: dict[str, Any]) -> str:
    if row["fastest"]:
        return "**ok, fastest**"
    if row["status"] == Status.oom and row["failed_rank"] is not None:
        where = f"rank {row['failed_rank']}"
        if row["failed_step"] is not None:
            where += f", step {row['failed_step']}, {row['failed_phase']}"
        return f"**oom** ({where})"
    return row["status"] if row["status"] == Status.ok else f"**{row['status']}**"


def markdown_failures(rows: list[dict[str, Any]]) -> list[str]:
    failed = [row for row in rows if row["reason"]]
    if not failed:
        return []
    return ["", "Points that did not end ok:", ""] + [
        f"- #{row['point']} `{row['overrides']}`: {row['status']}: {row['reason']}" for row in failed
    ]


def markdown_charts(charts: dict[str, Path]) -> list[str]:
    titles = {
        "throughput": "Throughput",
        "memory": "Peak tensor memory per rank",
        "losses": "Training loss",
        "loss_scale": "fp16 loss scale",
        "comm": "Memory saved against bytes moved",
    }
    lines: list[str] = []
    for name, path in charts.items():
        lines += ["", f"## {titles[name]}", "", f"![{titles[name]}]({path.name})"]
    return lines


def mib(value: float | None) -> str:
    return "–" if value is None else f"{value / MIB:,.2f}"


def number(value: Any, pattern: str) -> str:
    return "–" if value is None else pattern.format(value)


def gib(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.4f}" if value < 1 else f"{value:.2f}"


# ---------------------------------------------------------------------------- charts


def write_charts(report: Report) -> dict[str, Path]:
    """Draw every chart that has something to show; returns name -> file."""
    charts: dict[str, Path] = {}
    drawers = {
        "throughput": plot_throughput,
        "memory": plot_memory,
        "comm": plot_comm,
        "losses": plot_losses,
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


def plot_throughput(ax: plt.Axes, report: Report) -> bool:
    """Tokens/s against micro-batch, one line per combination of the other swept keys; a point that
    did not end ok is an ✕ on the axis with its status. Without a micro-batch axis: one bar per point."""
    if all(not point.summary for point in report.points):
        return False  # a mode=plan sweep: nothing ran
    if "micro_batch" not in report.swept:
        return plot_throughput_bars(ax, report)
    others = [key for key in report.swept if key != "micro_batch"]
    series: dict[str, list[tuple[Point, dict[str, Any]]]] = defaultdict(list)
    for point, row in zip(report.points, report.rows):
        series[label(point, others) if others else "all points"].append((point, row))
    for index, (name, members) in enumerate(series.items()):
        members.sort(key=lambda m: int(m[0].settings["micro_batch"]))
        ok = [
            (int(p.settings["micro_batch"]), r["tokens_per_s"])
            for p, r in members
            if r["status"] == Status.ok and r["tokens_per_s"] is not None
        ]
        line = ax.plot([x for x, _ in ok], [y for _, y in ok], marker="o", label=name)[0]
        for point, row in members:
            if row["status"] != Status.ok:
                mark_failure(ax, int(point.settings["micro_batch"]), row, line.get_color(), index)
    sizes = sorted({int(p.settings["micro_batch"]) for p in report.points})
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
        if row["predicted_peak_gib"] is not None:
            ax.hlines(
                row["predicted_peak_gib"],
                x - 0.45,
                x + 0.45,
                colors="black",
                linewidth=2,
                label="predicted peak (plan)" if x == 0 else None,
            )
        cap = point.config.get("device_memory_gib")
        if cap is not None:
            ax.hlines(
                cap,
                x - 0.45,
                x + 0.45,
                colors=FAILED_COLOR,
                linestyles="dashed",
                label="device_memory_gib cap" if x == 0 else None,
            )
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
    ax.set_xticks(
        range(len(report.points)),
        [label(p, report.swept) for p in report.points],
        rotation=30,
        ha="right",
        fontsize=8,
    )
    ax.set_ylim(bottom=0)
    ax.set_ylabel("peak tensor memory per rank (GiB)")
    ax.set_title("Peak memory of every rank (tensor-level; worst window of the run)")
    handles, names = ax.get_legend_handles_labels()
    by_name = dict(zip(names, handles))
    ax.legend(by_name.values(), by_name.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return True


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


# ---------------------------------------------------------------------------- W&B


def log_to_wandb(report: Report, project: str, entity: str | None) -> tuple[str, bool]:
    """One summary run in the sweep's group: the results table and every chart. Returns its id and
    whether it went to the server (online) rather than to an offline run directory.

    The run's id is derived from the report's directory, so writing the report again (a re-run of
    the sweep, or `python -m trainer.report`) continues the same W&B run instead of adding one.
    """
    import wandb

    from trainer.report.wandb_report import RESULTS_TABLE, report_run_id
    from trainer.telemetry.wandb_logger import wandb_mode

    group = sweep_group(report.sweep_dir)
    with wandb.init(
        project=project,
        entity=entity,
        group=group,
        name=f"{report.title.split(':')[0].lower()} {group}",
        job_type="report",
        id=report_run_id(report.sweep_dir),
        resume="allow",
        dir=str(report.sweep_dir),
        mode=wandb_mode(),
        config={"sweep_dir": str(report.sweep_dir), "swept": report.swept, "points": len(report.rows)},
    ) as run:
        table = wandb.Table(columns=COLUMNS, data=[[row[c] for c in COLUMNS] for row in report.rows])
        run.log(
            {
                RESULTS_TABLE: table,
                **{f"sweep/{name}": wandb.Image(str(path)) for name, path in report.charts.items()},
            }
        )
        if (best := report.fastest) is not None:
            run.summary.update(
                {"fastest/overrides": best["overrides"], "fastest/tokens_per_s": best["tokens_per_s"]}
            )
        run.summary.update(
            {
                f"points/{status}": sum(r["status"] == status for r in report.rows)
                for status in {r["status"] for r in report.rows}
            }
        )
        online = run.settings.mode == "online"
    return run.id, online


def mirror_to_wandb(report: Report) -> None:
    """With logger=wandb: the report run, and online the W&B Report saved and its URL in report.md.

    W&B is a mirror: each failure is one warning line, and the local report stays complete.
    """
    from trainer.report.wandb_report import REPORT_FILE

    logger = report_logger(report)
    if logger.get("backend") != "wandb":
        return
    try:
        run_id, online = log_to_wandb(report, logger.get("project") or "zerolab", logger.get("entity"))
    except Exception as err:  # unreachable, misconfigured: the local report is complete without it
        warn(
            redact_secrets(
                f"the report could not go to W&B ({type(err).__name__}: {err}); the local report is complete"
            )
        )
        return
    print(f"W&B: report run {run_id} in group {sweep_group(report.sweep_dir)}", flush=True)
    if online and (report.sweep_dir / REPORT_FILE).exists():
        publish_and_link(report.sweep_dir)


def publish_and_link(report_dir: Path) -> str | None:
    """Save the W&B Report in `report_dir` and write its URL into report.md; None (one warning) on failure."""
    from trainer.report.wandb_report import REPORT_FILE, publish

    try:
        url = publish(report_dir / REPORT_FILE)
    except Exception as err:  # the library, the server or the credentials: report.md keeps how to publish
        warn(
            redact_secrets(
                f"the W&B Report could not be saved ({type(err).__name__}: {err}); it is in {report_dir / REPORT_FILE}"
            )
        )
        return None
    set_wandb_url(report_dir, url)
    print(f"W&B Report: {url}", flush=True)
    return url


def report_logger(report: Report) -> dict[str, Any]:
    """The `logger` settings the report's runs used: the sweep's multirun.yaml, else the first
    point's config that names one (a comparison)."""
    if report.is_sweep and (logger := sweep_logger(report.sweep_dir)) is not None:
        return logger
    return next((p.config["logger"] for p in report.points if isinstance(p.config.get("logger"), dict)), {})


def sweep_logger(sweep_dir: Path) -> dict[str, Any] | None:
    """The sweep's `logger` settings, from the multirun.yaml Hydra saved in the sweep directory."""
    path = sweep_dir / "multirun.yaml"
    if not path.exists():
        return None
    logger = OmegaConf.load(path).get("logger")
    return OmegaConf.to_container(logger) if logger is not None else None  # type: ignore[return-value]


def write_sweep_report(sweep_dir: Path) -> Report:
    """The end-of-sweep report: the memory plan's fit table of every point (plan_table.md, printed
    here) and the report of how each point ran (report.md, results.csv, charts; the caller prints
    its summary_line)."""
    from trainer.report.fit_table import write_fit_table

    if (fit_table := write_fit_table(sweep_dir)) is not None:
        print(fit_table, flush=True)
    return write_report(sweep_dir)


def summary_line(report: Report) -> str:
    statuses = ", ".join(f"{n} {s}" for s, n in sorted(count_statuses(report.rows).items()))
    return f"report: {report.sweep_dir / 'report.md'} ({plural(len(report.rows), 'point')}: {statuses})"
