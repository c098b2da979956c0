"""Tokens/s of `python -m trainer` with checkpointing none, op and full, side by side on 2 CPU ranks.

    python benchmarks/checkpointing_throughput.py [--rounds 3] [--steps 30] [--model mid]
                                                  [--stage stage0] [--micro-batch 4] [--seq-len 256]

A sibling of benchmarks/runner_vs_handwritten.py (same models, same alternation): the three arms
alternate round by round in an order that rotates, so that a shared machine's load hits them
alike, and the ratios of the medians to `none` are printed. Warm-up is excluded (the runner's
summary leaves out its first log window). In FLOPs, full reruns every block's forward but w2,
op only wk, wo and w3 (trainer/advise/predict.py), so op sits between full and none; torchtitan
measured +8% eager and +12% compiled for op over full on Llama-2-7B on 8 H100s
(pytorch/torchtitan#165). Eager, though, the policy is a Python TorchDispatchMode that sees every
op of every block in forward and again in the recompute; on small CPU models that costs more than
the matmuls it saves (docs/memory_plan.md has a run). With --compile the policy is applied once,
when the block is traced.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.runner_vs_handwritten import MODELS  # noqa: E402  (the same model shapes)

ARMS = ("none", "op", "full")


def tokens_per_s(checkpointing: str, args: argparse.Namespace) -> float:
    fields = [f"model.{key}={value}" for key, value in MODELS[args.model].items()]
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, "-m", "trainer", "device=cpu", "nproc=2", f"zero={args.stage}", "precision=fp32",
             "logger=none", "model=tiny", *fields, f"steps={args.steps}", f"micro_batch={args.micro_batch}",
             f"seq_len={args.seq_len}", "log_every=10", "save=off", f"checkpointing={checkpointing}",
             f"compile={str(args.compile).lower()}", f"hydra.run.dir={out}"],
            cwd=REPO, check=True, capture_output=True, text=True,
        )  # fmt: skip
        return json.loads((Path(out) / "summary.json").read_text())["throughput/tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", choices=sorted(MODELS), default="mid")
    parser.add_argument("--stage", default="stage0")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--compile", action="store_true", help="every arm with compile=true (inductor)")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
        for arm in order:
            runs[arm].append(tokens_per_s(arm, args))
            print(f"round {r + 1}: checkpointing={arm} {runs[arm][-1]:,.0f} tokens/s", flush=True)
    medians = {arm: statistics.median(values) for arm, values in runs.items()}
    print(
        f"\nmodel={args.model} zero={args.stage} micro_batch={args.micro_batch} seq_len={args.seq_len} "
        f"compile={str(args.compile).lower()}, {args.rounds} rounds, medians:"
    )
    print("| checkpointing | tokens/s (median) | runs | vs none | vs full |\n|---|---:|---|---:|---:|")
    for arm in ARMS:
        listed = ", ".join(f"{v:,.0f}" for v in runs[arm])
        print(
            f"| {arm} | {medians[arm]:,.0f} | {listed} | {medians[arm] / medians['none']:.3f} | "
            f"{medians[arm] / medians['full']:.3f} |"
        )


if __name__ == "__main__":
    main()
