"""The memory plan: what each rank will hold, and when, known before any rank starts.

The plan walks one optimizer step as a list of moments (the last block's forward, the loss,
the output head's backward, the start, end and reduce-scatter of each block's backward, the
optimizer step), adds up the tensors alive at each, and calls the largest the peak. Every
figure is exact arithmetic on the parameter shapes of the model built on the meta device;
nothing is allocated. benchmarks/plan_accuracy.py checks it against real runs.

The planner is four modules; each one's docstring is its part of the design note:

- trainer/plan_states.py: model states per rank, the ZeRO arithmetic as PyTorch keeps it
  (FSDP2's padded shards, ZeroRedundancyOptimizer's greedy split), from the model's shapes;
- trainer/plan_step.py: the walk of one step, activations and temporaries moment by moment
  (DDP and FSDP2, every precision, checkpointing, accumulation, CPU offload);
- trainer/plan.py (this module): the plan of a job, every rank's moments and its peak, the
  memory a rank may use, the refusal and its way out, what plan.json and summary.json carry;
- trainer/plan_table.py: what the user reads, the console report and a sweep's fit table.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from trainer.config import CheckpointMode, OffloadTarget, Stage, TrainConfig
from trainer.devices import find_accelerator
from trainer.plan_comm import CommPlan, plan_comm
from trainer.plan_headroom import HEADROOM
from trainer.plan_states import RankStates, model_shape, rank_states
from trainer.plan_step import Moment, StepContext, activations, ddp_moments, fsdp_moments, other_bytes, precisions

GIB = 2**30


COMPILE_NOTE = (
    "compile=true: the plan is of the eager step; inductor fuses pointwise ops and chooses what to save "
    "for backward itself, which changes activations and temporaries in ways the plan does not model"
)


# ----------------------------------------------------------------------------- the plan of a job


@dataclass(frozen=True)
class RankPlan:
    rank: int
    states: RankStates
    activations: int
    moments: tuple[Moment, ...]
    offloaded: int  # model states kept in host memory instead (offload=cpu on a GPU)

    @property
    def peak(self) -> Moment:
        return max(self.moments, key=lambda moment: moment.total)

    def figures(self) -> dict[str, float]:
        """GiB figures of the plan.json row: model states at rest, activations at the end of
        forward, and the temporaries and other tensors at the peak."""
        peak = self.peak
        return {
            "params_gib": self.states.params / GIB,
            "grads_gib": self.states.grads / GIB,
            "optimizer_gib": self.states.optimizer / GIB,
            "activations_gib": self.activations / GIB,
            "temporary_gib": peak.parts["temporary"] / GIB,
            "other_gib": peak.parts["other"] / GIB,
            "peak_gib": peak.total / GIB,
            "offloaded_gib": self.offloaded / GIB,
        }


@dataclass(frozen=True)
class DeviceMemory:
    """What each rank may use, and where the figure comes from (None: unknown)."""

    per_rank_bytes: int | None
    source: str


def device_memory(config: TrainConfig, device_kind: str, world_size: int) -> DeviceMemory:
    """The cap (device_memory_gib), else a named accelerator, else this host's GPU or memory."""
    if config.device_memory_gib is not None:
        return DeviceMemory(int(config.device_memory_gib * GIB), f"device_memory_gib={config.device_memory_gib:g}")
    accelerator = config.plan.accelerator
    if accelerator is not None:
        spec = find_accelerator(accelerator)
        assert spec is not None  # PlanConfig checked the name
        return allocator_share(spec.memory_mib * 2**20, spec.short, world_size)
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            return DeviceMemory(None, "no GPU visible here")
        return allocator_share(torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0), world_size)
    # CPU ranks share this host's memory, so each gets an equal part of what is free now;
    # under torchrun only this host's ranks (LOCAL_WORLD_SIZE) share it.
    available = psutil.virtual_memory().available
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size // config.nodes)))  # this host's share
    return DeviceMemory(available // ranks_here, f"this host, {available / GIB:.1f} GiB available / {ranks_here} ranks")


def allocator_share(total: int, name: str, world_size: int) -> DeviceMemory:
    """What the caching allocator of a GPU rank may reserve: the device less the CUDA context and
    NCCL's buffers (trainer/plan_headroom.py). A `device_memory_gib` cap needs no such deduction:
    it caps the allocator's reserved memory itself."""
    outside = HEADROOM.outside_allocator(world_size)
    return DeviceMemory(total - outside, f"{name}, {total / GIB:.1f} GiB less {outside / GIB:.2g} GiB CUDA context and NCCL")


@dataclass(frozen=True)
class Plan:
    """The memory plan of one job: every rank's moments and whether the worst one fits."""

    config: TrainConfig
    device_kind: str
    world_size: int
    num_params: int
    ranks: tuple[RankPlan, ...]
    memory: DeviceMemory
    comm: CommPlan  # bytes each rank's collectives move per optimizer step (trainer/plan_comm.py)

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda rank: rank.peak.total)

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak.total

    def required_bytes(self, rank: RankPlan) -> int:
        """What must fit: on a GPU the allocator's reserved memory (tensor peak, fragmentation,
        cuBLAS workspace; trainer/plan_headroom.py), on CPU the tensor peak."""
        return HEADROOM.reserved(rank.peak.total) if self.device_kind == "cuda" else rank.peak.total

    def rank_fits(self, rank: RankPlan) -> bool | None:
        if self.memory.per_rank_bytes is None:
            return None
        return self.required_bytes(rank) <= self.memory.per_rank_bytes

    @property
    def fits(self) -> bool | None:
        return self.rank_fits(self.worst)

    def reserved_fields(self) -> dict[str, Any]:
        """GPU plans: the predicted reserved peak and the headroom assumptions behind it."""
        if self.device_kind != "cuda":
            return {}
        return {"predicted_reserved_gib": self.required_bytes(self.worst) / GIB, "headroom": dataclasses.asdict(HEADROOM)}

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "model": c.model.name,
            "num_params": self.num_params,
            "world_size": self.world_size,
            "device": self.device_kind,
            "zero": c.zero.stage.value,
            "precision": c.precision.name,
            "checkpointing": c.checkpointing.mode.value,
            "offload": c.offload.target.value,
            "micro_batch": c.micro_batch,
            "seq_len": c.seq_len,
            "grad_accum": c.grad_accum,
            "device_memory_gib": None if self.memory.per_rank_bytes is None else self.memory.per_rank_bytes / GIB,
            "device_memory_source": self.memory.source,
            "peak_gib": self.peak_bytes / GIB,
            **self.reserved_fields(),
            **({"compile": COMPILE_NOTE} if c.compile else {}),
            "peak_rank": self.worst.rank,
            "peak_moment": self.worst.peak.name,
            "fits": self.fits,
            "ranks": [
                {
                    "rank": r.rank,
                    **r.figures(),
                    "fits": self.rank_fits(r),
                    "peak_moment": r.peak.name,
                    "moments_gib": {m.name: m.total / GIB for m in r.moments},
                }
                for r in self.ranks
            ],
            "comm": self.comm.to_json(),
        }


def build_plan(config: TrainConfig, device_kind: str, world_size: int) -> Plan:
    """Plan every rank of a job; shapes come from the model built on meta, nothing is allocated."""
    shape = model_shape(config.model)
    acts, prec = activations(config, device_kind), precisions(config)
    offload = config.offload.target == OffloadTarget.cpu and device_kind == "cuda"
    ranks, planned = [], {}
    for rank, states in enumerate(rank_states(shape, config.zero.stage, world_size)):
        if states not in planned:  # most ranks hold equal shards: plan each distinct one once
            ctx = StepContext(config, shape, states, acts, prec, world_size, device_kind, other_bytes(config, states))
            planned[states] = tuple(fsdp_moments(ctx) if config.zero.uses_fsdp else ddp_moments(ctx))
        offloaded = states.params + states.grads + states.optimizer if offload else 0
        ranks.append(RankPlan(rank, states, acts.total, planned[states], offloaded))
    memory = device_memory(config, device_kind, world_size)
    comm = plan_comm(config, world_size, backend="nccl" if device_kind == "cuda" else "gloo")
    return Plan(config, device_kind, world_size, shape.num_params, tuple(ranks), memory, comm)


def planned_device_kind(config: TrainConfig) -> str:
    """The device the plan is for: a named accelerator or device=cuda plan for a GPU even
    where none is visible (mode=plan); auto is a GPU when one is visible."""
    if config.plan.accelerator is not None or config.device.value == "cuda":
        return "cuda"
    if config.device.value == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def planned_world_size(config: TrainConfig, device_kind: str) -> int:
    """nproc as given, never checked against this host (mode=plan plans for any cluster).

    auto: every visible GPU, else 2 CPU ranks, as a training run here would start; planning
    for a GPU where none is visible, one node of 8.
    """
    if config.nproc != "auto":
        return int(config.nproc)
    if device_kind == "cpu":
        return 2
    return torch.cuda.device_count() if torch.cuda.is_available() else 8


def predicted_peak_bytes(config: TrainConfig, world_size: int) -> int:
    """The worst rank's predicted peak tensor memory for this job on the device it runs on."""
    device_kind = "cuda" if config.device.value != "cpu" and torch.cuda.is_available() else "cpu"
    return build_plan(config, device_kind, world_size).peak_bytes


# ----------------------------------------------------------------------------- the refusal and its way out


def describe(config: TrainConfig, world_size: int, device_kind: str) -> str:
    c = config
    return (
        f"model={c.model.name} zero={c.zero.stage.value} precision={c.precision.name} "
        f"checkpointing={c.checkpointing.mode.value} offload={c.offload.target.value} micro_batch={c.micro_batch} "
        f"seq_len={c.seq_len} grad_accum={c.grad_accum} on {world_size} {device_kind} ranks"
    )


def refusal(plan: Plan) -> str | None:
    """None when every rank fits, else one line with the figures and a way out."""
    if plan.fits is not False:
        return None
    worst, c = plan.worst, plan.config
    parts = " + ".join(f"{name} {value / GIB:.2f}" for name, value in worst.peak.parts.items() if value)
    reserved = f", {plan.required_bytes(worst) / GIB:.2f} GiB reserved with headroom" if plan.device_kind == "cuda" else ""
    need = (
        f"{describe(c, plan.world_size, plan.device_kind)} ({plan.num_params / 1e9:.2f}B params) needs "
        f"{plan.peak_bytes / GIB:.2f} GiB on rank {worst.rank} at {worst.peak.name} ({parts}{reserved})"
    )
    assert plan.memory.per_rank_bytes is not None
    have = f"each rank has {plan.memory.per_rank_bytes / GIB:.2f} GiB ({plan.memory.source})"
    return f"does not fit: {need}, but {have}. {way_out(plan)}"


def preflight(config: TrainConfig, device_kind: str, world_size: int) -> str | None:
    """None when the plan fits, else the one-line refusal (the job refuses it unless plan.enforce=false)."""
    return refusal(build_plan(config, device_kind, world_size))


def _changed(config: TrainConfig, **changes: Any) -> TrainConfig:
    """A copy of the config with nested keys changed (`zero__stage` is zero.stage)."""
    new = copy.deepcopy(config)
    for key, value in changes.items():
        *path, leaf = key.split("__")
        target = functools.reduce(getattr, path, new)
        setattr(target, leaf, value)
    return new


def single_changes(c: TrainConfig, world_size: int, device_kind: str) -> list[tuple[str, dict[str, Any], int]]:
    """Changes a user could make one at a time: (override text, changes, world size)."""
    options: list[tuple[str, dict[str, Any], int]] = []
    if c.checkpointing.mode != CheckpointMode.full:
        options.append(("checkpointing=full", {"checkpointing__mode": CheckpointMode.full}, world_size))
    if c.zero.stage != Stage.stage3:
        options.append(("zero=stage3", {"zero__stage": Stage.stage3}, world_size))
    factor = 2
    while c.micro_batch // factor >= 1:  # the same global batch in more, smaller micro-batches
        mb, accum = c.micro_batch // factor, c.grad_accum * factor
        options.append((f"micro_batch={mb} grad_accum={accum}", {"micro_batch": mb, "grad_accum": accum}, world_size))
        factor *= 2
    if device_kind == "cuda":
        # GPUs each bring their own memory (CPU ranks share one host, so more of them never helps).
        if c.offload.target == OffloadTarget.none:  # FSDP2's CPUOffloadPolicy: stage2 or stage3
            stage = c.zero.stage if c.zero.uses_fsdp else Stage.stage2
            text = "offload=cpu" if c.zero.uses_fsdp else "zero=stage2 offload=cpu"
            options.append((text, {"offload__target": OffloadTarget.cpu, "zero__stage": stage}, world_size))
        options += [(f"zero=stage3 nproc={n}", {"zero__stage": Stage.stage3}, n) for n in (2**k for k in range(13)) if n > world_size]
    return options


def way_out(plan: Plan) -> str:
    """The first few changes that fit (alone, else on top of checkpointing=full), with their peaks."""
    c, fitting, seen = plan.config, [], set()
    bases: list[tuple[str, dict[str, Any]]] = [("", {})]
    if c.checkpointing.mode != CheckpointMode.full:
        bases.append(("checkpointing=full ", {"checkpointing__mode": CheckpointMode.full}))
    for base_text, base in bases:
        for text, changes, world_size in single_changes(_changed(c, **base), plan.world_size, plan.device_kind):
            kind = text.split("=")[0]  # the smallest micro-batch / world size that fits is enough
            if kind in seen:
                continue
            option = build_plan(_changed(c, **base, **changes), plan.device_kind, world_size)
            if option.fits:
                fitting.append(f"{base_text}{text} (peak {option.peak_bytes / GIB:.2f} GiB)")
                seen.add(kind)
            if len(fitting) == 3:
                break
        if fitting:
            break
    tried = "Try " + ", or ".join(fitting) + ", or" if fitting else "Nothing simple fits: a smaller model or more memory per rank, or"
    return f"{tried} plan.enforce=false to try anyway."


# ----------------------------------------------------------------------------- what plan.json and summary.json carry


def write_plan(out_dir: Path, plan: Plan) -> Path:
    path = out_dir / "plan.json"
    path.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    return path


def summary_fields(plan: Plan) -> dict[str, Any]:
    """What summary.json (and the W&B summary) carry of the plan."""
    worst = plan.worst
    return {
        "memory/predicted_peak_gib": plan.peak_bytes / GIB,
        "comm/predicted_bytes_per_step": plan.comm.total,
        "plan": {
            "fits": plan.fits,
            "peak_rank": worst.rank,
            "peak_moment": worst.peak.name,
            "device_memory_gib": None if plan.memory.per_rank_bytes is None else plan.memory.per_rank_bytes / GIB,
            "device_memory_source": plan.memory.source,
            **{key: value for key, value in worst.figures().items()},
            **plan.reserved_fields(),
        },
    }
