"""Gradient compression and local SGD for DDP (zero=stage0/1), on torch's communication-hook interface.

zero.compression=powersgd: torch's powerSGD_hook (PowerSGDState, error feedback and warm start on).
zero.compression=topk: `topk_hook` below, the largest zero.topk_ratio of each gradient with error feedback.
zero.sync_every > 1: torch's post_localSGD_hook (no gradient all-reduce after the warm-up) and a
PostLocalSGDOptimizer whose PeriodicModelAverager averages the parameters every zero.sync_every steps.
trainer/plan/comm.py counts the bytes each moves.
"""

# No `from __future__ import annotations`: DistributedDataParallel.register_comm_hook compares the
# hook's annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from trainer.config import Compression, ZeroConfig
from trainer.plan import MIN_COMPRESSION_RATE, topk_count
from trainer.private_apis.of_torch import powersgd_hook_in_this_thread

# One all-gather into one tensor: torch 2.13 names it all_gather_single (its old name warns there),
# torch 2.11, pyproject's lower bound, has only all_gather_into_tensor. The same collective either way.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def apply_compression(ddp: DistributedDataParallel, zero: ZeroConfig) -> None:
    """Register the hook of zero.compression, or local SGD's, on the DDP model (none: DDP's own all-reduce).
    Each hook communicates over DDP's own group (torch's hooks default to the world's): under parallel.pp one
    stage's replicas, whose buckets alone match."""
    if zero.compression == Compression.none and zero.sync_every == 1:
        return
    group = ddp.process_group
    if zero.compression == Compression.powersgd:
        state = PowerSGDState(
            process_group=group,
            matrix_approximation_rank=zero.powersgd_rank,
            start_powerSGD_iter=zero.powersgd_start_step,
            min_compression_rate=MIN_COMPRESSION_RATE,
        )
        ddp.register_comm_hook(state, powerSGD_hook if dist.get_backend() == "nccl" else serial_powersgd_hook)
    elif zero.compression == Compression.topk:
        ddp.register_comm_hook(TopKState(zero.topk_ratio, group), topk_hook)
    elif zero.sync_every > 1:
        # post_local_gradient_allreduce=False: after the warm-up each rank keeps its own gradient
        # (True would all-reduce within each node, a subgroup torch sizes by the CUDA device count).
        state = PostLocalSGDState(
            process_group=group,
            subgroup=None,
            start_localSGD_iter=zero.sync_warmup_steps,
            post_local_gradient_allreduce=False,
        )
        ddp.register_comm_hook(state, post_localSGD_hook)


def serial_powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """powerSGD_hook (gloo), its callbacks run in this thread before the next bucket's hook starts.

    powerSGD_hook issues its P and Q all-reduces from the callbacks of the one before. NCCL marks its
    futures complete once a collective is enqueued on the stream, so those callbacks run at once in the
    issuing thread and every rank issues in bucket order; gloo completes them, and would run the
    callbacks, on its worker threads, racing the next bucket's first all-reduce from autograd (two
    ranks can issue different collectives under the same sequence number: gloo aborts, size mismatch)
    and out of the memory tracker's sight (a thread-local dispatch mode, trainer/telemetry/memory.py),
    which then misses the new error feedback each bucket's last callback makes.
    """
    return powersgd_hook_in_this_thread(state, bucket)


def apply_local_sgd(
    optimizer: torch.optim.Optimizer, zero: ZeroConfig, group: dist.ProcessGroup | None = None
) -> torch.optim.Optimizer:
    """zero.sync_every > 1: wrap the optimizer so that each step is followed by the periodic average over
    `group`, the ranks that hold the same parameters (under parallel.pp one stage's; None: every rank)."""
    if zero.sync_every == 1:
        return optimizer
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    averager = PeriodicModelAverager(
        period=zero.sync_every, warmup_steps=zero.sync_warmup_steps, process_group=group
    )
    return PostLocalSGDOptimizer(optim=optimizer, averager=averager)


# TopK with error feedback (Lin et al. 2018, Deep Gradient Compression; Stich et al. 2018) is written
# here because torch ships no sparsifying hook: its ddp_comm_hooks hold fp16/bf16 casts, PowerSGD,
# quantisation and local SGD only.
@dataclass
class TopKState:
    ratio: float
    group: dist.ProcessGroup | None = None
    """DDP's group, over which the values are all-gathered (None: the default group)."""
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per parameter (by its data pointer), what was not sent so far: not per bucket, as DDP rebuilds its
    buckets after the first step."""


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Each rank picks the largest ceil(ratio * numel) of every gradient (plus its residual); one
    all-gather per bucket carries values and int32 indices (bit-cast to fp32, so one tensor of 2k
    elements per rank); every rank sums what all sent into a zero bucket and divides by the world size."""
    buffer = bucket.buffer()
    picks = [
        select(state, p, g, g.storage_offset() - buffer.storage_offset())
        for p, g in zip(bucket.parameters(), bucket.gradients())
    ]
    values = torch.cat([v for v, _ in picks])
    indices = torch.cat([i for _, i in picks]).to(torch.int32)
    sent = torch.cat([values.float(), indices.view(torch.float32)])
    world = dist.get_world_size(state.group)
    gathered = torch.empty(world * sent.numel(), dtype=sent.dtype, device=sent.device)
    work = all_gather_single(gathered, sent, group=state.group, async_op=True)

    def unpack(_: torch.futures.Future) -> torch.Tensor:
        per_rank = gathered.view(world, 2, -1)
        dense = torch.zeros_like(buffer)
        dense.index_add_(
            0,
            per_rank[:, 1].contiguous().view(torch.int32).flatten().long(),
            per_rank[:, 0].flatten().to(buffer.dtype),
        )
        return dense.div_(world)

    return work.get_future().then(unpack)


def select(
    state: TopKState, param: torch.Tensor, grad: torch.Tensor, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The values and bucket positions this rank sends of one gradient; the rest becomes its residual."""
    key = param.data_ptr()
    corrected = grad.flatten() + state.residuals[key] if key in state.residuals else grad.flatten().clone()
    chosen = corrected.abs().topk(topk_count(grad.numel(), state.ratio), sorted=False).indices
    values = corrected[chosen]
    corrected[chosen] = 0
    state.residuals[key] = corrected
    return values, chosen + offset
