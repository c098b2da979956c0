"""The pipeline's plan against what its stages hold: the three schedules in four precisions on 2 CPU ranks.

Each point is one `python -m trainer` job of the tiny model on 2 CPU ranks, parallel.pp=2 (a stage per rank),
grad_accum=4 micro-batches of 2 x 64 tokens, zero.reduce_every=step, 2 steps, for every schedule (gpipe, 1f1b,
interleaved_1f1b) at fp32 and bf16 and zero=stage0 (DDP's autocast under bf16) and stage3 (FSDP2's mixed
precision). The rows are plan_accuracy.py's: each rank's peak, plan against MemTracker's measurement of step 2,
and its model states to the byte, here held to 0.5%.

    .venv/bin/python checks/pipeline_plan.py      # docs/memory_plan.md, "Pipeline parallelism": 12 jobs, ~1 min
    .venv/bin/python checks/pipeline_plan.py --tp 2   # "Tensor-parallel stages": the same 12 on 4 ranks, tp=2

Exits 1 when a rank misses, 2 on a job that failed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from checks.plan_accuracy import markdown, misses, rows, run_point  # noqa: E402  (its rows and pass rule)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
REGIMES = (("fp32", "stage0"), ("bf16", "stage0"), ("bf16", "stage3"), ("fp32", "stage3"))
JOB = ("model=tiny", "seq_len=64", "micro_batch=2", "nproc=2", "parallel.pp=2", "grad_accum=4",
       "zero.reduce_every=step", "device=cpu", "logger=none", "save=off", "log_every=1",
       "telemetry.memory_every=0")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "checks" / "pipeline_plan")
    parser.add_argument("--peak-tolerance-pct", type=float, default=0.5)
    parser.add_argument("--tp", type=int, default=1, help="parallel.tp of each stage (nproc = 2 x tp)")
    args = parser.parse_args(argv)
    job = [o for o in JOB if not o.startswith("nproc=")] + [f"nproc={2 * args.tp}", f"parallel.tp={args.tp}"]
    all_rows = []
    for schedule, (precision, zero) in itertools.product(SCHEDULES, REGIMES):
        name = f"{schedule} {precision} {zero}"
        command = [*job, f"parallel.pp_schedule={schedule}", f"precision={precision}", f"zero={zero}"]
        try:
            result = run_point([*command, f"steps={args.steps}"], args.out / name.replace(" ", "-"))
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        for row in rows(result, name):
            all_rows.append(row)
            print(f"{name:32s} rank {row['rank']}  {row['error_pct']:+6.2f}%  ({row['moment']})", flush=True)
    print("\n" + markdown(all_rows))
    failed = misses(all_rows, args.peak_tolerance_pct)
    print(f"\nworst peak error {max(abs(r['error_pct']) for r in all_rows):.2f}%")
    for line in failed:
        print(f"MISS {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
