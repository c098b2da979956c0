"""What telemetry costs: the same job with telemetry on and off, side by side in one run.

    python benchmarks/telemetry_overhead.py [--rounds 16] [--steps 200] [--parts | --traces | --layer-norms]
                                            [--alternate] [extra overrides]

on:     the defaults: per-rank memory (host RSS every log step, tensor-level tracking on the
        steps `telemetry.memory_every` chooses), MFU, and a W&B run (offline) that the job
        process feeds from metrics.jsonl while the ranks train.
off:    telemetry.enabled=false logger=none: loss, lr, grad norm, throughput and loss scale only.
--parts adds each half of `on` alone: `ranks` (telemetry on, logger=none) and `wandb`
        (telemetry off, logger=wandb), to tell which half a cost comes from.
--traces compares tracing off (`on`, the defaults: no profiler is made) with `traced`: the same job with
        `telemetry.trace_steps=[steps/2]` on every rank (trainer/telemetry/traces.py), each rank profiling
        one step and writing its chrome trace; and measures a traced step's extra seconds.
--layer-norms compares `on` (the defaults: each layer's gradient and parameter norm every log step,
        trainer/telemetry/layer_norms.py) with `norms_off`: the same job with telemetry.layer_norms=false.

Every arm trains the default job (tiny model, CPU ranks) with the same seed. By default the
arms of a round run at the same time, each pinned to its own share of the cores with one rank
per core (on 2 cores: 1 rank each), and the shares swap from round to round: a shared machine's
load changes by several percent from minute to minute, and running the arms together makes
every arm see the same load. --alternate runs them one after another on every core instead
(the default job's 2 ranks on 2 cores), in an order that rotates; its rounds differ by more.
Figures per job: steady tokens/s as summary.json reports it (warm-up left out), tokens/s over
every step (warm-up and tracked steps included) from metrics.jsonl, and the CPU seconds of the
whole job (ranks, job process, W&B's service; start-up included).

The cost is the median over cycles (as many rounds as arms, so that every arm has had every
core share once) of each cycle's overhead (1 - the geometric mean of on/off), with a bootstrap
95% interval of that median: one round's noise on a shared 2-core machine is a few percent, more
than the 2% budget this is meant to resolve, and only the interval says whether the rounds run
were enough. The verdict line compares the interval with --budget-pct, and so does the exit
status: 0 within the budget, 1 over it, 3 undecided (the interval spans it: run more rounds).

Each part of the cost is then also measured on its own, where noise matters little: the memory
probe's per-window reset and read (in this process), the extra time of a tensor-tracked step (a
12-step job logging every step), and the CPU that W&B's processes use while a run logs one
record per log window (an offline run fed for 30 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
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
    "ranks": ("logger=none",),  # --parts: telemetry on, no W&B
    "wandb": ("telemetry.enabled=false", "logger=wandb"),  # --parts: W&B fed, telemetry off
    "traced": ("logger=wandb",),  # and which step and ranks it traces: start_job
    "norms_off": ("logger=wandb", "telemetry.layer_norms=false"),
}

OPTION_ARMS: dict[str | None, list[str]] = {
    None: ["on", "off"],
    "parts": ["off", "ranks", "wandb", "on"],
    "traces": ["on", "traced"],
    "layer_norms": ["on", "norms_off"],
}
"""The arms each option runs (none given: on against off)."""


def start_job(arm: str, steps: int, extra: list[str], cores: list[int]) -> tuple[subprocess.Popen, Path]:
    """Start one job of one arm on `cores` (its ranks, job process and W&B's service all stay on
    them), one rank per core; returns the process and its output directory."""
    out = Path(tempfile.mkdtemp(prefix=f"telemetry-{arm}-"))
    # save=off: a save's disk writes take a log window 20% longer, by an amount that varies with
    # the disk's other traffic; that noise is not telemetry's.
    # One step in the steady windows, on every rank of the job.
    ranks = ",".join(str(rank) for rank in range(len(cores)))
    traced = (
        [f"telemetry.trace_steps=[{steps // 2}]", f"telemetry.trace_ranks=[{ranks}]"]
        if arm == "traced"
        else []
    )
    args = [sys.executable, "-m", "trainer", "device=cpu", f"nproc={len(cores)}", f"steps={steps}", "save=off", *ARMS[arm],
            *traced, *extra, f"hydra.run.dir={out}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    with (out / "console.log").open("w") as log:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cores))  # fmt: skip
    return proc, out


def finish_job(proc: subprocess.Popen, out: Path) -> dict[str, float]:
    """Wait for a job: its steady and all-steps tokens/s, and the CPU seconds of it and all it started."""
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, even with another job running
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, proc.args))} exited {proc.returncode}:\n{(out / 'console.log').read_text()[-3000:]}"
        )
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out)
    return {"steady": summary["throughput/tokens_per_s"], "all_steps": all_steps_tokens_per_s(records),
            "cpu_s": usage.ru_utime + usage.ru_stime}  # fmt: skip


def run_round(arms: list[str], round_index: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One job per arm. Side by side: all at once, each on its own share of the cores (which share
    rotates from round to round), so that whatever else loads the machine loads every arm alike.
    --alternate: one after another on every core, in an order that rotates from round to round."""
    cores = sorted(os.sched_getaffinity(0))
    shift = round_index % len(arms)
    order = arms[shift:] + arms[:shift]
    if args.alternate:
        return {arm: finish_job(*start_job(arm, args.steps, args.extra, cores)) for arm in order}
    share = len(cores) // len(arms)
    if share == 0:
        raise SystemExit(
            f"side by side, {len(arms)} arms need at least {len(arms)} cores; this process has {len(cores)}: use --alternate"
        )
    started = {
        arm: start_job(arm, args.steps, args.extra, cores[i * share : (i + 1) * share])
        for i, arm in enumerate(order)
    }
    return {arm: finish_job(*job) for arm, job in started.items()}


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--parts", action="store_true", help="also run each half of `on` alone (arms ranks and wandb)"
    )
    parser.add_argument(
        "--traces",
        action="store_true",
        help="tracing off (arm on) against one traced step (arm traced) instead",
    )
    parser.add_argument(
        "--layer-norms",
        action="store_true",
        help="the defaults (arm on) against telemetry.layer_norms=false (arm norms_off) instead",
    )
    parser.add_argument(
        "--alternate", action="store_true", help="arms one after another on every core, not side by side"
    )
    parser.add_argument(
        "--budget-pct", type=float, default=2.0, help="the overhead the verdict compares against"
    )
    parser.add_argument("extra", nargs="*", help="overrides for every arm, e.g. model=125m")
    args = parser.parse_args()
    os.environ["WANDB_SILENT"] = "true"
    chosen = next((option for option in ("parts", "traces", "layer_norms") if getattr(args, option)), None)
    arms = OPTION_ARMS[chosen]
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for round_index in range(args.rounds):
        for arm, result in run_round(arms, round_index, args).items():
            results[arm].append(result)
        print(f"round {round_index + 1}: " + "; ".join(
            f"{arm} {results[arm][-1]['steady']:,.0f} tok/s, {results[arm][-1]['cpu_s']:.1f} cpu s" for arm in arms), flush=True)  # fmt: skip
    if args.traces:  # tracing's cost is one step's: no budget verdict, its ratio and that step's seconds
        report(results, args.budget_pct, baseline="on", subject="traced")
        report_traced_step(args.extra)
        return 0
    if args.layer_norms:  # the verdict: the per-layer norms' cost against the budget
        code = report(results, args.budget_pct, baseline="norms_off", subject="on")
        norms_s, window_s = layer_norms_cost_s(), 10 * tracked_step_extra_s(args.extra)[2]
        print(
            f"\nper-layer norms, per log window: {norms_s * 1e6:.0f} us, {100 * norms_s / window_s:.4f}% of a window"
        )
        return code
    code = report(results, args.budget_pct)
    report_components(args.extra)
    return code


def paired_overheads(
    on: list[dict[str, float]], off: list[dict[str, float]], figure: str, cycle: int
) -> list[float]:
    """Per cycle of rounds, the cost of `on` against `off` (fewer tokens/s, or more CPU seconds), as a fraction.

    A cycle is as many rounds as there are arms: in it every arm has had every core share (or
    place in the order) once, so the geometric mean of its rounds' ratios cancels what a core or
    a place costs by itself (seen here: the arm on core 0, started first, ran 1-2% slower, whichever it
    was). A last, incomplete cycle is left out.
    """
    sign = -1 if figure == "cpu_s" else 1
    ratios = [a[figure] / b[figure] for a, b in zip(on, off)]
    cycles = [ratios[i : i + cycle] for i in range(0, len(ratios) - cycle + 1, cycle)]
    return [sign * (1 - math.prod(c) ** (1 / cycle)) for c in cycles]


def bootstrap_interval(
    values: list[float], confidence: float = 0.95, draws: int = 10_000
) -> tuple[float, float]:
    """Percentile bootstrap interval of the median: how far the rounds' noise lets the median move."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    tail = (1 - confidence) / 2
    return medians[int(tail * draws)], medians[int((1 - tail) * draws) - 1]


def report(
    results: dict[str, list[dict[str, float]]], budget_pct: float, baseline: str = "off", subject: str = "on"
) -> int:
    """The table of every arm against `baseline`; returns verdict()'s exit status for `subject`."""
    cycle = len(results)
    print(
        f"\n| arm vs {baseline} | figure | median of arm | median of {baseline} | median overhead per cycle | 95% interval | {baseline}-arm spread |"
    )
    print("|---|---|---|---|---|---|---|")
    off = results[baseline]
    for arm in (a for a in results if a != baseline):
        for figure in ("steady", "all_steps", "cpu_s"):
            overheads = paired_overheads(results[arm], off, figure, cycle)
            low, high = bootstrap_interval(overheads)
            spread = max(r[figure] for r in off) / min(r[figure] for r in off) - 1
            unit = "s" if figure == "cpu_s" else "tok/s"
            print(f"| {arm} | {figure} ({unit}) | {statistics.median(r[figure] for r in results[arm]):,.1f} | "
                  f"{statistics.median(r[figure] for r in off):,.1f} | {100 * statistics.median(overheads):+.2f}% | "
                  f"{100 * low:+.2f}% .. {100 * high:+.2f}% | {100 * spread:.1f}% |")  # fmt: skip
    low, high = bootstrap_interval(paired_overheads(results[subject], off, "steady", cycle))
    code, text = verdict(low, high, budget_pct)
    print(f"\nsteady-throughput cost of {'telemetry' if subject == 'on' else subject}: {text}")
    return code


WITHIN, OVER, UNDECIDED = 0, 1, 3
"""Exit statuses: the interval below the budget, above it, or spanning it (not shown to hold)."""


def verdict(low: float, high: float, budget_pct: float) -> tuple[int, str]:
    """The pass rule: the 95% interval of the cost (fractions) against the budget (percent)."""
    if 100 * high <= budget_pct:
        return WITHIN, f"within the {budget_pct:g}% budget (the interval's top is {100 * high:+.2f}%)"
    if 100 * low > budget_pct:
        return OVER, f"OVER the {budget_pct:g}% budget (the interval's bottom is {100 * low:+.2f}%)"
    return UNDECIDED, f"undecided against the {budget_pct:g}% budget: the interval spans it; run more rounds"


def probe_cost_s() -> float:
    """Seconds one log window spends resetting and reading a rank's memory probe (CPU)."""
    import torch

    from trainer.telemetry.memory import MemoryProbe

    probe = MemoryProbe(torch.device("cpu"), memory_every=500, last_step=200)
    start = time.perf_counter()
    for _ in range(1000):
        probe.reset()
        probe.read()
    return (time.perf_counter() - start) / 1000


def comm_read_cost_s() -> float:
    """Seconds one log window spends reading the flight recorder (trainer/telemetry/comm.py) in the default job:
    a 1-rank gloo group in this process, the recorder sized as a rank sizes it, a window's collectives
    (the default job's DDP buckets and the loop's agreement, 10 steps) before each read."""
    import socket

    import torch
    import torch.distributed as dist

    from trainer.config import TrainConfig
    from trainer.telemetry.comm import CommProbe, enable_recording

    config = TrainConfig(log_every=10)  # the schema's job with conf/train.yaml's log_every
    enable_recording(config, 2, "cpu")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    grads, flags = torch.zeros(2**18), torch.zeros(4)
    probe, spent = CommProbe(torch.device("cpu"), memory_every=500, last_step=200), 0.0
    for _ in range(50):
        for _ in range(10):
            dist.all_reduce(grads)
            dist.all_reduce(flags)
        start = time.perf_counter()
        probe.read()
        spent += time.perf_counter() - start
    dist.destroy_process_group()
    return spent / 50


def tracked_step_extra_s(extra: list[str]) -> tuple[float, float, float]:
    """(extra seconds of the tensor-tracked step 2, extra seconds of the communication-profiled step 3,
    median seconds of a plain step) in a default-shaped job."""
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "trainer", "device=cpu", "nproc=2", "steps=12", "log_every=1", "logger=none",
                "telemetry.memory_every=0", *extra, f"hydra.run.dir={out}"]  # fmt: skip
        subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True)
        step_s = {
            r["step"]: r["time/step_s"]
            for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())
        }
    plain = statistics.median(t for step, t in step_s.items() if step > 3)
    return step_s[2] - plain, step_s[3] - plain, plain


def wandb_cpu_per_s(record_every_s: float, duration_s: float = 30.0) -> float:
    """CPU seconds per wall second that W&B's processes use while a run logs one record every `record_every_s`."""
    import psutil
    import wandb

    record = {
        "loss/train": 1.0,
        **{
            f"memory/rank{r}/{k}_gib": 0.5
            for r in range(2)
            for k in ("params", "grads", "optimizer", "peak_rss")
        },
    }
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


def report_traced_step(extra: list[str]) -> None:
    """The extra seconds of a traced step (both ranks profile it and export their trace inside its log window):
    the median of steps 6, 8 and 10 of a 12-step job against the median of its other steps after the
    third (the first three hold the warm-up, the tracked and the communication-profiled step), and the size
    of one step's traces."""
    traced = (6, 8, 10)
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "trainer", "device=cpu", "nproc=2", "steps=12", "log_every=1", "logger=none",
                "save=off", f"telemetry.trace_steps=[{','.join(map(str, traced))}]", "telemetry.trace_ranks=[0,1]",
                *extra, f"hydra.run.dir={out}"]  # fmt: skip
        subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True)
        step_s = {
            r["step"]: r["time/step_s"]
            for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())
        }
        trace_mib = sum(p.stat().st_size for p in (Path(out) / "traces").iterdir()) / 2**20 / len(traced)
    plain = statistics.median(t for step, t in step_s.items() if step > 3 and step not in traced)
    extra_s = statistics.median(step_s[step] for step in traced) - plain
    print(f"\n| traced step (steps 6, 8, 10 of 12, ranks 0 and 1) | {extra_s:+.3f} s on a {plain:.3f} s step | "
          f"{trace_mib:.1f} MiB of traces a step |")  # fmt: skip


def layer_norms_cost_s() -> float:
    """Seconds one log step spends on telemetry.layer_norms (trainer/telemetry/layer_norms.py) in the default
    job's model: the gradients' and parameters' squared sums per layer and the one all-reduce (a 1-rank gloo
    group in this process, the vector weighed as 2 DDP ranks weigh it)."""
    import socket

    import torch
    import torch.distributed as dist

    from trainer.config import TrainConfig
    from trainer.model.decoder import build_model, init_weights
    from trainer.telemetry.layer_norms import LayerNorms

    config = TrainConfig()
    model = build_model(config.model, device="cpu")
    init_weights(model, seed=0)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    norms = LayerNorms(config.model, world_size=2, pp=1, device=torch.device("cpu"))
    norms.world_size = 1  # the all-reduce over this process's group of one
    start = time.perf_counter()
    for _ in range(100):
        norms.fields(norms.reduce(norms.squares(model, grads=True), model))
    spent = (time.perf_counter() - start) / 100
    dist.destroy_process_group()
    return spent


def report_components(extra: list[str]) -> None:
    probe_s = probe_cost_s()
    extra_s, profiled_s, plain_s = tracked_step_extra_s(extra)
    window_s = 10 * plain_s  # the default log_every
    wandb_cores = wandb_cpu_per_s(record_every_s=window_s)
    cores = os.cpu_count() or 1
    print("\n| part | measured | share of training time |\n|---|---|---|")
    print(f"| memory probe, per log window | {probe_s * 1e6:.0f} us | {100 * probe_s / window_s:.4f}% |")
    comm_s = comm_read_cost_s()
    print(
        f"| flight-recorder read (communication bytes), per log window | {comm_s * 1e6:.0f} us | {100 * comm_s / window_s:.4f}% |"
    )
    norms_s = layer_norms_cost_s()
    print(
        f"| per-layer gradient and parameter norms (telemetry.layer_norms), per log window | {norms_s * 1e6:.0f} us | {100 * norms_s / window_s:.4f}% |"
    )
    print(f"| communication-profiled step (step 3, then every 500) | +{profiled_s:.3f} s on a {plain_s:.3f} s step | "
          f"{100 * profiled_s / (500 * plain_s):.2f}% per 500 steps; in the warm-up of runs under 503 steps |")  # fmt: skip
    print(f"| tensor-tracked step (default: step 2, then every 500) | +{extra_s:.3f} s on a {plain_s:.3f} s step | "
          f"{100 * extra_s / (500 * plain_s):.2f}% per 500 steps; in the warm-up of runs under 502 steps |")  # fmt: skip
    print(f"| W&B (job process + wandb-core), one record per {window_s:.2f} s | {wandb_cores:.4f} CPU s/s | "
          f"{100 * wandb_cores / cores:.2f}% of {cores} cores |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
