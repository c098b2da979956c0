"""What telemetry costs: the same job with telemetry on and off, side by side in one run.

    python benchmarks/telemetry_overhead.py [--rounds 4] [--steps 200] [-- extra overrides]

on:  the defaults: per-rank memory (host RSS every log step, tensor-level tracking on the
     steps `telemetry.memory_every` chooses), MFU, and a W&B run (offline) that the job process
     feeds from metrics.jsonl while the ranks train.
off: telemetry.enabled=false logger=none: loss, lr, grad norm, throughput and loss scale only.

Both train the default job (tiny model, 2 CPU ranks) with the same seed. Rounds alternate the
order (on-off, off-on, ...) so that drift in the machine's speed hits both alike. Figures per job:
steady tokens/s as summary.json reports it (warm-up left out), tokens/s over every step (warm-up
and tracked steps included) from metrics.jsonl, and the CPU seconds of the whole job (ranks, job
process, W&B's service; start-up included). The overhead is 1 - on/off of the medians, and the
median of the rounds' paired ratios. Run it on a quiet machine: other load moves throughput by
more than the 2% this is meant to resolve (the off arm's spread is printed as a guide).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARMS = {
    "on": ("logger=wandb",),
    "off": ("telemetry.enabled=false", "logger=none"),
}


def run_job(arm: str, steps: int, extra: list[str]) -> dict[str, float]:
    """One job of one arm: its steady and all-steps tokens/s."""
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "trainer", "device=cpu", "nproc=2", f"steps={steps}", *ARMS[arm], *extra, f"hydra.run.dir={out}"]
        env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        summary = json.loads((Path(out) / "summary.json").read_text())
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"steady": summary["throughput/tokens_per_s"], "all_steps": all_steps_tokens_per_s(records), "cpu_s": cpu_s}


def all_steps_tokens_per_s(records: list[dict[str, float]]) -> float:
    """Total tokens over total training seconds, every window included."""
    tokens = seconds = 0.0
    previous = 0
    for record in records:
        window_s = record["time/step_s"] * (record["step"] - previous)
        tokens += record["throughput/tokens_per_s"] * window_s
        seconds += window_s
        previous = record["step"]
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("extra", nargs="*", help="overrides for both arms, e.g. model=125m")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for round_index in range(args.rounds):
        order = ("on", "off") if round_index % 2 == 0 else ("off", "on")
        for arm in order:
            results[arm].append(run_job(arm, args.steps, args.extra))
        on, off = results["on"][-1], results["off"][-1]
        print(f"round {round_index + 1}: steady on {on['steady']:,.0f} / off {off['steady']:,.0f} tok/s; "
              f"all steps on {on['all_steps']:,.0f} / off {off['all_steps']:,.0f} tok/s; "
              f"cpu on {on['cpu_s']:.1f} / off {off['cpu_s']:.1f} s", flush=True)  # fmt: skip
    report(results)


def report(results: dict[str, list[dict[str, float]]]) -> None:
    print("\n| figure | telemetry on | telemetry off | overhead of medians | median of paired overheads | off-arm spread |")
    print("|---|---|---|---|---|---|")
    for figure in ("steady", "all_steps", "cpu_s"):
        on = statistics.median(r[figure] for r in results["on"])
        off = statistics.median(r[figure] for r in results["off"])
        sign = -1 if figure == "cpu_s" else 1  # more CPU seconds is a cost, fewer tokens/s is a cost
        paired = statistics.median(sign * (1 - a[figure] / b[figure]) for a, b in zip(results["on"], results["off"]))
        spread = max(r[figure] for r in results["off"]) / min(r[figure] for r in results["off"]) - 1
        unit = "s" if figure == "cpu_s" else "tok/s"
        print(f"| {figure} ({unit}) | {on:,.1f} | {off:,.1f} | {100 * sign * (1 - on / off):+.2f}% | {100 * paired:+.2f}% | {100 * spread:.1f}% |")


if __name__ == "__main__":
    main()
