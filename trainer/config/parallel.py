"""`parallel:` (ParallelConfig): tensor and pipeline parallelism inside each data-parallel replica, and
PIPELINE_SCHEDULES. What they do not compose with is composition.py's table."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.errors import _require
from trainer.config.model import ModelConfig

# parallel.pp_schedule: torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
# ScheduleInterleaved1F1B. A str, not an Enum: OmegaConf matches Enum members by name, and "1f1b"
# cannot be a Python name.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

# parallel.cp_impl: how attention sees the whole sequence when each rank holds 1/cp of it
# (trainer/model/context_parallel.py).
CONTEXT_PARALLEL_IMPLS = ("ulysses", "allgather")


TP_SPLIT_KEYS = ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
"""The model's sizes every parallel.tp must divide (each rank holds whole heads and equal slices)."""


@dataclass
class ParallelConfig:
    """conf/parallel/*.yaml: model parallelism inside each data-parallel replica (trainer/rank/tensor_parallel.py).

    The world is `nodes * nproc = pp * dp * tp`; the mesh's dims are ordered pp, dp, tp (trainer/layout.py),
    tp innermost, so a TP group is consecutive ranks inside one node; `zero` shards over dp.
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
    cp: int = 1
    """Context-parallel ranks: each holds 1/cp of every sequence (2 * cp chunks, head-tail balanced), the
    ranks of a cp group read the same samples, and FSDP2 shards over dp x cp (torchtitan's folding)."""
    ep: int = 1
    """Expert-parallel ranks (model.n_experts > 0): each holds n_experts / ep whole experts, and tokens travel
    to their experts' ranks by all-to-all; carved from the ranks FSDP2 shards over (torchtitan's borrowing)."""
    cp_impl: str = "ulysses"
    """ulysses: all-to-all of q, k, v to whole sequences of heads / cp heads, and of the output back
    (DeepSpeed-Ulysses); allgather: K and V all-gathered, each rank's queries against the whole sequence
    (Megatron's CP, without the ring)."""

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
        _require(self.cp >= 1, f"parallel.cp must be an integer >= 1, got {self.cp}")
        _require(self.ep >= 1, f"parallel.ep must be an integer >= 1, got {self.ep}")
        _require(
            self.cp_impl in CONTEXT_PARALLEL_IMPLS,
            f"parallel.cp_impl must be one of {', '.join(CONTEXT_PARALLEL_IMPLS)}, got {self.cp_impl}",
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
        """Data-parallel replicas: the ranks the batch is split over (zero shards over them, times cp)."""
        return world_size // (self.tp * self.pp * self.cp)

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
        self.check_context(model, seq_len)
        self.check_experts(model)
        if self.tp == 1:
            return
        tp, keys = self.tp, TP_SPLIT_KEYS
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

    def check_experts(self, model: ModelConfig) -> None:
        """parallel.ep: a mixture of experts whose experts split evenly over the ep ranks."""
        if self.ep == 1:
            return
        _require(
            model.is_moe,
            f"parallel.ep={self.ep} shards the experts of a mixture of experts, and model={model.name} is dense "
            "(model.n_experts=0); use parallel.ep=1, or a model with experts (e.g. model=tiny-moe)",
        )
        allowed = [d for d in range(1, model.n_experts + 1) if model.n_experts % d == 0]
        _require(
            model.n_experts % self.ep == 0,
            f"parallel.ep={self.ep} must divide model.n_experts={model.n_experts} (each rank holds whole experts); "
            f"allowed: {', '.join(map(str, allowed))}",
        )

    def check_context(self, model: ModelConfig, seq_len: int) -> None:
        """parallel.cp: 2 * cp equal chunks of every sequence; under Ulysses every rank whole heads of its
        tensor-parallel share (heads and kv heads divisible by tp * cp)."""
        if self.cp == 1:
            return
        cp, tp = self.cp, self.tp
        _require(
            seq_len % (2 * cp) == 0,
            f"parallel.cp={cp} splits every sequence into 2 * cp = {2 * cp} chunks (head-tail balanced): "
            f"seq_len={seq_len} must be a multiple of {2 * cp}",
        )
        if self.cp_impl != "ulysses":
            return
        for key in ("n_heads", "n_kv_heads"):
            value = getattr(model, key)
            allowed = [d for d in range(1, value + 1) if value % (d * tp) == 0]
            _require(
                value % (tp * cp) == 0,
                f"model.{key}={value} of model={model.name} must divide by parallel.tp={tp} * parallel.cp={cp} "
                f"under parallel.cp_impl=ulysses (each rank attends whole heads); allowed parallel.cp: "
                f"{', '.join(map(str, allowed))}, or parallel.cp_impl=allgather",
            )
