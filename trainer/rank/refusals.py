"""What the ranks would refuse, refused by the job process before any rank starts (trainer/job.py)
and by the advisor for each candidate (trainer/advise/).

Apart from precision.py and sharding.py, whose FSDP2 and DTensor imports the job process would
otherwise load for two checks of the config (tests/unit/test_imports.py keeps them out of it).
"""

from __future__ import annotations

from trainer.config import (
    LOSS_FAULTS,
    ConfigError,
    Fp8Recipe,
    PrecisionConfig,
    ReduceDType,
    TrainConfig,
    ZeroConfig,
)
from trainer.layout import Layout
from trainer.model.fp8 import float8_config


def check_device_support(zero: ZeroConfig, device_kind: str) -> None:
    """Refuse before any rank starts what DDP would refuse in every rank: torch's bf16_compress_hook
    is allowed only on CUDA with NCCL (DistributedDataParallel.register_comm_hook checks it by name)."""
    if zero.reduce_dtype == ReduceDType.bf16 and not zero.uses_fsdp and device_kind != "cuda":
        raise ConfigError(
            f"zero.reduce_dtype=bf16 with zero={zero.stage.value} needs CUDA and NCCL (torch's bf16_compress_hook for DDP); "
            f"on {device_kind} use zero.reduce_dtype=fp32, or zero=stage2 or stage3 (FSDP2 reduces in bf16 on gloo too)"
        )


def check_fp8_support(precision: PrecisionConfig, zero: ZeroConfig, device_kind: str) -> None:
    """Refuse before any rank starts what precision=fp8 cannot run here: torchao absent, fp8
    all-gather off CUDA (gloo carries no float8 dtype) or without FSDP2, and torchao's emulated
    rowwise_with_gw_hp under autocast (its backward mixes the bf16 gradient with the fp32 input)."""
    if not precision.is_fp8:
        return
    float8_config(precision, device_kind)  # one line naming the extra when torchao is absent
    recipe = precision.fp8_recipe.value
    if precision.fp8_all_gather and device_kind != "cuda":
        raise ConfigError(
            f"precision.fp8_all_gather=true needs CUDA and NCCL: the {device_kind} ranks' gloo backend cannot "
            "all-gather float8 tensors; use precision.fp8_all_gather=false"
        )
    if precision.fp8_all_gather and not zero.uses_fsdp:
        raise ConfigError(
            f"precision.fp8_all_gather=true with zero={zero.stage.value}: only FSDP2 all-gathers weights; "
            "use zero=stage2 or stage3, or precision.fp8_all_gather=false"
        )
    if precision.fp8_recipe == Fp8Recipe.rowwise_with_gw_hp and device_kind != "cuda" and not zero.uses_fsdp:
        raise ConfigError(
            f"precision.fp8_recipe={recipe} with zero={zero.stage.value} on {device_kind}: torchao's emulated "
            "backward fails under autocast; use precision.fp8_recipe=tensorwise or rowwise, or zero=stage2 or stage3"
        )


def check_pipeline_fault(config: TrainConfig, layout: Layout) -> None:
    """A fault that changes the loss (LOSS_FAULTS) under parallel.pp: only the ranks of the last stage take a
    loss (each pipeline's last pp rank, whatever the schedule: trainer/rank/pipeline.py rank_stages)."""
    if config.parallel.pp == 1 or config.fault.kind not in LOSS_FAULTS:
        return
    last = [rank for rank in range(layout.world_size) if layout.coords(rank)["pp"] == config.parallel.pp - 1]
    if config.fault.rank not in last:
        raise ConfigError(
            f"fault.kind={config.fault.kind.value} with parallel.pp={config.parallel.pp} changes the loss, which only "
            f"the last stage's ranks take: fault.rank={config.fault.rank} is not one; use fault.rank in "
            f"{', '.join(map(str, last))}"
        )
