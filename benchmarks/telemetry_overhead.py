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

Because a busy machine can hide a 2% effect, each part of the cost is then also measured on its
own, where noise matters little: the memory probe's per-window reset and read (in this process),
the extra time of a tensor-tracked step (a 12-step job logging every step), and the CPU that W&B's
processes use while a run logs one record per log window (an offline run fed for 30 s).
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
import time
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
    report_components(args.extra)


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


def probe_cost_s() -> float:
    """Seconds one log window spends resetting and reading a rank's memory probe (CPU)."""
    import torch

    from trainer.memory import MemoryProbe

    probe = MemoryProbe(torch.device("cpu"), memory_every=500, last_step=200)
    start = time.perf_counter()
    for _ in range(1000):
        probe.reset()
        probe.read()
    return (time.perf_counter() - start) / 1000


def tracked_step_extra_s(extra: list[str]) -> tuple[float, float]:
    """(extra seconds of the tensor-tracked step 2, median seconds of a plain step) in a default-shaped job."""
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "trainer", "device=cpu", "nproc=2", "steps=12", "log_every=1", "logger=none",
                "telemetry.memory_every=0", *extra, f"hydra.run.dir={out}"]  # fmt: skip
        subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True)
        step_s = {r["step"]: r["time/step_s"] for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())}
    plain = statistics.median(t for step, t in step_s.items() if step > 2)
    return step_s[2] - plain, plain


def wandb_cpu_per_s(record_every_s: float, duration_s: float = 30.0) -> float:
    """CPU seconds per wall second that W&B's processes use while a run logs one record every `record_every_s`."""
    import psutil
    import wandb

    record = {"loss/train": 1.0, **{f"memory/rank{r}/{k}_gib": 0.5 for r in range(2) for k in ("params", "grads", "optimizer", "peak_rss")}}
    me = psutil.Process()
    with tempfile.TemporaryDirectory() as out, wandb.init(project="overhead", dir=out, mode="offline") as run:
        helpers = me.children(recursive=True)  # wandb-core and its system monitor
        processes = [me, *helpers]
        before = sum(sum(p.cpu_times()[:2]) for p in processes)
        start, step = time.perf_counter(), 0
        while time.perf_counter() - start < duration_s:
            step += 1
            run.log(record, step=step, commit=True)
            time.sleep(record_every_s)
        used = sum(sum(p.cpu_times()[:2]) for p in processes) - before
    return used / duration_s


def report_components(extra: list[str]) -> None:
    probe_s = probe_cost_s()
    extra_s, plain_s = tracked_step_extra_s(extra)
    window_s = 10 * plain_s  # the default log_every
    wandb_cores = wandb_cpu_per_s(record_every_s=window_s)
    cores = os.cpu_count() or 1
    print("\n| part | measured | share of training time |\n|---|---|---|")
    print(f"| memory probe, per log window | {probe_s * 1e6:.0f} us | {100 * probe_s / window_s:.4f}% |")
    print(f"| tensor-tracked step (default: step 2, then every 500) | +{extra_s:.3f} s on a {plain_s:.3f} s step | "
          f"{100 * extra_s / (500 * plain_s):.2f}% per 500 steps; in the warm-up of runs under 502 steps |")  # fmt: skip
    print(f"| W&B (job process + wandb-core), one record per {window_s:.2f} s | {wandb_cores:.4f} CPU s/s | "
          f"{100 * wandb_cores / cores:.2f}% of {cores} cores |")  # fmt: skip


if __name__ == "__main__":
    main()
