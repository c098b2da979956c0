"""AdamW (fp32 state), its ZeRO-1 sharding, the warmup + cosine schedule, gradient clipping."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.amp import GradScaler
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import OffloadConfig, OffloadTarget, OptimConfig, Stage, ZeroConfig
from trainer.private_apis.of_torch import found_inf_per_device, set_last_lr
from trainer.rank.compression import apply_local_sgd
from trainer.rank.trainee import local_optimizer
from trainer.units import MIB


def build_optimizer(
    model: nn.Module,
    optim: OptimConfig,
    zero: ZeroConfig,
    fused: bool = False,
    offload: OffloadConfig | None = None,
    rank: int = 0,
    group: ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """AdamW over the rank's parameters; under stage1 each rank keeps the state of its partition only;
    under offload=nvme its moments live in a file (trainer/rank/nvme.py). `group`: the data-parallel ranks
    that hold the same parameters (DDP's), over which stage1 partitions and local SGD averages: under
    parallel.pp one stage's replicas, else every rank (None: the default group)."""
    hyper = dict(
        lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay
    )
    if offload is not None and offload.target == OffloadTarget.nvme:
        from trainer.rank.nvme import NvmeAdamW

        directory, buffer = Path(offload.path), offload.buffer_mib * MIB
        return apply_local_sgd(NvmeAdamW(model.parameters(), directory, rank, buffer, **hyper), zero, group)
    kwargs = dict(**hyper, fused=fused)
    # One rank has nothing to partition, and ZeroRedundancyOptimizer would still broadcast every parameter
    # to itself after each step (over its group, whose size is its partition count).
    if zero.stage == Stage.stage1 and dist.get_world_size(group) > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # see trainee.local_optimizer

        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, process_group=group, **kwargs
        )
    # Under FSDP2 the parameters are DTensor shards, so this state is sharded too.
    return apply_local_sgd(torch.optim.AdamW(parameter_groups(model), **kwargs), zero, group)


def parameter_groups(model: nn.Module) -> list[nn.Parameter] | list[dict[str, list[nn.Parameter]]]:
    """The model's parameters, as one group; under DDP with parallel.ep two, the experts' DTensors and the plain
    rest (`kinds_of`): AdamW's foreach and fused kernels (CUDA's defaults) step a group's tensors in one call,
    which DTensor refuses for a list of both kinds."""
    params = list(model.parameters())
    kinds = kinds_of(params)
    return params if len(kinds) == 1 else [{"params": kind} for kind in kinds]


def step_unless(optimizer: torch.optim.Optimizer, scaler: GradScaler, skip: torch.Tensor) -> None:
    """Step a fused AdamW unless `skip` (a device scalar, 1.0: skip), without a host sync.

    This is GradScaler.step's own path for optimizers that take `found_inf` (torch.amp's
    `_step_supports_amp_scaling` protocol): the fused kernel leaves parameters, moments and the
    step count untouched where found_inf is set. Here found_inf is the scaler's overflow (fp16;
    unscale_ already divided the gradients, hence grad_scale None) or the non-finite policy's skip.
    ZeroRedundancyOptimizer steps its wrapped AdamW, which is the one that reads the flags.
    """
    inner = local_optimizer(optimizer)
    found_inf = skip
    if scaler.is_enabled():
        overflow = sum(found_inf_per_device(scaler, optimizer).values())  # filled by unscale_
        found_inf = torch.maximum(
            found_inf, overflow.to(skip.device).reshape(())
        )  # ShardedGradScaler keeps shape [1]
    inner.grad_scale, inner.found_inf = None, on_params_device(inner, found_inf)
    try:
        optimizer.step()
    finally:
        del inner.grad_scale, inner.found_inf


def on_params_device(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> torch.Tensor:
    """The skip flag on the device the optimizer steps on, copied so that it has arrived.

    Under offload=cpu the parameters are host tensors and the fused AdamW steps on the CPU. Handed
    the GPU flag, it would copy it with non_blocking=True (torch/optim/adam.py `_fused_adamw`) and
    read the host copy at once, before the copy had landed: a race. A blocking copy makes the
    decision reach the CPU step first; it costs no extra sync, since the offloaded step already
    waits for the gradients' device-to-host copies (FSDP2 synchronises on them).
    """
    device = next(p.device for group in optimizer.param_groups for p in group["params"])
    return flag if flag.device == device else flag.to(device)  # blocking: see above


def lr_multiplier(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at the last step (step is 0-based)."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, optim, total_steps))


def rewind_scheduler(scheduler: LambdaLR, steps: int) -> None:
    """Set the schedule back to where it was after `steps` steps (the learning rate included).

    A stop that the host learns of after the fact (trainer/rank/nonfinite.py's deferred read) leaves
    the weights of the last good step, but the scheduler went on stepping: its save must match.
    """
    scheduler.last_epoch = steps
    lrs = [base * fn(steps) for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    set_last_lr(scheduler, lrs)  # what get_last_lr() returns; LambdaLR has no public setter


def clip_gradients(model: nn.Module, max_norm: float, stages: ProcessGroup | None = None) -> torch.Tensor:
    """The global gradient norm (before clipping), clipping when max_norm > 0.

    For FSDP2's DTensor gradients torch computes the norm over all shards (one all-reduce);
    under DDP every rank already holds the reduced gradients. `stages` (parallel.pp > 1): the pp group,
    whose ranks each hold some stages' gradients: their squared norms are summed over it (torch's
    clip_grad_norm_ knows no pipeline; torchtitan's dist_utils.clip_grad_norm_ does the same). Under DDP
    with parallel.ep the experts' gradients are DTensors and the rest plain tensors, and under an ep group inside
    FSDP2's ranks DTensors of two meshes, which torch's foreach norm refuses in one list: each kind is normed
    (and clipped) apart (`mixed_norm`).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    kinds = kinds_of(params)
    if stages is None and len(kinds) == 1:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    squared = mixed_norm(kinds) ** 2
    if stages is not None:
        dist.all_reduce(squared, group=stages)
    total = squared.sqrt()
    if max_norm > 0:
        for kind in kinds:
            torch.nn.utils.clip_grads_with_norm_(kind, max_norm, total)
    return total


def kinds_of(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters split into DTensors, one list per mesh (FSDP2's, and under an ep group inside the
    data-parallel ranks the experts' 2-D one: DTensor's foreach ops take one mesh), then plain tensors; the kinds
    that present, in order of first appearance."""
    kinds: dict[object, list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return sorted(kinds.values(), key=lambda kind: not isinstance(kind[0], DTensor))


def mixed_norm(kinds: list[list[nn.Parameter]]) -> torch.Tensor:
    """The 2-norm of every gradient of every kind: each kind's total norm (a DTensor's over all its shards,
    one all-reduce), then, of two kinds, the norm of those."""
    if len(kinds) <= 1:  # torch's own total norm (of no gradient: 0)
        norm = torch.nn.utils.get_total_norm([p.grad for kind in kinds for p in kind])
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norms = []
    for kind in kinds:
        norm = torch.nn.utils.get_total_norm([p.grad for p in kind])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms))
