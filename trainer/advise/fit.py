"""What fits a rank's memory, from the plan alone: the remedies printed after an out-of-memory failure,
and the micro-batch `micro_batch=auto` proposes.

Both judge a configuration as mode=advise does (advisor.py `evaluate`): the worst rank's planned peak
(on a GPU the allocator's reserved memory) must leave `advise.headroom` of each rank's memory free. On a
capped CPU rank that share is what the process itself adds after the cap (gloo's and the allocator's
memory, thread stacks, the tensor tracker's books): about 50 MiB for model=tiny, docs/faults.md.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any

from trainer.advise.advisor import CHOSEN_KEYS, choices, command_args, configure
from trainer.config import ConfigError, Mode, TrainConfig
from trainer.plan import build_plan, shard_groups
from trainer.rank.refusals import check_device_support
from trainer.units import GIB

AUTO_MAX = 32
"""micro_batch=auto considers 1..AUTO_MAX (divisors of the sequences per rank when global_batch is given)."""
MAX_REMEDIES = 3


@dataclass(frozen=True)
class Remedy:
    """A configuration the plan says fits: what changes, the command that runs it, its planned peak."""

    changes: str
    command: str
    peak_gib: float
    distance: int


def budget_bytes(config: TrainConfig, device_kind: str, world_size: int) -> int | None:
    """What a rank's planned peak may reach: its memory less advise.headroom (None: unknown)."""
    plan = build_plan(config, device_kind, world_size)
    limit = plan.memory.per_rank_bytes
    return None if limit is None else int(limit * (1 - config.advise.headroom))


def current_choice(config: TrainConfig) -> dict[str, Any]:
    """The job's own values of the advisor's keys."""
    return {
        "zero": config.zero.stage.value,
        "checkpointing": config.checkpointing.mode.value,
        "offload": config.offload.target.value,
        "zero.reduce_dtype": config.zero.reduce_dtype.value,
        "zero.reduce_every": config.zero.reduce_every.value,
        "zero.reshard_after_backward": config.zero.reshard_after_backward,
        "micro_batch": config.micro_batch,
        "grad_accum": config.grad_accum,
        "loss": config.loss.kind.value,
        "zero.shard_ranks": config.zero.shard_ranks,
        "zero.hpz_ranks": config.zero.hpz_ranks,
    }


def changed_keys(now: dict[str, Any], choice: dict[str, Any]) -> list[str]:
    """The advisor's keys a choice changes; at grad_accum 1 reduce_every changes nothing (the one
    backward reduces either way)."""
    keys = [key for key in CHOSEN_KEYS if choice.get(key) != now.get(key)]
    if choice["grad_accum"] == 1 and now["grad_accum"] == 1:
        keys = [key for key in keys if key not in ("zero.reduce_every", "zero.reshard_after_backward")]
    return keys


def distance(keys: list[str]) -> int:
    """Changes a user makes: the micro-batch split is one (the same global batch, cut differently)."""
    return len([key for key in keys if key != "grad_accum"]) + (
        1 if "grad_accum" in keys and "micro_batch" not in keys else 0
    )


def remedies(
    config: TrainConfig,
    device_kind: str,
    world_size: int,
    overrides: list[str],
    ran_out_bytes: int | None = None,
) -> list[Remedy]:
    """The advisor's candidates for this job's global batch that the plan says fit, nearest first
    (fewest changes, then the largest peak: the least memory given up), as runnable command lines.
    `ran_out_bytes`: the planned peak of what just ran out; a candidate planned at as much or more is
    no remedy, whatever the budget says."""
    sequences = config.sequences_per_step(world_size)
    space = dataclasses.replace(config, mode=Mode.advise, global_batch=sequences)
    budget = budget_bytes(config, device_kind, world_size)
    if budget is None:
        return []
    now, found = current_choice(config), []
    for choice in choices(space, world_size, device_kind):
        keys = changed_keys(now, choice)
        if not keys or not (peak := fitting_peak(config, choice, device_kind, world_size, budget)):
            continue
        if ran_out_bytes is not None and peak >= ran_out_bytes:
            continue
        args = [
            arg for arg in command_args(overrides, _Choice(choice)) if not arg.startswith("micro_batch=auto")
        ]
        changes = " ".join(f"{key}={_value(choice[key])}" for key in keys)
        found.append(
            Remedy(changes, shlex.join(["python", "-m", "trainer", *args]), peak / GIB, distance(keys))
        )
    found.sort(key=lambda r: (r.distance, -r.peak_gib))
    return found[:MAX_REMEDIES]


def fitting_peak(
    config: TrainConfig, choice: dict[str, Any], device_kind: str, world_size: int, budget: int
) -> int | None:
    """The planned peak of a choice when it fits the budget, else None (also where the schema or the
    device refuses the combination, as advisor.evaluate does)."""
    try:
        candidate = configure(config, choice)
        check_device_support(candidate.zero, device_kind)
        shard_groups(candidate.zero, world_size, world_size // config.nodes)
    except ConfigError:
        return None
    plan = build_plan(candidate, device_kind, world_size)
    reserved = plan.required_bytes(plan.worst)
    return plan.peak_bytes if reserved <= budget and plan.host_fits is not False else None


class _Choice:
    """The part of advisor.Candidate that command_args reads."""

    def __init__(self, choice: dict[str, Any]) -> None:
        self.choice = choice

    def overrides(self) -> list[str]:
        return [
            f"{key}={_value(self.choice[key])}"
            for key in CHOSEN_KEYS
            if self.choice.get(key) is not None
            and not (key == "zero.reshard_after_backward" and self.choice[key] is True)
        ]


def _value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# ----------------------------------------------------------------------------- micro_batch=auto


@dataclass(frozen=True)
class AutoProposal:
    """micro_batch=auto's plan: every candidate's planned peak, the largest that fits, its grad_accum."""

    peaks_gib: dict[int, float]
    budget_gib: float
    micro_batch: int | None  # None: not even the smallest fits
    grad_accum: int

    def fitting_below(self, micro_batch: int) -> list[int]:
        """The candidates that fit, largest first, below `micro_batch` (the probes' fallbacks)."""
        return sorted(
            (mb for mb, peak in self.peaks_gib.items() if mb < micro_batch and peak <= self.budget_gib),
            reverse=True,
        )

    def next_above(self, micro_batch: int) -> int | None:
        larger = [mb for mb in self.peaks_gib if mb > micro_batch]
        return min(larger) if larger else None


def auto_candidates(config: TrainConfig, world_size: int, global_batch: int | None) -> list[int]:
    """1..AUTO_MAX, or with global_batch the micro-batches that divide its sequences per rank."""
    if global_batch is None:
        return list(range(1, AUTO_MAX + 1))
    per_rank = global_batch // world_size
    return [mb for mb in range(1, per_rank + 1) if per_rank % mb == 0]


def grad_accum_for(micro_batch: int, config: TrainConfig, world_size: int) -> int:
    """grad_accum from global_batch where given, else the job's own."""
    if config.global_batch is None:
        return config.grad_accum
    return config.global_batch // (world_size * micro_batch)


def propose_micro_batch(config: TrainConfig, device_kind: str, world_size: int) -> AutoProposal:
    """Plan every candidate micro-batch and take the largest whose peak leaves advise.headroom free."""
    peaks: dict[int, float] = {}
    for mb in auto_candidates(config, world_size, config.global_batch):
        plan = build_plan(
            dataclasses.replace(
                config, micro_batch=mb, grad_accum=grad_accum_for(mb, config, world_size), global_batch=None
            ),
            device_kind,
            world_size,
        )
        peaks[mb] = plan.required_bytes(plan.worst) / GIB
    budget = budget_bytes(
        dataclasses.replace(config, micro_batch=1, global_batch=None), device_kind, world_size
    )
    if budget is None:
        raise ConfigError(
            "micro_batch=auto needs the rank's memory: set device_memory_gib or plan.accelerator"
        )
    fitting = [mb for mb, peak in peaks.items() if peak * GIB <= budget]
    chosen = max(fitting) if fitting else None
    accum = grad_accum_for(chosen or 1, config, world_size)
    return AutoProposal(peaks, budget / GIB, chosen, accum)
