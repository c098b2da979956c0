"""`parallel:` (ParallelConfig): tensor and pipeline parallelism inside each data-parallel replica,
PIPELINE_SCHEDULES, and what they do not compose with (`model_parallel_refusals`, the `check_*` methods)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.config.enums import (
    Compression,
    DataKind,
    FaultKind,
    LossKind,
    OffloadTarget,
    Packing,
    ReduceEvery,
    Stage,
)
from trainer.config.errors import _require
from trainer.config.model import ModelConfig
from trainer.config.zero import ZeroConfig

if TYPE_CHECKING:  # train.py imports this module: the root config is named in annotations only
    from trainer.config.train import TrainConfig


def model_parallel_refusals(config: TrainConfig) -> tuple[tuple[bool, str, str], ...]:
    """What neither tensor nor pipeline parallelism composes with here: (refused, key, way out)."""
    zero = config.zero
    return (
        (zero.stage == Stage.stage1, "zero=stage1", "use zero=stage0, stage2 or stage3"),
        (zero.shard_ranks is not None, "zero.shard_ranks", "use zero.shard_ranks=null"),
        (zero.hpz_ranks is not None, "zero.hpz_ranks", "use zero.hpz_ranks=null"),
        (zero.compression != Compression.none, "zero.compression", "use zero.compression=none"),
        (zero.sync_every > 1, "zero.sync_every", "use zero.sync_every=1"),
        (config.compile, "compile=true", "use compile=false"),
        (config.model.weights is not None, "model.weights", "use model.weights=null"),
        (config.precision.is_fp8, "precision=fp8", "use precision=bf16"),
        (
            config.data.kind == DataKind.text and config.data.packing == Packing.document,
            "data.packing=document",
            "use data.packing=concat",
        ),
    )


# parallel.pp_schedule: torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
# ScheduleInterleaved1F1B. A str, not an Enum: OmegaConf matches Enum members by name, and "1f1b"
# cannot be a Python name.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass
class ParallelConfig:
    """conf/parallel/*.yaml: model parallelism inside each data-parallel replica (trainer/rank/tensor_parallel.py).

    The world is `nodes * nproc = dp * tp` (and `* pp` once pipeline parallelism joins: the mesh's dims are
    ordered dp, pp, tp, tp innermost, so a TP group is consecutive ranks inside one node); `zero` shards over dp.
    """

    tp: int = 1
    """Tensor-parallel ranks per model replica (Megatron-LM's column- and row-parallel layers, torch's
    parallelize_module); a divisor of nproc and of the attention heads."""
    sp: bool | None = None
    """Sequence parallelism: norms and the residual stream sharded over the sequence between blocks
    (reduce-scatter + all-gather in place of all-reduce); null: on whenever tp > 1."""
    pp: int = 1
    """Pipeline stages (ranks) per model replica: consecutive blocks on consecutive stages, the
    embedding on the first, the norm, head and loss on the last (torch.distributed.pipelining)."""
    pp_schedule: str = "1f1b"
    """gpipe: every micro-batch forward, then every backward; 1f1b: one forward, one backward after
    the warm-up; interleaved_1f1b: 1F1B over pp_virtual_stages stages per rank."""
    pp_virtual_stages: int = 2
    """Stages per rank under interleaved_1f1b (the blocks are split into pp * pp_virtual_stages stages)."""

    def __post_init__(self) -> None:
        _require(self.tp >= 1, f"parallel.tp must be an integer >= 1, got {self.tp}")
        _require(self.pp >= 1, f"parallel.pp must be an integer >= 1, got {self.pp}")
        _require(
            self.pp_schedule in PIPELINE_SCHEDULES,
            f"parallel.pp_schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {self.pp_schedule}",
        )
        _require(
            self.pp_virtual_stages >= 1,
            f"parallel.pp_virtual_stages must be an integer >= 1, got {self.pp_virtual_stages}",
        )
        _require(
            not self.sp or self.tp > 1,
            "parallel.sp=true shards the sequence over the tensor-parallel group: it needs parallel.tp > 1",
        )

    @property
    def sequence_parallel(self) -> bool:
        """parallel.sp as set, or (null) whether tp > 1: the key keeps the value its file gave it."""
        return self.tp > 1 if self.sp is None else self.sp

    def dp(self, world_size: int) -> int:
        """Data-parallel replicas: the ranks zero shards over, and the batch is split over."""
        return world_size // (self.tp * self.pp)

    @property
    def stages(self) -> int:
        """Pipeline stages over all ranks of a replica: pp, times pp_virtual_stages when interleaved."""
        interleaved = self.pp_schedule == "interleaved_1f1b"
        return self.pp * (self.pp_virtual_stages if interleaved else 1)

    def check_pipeline(self, model: ModelConfig, grad_accum: int) -> None:
        """Every stage holds at least one block; 1F1B's warm-up needs a micro-batch per stage in flight."""
        if self.pp == 1:
            return
        _require(
            self.stages <= model.n_layers,
            f"parallel.pp={self.pp} makes {self.stages} pipeline stages but model={model.name} has "
            f"{model.n_layers} blocks (model.n_layers); allowed: parallel.pp * stages per rank <= {model.n_layers}",
        )
        _require(
            self.pp_schedule == "gpipe" or grad_accum >= self.pp,
            f"parallel.pp_schedule={self.pp_schedule} streams grad_accum={grad_accum} micro-batches through "
            f"parallel.pp={self.pp} stages; allowed: grad_accum >= {self.pp}",
        )
        _require(
            self.pp_schedule != "interleaved_1f1b" or grad_accum % self.pp == 0,
            f"parallel.pp_schedule=interleaved_1f1b needs grad_accum={grad_accum} a multiple of parallel.pp={self.pp}",
        )

    def check_model(self, model: ModelConfig, seq_len: int) -> None:
        """Every rank must hold whole heads and equal slices (ColwiseParallel / RowwiseParallel shard evenly here)."""
        if self.tp == 1:
            return
        tp, keys = self.tp, ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
        values = [getattr(model, key) for key in keys]
        allowed = ", ".join(str(d) for d in range(1, min(values) + 1) if all(v % d == 0 for v in values))
        for key, value in zip(keys, values):
            _require(
                value % tp == 0,
                f"parallel.tp={tp} must divide model.{key}={value} of model={model.name} "
                f"(each rank holds whole heads and equal slices); allowed: {allowed}",
            )
        _require(
            not self.sequence_parallel or seq_len % tp == 0,
            f"parallel.sp=true shards the sequence: seq_len={seq_len} must divide by parallel.tp={tp}",
        )
        _require(
            not model.tie_embeddings,
            f"parallel.tp={tp} with model.tie_embeddings=true is not supported: the embedding (row-wise) and the "
            "output head (column-wise) shard the one tied weight two ways; use parallel.tp=1",
        )

    def check_composition(self, config: TrainConfig) -> None:
        """What tensor parallelism does not compose with here: one line naming both keys."""
        self.check_pipeline_composition(config)
        if self.tp == 1:
            return
        tp = f"parallel.tp={self.tp}"
        refusals = (
            (config.offload.target != OffloadTarget.none, "offload=cpu", "use offload=none"),
            (
                config.loss.kind == LossKind.chunked,
                "loss=chunked",
                "use loss=full (loss_parallel shards the logits)",
            ),
            # Not yet proven: the weights' reader slices FSDP2's shards, not tensor-parallel ones; and
            # the block-causal mask's attention under sequence parallelism.
            *model_parallel_refusals(config),
        )
        for refused, key, way_out in refusals:
            _require(not refused, f"{tp} with {key} is not supported; {way_out} or parallel.tp=1")

    def check_pipeline_composition(self, config: TrainConfig) -> None:
        """What pipeline parallelism (trainer/rank/pipeline.py) does not compose with here: one line naming both keys.

        Not yet built or not yet proven with the schedules: each is refused rather than run half-way."""
        if self.pp == 1:
            return
        pp = f"parallel.pp={self.pp}"
        refusals = (
            (self.tp > 1, f"parallel.tp={self.tp}", "use parallel.tp=1"),
            (config.offload.target != OffloadTarget.none, "offload=cpu", "use offload=none"),
            (
                config.loss.kind == LossKind.chunked,
                "loss=chunked",
                "use loss=full (the last stage takes the loss)",
            ),
            *model_parallel_refusals(config),
            # The schedule reduces the gradients once, after the step's last backward (PipelineStage).
            (
                config.zero.reduce_every != ReduceEvery.step,
                "zero.reduce_every=micro_batch",
                "use zero.reduce_every=step",
            ),
            (
                not config.zero.reshard_after_backward,
                "zero.reshard_after_backward=false",
                "use zero.reshard_after_backward=true",
            ),
            (
                config.model.tie_embeddings,
                "model.tie_embeddings=true",
                "the embedding (first stage) and the head (last stage) cannot share one weight; use a model without tied embeddings",
            ),
            (config.eval.every > 0, "eval.every", "use eval.every=0"),
            (config.fault.kind != FaultKind.none, "fault.kind", "use fault.kind=none"),
        )
        for refused, key, way_out in refusals:
            _require(not refused, f"{pp} with {key} is not supported; {way_out} or parallel.pp=1")

    def check_world(self, nproc: int, nodes: int, zero: ZeroConfig) -> None:
        """A TP group is consecutive ranks inside one node: tp divides nproc. DDP replicates no DTensor
        parameters here (trainer/rank/sharding.py), so stage0 only with one data-parallel replica."""
        allowed = ", ".join(str(d) for d in range(1, nproc + 1) if nproc % d == 0)
        world = nodes * nproc
        _require(
            nproc % self.tp == 0,
            f"parallel.tp={self.tp} must divide nproc={nproc} (a tensor-parallel group stays inside one node "
            f"of {nproc} ranks); allowed: {allowed}",
        )
        _require(
            world % (self.tp * self.pp) == 0,
            f"parallel.pp={self.pp} * parallel.tp={self.tp} must divide the world of {world} ranks (nodes * nproc); "
            f"allowed parallel.pp: {', '.join(str(d) for d in range(1, world // self.tp + 1) if (world // self.tp) % d == 0)}",
        )
        dp = self.dp(nodes * nproc)
        _require(
            self.tp == 1 or zero.uses_fsdp or dp == 1,
            f"parallel.tp={self.tp} with zero={zero.stage.value} on {dp} data-parallel replicas is not supported (torch's "
            f"DDP holds tensor-parallel parameters as local tensors); use zero=stage2 or stage3, or parallel.tp={nodes * nproc}",
        )
