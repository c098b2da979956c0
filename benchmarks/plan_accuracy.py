"""How close the memory plan is to what the ranks really hold: a grid of real 2-rank CPU jobs.

Every point is `python -m trainer` exactly as a user runs it. The job writes its plan
(plan.json, per rank) before launching, and the ranks log what they measured (metrics.jsonl):
`memory/rank{r}/peak_allocated_gib`, the peak tensor memory of the tracked step (torch's
MemTracker, step 2: the first step that starts with Adam's state), and the model states
`memory/rank{r}/{params,grads,optimizer}_gib` after the step. This script puts them side by side.

    .venv/bin/python benchmarks/plan_accuracy.py                # the full grid, ~30 minutes here
    .venv/bin/python benchmarks/plan_accuracy.py --zero stage3 --micro-batch 1

Grid (defaults): zero stage0-3 x precision fp32, bf16 x checkpointing none, full x micro_batch
1, 4, model=125m (134M parameters), seq_len=128, 2 steps. Finished points are kept in
--out/results.jsonl and not run again (--fresh runs everything again). Exits 1 when a point's
peak misses by more than --peak-tolerance-pct or its model states by more than
--states-tolerance-pct.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STATES = ("params", "grads", "optimizer")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="125m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--zero", nargs="+", default=["stage0", "stage1", "stage2", "stage3"])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--checkpointing", nargs="+", default=["none", "full"])
    parser.add_argument("--micro-batch", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "benchmarks" / "plan_accuracy")
    parser.add_argument("--fresh", action="store_true", help="run every point again")
    parser.add_argument("--peak-tolerance-pct", type=float, default=10.0)
    parser.add_argument("--states-tolerance-pct", type=float, default=2.0)
    return parser.parse_args()


def overrides(
    args: argparse.Namespace, zero: str, precision: str, checkpointing: str, micro_batch: int
) -> list[str]:
    return [
        f"model={args.model}",
        f"zero={zero}",
        f"precision={precision}",
        f"checkpointing={checkpointing}",
        f"micro_batch={micro_batch}",
        f"seq_len={args.seq_len}",
        f"steps={args.steps}",
        "nproc=2",
        "device=cpu",
        "logger=none",
        "save=off",  # a 1b checkpoint is ~13 GB per job; the plan is what is measured
        "log_every=1",
        "telemetry.memory_every=0",  # MemTracker on step 2 only
    ]


def run_point(point: list[str], job_dir: Path) -> dict[str, Any]:
    """Run one job; return the plan it wrote and the ranks' measurements."""
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
    records = [
        json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    measured = []
    for rank in range(plan["world_size"]):
        peaks = [
            r[f"memory/rank{rank}/peak_allocated_gib"]
            for r in records
            if f"memory/rank{rank}/peak_allocated_gib" in r
        ]
        if not peaks:
            raise RuntimeError(
                f"{' '.join(point)}: no memory/rank{rank}/peak_allocated_gib in {job_dir}/metrics.jsonl"
            )
        last = records[-1]
        states = {kind: last[f"memory/rank{rank}/{kind}_gib"] for kind in STATES}
        measured.append({"peak_gib": max(peaks), **states})
    return {"overrides": point, "plan": plan, "measured": measured, "seconds": time.perf_counter() - start}


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rank: predicted against measured peak and model states, errors in percent."""
    out = []
    for planned, measured in zip(result["plan"]["ranks"], result["measured"]):
        states_planned = sum(planned[f"{kind}_gib"] for kind in STATES)
        states_measured = sum(measured[kind] for kind in STATES)
        out.append(
            {
                "point": " ".join(o for o in result["overrides"][1:5]),
                "rank": planned["rank"],
                "predicted_gib": planned["peak_gib"],
                "measured_gib": measured["peak_gib"],
                "error_pct": 100 * (planned["peak_gib"] - measured["peak_gib"]) / measured["peak_gib"],
                "states_predicted_gib": states_planned,
                "states_measured_gib": states_measured,
                "states_error_pct": 100 * (states_planned - states_measured) / states_measured,
                "moment": planned["peak_moment"],
            }
        )
    return out


def markdown(all_rows: list[dict[str, Any]]) -> str:
    lines = [
        "| point | rank | predicted peak GiB | measured peak GiB | error | model states predicted / measured GiB | error | peak at |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in all_rows:
        lines.append(
            f"| {r['point']} | {r['rank']} | {r['predicted_gib']:.4f} | {r['measured_gib']:.4f} | {r['error_pct']:+.2f}% "
            f"| {r['states_predicted_gib']:.4f} / {r['states_measured_gib']:.4f} | {r['states_error_pct']:+.3f}% | {r['moment']} |"
        )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.jsonl"
    done: dict[tuple[str, ...], dict[str, Any]] = {}
    if results_path.exists() and not args.fresh:
        for line in results_path.read_text().splitlines():
            result = json.loads(line)
            done[tuple(result["overrides"])] = result
    grid = itertools.product(args.zero, args.precision, args.checkpointing, args.micro_batch)
    all_rows = []
    for zero, precision, checkpointing, micro_batch in grid:
        point = overrides(args, zero, precision, checkpointing, micro_batch)
        result = done.get(tuple(point))
        if result is None:
            result = run_point(
                point, args.out / "jobs" / f"{zero}-{precision}-{checkpointing}-mb{micro_batch}"
            )
            with results_path.open("a") as f:
                f.write(json.dumps(result) + "\n")
        for row in rows(result):
            all_rows.append(row)
            print(
                f"{row['point']:55s} rank {row['rank']}  predicted {row['predicted_gib']:.4f} GiB  measured "
                f"{row['measured_gib']:.4f} GiB  {row['error_pct']:+6.2f}%  states {row['states_error_pct']:+.3f}%  ({row['moment']})",
                flush=True,
            )
    print("\n" + markdown(all_rows))
    worst_peak = max(abs(r["error_pct"]) for r in all_rows)
    worst_states = max(abs(r["states_error_pct"]) for r in all_rows)
    print(
        f"\nworst peak error {worst_peak:.2f}% (tolerance {args.peak_tolerance_pct}%), worst model-state error {worst_states:.3f}% (tolerance {args.states_tolerance_pct}%)"
    )
    return int(worst_peak > args.peak_tolerance_pct or worst_states > args.states_tolerance_pct)


if __name__ == "__main__":
    sys.exit(main())
