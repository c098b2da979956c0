"""Steps/s before and after the non-finite agreement left the host (trainer/rank/nonfinite.py), side by side.

    python benchmarks/step_sync.py [--before /path/to/older/checkout] [--rounds 3] [--steps 60] [extra overrides]

Arms, each the same `python -m trainer` job (2 CPU ranks, the tiny model, fp32, no saves, W&B off):

  before      an older checkout (--before; e.g. a worktree of the commit before the change),
              whose ranks read the agreed flags with .tolist() every step;
  after       this checkout with its CPU defaults: the per-tensor AdamW, flags read every step
              (on CPU that read costs nothing: there is no device queue to drain);
  after-fused this checkout with optim.fused=true: the fused AdamW takes the skip on the device
              and the host reads the flags only at log steps.

The arms alternate within a round in an order that rotates from round to round, so that a
shared machine's load hits them alike; the ratio of the medians of steady-state steps/s (the
runner's summary leaves its warm-up out) is printed against `before`, with each arm's noise (its
fastest round over its slowest, less 1).

Pass rule: the change must not slow the step: every arm / before >= --min-ratio (default 0.95,
the few percent a ratio of two medians moves here between runs); exits 1 when one is below.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def steps_per_s(checkout: Path, steps: int, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "trainer", "device=cpu", "nproc=2", "model=tiny", "precision=fp32", "logger=none",
                "save=off", f"steps={steps}", "log_every=10", *extra, f"hydra.run.dir={out}"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(checkout), "WANDB_MODE": "disabled"}
        subprocess.run(args, cwd=checkout, env=env, check=True, capture_output=True, text=True)
        summary = json.loads((Path(out) / "summary.json").read_text())
        return 1.0 / summary["time/step_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of zerolab before the change")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--min-ratio", type=float, default=0.95, help="the pass rule's floor for arm / before"
    )
    args, extra = parser.parse_known_args()
    arms = {
        "before": lambda: steps_per_s(args.before, args.steps, extra),
        "after": lambda: steps_per_s(REPO, args.steps, extra),
        "after-fused": lambda: steps_per_s(REPO, args.steps, ["optim.fused=true", *extra]),
    }
    results: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for index in range(args.rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            results[name].append(arms[name]())
        print(
            f"round {index + 1}: " + ", ".join(f"{n} {v[-1]:.2f} steps/s" for n, v in results.items()),
            flush=True,
        )
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(", ".join(f"median {n} {m:.2f} steps/s" for n, m in medians.items()))
    print(", ".join(f"{n} noise {max(v) / min(v) - 1:.1%}" for n, v in results.items()))
    ratios = {n: medians[n] / medians["before"] for n in names[1:]}
    print(", ".join(f"{n} / before: {r:.3f}" for n, r in ratios.items()))
    failed = slower(ratios, args.min_ratio)
    for name in failed:
        print(f"MISS {name} / before {ratios[name]:.3f} < {args.min_ratio:g}")
    return 1 if failed else 0


def slower(ratios: dict[str, float], min_ratio: float) -> list[str]:
    """The pass rule: the arms whose steps/s over `before`'s is below min_ratio."""
    return [name for name, ratio in ratios.items() if ratio < min_ratio]


if __name__ == "__main__":
    sys.exit(main())
