"""micro_batch=auto, in the job process: the plan proposes the largest micro-batch that fits
(trainer/advise/fit.py), short probe runs of every rank confirm it and check the next one, and the
job trains with what was confirmed.

A probe is a real launch of the job's ranks into `auto/micro_batch_<n>/` of the job's directory, for as
many steps as the job's memory takes to settle (PROBE_STEPS: Adam's state exists from the second step,
which the tensor tracker measures; the third is the communication profiler's), with an evaluation and
a save at its end where the job has them (their checkpoint then deleted). Its ranks agree the way every job's ranks do: a rank
that runs out ends the probe through the elastic launcher, which stops the others, so no rank waits
in a collective for one that died (Composer's in-process halving deadlocked on exactly that:
mosaicml/composer#2117). At most MAX_PROBES probes: the proposal, smaller ones the plan says fit
while a probe fails, then the next larger one where probes are left (expected to run out).

Why no all-reduced OOM flag: a flag reduced after each probe step needs every rank to survive its
own OOM and reach that collective, and a rank that runs out inside one (a gradient all-reduce, an
all-gather) never does: its peers would wait there. Here no rank goes on after an OOM; the launcher
sees every rank's exit and its verdict is the probe's, the one place all ranks' outcomes meet. A
peer blocked in a collective leaves it when the dead rank's connection breaks (gloo: "Connection
reset by peer"; NCCL: the watchdog's timeout), or at the launcher's SIGTERM then SIGKILL
(tests/integration/test_oom_triage.py: one rank runs out in a probe, the other does not).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from trainer.advise.fit import AutoProposal, grad_accum_for, propose_micro_batch
from trainer.config import ConfigError, HfExport, Mode, TrainConfig, to_plain
from trainer.console import warn
from trainer.files import SAVES_DIR
from trainer.jsonl import read_jsonl
from trainer.telemetry import keys

MAX_PROBES = 4
PROBE_STEPS = 3
"""The tracked step (2, trainer/telemetry/memory.py) and the profiled one (3, trainer/telemetry/comm.py)."""


def check_auto(config: TrainConfig, world_size: int) -> None:
    """What micro_batch=auto needs before anything is planned (one line naming the key, exit 2)."""
    if config.nodes > 1:
        raise ConfigError("micro_batch=auto probes on one node: set micro_batch=N with nodes > 1")
    if config.global_batch is not None and config.global_batch % world_size:
        raise ConfigError(
            f"global_batch ({config.global_batch}) must be divisible by the {world_size} ranks with micro_batch=auto"
        )


def choose_micro_batch(
    config: TrainConfig, out_dir: Path, device_kind: str, nproc: int, world_size: int
) -> tuple[TrainConfig, dict[str, Any]]:
    """The config with micro_batch (and grad_accum) chosen, and the record of how: probed in a job
    that trains, the plan's proposal alone in mode=plan."""
    check_auto(config, world_size)
    proposal = propose_micro_batch(config, device_kind, world_size)
    if proposal.micro_batch is None:
        raise ConfigError(
            f"micro_batch=auto: not even micro_batch=1 fits ({proposal.peaks_gib[min(proposal.peaks_gib)]:.3f} GiB "
            f"planned, {proposal.budget_gib:.3f} GiB allowed less advise.headroom): see mode=plan's way out"
        )
    record: dict[str, Any] = {
        "proposed": proposal.micro_batch,
        "global_batch": config.global_batch,
        "budget_gib": proposal.budget_gib,
        "planned_peak_gib": {str(mb): peak for mb, peak in proposal.peaks_gib.items()},
        "tried": [],
    }
    chosen = proposal.micro_batch
    if config.mode == Mode.train:
        chosen = probe_all(config, proposal, out_dir, device_kind, nproc, world_size, record["tried"])
    accum = grad_accum_for(chosen, config, world_size)
    record.update(chosen=chosen, grad_accum=accum)
    print(f"micro_batch=auto: {summary_line(record)}", flush=True)
    chosen_config = dataclasses.replace(config, micro_batch=chosen, grad_accum=accum, global_batch=None)
    if config.global_batch is None:
        warn(memory_batch_line(chosen_config, world_size))
    return chosen_config, record


def memory_batch_line(config: TrainConfig, world_size: int) -> str:
    """What micro_batch=auto without global_batch changed: the global batch, which then follows the
    rank's memory (another device or cap trains another batch size)."""
    sequences = config.sequences_per_step(world_size)
    return (
        f"micro_batch=auto without global_batch: the global batch follows memory: micro_batch={config.micro_batch} "
        f"x grad_accum={config.grad_accum} x {config.parallel.dp(world_size)} data-parallel ranks = {sequences} "
        f"sequences per step; global_batch={sequences} keeps it on other devices"
    )


def probe_all(
    config: TrainConfig,
    proposal: AutoProposal,
    out_dir: Path,
    device_kind: str,
    nproc: int,
    world_size: int,
    tried: list[dict[str, Any]],
) -> int:
    """Probe the proposal, then smaller fitting ones until one runs; then the next larger one."""
    assert proposal.micro_batch is not None
    chosen = None
    for mb in [proposal.micro_batch, *proposal.fitting_below(proposal.micro_batch)][:MAX_PROBES]:
        tried.append(probe(config, proposal, mb, out_dir, device_kind, nproc, world_size))
        if tried[-1]["status"] == "ok":
            chosen = mb
            break
    if chosen is None:
        raise ConfigError(
            "micro_batch=auto: no probe ran ("
            + ", ".join(f"micro_batch={t['micro_batch']}: {t['status']}" for t in tried)
            + "); set micro_batch=N, or give each rank more memory"
        )
    above = proposal.next_above(chosen)
    if above is not None and len(tried) < MAX_PROBES and all(t["micro_batch"] != above for t in tried):
        tried.append(probe(config, proposal, above, out_dir, device_kind, nproc, world_size))
    return chosen


def probe(
    config: TrainConfig,
    proposal: AutoProposal,
    micro_batch: int,
    out_dir: Path,
    device_kind: str,
    nproc: int,
    world_size: int,
) -> dict[str, Any]:
    """One probe run: every rank trains PROBE_STEPS steps at `micro_batch`, then evaluates and saves where
    the job does; its status and measured peak."""
    from trainer.launch import RankFailure, launch_local

    steps = min(PROBE_STEPS, config.steps)
    probe_config = dataclasses.replace(
        config,
        micro_batch=micro_batch,
        grad_accum=grad_accum_for(micro_batch, config, world_size),
        global_batch=None,
        steps=steps,
        log_every=1,
        resume="false",
        max_restarts=0,
        save=dataclasses.replace(config.save, every=steps if config.save.every else 0, hf=HfExport.none),
        eval=dataclasses.replace(config.eval, every=steps if config.eval.every else 0),
    )
    probe_dir = out_dir / "auto" / f"micro_batch_{micro_batch}"
    probe_dir.mkdir(parents=True, exist_ok=True)
    try:
        launch_local(to_plain(probe_config), probe_dir, device_kind, nproc, 0, {})
        status, error = "ok", None
    except RankFailure as failure:
        status, error = ("oom" if failure.oom else "crashed"), str(failure)
    shutil.rmtree(probe_dir / SAVES_DIR, ignore_errors=True)  # saved for its memory, not to resume from
    metrics = probe_dir / "metrics.jsonl"
    peaks = (
        [r[keys.MAX_RANK_PEAK] for r in read_jsonl(metrics) if keys.MAX_RANK_PEAK in r]
        if metrics.exists()
        else []
    )
    result = {
        "micro_batch": micro_batch,
        "status": status,
        "planned_peak_gib": proposal.peaks_gib[micro_batch],
        "measured_peak_gib": max(peaks) if peaks else None,
        "dir": str(probe_dir),
    }
    if error is not None:
        result["error"] = error
    print(f"micro_batch=auto: probe micro_batch={micro_batch}: {probe_text(result)}", flush=True)
    return result


def probe_text(result: dict[str, Any]) -> str:
    measured = result["measured_peak_gib"]
    peak = f", measured peak {measured:.4f} GiB" if measured is not None else ""
    return f"{result['status']} (planned {result['planned_peak_gib']:.4f} GiB{peak})"


def summary_line(record: dict[str, Any]) -> str:
    """The choice in one line: proposed, each probe, chosen."""
    probes = "; ".join(f"{t['micro_batch']}: {probe_text(t)}" for t in record["tried"]) or "none (mode=plan)"
    return (
        f"chose micro_batch={record['chosen']} grad_accum={record['grad_accum']} (the plan proposed "
        f"{record['proposed']} of 1..{max(int(mb) for mb in record['planned_peak_gib'])} within "
        f"{record['budget_gib']:.4f} GiB; probes: {probes})"
    )
