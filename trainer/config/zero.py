"""`zero:` (ZeroConfig): how model states are sharded, when gradients are reduced and how they are
compressed; STAGE_REDUCE_EVERY, each stage's zero.reduce_every."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from trainer.config.enums import Compression, ReduceDType, ReduceEvery, Stage
from trainer.config.errors import _require

STAGE_REDUCE_EVERY = {
    Stage.stage0: ReduceEvery.step,
    Stage.stage1: ReduceEvery.step,
    Stage.stage2: ReduceEvery.micro_batch,
    Stage.stage3: ReduceEvery.micro_batch,
}
"""zero.reduce_every as each conf/zero option file sets it (tests/configs checks they agree): what a
suggestion that changes the stage (`zero=stage3`) runs with."""


def reduce_every_default(choice: str, pp: int) -> str:
    """`${zerolab.reduce_every:micro_batch,${parallel.pp}}`, conf/zero/stage2.yaml's and stage3.yaml's value:
    their `choice`, or `step` under a pipeline, whose PipelineStage reduces the gradients once after the step's
    last backward (the composition table refuses an explicit zero.reduce_every=micro_batch with parallel.pp)."""
    return ReduceEvery.step.value if int(pp) > 1 else choice


# Registered on import: whatever composes conf/ (the job, the checks, the tests) validates into ZeroConfig.
if not OmegaConf.has_resolver("zerolab.reduce_every"):
    OmegaConf.register_new_resolver("zerolab.reduce_every", reduce_every_default)


@dataclass
class ZeroConfig:
    """conf/zero/*.yaml: how model states are sharded across data-parallel ranks."""

    stage: Stage = Stage.stage0
    """stage0 DDP; stage1 + ZeroRedundancyOptimizer; stage2/3 FSDP2 fully_shard."""
    reduce_dtype: ReduceDType = ReduceDType.fp32
    """Dtype gradients are reduced in: fp32, or bf16 (FSDP2: MixedPrecisionPolicy.reduce_dtype; DDP: torch's bf16_compress_hook)."""
    bucket_cap_mb: float | None = None
    """DDP (stage0/1) only: gradient bucket size in MiB (DistributedDataParallel's bucket_cap_mb); None: torch's default."""
    shard_ranks: int | None = None
    """stage2/3: ranks each model state is sharded over (FSDP2's shard mesh dim); None: every rank. A divisor
    of the world size (typically nproc, one node) gives HSDP: shards replicated across the groups (trainer/plan/groups.py)."""
    hpz_ranks: int | None = None
    """stage3: ZeRO++'s hpZ, FSDP2 fully_shard(reshard_after_forward=<int>): after forward each block keeps a
    secondary shard over groups of this many ranks, so backward's all-gather stays inside one; None: none."""
    reduce_every: ReduceEvery = ReduceEvery.step
    """With grad_accum > 1, when gradients are reduced: micro_batch (every backward: stage2/3 reduce-scatter into
    the rank's gradient shard, which accumulates; stage0/1 all-reduce) or step (the last micro-batch only; a full
    unsharded gradient is held in between). Each conf/zero option sets its own default."""
    reshard_after_backward: bool = True
    """stage2/3 with grad_accum > 1: false keeps every FSDP2 group's parameters unsharded from a micro-batch's
    backward to the next forward (FSDPModule.set_reshard_after_backward(False) on every micro-batch but the
    last), which skips that forward's all-gathers for the memory of the unsharded parameters; true: torch's default."""
    compression: Compression = Compression.none
    """stage0/1: DDP communication hook compressing the gradient all-reduce (trainer/rank/compression.py): none,
    powersgd (torch's powerSGD_hook) or topk (the largest zero.topk_ratio of each gradient, with error feedback)."""
    powersgd_rank: int = 1
    """PowerSGDState.matrix_approximation_rank: the rank of each gradient matrix's approximation."""
    powersgd_start_step: int = 10
    """PowerSGDState.start_powerSGD_iter: gradient reductions all-reduced exactly before compression starts (>= 2)."""
    topk_ratio: float = 0.01
    """Share of each gradient tensor's elements zero.compression=topk sends, in (0, 1]."""
    sync_every: int = 1
    """stage0: local SGD (torch's post_localSGD_hook and PeriodicModelAverager) when > 1: after zero.sync_warmup_steps
    synchronous steps each rank steps on its own gradients and parameters are averaged every this many steps."""
    sync_warmup_steps: int = 10
    """zero.sync_every > 1: the first optimizer steps, with gradients all-reduced as usual (start_localSGD_iter)."""

    def __post_init__(self) -> None:
        self.check_groups()
        self.check_reshard_after_backward()
        self.check_compression()
        if self.bucket_cap_mb is None:
            return
        _require(self.bucket_cap_mb > 0, f"zero.bucket_cap_mb must be > 0 or null, got {self.bucket_cap_mb}")
        _require(
            not self.uses_fsdp,
            f"zero.bucket_cap_mb applies to DDP buckets (zero=stage0 or stage1), got zero={self.stage.value}; FSDP2 reduces per block",
        )

    def check_groups(self) -> None:
        """What the keys alone decide; trainer/plan/groups.py checks them against the world size."""
        if self.shard_ranks is not None:
            _require(self.shard_ranks >= 1, f"zero.shard_ranks must be >= 1 or null, got {self.shard_ranks}")
            _require(
                self.uses_fsdp,
                f"zero.shard_ranks shards FSDP2's states (zero=stage2 or stage3), got zero={self.stage.value}",
            )
        if self.hpz_ranks is not None:
            _require(
                self.stage == Stage.stage3,
                f"zero.hpz_ranks (hpZ: reshard_after_forward=<int>) needs zero=stage3, got zero={self.stage.value}",
            )
            _require(self.hpz_ranks >= 2, f"zero.hpz_ranks must be >= 2 or null, got {self.hpz_ranks}")

    def check_reshard_after_backward(self) -> None:
        if self.reshard_after_backward:
            return
        _require(
            self.uses_fsdp,
            f"zero.reshard_after_backward=false keeps FSDP2's parameters unsharded between micro-batches: it needs "
            f"zero=stage2 or stage3, got zero={self.stage.value}",
        )
        _require(
            self.hpz_ranks is None,
            "zero.reshard_after_backward=false with zero.hpz_ranks is not planned: hpZ's secondary shards and blocks "
            "kept whole between micro-batches are not modelled together; use zero.hpz_ranks=null or zero.reshard_after_backward=true",
        )

    def check_compression(self) -> None:
        """The ranges of the compression keys, then what composes: each method is a DDP communication hook,
        and DDP takes one (zero.reduce_dtype=bf16 is torch's bf16_compress_hook)."""
        _require(0 < self.topk_ratio <= 1, f"zero.topk_ratio must be in (0, 1], got {self.topk_ratio}")
        _require(self.powersgd_rank >= 1, f"zero.powersgd_rank must be >= 1, got {self.powersgd_rank}")
        _require(
            self.powersgd_start_step >= 2,
            f"zero.powersgd_start_step must be >= 2 (torch's PowerSGD with error feedback starts after DDP rebuilds "
            f"its buckets), got {self.powersgd_start_step}",
        )
        _require(self.sync_every >= 1, f"zero.sync_every must be >= 1, got {self.sync_every}")
        _require(
            self.sync_warmup_steps >= 0, f"zero.sync_warmup_steps must be >= 0, got {self.sync_warmup_steps}"
        )
        methods = (
            [f"zero.compression={self.compression.value}"] if self.compression != Compression.none else []
        )
        methods += [f"zero.sync_every={self.sync_every}"] if self.sync_every > 1 else []
        if not methods:
            return
        _require(
            not self.uses_fsdp,
            f"{methods[0]} hooks DDP's gradient all-reduce (zero=stage0 or stage1), got zero={self.stage.value}; "
            "allowed there: zero.compression=none, zero.sync_every=1",
        )
        hooks = methods + (["zero.reduce_dtype=bf16"] if self.reduce_dtype == ReduceDType.bf16 else [])
        _require(
            len(hooks) == 1,
            f"{' and '.join(hooks)} are each a DDP communication hook and DDP takes one: choose one",
        )
        if self.sync_every > 1:
            self.check_local_sgd()

    def check_local_sgd(self) -> None:
        _require(
            self.stage == Stage.stage0,
            f"zero.sync_every={self.sync_every} (local SGD) needs zero=stage0: under stage1 each rank steps one "
            "partition and broadcasts it, so no rank ever steps alone; use zero.sync_every=1",
        )
        _require(
            self.reduce_every == ReduceEvery.step,
            f"zero.sync_every={self.sync_every} needs zero.reduce_every=step: post_localSGD_hook counts its warm-up in "
            "reductions, PeriodicModelAverager in optimizer steps",
        )

    @property
    def uses_fsdp(self) -> bool:
        return self.stage in (Stage.stage2, Stage.stage3)
