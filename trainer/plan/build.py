"""The plan of a job: every rank's moments and its peak, the memory a rank may use, what
plan.json and summary.json carry (the design note is trainer/plan/__init__.py's docstring)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from trainer.config import OffloadTarget, PlanConfig, TrainConfig, ZeroConfig
from trainer.devices import find_accelerator
from trainer.layout import Layout
from trainer.model.fp8 import precision_split
from trainer.plan.activations import activations, precisions
from trainer.plan.comm import CommPlan, data_parallel_groups, pipeline_gathers, plan_comm
from trainer.plan.context_parallel import cp_local, cp_positions
from trainer.plan.ddp_walk import ddp_moments
from trainer.plan.disk import DiskPlan, build_disk_plan, nvme_buffer_bytes
from trainer.plan.fsdp_walk import fsdp_moments
from trainer.plan.groups import GROUPS, ShardGroups
from trainer.plan.headroom import HEADROOM
from trainer.plan.host import HostPlan, build_host_plan, offload_applies
from trainer.plan.moe import expert_shard_ranks, moe_fields
from trainer.plan.moments import Moment, StepContext, other_bytes
from trainer.plan.pipeline import Pipeline
from trainer.plan.pipeline_walk import pipeline_stage_plans
from trainer.plan.replica_walk import replica_moments
from trainer.plan.states import (
    ModelShape,
    RankStates,
    model_shape,
    rank_states,
    with_expert_shards,
    with_experts,
)
from trainer.plan.tensor_parallel import tp_local
from trainer.telemetry import keys
from trainer.units import GIB, MIB

COMPILE_NOTE = (
    "compile=true: the plan is of the eager step; inductor fuses pointwise ops and chooses what to save "
    "for backward itself, which changes activations and temporaries in ways the plan does not model"
)


FP8_NOTE = (
    "fp8 is fast only compiled: eager, torchao's casts to float8 (amax, scale, cast) run as separate kernels "
    "and cost more than the fp8 GEMMs save (torchao's and torchtitan's float8 benchmarks are all compiled)"
)


def fp8_split_fields(c: TrainConfig) -> dict[str, Any]:
    """precision=fp8: the recipe, the filter, the linears converted per block and those left in bf16 (why);
    plan.json's `fp8` and summary.json's `fp8` (apply_fp8 converts exactly these)."""
    split = precision_split(c.model, c.precision, c.parallel.tp)
    return {
        "recipe": c.precision.fp8_recipe.value,
        "filter": c.precision.fp8_filter.value,
        "converted_per_block": list(split.converted),
        "converted": len(split.converted) * c.model.n_layers,
        "left_in_bf16": {name: why for name, why in split.kept},
    }


def fp8_fields(c: TrainConfig, device_kind: str) -> dict[str, Any]:
    """precision=fp8 in plan.json: the recipe, the linears converted per block and those left in bf16 (why),
    whether the emulated path runs, and what fp8 adds to memory (nothing it keeps: trainer/model/fp8.py)."""
    return {
        **fp8_split_fields(c),
        "all_gather": "fp8" if c.precision.fp8_all_gather else "bf16",
        "emulated": device_kind != "cuda",
        "saved_for_backward": "the high-precision input and weight of each fp8 linear, as nn.Linear does; no fp8 casts, no scales",
        **({} if c.compile else {"note": FP8_NOTE}),
    }


# ----------------------------------------------------------------------------- the plan of a job


@dataclass(frozen=True)
class RankPlan:
    rank: int
    states: RankStates
    activations: int
    moments: tuple[Moment, ...]
    offloaded: int  # model states kept in host memory instead (offload=cpu or nvme on a GPU)
    on_disk: int = 0  # Adam's moments in offload.path's file instead of memory (offload=nvme)
    buffer: int = 0  # offload=nvme: the host buffer the moments stream through, held in their place

    @property
    def peak(self) -> Moment:
        return max(self.moments, key=lambda moment: moment.total)

    @property
    def peak_total(self) -> int:
        return self.peak.total

    def figures(self) -> dict[str, float]:
        """GiB figures of the plan.json row: model states at rest, activations at the end of
        forward, and the temporaries and other tensors at the peak."""
        peak = self.peak
        return {
            "params_gib": self.states.params / GIB,
            "grads_gib": self.states.grads / GIB,
            "optimizer_gib": (self.buffer if self.on_disk else self.states.optimizer) / GIB,
            "activations_gib": self.activations / GIB,
            "temporary_gib": peak.parts["temporary"] / GIB,
            "other_gib": peak.parts["other"] / GIB,
            "peak_gib": peak.total / GIB,
            "offloaded_gib": self.offloaded / GIB,
            **({"on_disk_gib": self.on_disk / GIB} if self.on_disk else {}),
        }


@dataclass(frozen=True)
class DeviceMemory:
    """What each rank may use, and where the figure comes from (None: unknown)."""

    per_rank_bytes: int | None
    source: str


def device_memory(
    plan: PlanConfig,
    device_memory_gib: float | None,
    device_kind: str,
    world_size: int,
    nodes: int,
    communicators: int | None = None,
) -> DeviceMemory:
    """The cap (device_memory_gib), else a named accelerator, else this host's GPU or memory.
    `communicators`: NCCL communicators that carry a GPU rank's traffic (None: the default group
    alone, which init_process_group makes on one rank too)."""
    if communicators is None:
        communicators = 1
    if device_memory_gib is not None:
        return DeviceMemory(int(device_memory_gib * GIB), f"device_memory_gib={device_memory_gib:g}")
    accelerator = plan.accelerator
    if accelerator is not None:
        spec = find_accelerator(accelerator)
        assert spec is not None  # PlanConfig checked the name
        return allocator_share(spec.memory_mib * MIB, spec.short, communicators, world_size)
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            return DeviceMemory(None, "no GPU visible here")
        return allocator_share(
            torch.cuda.get_device_properties(0).total_memory,
            torch.cuda.get_device_name(0),
            communicators,
            world_size,
        )
    # CPU ranks share this host's memory, so each gets an equal part of what is free now;
    # under torchrun only this host's ranks (LOCAL_WORLD_SIZE) share it.
    available = psutil.virtual_memory().available
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size // nodes)))  # this host's share
    return DeviceMemory(
        available // ranks_here, f"this host, {available / GIB:.1f} GiB available / {ranks_here} ranks"
    )


def allocator_share(total: int, name: str, communicators: int, world_size: int) -> DeviceMemory:
    """What the caching allocator of a GPU rank may reserve: the device less the CUDA context and
    the buffers of `communicators` NCCL communicators (trainer/plan/headroom.py). A
    `device_memory_gib` cap needs no such deduction: it caps the allocator's reserved memory itself."""
    outside = HEADROOM.outside_allocator(communicators, world_size)
    nccl = f"{communicators} NCCL communicator{'s' if communicators != 1 else ''}"
    return DeviceMemory(
        total - outside,
        f"{name}, {total / GIB:.1f} GiB less {outside / GIB:.2g} GiB for the CUDA context and {nccl}",
    )


@dataclass(frozen=True)
class Plan:
    """The memory plan of one job: every rank's moments and whether the worst one fits."""

    config: TrainConfig
    device_kind: str
    world_size: int
    num_params: int
    ranks: tuple[RankPlan, ...]
    memory: DeviceMemory
    comm: CommPlan  # bytes each rank's collectives move per optimizer step (trainer/plan/comm.py)
    host: HostPlan  # the host memory of a node: its ranks' runtime, CPU tensors, offloaded states
    pipeline: Pipeline | None = None  # parallel.pp > 1: the stages (trainer/plan/pipeline.py)
    # offload=nvme: the moments' files, their traffic per step, the stall (trainer/plan/disk.py)
    disk: DiskPlan | None = None

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda rank: rank.peak.total)

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak.total

    def required_bytes(self, rank: RankPlan) -> int:
        """What must fit: on a GPU the allocator's reserved memory (tensor peak, fragmentation,
        cuBLAS workspace; trainer/plan/headroom.py), on CPU the tensor peak."""
        return HEADROOM.reserved(rank.peak.total) if self.device_kind == "cuda" else rank.peak.total

    def rank_fits(self, rank: RankPlan) -> bool | None:
        if self.memory.per_rank_bytes is None:
            return None
        return self.required_bytes(rank) <= self.memory.per_rank_bytes

    @property
    def fits(self) -> bool | None:
        return self.rank_fits(self.worst)

    @property
    def host_fits(self) -> bool | None:
        """Whether a node's ranks fit its host's memory (None: the host's memory is unknown)."""
        return self.host.fits

    def reserved_fields(self) -> dict[str, Any]:
        """GPU plans: the predicted reserved peak and the headroom assumptions behind it."""
        if self.device_kind != "cuda":
            return {}
        return {
            "predicted_reserved_gib": self.required_bytes(self.worst) / GIB,
            "headroom": dataclasses.asdict(HEADROOM),
        }

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
            "reduce_every": c.zero.reduce_every.value,
            "parallel": parallel_fields(c, self.world_size),
            "device_memory_gib": None
            if self.memory.per_rank_bytes is None
            else self.memory.per_rank_bytes / GIB,
            "device_memory_source": self.memory.source,
            "peak_gib": self.peak_bytes / GIB,
            **self.reserved_fields(),
            **({"compile": COMPILE_NOTE} if c.compile else {}),
            **({"fp8": fp8_fields(c, self.device_kind)} if c.precision.is_fp8 else {}),
            **({"moe": moe_fields(c)} if c.model.is_moe else {}),
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
            "host": self.host.to_json(),
            **({"disk": self.disk.to_json()} if self.disk is not None else {}),
            **({"pipeline": self.pipeline_json()} if self.pipeline is not None else {}),
        }

    @functools.cached_property
    def layout(self) -> Layout:
        """Where each of the job's ranks stands (trainer/layout.py): made once, read per rank."""
        return Layout.from_config(self.config, self.world_size)

    def pipeline_stage(self, rank: int) -> int:
        """The pipeline rank (stage) of a global rank."""
        return self.layout.coords(rank)["pp"]

    @property
    def worst_stage(self) -> int:
        return self.pipeline_stage(self.worst.rank)

    def pipeline_json(self) -> dict[str, Any]:
        """plan.json's `pipeline` section: per stage its blocks, in-flight micro-batches and peak; the bubble."""
        assert self.pipeline is not None
        peaks: dict[int, int] = {}
        members: dict[int, list[int]] = {}
        for rank in self.ranks:
            stage = self.pipeline_stage(rank.rank)
            peaks[stage] = max(peaks.get(stage, 0), rank.peak_total)
            members.setdefault(stage, []).append(rank.rank)
        record = self.pipeline.to_json(peaks, self.worst_stage, members)
        shard = self.comm.groups.get("shard")
        if self.config.zero.uses_fsdp and shard is not None and shard.ranks > 1:  # the worst pipeline rank's
            gathers = pipeline_gathers(self.config, self.world_size, record["worst_stage"])
            record["all_gather_bytes_per_step_by_zero_stage"] = gathers
        return record


def build_plan(config: TrainConfig, device_kind: str, world_size: int) -> Plan:
    """Plan every rank of a job; shapes come from the model built on meta, nothing is allocated."""
    num_params = model_shape(config.model).num_params
    full = config
    # one TP rank's layers (trainer/plan/tensor_parallel.py) on one cp rank's T / cp positions
    # (trainer/plan/context_parallel.py); the job itself at tp = cp = 1
    config = cp_local(tp_local(config))
    shape = model_shape(config.model)
    ranks, planned = [], {}
    layout = Layout.from_config(full, world_size)
    groups = data_parallel_groups(full, world_size)  # ZeRO's over dp x cp, the cp group's communicator
    sharded_over = zero_ranks(layout, config.zero)
    acts, prec = activations(config, device_kind, 0, sharded_over), precisions(config.precision, config.zero)
    if config.parallel.pp > 1:
        return build_pipeline_plan(config, full, device_kind, layout, num_params, groups, sharded_over)
    shards = rank_states(held_shape(config, sharded_over), config.zero.stage, sharded_over)
    for rank in range(world_size):
        states = shards[shard_index(layout, rank, config.zero)]
        ep_rank = expert_rank(layout, rank, config)
        # parallel.ep: each ep rank's experts compute their own rows (trainer/plan/moe.py)
        rank_acts = acts if ep_rank == 0 else activations(config, device_kind, ep_rank, sharded_over)
        key = (states, ep_rank)
        if key not in planned:  # most ranks hold equal shards: plan each distinct one once
            ctx = StepContext(
                config,
                shape,
                states,
                rank_acts,
                prec,
                sharded_over,
                device_kind,
                other_bytes(config.model, config.data, states) + cp_positions(config),
                ep_rank,
            )
            planned[key] = tuple(walk(config, layout)(ctx))
        ranks.append(rank_plan(config, device_kind, rank, states, rank_acts.total, planned[key]))
    communicators = groups.nccl_communicators(hpz_modules=config.model.n_layers)
    memory = device_memory(
        config.plan, config.device_memory_gib, device_kind, world_size, config.nodes, communicators
    )
    comm = plan_comm(full, world_size, backend="nccl" if device_kind == "cuda" else "gloo")
    host = build_host_plan(config, device_kind, world_size, shape, ranks, shard_size=sharded_over)
    disk = build_disk_plan(config, world_size, shape, [r.states for r in ranks], shard=sharded_over)
    return Plan(full, device_kind, world_size, num_params, tuple(ranks), memory, comm, host, disk=disk)


def rank_plan(
    config: TrainConfig,
    device_kind: str,
    rank: int,
    states: RankStates,
    acts: int,
    moments: tuple[Moment, ...],
) -> RankPlan:
    """A rank's plan, with where its states are: on the device, in host memory (offload=cpu or nvme on a
    GPU), its moments on disk and a buffer in their place (offload=nvme)."""
    nvme = config.offload.target == OffloadTarget.nvme
    buffer = nvme_buffer_bytes(config.offload.buffer_mib) if nvme else 0
    held = states.params + states.grads + (buffer if nvme else states.optimizer)
    offloaded = held if offload_applies(config, device_kind) else 0
    return RankPlan(rank, states, acts, moments, offloaded, states.optimizer if nvme else 0, buffer)


def shard_index(layout: Layout, rank: int, zero: ZeroConfig) -> int:
    """Which of the ZeRO shards a rank holds: its place in FSDP2's shard group (dp_shard x cp), or among DDP's
    replicas (dp_replicate x cp: ZeroRedundancyOptimizer's partition; stage0's states are alike on every
    replica)."""
    if zero.uses_fsdp:
        return layout.shard_index(rank)
    return layout.dp_index(rank) * layout.cp + layout.coords(rank)["cp"]


def expert_rank(layout: Layout, rank: int, config: TrainConfig) -> int:
    """parallel.ep > 1: the rank's place in the ep group, which is ZeRO's data-parallel group, FSDP2's shard group
    or DDP's replicas, or ep consecutive ranks of FSDP2's shard group (trainer/rank/mesh.py `expert_mesh`; a way
    out planned at more DDP ranks wraps around the ep ranks too); 0 otherwise."""
    ep = config.parallel.ep
    return shard_index(layout, rank, config.zero) % ep if ep > 1 else 0


def held_shape(config: TrainConfig, sharded_over: int) -> ModelShape:
    """The shapes whose states a rank holds before ZeRO's sharding: the model's, under DDP with parallel.ep
    the experts E / ep each (FSDP2 shards them on dim 0 over the same ranks itself: trainer/rank/experts.py),
    and under an ep group inside FSDP2's `sharded_over` ranks as FSDP2 shards them over the rest."""
    shape = model_shape(config.model)
    if config.parallel.ep > 1 and not config.zero.uses_fsdp:
        return with_experts(shape, config.parallel.ep)
    ranks = expert_shard_ranks(config, sharded_over)
    return with_expert_shards(shape, config.parallel.ep, ranks) if ranks else shape


def zero_ranks(layout: Layout, zero: ZeroConfig) -> int:
    """The ranks ZeRO shards model states over: FSDP2's shard group, dp_shard x cp (HSDP's shard dim
    without cp), or DDP's replicas, dp x cp (ZeroRedundancyOptimizer's partitions; stage0 shards nothing)."""
    return layout.shard_size() if zero.uses_fsdp else layout.dp * layout.cp


def build_pipeline_plan(
    config: TrainConfig,
    full: TrainConfig,
    device_kind: str,
    layout: Layout,
    num_params: int,
    groups: ShardGroups,
    sharded_over: int,
) -> Plan:
    """parallel.pp > 1: every rank's plan is its stage's (trainer/plan/pipeline_walk.py), its states sharded
    over the dp ranks of its stage; `config` is one TP rank's job, `full` the job's."""
    world_size = layout.world_size
    acts, prec = activations(config, device_kind), precisions(config.precision, config.zero)
    shape = model_shape(config.model)
    pipe, stages = pipeline_stage_plans(
        config,
        shape,
        acts,
        prec,
        device_kind,
        sharded_over,
        layout.replicas,  # a stage's data-parallel replicas, dp x cp: DDP wraps it over those (parallelize.py)
    )
    ranks = []
    for rank in range(world_size):
        stage = stages[layout.coords(rank)["pp"]]
        states = stage.shards[shard_index(layout, rank, config.zero)]
        ranks.append(rank_plan(config, device_kind, rank, states, stage.activations, stage.moments[states]))
    # + the pp group's; hpZ's secondary groups are one mesh every stage's blocks share (trainer/rank/mesh.py)
    communicators = groups.nccl_communicators(hpz_modules=1) + 1
    memory = device_memory(
        config.plan, config.device_memory_gib, device_kind, world_size, config.nodes, communicators
    )
    comm = plan_comm(full, world_size, backend="nccl" if device_kind == "cuda" else "gloo")
    # each rank holds (and under offload=cpu keeps in host memory) its stages' parameters only
    shapes = [stages[layout.coords(rank)["pp"]].shape for rank in range(world_size)]
    host = build_host_plan(
        config, device_kind, world_size, shape, ranks, shard_size=sharded_over, rank_shapes=shapes
    )
    disk = build_disk_plan(config, world_size, shape, [r.states for r in ranks], shard=sharded_over)
    return Plan(full, device_kind, world_size, num_params, tuple(ranks), memory, comm, host, pipe, disk=disk)


def walk(config: TrainConfig, layout: Layout) -> Callable[[StepContext], list[Moment]]:
    """The walk of one step: FSDP2's (stages 2-3), one data-parallel replica's without DDP (a tensor-parallel
    model's at dp = 1, or a one-rank job's: trainer/plan/replica_walk.py), or DDP's."""
    if config.zero.uses_fsdp:
        return fsdp_moments
    return replica_moments if layout.replicas == 1 else ddp_moments


def parallel_fields(config: TrainConfig, world_size: int) -> dict[str, Any]:
    """plan.json's `parallel`: the layout's degrees (trainer/layout.py), and the pipeline's schedule."""
    p = config.parallel
    fields: dict[str, Any] = {"dp": p.dp(world_size), "tp": p.tp, "pp": p.pp}
    if p.tp > 1:
        fields["sequence_parallel"] = p.sequence_parallel
    if p.pp > 1:
        fields["pp_schedule"] = p.pp_schedule
    if p.cp > 1:  # trainer/plan/context_parallel.py
        fields.update(cp=p.cp, cp_impl=p.cp_impl)
    return fields


def describe(config: TrainConfig, world_size: int, device_kind: str) -> str:
    c, p = config, config.parallel
    layout = (
        "".join(
            f" parallel.{key}={value}"
            for key, value in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp))
            if value > 1
        )
        + (f" parallel.pp_schedule={p.pp_schedule}" if p.pp > 1 else "")
        + (f" parallel.cp_impl={p.cp_impl}" if p.cp > 1 else "")
    )
    return (
        f"model={c.model.name} zero={c.zero.stage.value} precision={c.precision.name} "
        f"checkpointing={c.checkpointing.mode.value} offload={c.offload.target.value} micro_batch={c.micro_batch} "
        f"seq_len={c.seq_len} grad_accum={c.grad_accum}{reduce_every_text(c)}{layout} on {world_size} {device_kind} "
        "ranks"
    )


def reduce_every_text(c: TrainConfig) -> str:
    """Which accumulation the plan is of; at grad_accum 1 both choices are the same single reduction."""
    return f" zero.reduce_every={c.zero.reduce_every.value}" if c.grad_accum > 1 else ""


# ----------------------------------------------------------------------------- what plan.json and summary.json carry


def write_plan(out_dir: Path, plan: Plan) -> Path:
    path = out_dir / "plan.json"
    path.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    return path


PREDICTED_GROUP_KEYS = {group: keys.comm_group_predicted_key(group) for group in GROUPS}
"""The plan's bytes per process group (trainer/plan/groups.py), beside comm/rank{r}/{group}/bytes_per_step."""
RANK_FIGURES = (keys.PREDICTED_PEAK, keys.COMM_PREDICTED_BYTES, *PREDICTED_GROUP_KEYS.values())
"""The plan's figures the job hands its ranks, which write them beside what they measure."""


def summary_fields(plan: Plan) -> dict[str, Any]:
    """What summary.json (and the W&B summary) carry of the plan."""
    worst = plan.worst
    return {
        keys.PREDICTED_PEAK: plan.peak_bytes / GIB,
        keys.COMM_PREDICTED_BYTES: plan.comm.total,
        **{PREDICTED_GROUP_KEYS[name]: group.total for name, group in plan.comm.groups.items()},
        "plan": {
            "fits": plan.fits,
            "peak_rank": worst.rank,
            "peak_moment": worst.peak.name,
            "device_memory_gib": None
            if plan.memory.per_rank_bytes is None
            else plan.memory.per_rank_bytes / GIB,
            "device_memory_source": plan.memory.source,
            **{key: value for key, value in worst.figures().items()},
            **plan.reserved_fields(),
        },
        **({"fp8": fp8_split_fields(plan.config)} if plan.config.precision.is_fp8 else {}),
    }
