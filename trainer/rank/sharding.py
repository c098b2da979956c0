"""ZeRO stages on PyTorch's own data parallelism.

stage0: DistributedDataParallel (every rank holds everything, but for parallel.ep's experts: its own).
stage1: DDP + ZeroRedundancyOptimizer (optimizer state sharded; see trainer/rank/optim.py).
stage2: FSDP2 fully_shard(reshard_after_forward=False): gradients and optimizer state sharded;
        parameters are sharded at rest but stay unsharded from forward to backward.
stage3: FSDP2 fully_shard: parameters re-sharded after each block's forward as well.
zero.shard_ranks (HSDP) and zero.hpz_ranks (hpZ) choose FSDP2's mesh and reshard_after_forward=<int>.
"""

from __future__ import annotations

import contextlib
import functools
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from trainer.config import (
    OffloadConfig,
    OffloadTarget,
    PrecisionConfig,
    ReduceDType,
    ReduceEvery,
    Stage,
    ZeroConfig,
)
from trainer.model.decoder import materialize
from trainer.model.hf_weights import load_weights
from trainer.model.moe import moe_layers
from trainer.plan import ShardGroups, expert_shard_dim
from trainer.private_apis.of_torch import ddp_ignore_params, prebuilt_secondary_mesh
from trainer.rank.compression import apply_compression
from trainer.rank.precision import build_mp_policy
from trainer.telemetry.memory import measured_load
from trainer.world import World


def apply_zero(
    model: nn.Module,
    zero: ZeroConfig,
    precision: PrecisionConfig,
    offload: OffloadConfig,
    world: World,
    seed: int,
    weights: str | None,
    *,
    dp_mesh: DeviceMesh,
    replicas: bool,
    ignored: set[nn.Parameter] | None = None,
    secondary: DeviceMesh | None = None,
    experts_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard (or replicate) a meta-device model over `dp_mesh` (the job mesh's data-parallel dims,
    trainer/rank/mesh.py), then give each rank real memory for what it holds, initialised, or filled
    from `weights` (model.weights: each rank reads what it holds).

    FSDP2 must shard before materialising, so that no rank ever allocates the whole model;
    DDP wraps real parameters, so it comes after, and only where `replicas` (trainer/rank/parallelize.py
    `replicas_to_wrap`), told first to leave the `ignored` experts alone (named on the meta model, whose
    parameters `to_empty` replaces).
    """
    # What loading takes of the host is measured (trainer/telemetry/memory.py measure_load).
    load = None if weights is None else measured_load(functools.partial(load_weights, weights=Path(weights)))
    if zero.uses_fsdp:
        apply_fsdp(model, zero, precision, offload, world, dp_mesh, ignored, secondary, experts_mesh)
        materialize(model, state_device(offload, world), seed=seed, load=load)
        return model
    if ignored:  # parallel.ep: each rank holds its own experts, which DDP must neither broadcast nor average
        ddp_ignore_params(model, [name for name, param in model.named_parameters() if param in ignored])
    materialize(model, world.device, seed=seed, load=load)
    return apply_ddp(model, zero, world, dp_mesh) if replicas else model


def apply_ddp(model: nn.Module, zero: ZeroConfig, world: World, dp_mesh: DeviceMesh) -> nn.Module:
    """DDP over `dp_mesh`'s group, the one way every part is replicated: its buckets, their view and
    its communication hook as zero's keys set them, whether the part is a model or a pipeline stage."""
    device_ids = [world.device.index] if world.device.type == "cuda" else None
    buckets = {} if zero.bucket_cap_mb is None else {"bucket_cap_mb": zero.bucket_cap_mb}
    # Gradients as views into DDP's buckets: without it DDP keeps a second copy of every gradient.
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=dp_mesh.get_group(),
        gradient_as_bucket_view=True,
        **buckets,
    )
    if zero.reduce_dtype == ReduceDType.bf16:
        # torch's own hook: each bucket is cast to bf16, all-reduced, and written back in fp32.
        ddp.register_comm_hook(state=None, hook=bf16_compress_hook)
    apply_compression(ddp, zero)  # zero.compression or local SGD: another hook (never with bf16's)
    return ddp


def state_device(offload: OffloadConfig, world: World) -> torch.device:
    """Where sharded model states live: host memory under offload=cpu, else the training device."""
    return torch.device("cpu") if offload.on_host else world.device


def apply_fsdp(
    model: nn.Module,
    zero: ZeroConfig,
    precision: PrecisionConfig,
    offload: OffloadConfig,
    world: World,
    dp_mesh: DeviceMesh,
    ignored: set[nn.Parameter] | None = None,
    secondary: DeviceMesh | None = None,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """fully_shard each transformer block, then the root (embeddings, final norm, output head), over
        `dp_mesh`: 1-D, or HSDP's 2-D `(dp_replicate, dp_shard)`, `dp_shard_cp` under cp (FSDP2 shards over the last dim and all-reduces
        gradient shards over the first: torchtitan's data_parallel_replicate_degree x data_parallel_shard_degree,
        pytorch/torchtitan docs/fsdp.md). Under tensor parallelism FSDP2 shards the TP layers' DTensors again; under
    parallel.ep it leaves the `ignored` expert weights, sharded over the same ranks already (trainer/rank/experts.py),
    or, with an ep group inside them, shards the experts over `experts_mesh` first (`shard_experts`)."""
    # FSDP2 shards over the mesh's last dim (dp_shard, or dp_shard_cp under cp): its size is the shard group's;
    # zero.shard_ranks and zero.hpz_ranks were checked against it with the layout (trainer/layout.py). Its last dim
    # by index, not -1: torch 2.11's size() of a flattened 1-D mesh (dp_shard_cp) takes no negative dim.
    groups = ShardGroups(dp_mesh.size(), dp_mesh.size(), dp_mesh.size(dp_mesh.ndim - 1), zero.hpz_ranks)
    reshard = block_reshard(zero, groups)
    common = dict(
        mesh=dp_mesh,
        mp_policy=build_mp_policy(precision, zero),
        offload_policy=build_offload_policy(offload, world),
        ignored_params=ignored,
    )
    # an ep group inside the data-parallel ranks: its experts sharded over the rest
    if experts_mesh is not None:
        shard_experts(model, experts_mesh, reshard, common)
        common["ignored_params"] = None
    # hpZ under a pipeline: each block's secondary mesh is the one every rank made (trainer/rank/mesh.py)
    with prebuilt_secondary_mesh(secondary) if secondary is not None else contextlib.nullcontext():
        for block in model.layers:
            fully_shard(block, reshard_after_forward=reshard, **common)
    # The root's parameters are used again at the very start of backward (the output head), so
    # re-sharding them after forward would only buy an immediate all-gather (torchtitan does the same).
    fully_shard(model, reshard_after_forward=False, **common)


def shard_experts(model: nn.Module, mesh: DeviceMesh, reshard: bool | int, common: dict) -> None:
    """parallel.ep < dp: fully_shard each MoE layer's experts (DTensors over the ep group already,
    trainer/rank/experts.py) over `mesh`, the ranks holding the same experts, as its own FSDP2 unit inside its
    block's (torchtitan shards them over dp_shard_mod_ep likewise). FSDP2 averages their gradients over those
    ranks; `MeanOverRanks` has divided them by the ep ranks whose tokens reached them: the mean over all. They are
    sharded on the expert dim where a rank's experts split evenly over `mesh`, else on the next: FSDP2 pads its
    shard dim to a multiple of the ranks, which on the expert dim would hold them several times over."""
    # hpZ's secondary groups are consecutive ranks of the blocks' shard group (zero.hpz_ranks divides it, not
    # this mesh's group): the experts reshard fully after forward, as at stage3 without hpZ
    reshard = reshard if isinstance(reshard, bool) else True
    for layer in moe_layers(model):
        local = layer.experts.w1.to_local().shape[0]  # this rank's E / ep experts
        dim = expert_shard_dim(local, mesh.size())  # the plan's rule (trainer/plan/moe.py)
        fully_shard(
            layer.experts,
            mesh=mesh,
            reshard_after_forward=reshard,
            shard_placement_fn=lambda _param, dim=dim: Shard(dim),
            mp_policy=common["mp_policy"],
            offload_policy=common["offload_policy"],
        )


def block_reshard(zero: ZeroConfig, groups: ShardGroups) -> bool | int:
    """reshard_after_forward of each block: stage2 False, stage3 True, hpZ the secondary group's size
    (FSDP2 keeps a shard over `mesh.view(-1, hpz_ranks)` from forward to backward)."""
    if zero.stage != Stage.stage3:
        return False
    return groups.hpz if groups.hpz is not None else True


def build_offload_policy(offload: OffloadConfig, world: World) -> OffloadPolicy:
    if offload.target == OffloadTarget.none:
        return OffloadPolicy()
    # Pinning needs a CUDA runtime; on a CPU-only host the offloaded states are plain host memory.
    return CPUOffloadPolicy(pin_memory=offload.pin_memory and world.device.type == "cuda")


def reduces_now(zero: ZeroConfig, is_last: bool) -> bool:
    """Whether this micro-batch's backward reduces gradients (zero.reduce_every).

    micro_batch: every backward. FSDP2 reduce-scatters each block's gradient and adds the new
    shard into the one already held (foreach_reduce in torch's _fsdp_collectives.py), so a rank
    never holds more than its shard between micro-batches; DDP all-reduces each backward into
    its buckets, where the next backward accumulates. step: only the last micro-batch's; before
    it FSDP2 keeps each block's unsharded gradient (in the reduce dtype, `unsharded_accumulated_grad`)
    and DDP (no_sync) a full gradient outside its buckets.
    """
    return is_last or zero.reduce_every == ReduceEvery.micro_batch


def gradient_sync(model: nn.Module, enabled: bool) -> AbstractContextManager:
    """Reduce this micro-batch's gradients or not (`reduces_now` decides)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


def reshards_now(zero: ZeroConfig, is_last: bool) -> bool:
    """Whether this micro-batch's backward reshards FSDP2's parameters (zero.reshard_after_backward).

    true: every backward (torch's default). false: only the last micro-batch's, so the optimizer step
    sees sharded parameters; before it every group keeps its unsharded parameters (param_dtype) to the
    next forward, whose all-gathers are then skipped (FSDPParamGroup.unshard returns when already
    unsharded). stage3 blocks still reshard after that forward (reshard_after_forward=True) and
    gather again in backward: only the forward's all-gathers are saved there.
    """
    return is_last or zero.reshard_after_backward


def parameter_resharding(model: nn.Module, enabled: bool) -> None:
    """FSDP2's own switch, on the root and (recurse=True, its default) every FSDP module under it."""
    if isinstance(model, FSDPModule):
        model.set_reshard_after_backward(enabled)
