"""How well the advisor ranks configurations: its prediction against a grid of real 2-rank CPU jobs.

The advisor itself runs the grid: `python -m trainer mode=advise ... advise.verify=<every point>`
restricts its candidates to the grid (advise.stages, advise.checkpointing, advise.micro_batches),
predicts each point from this host's calibration, then runs every point as a real job through
the runner, one after another. This script reads its advice.json and prints both rankings,
Spearman's rank correlation of predicted against measured tokens/s, and how far the top pick is
from the fastest measured point.

    .venv/bin/python checks/advisor_accuracy.py              # 16 points, ~15 minutes on 2 quiet cores
    .venv/bin/python checks/advisor_accuracy.py --zero stage0 stage2 stage3 --steps 8   # 12 points

Grid (defaults): a ~10M-parameter decoder (dim 384, 6 layers, ffn 1024, vocab 512) at seq_len 128,
global_batch 8 on 2 ranks, zero stage0-3 x checkpointing none, full x micro_batch 1, 4 (grad_accum
4, 1). Pass rule (verdict()): at least MIN_POINTS points, every one measured, Spearman >= 0.8, the
top pick within 10% of the fastest, and every point's predicted worst-rank peak within
--peak-tolerance-pct (2%, docs/advisor.md's agreement) of the measured one; exit 1 otherwise, 2
for a grid too small to be judged. Timings are only as good as the machine is quiet: run it with
nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIN_POINTS = 12  # fewer ranks make Spearman's rho too coarse to tell a good ranking from luck
MODEL_10M = [
    "model.name=m10",
    "model.dim=384",
    "model.n_layers=6",
    "model.n_heads=6",
    "model.n_kv_heads=6",
    "model.ffn_dim=1024",
    "model.vocab_size=512",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--zero", nargs="+", default=["stage0", "stage1", "stage2", "stage3"])
    parser.add_argument("--checkpointing", nargs="+", default=["none", "full"])
    parser.add_argument("--micro-batch", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps of each measured job")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "checks" / "advisor_accuracy")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="advise.cache_dir (this host's calibration); default: the schema's",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the jobs' directories (default: advice.json only)"
    )
    parser.add_argument("--peak-tolerance-pct", type=float, default=2.0)
    return parser.parse_args()


def advise_command(args: argparse.Namespace, points: int) -> list[str]:
    listed = lambda values: "[" + ",".join(str(v) for v in values) + "]"  # noqa: E731
    return [
        sys.executable,
        "-m",
        "trainer",
        "mode=advise",
        *MODEL_10M,
        f"seq_len={args.seq_len}",
        f"global_batch={args.global_batch}",
        "nproc=2",
        "device=cpu",
        "logger=none",
        f"advise.stages={listed(args.zero)}",
        f"advise.checkpointing={listed(args.checkpointing)}",
        "advise.offload=[none]",
        "advise.reduce_dtypes=[fp32]",
        f"advise.micro_batches={listed(args.micro_batch)}",
        f"advise.verify={points}",
        f"advise.verify_steps={args.steps}",
        f"advise.top={points}",
        f"hydra.run.dir={args.out}",
        *([f"advise.cache_dir={args.cache_dir.expanduser()}"] if args.cache_dir else []),
    ]


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank (scipy is not a dependency here)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks."""
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def table(rows: list[dict[str, Any]]) -> str:
    measured_rank = ranks([-r["measured_tokens_per_s"] for r in rows])
    lines = [
        "| predicted rank | configuration | predicted tokens/s | measured tokens/s | measured rank | predicted peak GiB | measured peak GiB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for i, (row, rank) in enumerate(zip(rows, measured_rank), 1):
        lines.append(
            f"| {i} | {row['configuration']} | {row['predicted_tokens_per_s']:,.0f} | {row['measured_tokens_per_s']:,.0f} | {rank:g} "
            f"| {row['predicted_peak_gib']:.3f} | {row['measured_peak_gib']:.3f} |"
        )
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]], points: int, peak_tolerance_pct: float) -> list[str]:
    """The pass rule: one line per way the measured grid misses it; empty when it passes."""
    out = []
    if len(rows) < max(points, MIN_POINTS):
        out.append(f"{len(rows)} of {points} points measured (needs all, and at least {MIN_POINTS})")
    if len(rows) >= 2:
        rho = spearman(
            [r["predicted_tokens_per_s"] for r in rows], [r["measured_tokens_per_s"] for r in rows]
        )
        if rho < 0.8:
            out.append(f"Spearman {rho:.3f} < 0.8")
    if rows:
        top = rows[0]["measured_tokens_per_s"] / max(r["measured_tokens_per_s"] for r in rows)
        if top < 0.9:
            out.append(f"top pick at {top:.1%} of the fastest (< 90%)")
    for row in rows:
        error = 100 * (row["predicted_peak_gib"] - row["measured_peak_gib"]) / row["measured_peak_gib"]
        if abs(error) > peak_tolerance_pct:
            out.append(
                f"{row['configuration']}: predicted peak {error:+.1f}% off (tolerance {peak_tolerance_pct:g}%)"
            )
    return out


def main() -> int:
    args = parse_args()
    points = len(args.zero) * len(args.checkpointing) * len(args.micro_batch)
    if points < MIN_POINTS:
        print(
            f"error: a grid of {points} points cannot be judged; it needs at least {MIN_POINTS}",
            file=sys.stderr,
        )
        return 2
    shutil.rmtree(args.out, ignore_errors=True)
    start = time.monotonic()
    subprocess.run(advise_command(args, points), cwd=REPO, check=True)
    minutes = (time.monotonic() - start) / 60
    advice = json.loads((args.out / "advice.json").read_text())
    rows = [r for r in advice["verify"] if r["measured_tokens_per_s"] is not None]
    if not args.keep:
        shutil.rmtree(args.out / "verify", ignore_errors=True)
    rho = spearman([r["predicted_tokens_per_s"] for r in rows], [r["measured_tokens_per_s"] for r in rows])
    fastest = max(r["measured_tokens_per_s"] for r in rows)
    top = rows[0]["measured_tokens_per_s"] / fastest
    print(f"\n{table(rows)}\n")
    print(f"rates: {advice['rates']['source']}")
    print(
        f"{len(rows)} of {points} points measured in {minutes:.1f} min; Spearman {rho:.3f} (>= 0.8); top pick at {top:.1%} of the fastest (>= 90%)"
    )
    failed = verdict(rows, points, args.peak_tolerance_pct)
    for line in failed:
        print(f"MISS {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
