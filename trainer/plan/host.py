"""The host memory of a node: what every rank on it takes from the host it shares.

Every rank is a process that holds its runtime in host memory before it allocates a tensor:
a CPU rank its Python interpreter, torch's libraries, gloo's buffers and thread pools (about
0.3-0.45 GiB with torch 2.13, `plan.cpu_rank_runtime_gib`); a CUDA rank also the CUDA runtime
and NCCL's host side (`plan.cuda_rank_runtime_gib`, an assumption until the GPU check's host
row measures it). On top of that:

- CPU ranks keep their tensors in host memory: the plan's tensor peak of each rank;
- `offload=cpu` (FSDP2's CPUOffloadPolicy) keeps each rank's model states there: the sharded
  fp32 parameters and gradients, pinned when `offload.pin_memory` is on, and Adam's moments
  (`torch.zeros_like` of a pinned tensor is not pinned), plus Adam's per-tensor temporaries
  when the optimizer is not fused.
- `offload=nvme` keeps the same shards there, but not Adam's moments, which live in a file per rank
  (trainer/plan/disk.py): instead the rank's one buffer of `offload.buffer_mib` MiB (pageable: the
  step runs on host tensors, nothing copies it to a device), its step counters and one chunk's AdamW
  temporaries.
- `save.async_mode=thread|process` keeps a staging copy of each rank's saved state for the whole
  run (torch's DefaultStager copies every tensor's storage once and reuses it at every save): the
  rank's fp32 parameters as it holds them (whole under stage0/1, padded shards under stage2/3),
  Adam's moments and step counters; pinned on CUDA with cudaHostRegister (no power-of-two
  rounding: torch/distributed/checkpoint/_state_dict_stager.py), in shared memory in `process`
  mode, where each rank also has a save process of its own (torch spawns it: a CPU rank's
  runtime, `plan.cpu_rank_runtime_gib`). The rng and progress entries (a few KiB) are left out.

Pinned tensors cost more than their bytes: torch's caching host allocator rounds every pinned
allocation up to the next power of two (torch 2.13, include/ATen/core/CachingHostAllocator.h:302-305,
`c10::llvm::PowerOf2Ceil(size)` below `pinned_max_round_threshold`, which defaults to no limit,
c10/core/AllocatorConfig.h:361). FSDP2 pins each parameter's padded shard
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py:313-315) and each reduced gradient's
shard, copied to the host with `non_blocking=True` (_fsdp_collectives.py:729-739), which
`_to_copy` allocates pinned: so each tensor is rounded up on its own.

The node's need is the sum over its ranks, held against the host's memory: measured here
(available now) when the job runs on this host, `plan.host_memory_gib` when given (planning
for another machine), else unknown, and then the plan prints what the node needs and says so.
Under torchrun the ranks exist already when the plan is made (their memory is no longer
available): nothing is measured there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from trainer.config import OffloadTarget, SaveAsync, TrainConfig, uses_fused
from trainer.layout import Layout
from trainer.model.hf_weights import largest_tensor_bytes, safetensors_files
from trainer.plan.disk import chunk_temporary_bytes, nvme_buffer_bytes
from trainer.plan.states import ModelShape, RankStates, padded_numel, shard_rows
from trainer.units import GIB
from trainer.world import is_under_torchrun, usable_cores

# ----------------------------------------------------------------------------- one rank's host memory


def pinned_bytes(nbytes: int) -> int:
    """What torch's caching host allocator takes for a pinned tensor of `nbytes`: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


@dataclass(frozen=True)
class HostRank:
    """What one rank holds in its host's memory, in bytes."""

    runtime: int
    """The process itself (plan.cpu_rank_runtime_gib or plan.cuda_rank_runtime_gib)."""
    tensors: int = 0
    """CPU ranks: the plan's tensor peak (their device memory is the host's)."""
    pinned: int = 0
    """offload=cpu with pinning: parameter and gradient shards, each rounded up to a power of two."""
    pageable: int = 0
    """offload=cpu: the rest of the offloaded states (Adam's moments, unpinned shards, step temporaries);
    offload=nvme: the same less the moments (their step counters, one chunk's temporaries)."""
    buffer: int = 0
    """offload=nvme on a GPU: the buffer the moments stream through (a CPU rank's is in `tensors`)."""
    staging: int = 0
    """save.async_mode=thread|process: the staging copy of the rank's saved state."""
    writer: int = 0
    """save.async_mode=process: the runtime of the rank's save process."""
    loading: int = 0
    """model.weights: what loading the checkpoint holds before training, beyond the runtime (`loading_bytes`)."""

    @property
    def total(self) -> int:
        """The runtime and the larger of training's parts (together) and loading's, which comes before."""
        training = self.tensors + self.pinned + self.pageable + self.buffer + self.staging + self.writer
        return self.runtime + max(training, self.loading)


def offloaded_host_rank(
    runtime: int, shards: int, optimizer: int, temporary: int, pin: bool, buffer: int = 0
) -> HostRank:
    """An offloading rank: `shards` is the bytes of its parameter and gradient shards (offload_shard_bytes),
    `buffer` offload=nvme's."""
    if pin:
        return HostRank(runtime, pinned=shards, pageable=optimizer + temporary, buffer=buffer)
    return HostRank(runtime, pageable=shards + optimizer + temporary, buffer=buffer)


# ----------------------------------------------------------------------------- a node against its host


@dataclass(frozen=True)
class HostPlan:
    """The most loaded node's ranks against its host's memory (None: the host's memory is unknown)."""

    ranks: tuple[HostRank, ...]
    available_bytes: int | None
    source: str
    cores: int | None = None
    """This host's usable cores, when the job would run its ranks here."""

    @property
    def need_bytes(self) -> int:
        return sum(rank.total for rank in self.ranks)

    @property
    def fits(self) -> bool | None:
        return None if self.available_bytes is None else self.need_bytes <= self.available_bytes

    @property
    def worst(self) -> HostRank:
        return max(self.ranks, key=lambda rank: rank.total)

    def to_json(self) -> dict[str, object]:
        worst = self.worst
        return {
            "ranks_per_node": len(self.ranks),
            "need_gib": self.need_bytes / GIB,
            "available_gib": None if self.available_bytes is None else self.available_bytes / GIB,
            "source": self.source,
            "fits": self.fits,
            "per_rank_gib": {
                "runtime": worst.runtime / GIB,
                "tensors": worst.tensors / GIB,
                "pinned": worst.pinned / GIB,
                "pageable": worst.pageable / GIB,
                "buffer": worst.buffer / GIB,
                "staging": worst.staging / GIB,
                "writer": worst.writer / GIB,
            },
            "loading_gib": max(rank.loading for rank in self.ranks) / GIB,
        }

    def describe(self) -> str:
        """The plan's line for the host: the largest rank by part, the node's total, against what it has."""
        worst = self.worst
        named = (
            ("process runtime", worst.runtime),
            ("tensors", worst.tensors),
            ("pinned offloaded states", worst.pinned),
            ("pageable offloaded states", worst.pageable),
            ("offload=nvme buffer", worst.buffer),
            ("staging copy of the save", worst.staging),
            ("save process runtime", worst.writer),
        )
        parts = " + ".join(f"{n / GIB:.3g} GiB {name}" for name, n in named if n)
        have = (
            f"of {self.available_bytes / GIB:.1f} GiB ({self.source})"
            if self.available_bytes is not None
            else f"needed; {self.source}"
        )
        cores = f"; {self.cores} cores" if self.cores is not None else ""
        loading = max(rank.loading for rank in self.ranks)
        load = f" ({loading / GIB:.3g} GiB while loading model.weights)" if loading else ""
        return (
            f"host: {len(self.ranks)} ranks per node, each up to {parts}{load}: "
            f"{self.need_bytes / GIB:.2f} GiB per node {have}{cores}"
        )


# ----------------------------------------------------------------------------- which host, how much


def host_memory(config: TrainConfig, device_kind: str) -> tuple[int | None, str, int | None]:
    """The host's memory, where the figure comes from, and its cores (None where it is not this host)."""
    if config.plan.host_memory_gib is not None:
        return (
            int(config.plan.host_memory_gib * GIB),
            f"plan.host_memory_gib={config.plan.host_memory_gib:g}",
            None,
        )
    runs_here = config.plan.accelerator is None and (device_kind == "cpu" or config.mode.value == "train")
    if is_under_torchrun() or not runs_here:
        return None, "this node's host memory is unknown: set plan.host_memory_gib to check it", None
    return psutil.virtual_memory().available, "available on this host now", usable_cores()


def node_ranks(world_size: int, nodes: int) -> range:
    """The ranks of one node (node 0: the nodes are alike, each holds world_size / nodes ranks)."""
    return range(world_size // nodes)


def offload_applies(config: TrainConfig, device_kind: str) -> bool:
    """Whether a rank's sharded parameters and gradients move to host memory: offload=cpu or nvme on a GPU."""
    return config.offload.on_host and device_kind == "cuda"


def runtime_bytes(config: TrainConfig, device_kind: str) -> int:
    gib = config.plan.cpu_rank_runtime_gib if device_kind == "cpu" else config.plan.cuda_rank_runtime_gib
    return int(gib * GIB)


class PlannedRank(Protocol):
    """What the host plan reads of a rank's device plan (trainer/plan/build.py's RankPlan)."""

    rank: int
    states: RankStates

    @property
    def peak_total(self) -> int: ...


@functools.lru_cache(maxsize=4096)
def offload_shard_bytes(order: tuple[tuple[int, ...], ...], shard_size: int, place: int, pin: bool) -> int:
    """Host bytes of the fp32 parameter shards (padded, as FSDP2 pins them) and gradient shards
    (unpadded) of the parameters shaped `order` (ModelShape.order), at `place` in a shard group of
    `shard_size` (the world, or HSDP's group); pinned, each rounded up to a power of two. Cached: the
    advisor asks it for every rank of hundreds of candidates that share a few group sizes (13b on
    64 H100s: 14k calls over 363 tensors each; its `mode=advise` took 13.8 s uncached, 5.3 s cached,
    the same advice.json)."""
    params = [4 * padded_numel(s, shard_size) // shard_size for s in order]
    grads = [4 * shard_rows(s[0], shard_size, place) * math.prod(s[1:]) for s in order]
    shards = [*params, *grads]
    return sum(map(pinned_bytes, shards)) if pin else sum(shards)


def staging_bytes(config: TrainConfig, states: RankStates) -> int:
    """The staging copy of a rank's saved state under save.async_mode=thread|process (else 0)."""
    if config.save.async_mode == SaveAsync.off or config.save.every == 0:
        return 0
    return states.params + states.optimizer + states.step_counters


def host_rank(
    config: TrainConfig,
    device_kind: str,
    shard: tuple[int, int],
    shape: ModelShape,
    planned: PlannedRank,
) -> HostRank:
    """A rank's host memory: its states and tensors (at_rest), and what saving in the background adds.
    `shard`: FSDP2's shard group size and the rank's place in it (trainer/layout.py)."""
    rank = at_rest(config, device_kind, shard, shape, planned)
    writer = config.save.async_mode == SaveAsync.process and config.save.every > 0
    return dataclasses.replace(
        rank,
        staging=staging_bytes(config, planned.states),
        writer=int(config.plan.cpu_rank_runtime_gib * GIB) if writer else 0,
        loading=loading_bytes(config, device_kind, planned.states),
    )


def loading_bytes(config: TrainConfig, device_kind: str, states: RankStates) -> int:
    """model.weights: what a rank holds in host memory while it loads (trainer/model/hf_weights.py
    load_weights; measured: trainer/telemetry/memory.py measure_load): its parameter shard, where
    that lives in host memory (a CPU rank, or offload=cpu), and the checkpoint's largest tensor.

    Besides the shard a rank holds at most one whole tensor of the file at a time: the rotary-permuted
    ones (wq, wk, their biases, q/k norms) are read whole and laid out in one copy, then sliced
    (`load_permuted`). DCP's reader copies the rank's slice straight into its parameter
    (torch/distributed/checkpoint/hf_storage.py:226-234, `f.get_slice(fqn)[slices]`, then
    `target_tensor.copy_`): in safetensors 0.8 that slice is a view of the whole tensor's mapping of
    the file, page cache shared by the node's ranks rather than memory the rank holds. The largest
    tensor of all, not only of the permuted ones, is planned: it covers that copy and DCP's own
    planning objects (about 1 MiB measured; docs/pretrained.md)."""
    if config.model.weights is None:
        return 0
    shard = states.params if device_kind == "cpu" or offload_applies(config, device_kind) else 0
    return shard + checkpoint_largest_tensor(config.model.weights)


@functools.lru_cache(maxsize=8)
def checkpoint_largest_tensor(weights: str) -> int:
    """The largest tensor of the checkpoint in `weights`, its headers read once per process (the
    advisor plans hundreds of candidates from one checkpoint)."""
    return largest_tensor_bytes(safetensors_files(Path(weights)))


def at_rest(
    config: TrainConfig, device_kind: str, shard: tuple[int, int], shape: ModelShape, planned: PlannedRank
) -> HostRank:
    runtime = runtime_bytes(config, device_kind)
    if device_kind == "cpu":
        return HostRank(runtime, tensors=planned.peak_total)
    if not offload_applies(config, device_kind):
        return HostRank(runtime)
    pin = config.offload.pin_memory
    shards = offload_shard_bytes(shape.order, *shard, pin)
    states = planned.states
    if config.offload.target == OffloadTarget.nvme:  # the moments on disk, one buffer and chunk in memory
        buffer_mib = config.offload.buffer_mib
        temporary = chunk_temporary_bytes(buffer_mib, states.largest_numel)
        buffer = nvme_buffer_bytes(buffer_mib)
        return offloaded_host_rank(runtime, shards, states.step_counters, temporary, pin, buffer)
    # The CPU AdamW runs on the offloaded shards: fused in place, else a per-tensor loop whose
    # temporaries trainer/plan/states.py sizes (loop_temporary).
    temporary = 0 if uses_fused(config.optim, device_kind) else 4 * states.loop_temporary
    return offloaded_host_rank(runtime, shards, states.optimizer + states.step_counters, temporary, pin)


def build_host_plan(
    config: TrainConfig,
    device_kind: str,
    world_size: int,
    shape: ModelShape,
    ranks: Sequence[PlannedRank],
    *,
    shard_size: int,
    rank_shapes: Sequence[ModelShape] | None = None,
) -> HostPlan:
    """Node 0's ranks (every node holds world_size / nodes alike) against the host's memory;
    FSDP2's states are sharded over `shard_size` ranks (the world, or HSDP's shard group). `rank_shapes`:
    under parallel.pp each rank's parameters, its stages' only (trainer/plan/pipeline.py
    `stage_model_shape`), in rank order; else every rank shards `shape`."""
    available, source, cores = host_memory(config, device_kind)
    layout = Layout.from_config(config, world_size)
    per_node = [
        host_rank(
            config,
            device_kind,
            (shard_size, layout.shard_index(r)),
            shape if rank_shapes is None else rank_shapes[r],
            ranks[r],
        )
        for r in node_ranks(world_size, config.nodes)
    ]
    return HostPlan(tuple(per_node), available, source, cores)


def cores_warning(plan: HostPlan) -> str | None:
    """A warning when ranks outnumber the cores they may run on: they take turns, every step waits for the slowest."""
    if plan.cores is None or len(plan.ranks) <= plan.cores:
        return None
    return f"{len(plan.ranks)} CPU ranks share {plan.cores} cores: they take turns; nproc={plan.cores} or fewer runs faster here"
