"""Mixed precision: autocast for DDP stages, FSDP2's MixedPrecisionPolicy, and the fp16 loss scaler.

Master weights and optimizer state are fp32 in every mode: autocast casts per op and FSDP2
casts the unsharded copy, while the sharded parameters the optimizer updates stay fp32.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.amp import GradScaler
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from trainer.config import DType, PrecisionConfig, ReduceDType, ZeroConfig
from trainer.private_apis.of_torch import scale_on_device

TORCH_DTYPES = {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16, DType.float16: torch.float16}
REDUCE_DTYPES = {ReduceDType.fp32: torch.float32, ReduceDType.bf16: torch.bfloat16}


def compute_dtype(precision: PrecisionConfig) -> torch.dtype:
    return TORCH_DTYPES[precision.compute_dtype]


def build_autocast(
    precision: PrecisionConfig, zero: ZeroConfig, device: torch.device
) -> AbstractContextManager:
    """torch.autocast for DDP stages in bf16/fp16; FSDP2 casts through its policy instead."""
    if precision.compute_dtype == DType.float32 or zero.uses_fsdp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype(precision))


def build_mp_policy(precision: PrecisionConfig, zero: ZeroConfig) -> MixedPrecisionPolicy:
    """FSDP2 all-gathers parameters in the compute dtype and reduce-scatters gradients in zero.reduce_dtype.

    The sharded gradients the optimizer reads stay in the parameters' fp32 either way: FSDP2
    casts the reduced shard back.
    """
    param_dtype = None if precision.compute_dtype == DType.float32 else compute_dtype(precision)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=REDUCE_DTYPES[zero.reduce_dtype])


def build_grad_scaler(
    precision: PrecisionConfig, zero: ZeroConfig, device: torch.device, pipelined: bool = False
) -> GradScaler:
    """Always present, enabled only for fp16 (nanoGPT's habit: one code path for every precision).

    FSDP2 needs ShardedGradScaler: each rank sees only its gradient shard, so the overflow
    flag must be all-reduced for every rank to skip the same step. Under DDP the gradients
    are already all-reduced, so an overflow anywhere is an overflow everywhere.
    Pipelined (parallel.pp > 1), each rank holds only its stages' gradients: ShardedGradScaler too, so that the
    whole pipeline keeps one loss scale (its flag all-reduced over every rank, pp and dp alike).
    """
    scaler_cls = ShardedGradScaler if zero.uses_fsdp or pipelined else GradScaler
    return scaler_cls(
        device=device.type,
        init_scale=precision.loss_scale_init,
        growth_factor=precision.growth_factor,
        backoff_factor=precision.backoff_factor,
        growth_interval=precision.growth_interval,
        enabled=precision.is_fp16,
    )


def update_loss_scale(scaler: GradScaler, min_loss_scale: float) -> None:
    """scaler.update(), then hold the scale at the floor GradScaler itself does not have.

    The floor is applied on the device (a clamp handed back through update's `new_scale`):
    reading the scale (get_scale() is a .item()) would sync the host with the GPU every step.
    """
    scaler.update()
    if scaler.is_enabled():
        scale = scale_on_device(scaler)  # the scale tensor itself; GradScaler has no public getter
        scaler.update(new_scale=torch.clamp(scale, min=min_loss_scale))


def precompute_fp8_scales(model: torch.nn.Module, precision: PrecisionConfig) -> None:
    """After each optimizer step under fp8 all-gather: every weight's fp8 scale in one all-reduce
    (torchao's precompute_float8_dynamic_scale_for_fsdp) instead of one per weight in the next forward."""
    if precision.fp8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
