"""How close the memory plan is to what the ranks really hold: tables of real multi-rank CPU jobs.

Every point is `python -m trainer` exactly as a user runs it. The job writes its plan
(plan.json, per rank) before launching, and the ranks log what they measured (metrics.jsonl):
`memory/rank{r}/peak_allocated_gib`, the peak tensor memory of the tracked step (torch's
MemTracker, step 2: the first step that starts with Adam's state), and the model states
`memory/rank{r}/{params,grads,optimizer}_gib` after the step. This script puts them side by side.

    .venv/bin/python checks/plan_accuracy.py                      # docs/memory_plan.md's first table, ~30 min
    .venv/bin/python checks/plan_accuracy.py --table seq512        # its second table
    .venv/bin/python checks/plan_accuracy.py --table cases         # fp16 selective, grad_accum, 3 ranks, offload, wide
    .venv/bin/python checks/plan_accuracy.py --table cases --grids 3-ranks --zero stage3   # any subset

A table is a set of named grids (TABLES; --grids picks some); each option given on the command line (--model, --zero,
--precision, --checkpointing, --micro-batch, --grad-accum, --nproc, --offload, --seq-len)
replaces that axis in every grid of the table, so a subset of a documented table, or a new grid,
is one command. --model takes a preset of conf/model or a shape of SHAPES (`wide`: dim 512,
MLP 2048, vocabulary 64, 2 blocks).

Pass rule (docs/memory_plan.md publishes both): every rank's predicted peak within
--peak-tolerance-pct (1%) of the measured one, and every rank's model states (parameters,
gradients, optimizer state, each) equal to the byte. Exits 1 when a point misses, 2 on a job that
failed. Every point runs fresh; --reuse takes a point from --out/results.jsonl only when it was
measured with the same overrides on the same tree (HEAD and uncommitted changes: revision()).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STATES = ("params", "grads", "optimizer")
GIB = 2**30
# Model shapes that are not presets: (the preset they start from, the fields they change).
SHAPES = {
    "wide": ["model=tiny", "model.name=wide", "model.dim=512", "model.ffn_dim=2048", "model.vocab_size=64",
             "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=8"],
}  # fmt: skip
ALL_STAGES = ["stage0", "stage1", "stage2", "stage3"]
BASE = {"model": "125m", "seq_len": 128, "grad_accum": 1, "nproc": 2, "offload": "none"}
AXES = (
    "model",
    "seq_len",
    "zero",
    "precision",
    "checkpointing",
    "micro_batch",
    "grad_accum",
    "nproc",
    "offload",
)
# Each table: named grids whose axes are lists (a single value is a one-element list); BASE fills the rest.
TABLES: dict[str, dict[str, dict[str, list[Any]]]] = {
    # docs/memory_plan.md, "How close it is": 125m at seq_len 128.
    "grid": {"125m": dict(zero=ALL_STAGES, precision=["fp32", "bf16"], checkpointing=["none", "full"],
                          micro_batch=[1, 4])},
    # docs/memory_plan.md: where activations weigh more.
    "seq512": {"125m-seq512": dict(seq_len=[512], zero=ALL_STAGES, precision=["fp32", "bf16"],
                                   checkpointing=["none", "full"], micro_batch=[4])},
    # docs/memory_plan.md, "Beyond these grids": the tiny model across the grid, then one case each.
    "cases": {
        "tiny": dict(model=["tiny"], seq_len=[64], zero=ALL_STAGES, precision=["fp32", "bf16"],
                     checkpointing=["none", "full"], micro_batch=[2, 8]),
        "fp16-selective": dict(model=["tiny"], seq_len=[64], zero=ALL_STAGES, precision=["fp16"],
                               checkpointing=["selective"], micro_batch=[2]),
        "grad-accum": dict(model=["tiny"], seq_len=[64], zero=ALL_STAGES, precision=["fp32"], checkpointing=["none"],
                           micro_batch=[2], grad_accum=[2]),
        "3-ranks": dict(model=["tiny"], seq_len=[64], zero=ALL_STAGES, precision=["fp32"], checkpointing=["none"],
                        micro_batch=[2], nproc=[3]),
        "offload": dict(model=["tiny"], seq_len=[64], zero=["stage2", "stage3"], precision=["fp32"],
                        checkpointing=["none"], micro_batch=[2], offload=["cpu"]),
        "wide": dict(model=["wide"], seq_len=[8], zero=ALL_STAGES, precision=["fp32", "bf16"], checkpointing=["none"],
                     micro_batch=[1]),
    },
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", choices=sorted(TABLES), default="grid")
    parser.add_argument("--grids", nargs="+", help="only these grids of the table (default: all)")
    parser.add_argument("--model", nargs="+", help="presets of conf/model or shapes of SHAPES")
    parser.add_argument("--seq-len", nargs="+", type=int)
    parser.add_argument("--zero", nargs="+", choices=ALL_STAGES)
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--checkpointing", nargs="+", choices=["none", "full", "selective"])
    parser.add_argument("--micro-batch", nargs="+", type=int)
    parser.add_argument("--grad-accum", nargs="+", type=int)
    parser.add_argument("--nproc", nargs="+", type=int, help="ranks per job")
    parser.add_argument("--offload", nargs="+", choices=["none", "cpu"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "checks" / "plan_accuracy")
    parser.add_argument("--reuse", action="store_true", help="reuse points measured on this very tree")
    parser.add_argument("--peak-tolerance-pct", type=float, default=1.0)
    return parser.parse_args(argv)


def points(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The table's grids with the command line's axes in place of theirs, one dict per point."""
    given = {axis: getattr(args, axis) for axis in AXES if getattr(args, axis) is not None}
    out: list[dict[str, Any]] = []
    grids = TABLES[args.table]
    unknown = set(args.grids or []) - set(grids)
    if unknown:
        raise SystemExit(f"error: --table {args.table} has no grid {sorted(unknown)}; it has {list(grids)}")
    for name, grid in grids.items():
        if args.grids and name not in args.grids:
            continue
        axes = {axis: given.get(axis, grid.get(axis, [BASE.get(axis)])) for axis in AXES}
        for values in itertools.product(*axes.values()):
            point = dict(zip(AXES, values))
            if point["offload"] == "cpu" and point["zero"] in ("stage0", "stage1"):
                continue  # offload needs FSDP2 (config.py refuses it)
            if point not in out:
                out.append(point)
    return out


def overrides(point: dict[str, Any], steps: int) -> list[str]:
    model = SHAPES.get(point["model"], [f"model={point['model']}"])
    return [
        *model,
        *(f"{axis}={point[axis]}" for axis in AXES if axis != "model"),
        f"steps={steps}",
        "device=cpu",
        "logger=none",
        "save=off",  # a 1b checkpoint is ~13 GB per job; the plan is what is measured
        "log_every=1",
        "telemetry.memory_every=0",  # MemTracker on step 2 only
    ]


def label(point: dict[str, Any]) -> str:
    """The point as the docs' tables name it: the grid's axes, and what differs from BASE."""
    shown = ("zero", "precision", "checkpointing", "micro_batch")
    extra = [f"{axis}={point[axis]}" for axis in AXES if axis in BASE and point[axis] != BASE[axis]]
    return " ".join([*(f"{axis}={point[axis]}" for axis in shown), *extra])


def revision() -> str:
    """The tree a result was measured on: HEAD, and a digest of the uncommitted changes if any."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, check=True).stdout  # noqa: E731
    head = git("rev-parse", "HEAD").strip()
    changes = git("diff", "HEAD") + git("ls-files", "--others", "--exclude-standard")
    return head if not changes else f"{head}+{hashlib.sha256(changes.encode()).hexdigest()[:12]}"


def run_point(point: list[str], job_dir: Path) -> dict[str, Any]:
    """Run one job; return the plan it wrote and the ranks' measurements (bytes)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", *point, f"hydra.run.dir={job_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(point)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    plan = json.loads((job_dir / "plan.json").read_text())
    measured = measurements(job_dir, plan["world_size"])
    return {"overrides": point, "plan": plan, "measured": measured, "seconds": time.perf_counter() - start}


def measurements(job_dir: Path, world_size: int) -> list[dict[str, int]]:
    """What each rank measured (metrics.jsonl, bytes): its highest peak allocated and, at the last
    record, its model states; never the plan's figures, which rows() compares them with."""
    records = [
        json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    measured = []
    for rank in range(world_size):
        key = f"memory/rank{rank}/peak_allocated_gib"
        peaks = [r[key] for r in records if key in r]
        if not peaks:
            raise RuntimeError(f"no {key} in {job_dir}/metrics.jsonl")
        last = records[-1]
        states = {kind: round(last[f"memory/rank{rank}/{kind}_gib"] * GIB) for kind in STATES}
        measured.append({"peak_bytes": round(max(peaks) * GIB), **states})
    return measured


def rows(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """One row per rank: predicted against measured peak (percent) and model states (bytes)."""
    out = []
    for planned, measured in zip(result["plan"]["ranks"], result["measured"]):
        predicted = {kind: round(planned[f"{kind}_gib"] * GIB) for kind in STATES}
        peak = round(planned["peak_gib"] * GIB)
        out.append(
            {
                "point": name,
                "rank": planned["rank"],
                "predicted_bytes": peak,
                "measured_bytes": measured["peak_bytes"],
                "error_pct": 100 * (peak - measured["peak_bytes"]) / measured["peak_bytes"],
                "states_predicted": predicted,
                "states_measured": {kind: measured[kind] for kind in STATES},
                "moment": planned["peak_moment"],
            }
        )
    return out


def misses(all_rows: list[dict[str, Any]], peak_tolerance_pct: float) -> list[str]:
    """The pass rule: one line per rank whose peak misses by more than the tolerance or whose model
    states differ from the plan by any byte; empty when every point passes."""
    out = []
    for r in all_rows:
        where = f"{r['point']} rank {r['rank']}"
        if abs(r["error_pct"]) > peak_tolerance_pct:
            out.append(f"{where}: peak {r['error_pct']:+.2f}% (tolerance {peak_tolerance_pct:g}%)")
        for kind in STATES:
            planned, measured = r["states_predicted"][kind], r["states_measured"][kind]
            if planned != measured:
                out.append(f"{where}: {kind} {planned:,} bytes planned, {measured:,} measured")
    return out


def markdown(all_rows: list[dict[str, Any]]) -> str:
    lines = [
        "| point | rank | predicted peak GiB | measured peak GiB | error | model states predicted / measured GiB | error | peak at |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in all_rows:
        planned, measured = sum(r["states_predicted"].values()), sum(r["states_measured"].values())
        lines.append(
            f"| {r['point']} | {r['rank']} | {r['predicted_bytes'] / GIB:.4f} | {r['measured_bytes'] / GIB:.4f} "
            f"| {r['error_pct']:+.2f}% | {planned / GIB:.4f} / {measured / GIB:.4f} "
            f"| {100 * (planned - measured) / measured:+.3f}% | {r['moment']} |"
        )
    return "\n".join(lines)


def cached(path: Path, tree: str) -> dict[tuple[str, ...], dict[str, Any]]:
    """Results measured on `tree` (revision()), by their overrides; any other tree's are ignored."""
    if not path.exists():
        return {}
    results = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {tuple(r["overrides"]): r for r in results if r.get("revision") == tree}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results_path, tree = args.out / "results.jsonl", revision()
    done = cached(results_path, tree) if args.reuse else {}
    all_rows = []
    for point in points(args):
        command = overrides(point, args.steps)
        result = done.get(tuple(command))
        if result is None:
            job_dir = args.out / "jobs" / "-".join(str(v) for v in point.values())
            try:
                result = {**run_point(command, job_dir), "revision": tree}
            except RuntimeError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            with results_path.open("a") as f:
                f.write(json.dumps(result) + "\n")
        for row in rows(result, label(point)):
            all_rows.append(row)
            print(
                f"{row['point']:60s} rank {row['rank']}  predicted {row['predicted_bytes'] / GIB:.4f} GiB  measured "
                f"{row['measured_bytes'] / GIB:.4f} GiB  {row['error_pct']:+6.2f}%  ({row['moment']})",
                flush=True,
            )
    print("\n" + markdown(all_rows))
    failed = misses(all_rows, args.peak_tolerance_pct)
    worst = max(abs(r["error_pct"]) for r in all_rows)
    differ = sum(r["states_predicted"] != r["states_measured"] for r in all_rows)
    print(
        f"\nworst peak error {worst:.2f}% (tolerance {args.peak_tolerance_pct:g}%); model states equal "
        f"to the byte on {len(all_rows) - differ} of {len(all_rows)} ranks"
    )
    for line in failed:
        print(f"MISS {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
