"""Throughput of `python -m trainer` against a minimal hand-written loop, side by side.

    python benchmarks/runner_vs_handwritten.py [--rounds 3] [--steps 60]

Both train the tiny model on 2 CPU ranks (DDP, fp32, the same shapes, AdamW, clipping). The
two alternate round by round so that the machine's noise hits both alike; the ratio of the
medians is printed. Warm-up steps are excluded from both (the runner's summary does it too).
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


def run_runner(steps: int, micro_batch: int, seq_len: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, "-m", "trainer", "device=cpu", "nproc=2", "zero=stage0", "precision=fp32",
             "logger=none", "model=tiny", f"steps={steps}", f"micro_batch={micro_batch}", f"seq_len={seq_len}",
             "log_every=10", "save=off", f"hydra.run.dir={out}"],  # the hand-written loop saves nothing
            cwd=REPO, check=True, capture_output=True, text=True,
        )
        return json.loads((Path(out) / "summary.json").read_text())["throughput/tokens_per_s"]


def run_handwritten(steps: int, micro_batch: int, seq_len: int) -> float:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-endpoint", "localhost:0",
         "--rdzv-backend", "c10d", str(REPO / "benchmarks" / "handwritten_loop.py"), "--steps", str(steps),
         "--warmup", str(max(1, steps // 10)), "--micro-batch", str(micro_batch), "--seq-len", str(seq_len)],
        cwd=REPO, check=True, capture_output=True, text=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    runner, handwritten = [], []
    for round_index in range(args.rounds):
        runner.append(run_runner(args.steps, args.micro_batch, args.seq_len))
        handwritten.append(run_handwritten(args.steps, args.micro_batch, args.seq_len))
        print(f"round {round_index + 1}: runner {runner[-1]:,.0f} tok/s, hand-written {handwritten[-1]:,.0f} tok/s", flush=True)
    ratio = statistics.median(runner) / statistics.median(handwritten)
    print(f"median: runner {statistics.median(runner):,.0f} tok/s, hand-written {statistics.median(handwritten):,.0f} tok/s")
    print(f"ratio runner / hand-written: {ratio:.3f}")


if __name__ == "__main__":
    main()
