"""The typed schema: one dataclass per config group and the root config.

Hydra composes conf/ against `TrainConfig` (registered as `train_schema` by trainer/cli.py), so a misspelt key
or a value of the wrong type fails at compose time. Range and cross-field rules live in
`__post_init__`, which OmegaConf runs only in `OmegaConf.to_object`: `validate` below is the
first thing a job does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A user mistake in the composed config; its message names the dotted key."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# OmegaConf 2.3 rejects Literal[...]; a str Enum validates at compose time and prints the
# allowed names. Enum members are matched by name, so each name equals its value.
class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Fp8Recipe(str, Enum):
    """precision.fp8_recipe: none, or one of torchao's named recipes (Float8LinearRecipeName)."""

    none = "none"
    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"


class Stage(str, Enum):
    stage0 = "stage0"
    stage1 = "stage1"
    stage2 = "stage2"
    stage3 = "stage3"


class ReduceDType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Compression(str, Enum):
    none = "none"
    powersgd = "powersgd"
    topk = "topk"


class ReduceEvery(str, Enum):
    micro_batch = "micro_batch"
    step = "step"


STAGE_REDUCE_EVERY = {
    Stage.stage0: ReduceEvery.step,
    Stage.stage1: ReduceEvery.step,
    Stage.stage2: ReduceEvery.micro_batch,
    Stage.stage3: ReduceEvery.micro_batch,
}
"""zero.reduce_every as each conf/zero option file sets it (tests/configs checks they agree): what a
suggestion that changes the stage (`zero=stage3`) runs with."""


class CheckpointMode(str, Enum):
    none = "none"
    full = "full"
    selective = "selective"
    op = "op"


class OffloadTarget(str, Enum):
    none = "none"
    cpu = "cpu"


class DataKind(str, Enum):
    synthetic = "synthetic"
    tokens = "tokens"
    text = "text"


class Packing(str, Enum):
    concat = "concat"
    document = "document"


class LoggerBackend(str, Enum):
    wandb = "wandb"
    none = "none"


class Mode(str, Enum):
    train = "train"
    plan = "plan"
    advise = "advise"


class DeviceKind(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


# `raise` is a keyword, so this Enum is built from a mapping rather than a class body.
NonFinitePolicy = Enum("NonFinitePolicy", {"raise": "raise", "skip": "skip"}, type=str)


class AttentionKernel(str, Enum):
    auto = "auto"
    flash = "flash"
    efficient = "efficient"
    math = "math"


class RopeScaling(str, Enum):
    none = "none"
    llama3 = "llama3"


class LossKind(str, Enum):
    full = "full"
    chunked = "chunked"


class HfExport(str, Enum):
    none = "none"
    last = "last"


class FaultKind(str, Enum):
    none = "none"
    inf_grad = "inf_grad"
    nan_loss = "nan_loss"
    raise_error = "raise_error"
    kill = "kill"
    kill_during_save = "kill_during_save"
    term_during_save = "term_during_save"
    oom = "oom"
    hang = "hang"


class SaveAsync(str, Enum):
    """save.async_mode: how a save is written (torch.distributed.checkpoint.async_save's AsyncCheckpointerType)."""

    off = "off"
    thread = "thread"
    process = "process"


@dataclass
class ModelConfig:
    """conf/model/*.yaml: the shape of a Llama-style decoder."""

    name: str = "tiny"
    """Preset name, reported in logs."""
    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads."""
    n_kv_heads: int = 2
    """Key/value heads; fewer than n_heads is grouped-query attention."""
    vocab_size: int = 512
    """Token vocabulary."""
    ffn_dim: int = 384
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 512
    """Longest context the model accepts."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    head_dim: int | None = None
    """Width of each attention head; None: dim / n_heads (Qwen3 sets it apart, e.g. 128 at dim 1024 with 16 heads)."""
    tie_embeddings: bool = False
    """The output head reuses the token embedding's weight: one parameter (Llama-3.2 1B/3B, small Qwen3)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before the rotary embedding (Qwen3)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    rope_scaling: RopeScaling = RopeScaling.none
    """none, or llama3: Llama-3.1's rotary frequency scaling (the rope_* keys below)."""
    rope_factor: float = 8.0
    """rope_scaling=llama3 only: low frequencies are divided by this."""
    rope_low_freq_factor: float = 1.0
    """rope_scaling=llama3 only: wavelengths above original_max_seq_len / this are scaled fully."""
    rope_high_freq_factor: float = 4.0
    """rope_scaling=llama3 only: wavelengths below original_max_seq_len / this are kept."""
    rope_original_max_seq_len: int = 8192
    """rope_scaling=llama3 only: the context the frequencies were trained for before scaling."""
    config: str | None = None
    """model=hf only: a Hugging Face config.json (or a directory holding one) whose shapes replace the keys
    above (trainer/model/hf_config.py); LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM."""
    weights: str | None = None
    """A Hugging Face checkpoint directory (safetensors) loaded in place of the initialisation before step 1
    (trainer/model/hf_weights.py); with model=hf, model.config defaults to it."""
    weights_sha256: str | None = None
    """Set by the job, not by hand: the first 16 hex digits of sha256 over model.weights' safetensors files."""

    def __post_init__(self) -> None:
        if self.weights is not None:
            self.weights = str(Path(self.weights).expanduser().resolve())
            if self.name == "hf" and self.config is None:
                self.config = self.weights  # the checkpoint's own config.json
        _require(
            self.name != "hf" or self.config is not None,
            "model=hf needs model.config=<a Hugging Face config.json, or a directory holding one>",
        )
        if self.config is not None:
            self._apply_hf_config()
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            _require(getattr(self, key) >= 1, f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.head_dim is None:
            _require(
                self.dim % self.n_heads == 0,
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}), or set model.head_dim",
            )
        _require(
            self.head_dim is None or self.head_dim >= 1,
            f"model.head_dim must be >= 1 or null, got {self.head_dim}",
        )
        _require(
            self.n_heads % self.n_kv_heads == 0,
            f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})",
        )
        _require(
            self.head_width % 2 == 0,
            f"model.head_dim ({self.head_width}, dim / n_heads unless set) must be even for rotary embeddings",
        )
        if self.rope_scaling == RopeScaling.llama3:
            _require(
                self.rope_high_freq_factor > self.rope_low_freq_factor > 0 and self.rope_factor > 0,
                "model.rope_high_freq_factor must be > model.rope_low_freq_factor > 0 and model.rope_factor > 0",
            )

    def _apply_hf_config(self) -> None:
        """model=hf: the config.json's shapes replace these keys (trainer/model/hf_config.py). Read once, in
        the job: `config` is emptied and `name` becomes hf:<path>, so ranks neither read it nor import
        transformers, and the run's config records where its shapes came from."""
        from trainer.console import warn
        from trainer.model.hf_config import (  # transformers, lazily
            SHAPE_FIELDS,
            HfConfigError,
            absent_shape_fields,
            config_path,
            model_fields,
        )

        try:
            path = config_path(self.config or "")
            fields = model_fields(path)
            absent = absent_shape_fields(path)
        except HfConfigError as err:
            raise ConfigError(str(err)) from None
        # The file is the model: a shape key set beside it would be dropped, so it is refused instead.
        defaults = ModelConfig.__dataclass_fields__
        for key in sorted(set(fields) & {*SHAPE_FIELDS.values(), "head_dim"}):
            _require(
                getattr(self, key) == defaults[key].default,
                f"model.{key}={getattr(self, key)} beside model=hf: the shapes come from model.config={self.config}; "
                "edit that config.json, or drop the override",
            )
        if absent:
            warn(
                f"model.config={path}: {', '.join(absent)} absent: transformers' defaults taken "
                f"({', '.join(f'{k}={fields[SHAPE_FIELDS[k]]}' for k in absent)}), likely not the checkpoint's model"
            )
        for key, value in fields.items():
            setattr(self, key, value)
        self.rope_scaling = RopeScaling(self.rope_scaling)
        self.name, self.config = f"hf:{path.resolve()}", None

    @property
    def head_width(self) -> int:
        """Each attention head's width: `head_dim`, else dim / n_heads."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads


@dataclass
class LossConfig:
    """conf/loss/*.yaml: how the output projection and the cross-entropy are computed (trainer/model/loss.py)."""

    kind: LossKind = LossKind.full
    """full: all logits at once (fp32 B x T x V); chunked: chunk_tokens at a time, each recomputed in backward."""
    chunk_tokens: int = 1024
    """chunked only: tokens (of micro_batch x seq_len) per chunk of the output projection and loss."""

    def __post_init__(self) -> None:
        _require(self.chunk_tokens >= 1, f"loss.chunk_tokens must be >= 1, got {self.chunk_tokens}")


@dataclass
class PrecisionConfig:
    """conf/precision/*.yaml: the compute dtype; master weights and optimizer state stay fp32."""

    name: str = "fp32"
    """Preset name, reported in logs."""
    compute_dtype: DType = DType.float32
    """Dtype the forward and backward run in."""
    loss_scale_init: float = 2.0**16
    """fp16 only: the dynamic loss scaler's starting scale."""
    growth_interval: int = 2000
    """fp16 only: overflow-free steps before the scale grows."""
    growth_factor: float = 2.0
    """fp16 only: factor the scale grows by."""
    backoff_factor: float = 0.5
    """fp16 only: factor the scale shrinks by on overflow."""
    min_loss_scale: float = 1.0
    """fp16 only: the scale never backs off below this."""
    tf32: bool = True
    """CUDA: fp32 matmuls and convolutions may use TF32 tensor cores (torch.backends fp32_precision "tf32"; false: "ieee")."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.none
    """precision=fp8: the block linears become torchao's Float8Linear with this named recipe (none: no fp8)."""
    fp8_all_gather: bool = False
    """fp8, tensorwise, zero=stage2/3 on CUDA: FSDP2 all-gathers the converted weights in fp8 (torchao's
    enable_fsdp_float8_all_gather)."""

    def __post_init__(self) -> None:
        _require(
            self.loss_scale_init > 0, f"precision.loss_scale_init must be > 0, got {self.loss_scale_init}"
        )
        _require(
            self.growth_interval >= 1, f"precision.growth_interval must be >= 1, got {self.growth_interval}"
        )
        _require(self.growth_factor > 1, f"precision.growth_factor must be > 1, got {self.growth_factor}")
        _require(
            0 < self.backoff_factor < 1,
            f"precision.backoff_factor must be in (0, 1), got {self.backoff_factor}",
        )
        _require(self.min_loss_scale > 0, f"precision.min_loss_scale must be > 0, got {self.min_loss_scale}")
        self.check_fp8()

    def check_fp8(self) -> None:
        """fp8 runs its matmuls' other half in bf16 (torchao's training recipes are for bf16 autocast
        or bf16 FSDP2 parameters); fp8 all-gather casts a whole tensor with one scale: tensorwise only."""
        if not self.is_fp8:
            _require(
                not self.fp8_all_gather,
                "precision.fp8_all_gather=true needs precision=fp8 (precision.fp8_recipe=tensorwise)",
            )
            return
        _require(
            self.name == "fp8",
            f"precision.fp8_recipe={self.fp8_recipe.value} needs precision=fp8 (got precision={self.name}: logs, "
            "W&B groups and the sweep report would name an fp8 run after it); use precision=fp8 "
            f"precision.fp8_recipe={self.fp8_recipe.value}",
        )
        _require(
            self.compute_dtype == DType.bfloat16,
            f"precision.fp8_recipe={self.fp8_recipe.value} needs precision.compute_dtype=bfloat16 "
            f"(got {self.compute_dtype.value}): use precision=fp8",
        )
        _require(
            not self.fp8_all_gather or self.fp8_recipe == Fp8Recipe.tensorwise,
            f"precision.fp8_all_gather=true with precision.fp8_recipe={self.fp8_recipe.value}: "
            "fp8 all-gather is tensorwise only (one scale per weight); use precision.fp8_recipe=tensorwise "
            "or precision.fp8_all_gather=false",
        )

    @property
    def is_fp16(self) -> bool:
        return self.compute_dtype == DType.float16

    @property
    def is_fp8(self) -> bool:
        return self.fp8_recipe != Fp8Recipe.none


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


# torchtitan's per-op save list for Llama 3 (pytorch/torchtitan@1f029641b5caeb4df18ac094263e8bcc674b3686,
# torchtitan/models/llama3/parallelize.py lines 45-61, `_op_sac_save_list`: the last per-model list before
# 114151ad4 centralised the policy), less its ops this model never runs (flex attention, varlen attention,
# inductor-compiled code), plus the SDPA op CPU runs. The one source of checkpointing.save_ops's default
# (conf/checkpointing/op.yaml sets no list); tests/unit/test_config.py holds it against a copy of that list.
TORCHTITAN_SAVE_OPS = (
    "aten.mm",
    "aten.linear",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_attention_math",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.reduce_scatter_tensor",
    "aten.max",
)


@dataclass
class CheckpointingConfig:
    """conf/checkpointing/*.yaml: activation checkpointing (recompute in backward)."""

    mode: CheckpointMode = CheckpointMode.none
    """none, full (every block), selective (every Nth block) or op (every block keeps the outputs of save_ops)."""
    every_n_layers: int = 2
    """selective only: checkpoint blocks 0, N, 2N, ..."""
    save_ops: list[str] = field(default_factory=lambda: list(TORCHTITAN_SAVE_OPS))
    """op only: the ops whose outputs every block keeps (`namespace.op[.overload]`, e.g. aten.mm);
    of aten.mm and aten.linear every other call is recomputed all the same (torchtitan's policy)."""

    def __post_init__(self) -> None:
        _require(
            self.every_n_layers >= 1, f"checkpointing.every_n_layers must be >= 1, got {self.every_n_layers}"
        )
        from trainer.model.op_names import unknown_op  # a leaf: torch and private_apis only

        for name in self.save_ops:
            reason = unknown_op(name)
            _require(reason is None, f"checkpointing.save_ops: {name!r} {reason}")


@dataclass
class OffloadConfig:
    """conf/offload/*.yaml: FSDP2 CPUOffloadPolicy."""

    target: OffloadTarget = OffloadTarget.none
    """none, or cpu: parameters, gradients and optimizer state live in host memory."""
    pin_memory: bool = True
    """cpu only: pin the offloaded tensors for faster host-device copies (GPU only)."""


@dataclass
class DataloaderConfig:
    """conf/dataloader/*.yaml: options handed to torch.utils.data.DataLoader."""

    num_workers: int = 0
    """Worker processes per rank; 0 loads in the rank's own process."""
    prefetch_factor: int | None = None
    """Batches each worker loads ahead; needs num_workers > 0."""
    pin_memory: bool = False
    """Page-lock batches for faster host-to-GPU copies."""
    persistent_workers: bool = False
    """Keep workers alive between epochs; needs num_workers > 0."""

    def __post_init__(self) -> None:
        _require(self.num_workers >= 0, f"dataloader.num_workers must be >= 0, got {self.num_workers}")
        if self.num_workers == 0:
            _require(
                self.prefetch_factor is None, "dataloader.prefetch_factor needs dataloader.num_workers > 0"
            )
            _require(
                not self.persistent_workers, "dataloader.persistent_workers needs dataloader.num_workers > 0"
            )
        _require(
            self.prefetch_factor is None or self.prefetch_factor >= 1,
            f"dataloader.prefetch_factor must be >= 1, got {self.prefetch_factor}",
        )


@dataclass
class DataConfig:
    """conf/data/*.yaml: where training tokens come from."""

    kind: DataKind = DataKind.synthetic
    """synthetic (a learnable Markov stream), tokens (a memory-mapped .npy of token ids) or text (local
    files through a model's tokenizer, trainer/text/)."""
    path: str | None = None
    """tokens only: the .npy file made by `python -m trainer.data make-tokens`."""
    branching: int = 4
    """synthetic only: how many next tokens each token may be followed by."""
    data_seed: int = 1234
    """synthetic: seed of the Markov chain's transition table (fixed across runs); text: of the held-out split."""
    files: list[str] = field(default_factory=list)
    """text only: .txt (one document per blank-line-separated paragraph), .json/.jsonl, .parquet files."""
    text_field: str = "text"
    """text only: the field of a json/jsonl/parquet record that holds the document."""
    tokenizer: str | None = None
    """text only: a tokenizer.json, or a model directory holding one (BOS/EOS from its tokenizer_config.json)."""
    packing: Packing = Packing.concat
    """text only: concat (documents joined with EOS, attending across) or document (block-causal: a row's
    documents do not attend to each other, and no target crosses a document boundary)."""
    validation_files: list[str] = field(default_factory=list)
    """text only: held-out files for eval (loss/val); else `validation_fraction` of the documents."""
    validation_fraction: float = 0.0
    """text only: the fraction of documents set apart for eval, chosen by `data_seed`; 0 with no
    validation_files: no held-out text."""
    cache_dir: str = "~/.cache/zerolab/tokens"
    """text only: where token streams are cached, keyed by the files' content and the tokenizer."""

    def __post_init__(self) -> None:
        _require(self.branching >= 1, f"data.branching must be >= 1, got {self.branching}")
        if self.kind == DataKind.tokens:
            _require(bool(self.path), "data.path must name a token file (.npy) when data=tokens")
        if self.kind == DataKind.text:
            _require(
                bool(self.files),
                "data.files must list at least one file (txt, json, jsonl, parquet) when data=text",
            )
        _require(
            0 <= self.validation_fraction < 1,
            f"data.validation_fraction must be in [0, 1), got {self.validation_fraction}",
        )

    @property
    def has_validation(self) -> bool:
        """Held-out text: validation files or a fraction of the documents (synthetic: always, trainer/data.py)."""
        return bool(self.validation_files) or self.validation_fraction > 0


@dataclass
class EvalConfig:
    """conf/train.yaml `eval:`: the held-out loss (`loss/val`), on the same batches every time (trainer/rank/evaluate.py)."""

    every: int = 0
    """Optimizer steps between evaluations (and after the last step); 0: none."""
    batches: int = 4
    """Global batches (micro_batch * grad_accum * ranks sequences each) of held-out data per evaluation."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"eval.every must be >= 0, got {self.every}")
        _require(self.batches >= 1, f"eval.batches must be >= 1, got {self.batches}")


@dataclass
class OptimConfig:
    """conf/optim/*.yaml: AdamW with linear warmup, cosine decay and gradient clipping."""

    name: str = "adamw"
    """Optimizer name."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    """Linear warmup from 0 to lr over this many optimizer steps."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    fused: bool | None = None
    """AdamW's fused kernel (and the non-finite skip decided on the device, trainer/rank/nonfinite.py); null: fused on CUDA only."""

    def __post_init__(self) -> None:
        _require(self.name == "adamw", f"optim.name must be adamw, got {self.name}")
        _require(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        _require(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(
            0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
        )
        _require(self.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {self.grad_clip}")


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


@dataclass
class SaveConfig:
    """conf/save/*.yaml: full training state saved with torch.distributed.checkpoint."""

    every: int = 100
    """Save every N optimizer steps (and at the end); 0 disables saving."""
    keep: int = 2
    """How many saves to keep."""
    hf: HfExport = HfExport.none
    """last: when the run ends ok, its last save exported to <run>/hf as a Hugging Face checkpoint
    (trainer/saves/hf_export.py, what `python -m trainer.export` writes)."""
    async_mode: SaveAsync = SaveAsync.off
    """off: every rank writes, then training goes on; thread or process: the state is staged (a copy
    in host memory, pinned on CUDA, shared with the writer in process mode) and written in the
    background by a thread or a process of each rank (`async` itself is a Python keyword)."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"save.every must be >= 0, got {self.every}")
        _require(self.keep >= 1, f"save.keep must be >= 1, got {self.keep}")
        _require(
            self.hf == HfExport.none or self.every >= 1,
            "save.hf=last exports the run's last save: needs save.every >= 1 (save=default), got save.every=0",
        )


@dataclass
class LoggerConfig:
    """conf/logger/*.yaml: where metrics go besides the always-written metrics.jsonl."""

    backend: LoggerBackend = LoggerBackend.wandb
    """wandb or none."""
    project: str = "zerolab"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None uses the account's default."""


@dataclass
class FaultConfig:
    """Fault injection for tests and rehearsals: what goes wrong, on which rank, at which step."""

    kind: FaultKind = FaultKind.none
    """none, inf_grad, nan_loss, raise_error, kill, kill_during_save (SIGKILL once the save of
    `step` is written, before it is renamed into place; with save.async_mode, while it is written in
    the background), term_during_save (the rank sends itself SIGTERM while the background write
    of `step` runs), or oom (an allocation no device can hold, which the allocator refuses: a real
    out-of-memory error on one rank), or hang (the rank stops where it is and never returns, as one
    stuck in a collective does: only a kill or a timeout ends the job). Fires in the launcher's first
    attempt only."""
    step: int = 0
    """Optimizer step (1-based) at which the fault happens."""
    rank: int = 0
    """Rank on which it happens."""


@dataclass
class TelemetryConfig:
    """conf/train.yaml `telemetry:`: what ranks measure besides loss and time (trainer/telemetry/metrics.py, memory.py)."""

    enabled: bool = True
    """false: no memory figures and no MFU, only loss, lr, grad norm, throughput and the loss scale."""
    memory_every: int = 500
    """CPU: tensor-level memory tracking (torch's MemTracker, several times slower than a plain step)
    runs on the run's second step and then every this many steps; 0: that step only. GPU counters
    and host RSS are read on every log step at no cost."""
    peak_tflops: float | None = None
    """Dense peak TFLOPS of one device, for MFU; None: looked up from the GPU's name (CPU: no MFU)."""
    warmup_steps: int | None = None
    """Steps that steady-state throughput leaves out; None: 10% of steps, at least the first log window."""

    def __post_init__(self) -> None:
        _require(self.memory_every >= 0, f"telemetry.memory_every must be >= 0, got {self.memory_every}")
        _require(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"telemetry.peak_tflops must be > 0 or null, got {self.peak_tflops}",
        )
        _require(
            self.warmup_steps is None or self.warmup_steps >= 0,
            f"telemetry.warmup_steps must be >= 0 or null, got {self.warmup_steps}",
        )


class SnapshotMode(str, Enum):
    off = "off"
    oom = "oom"
    steps = "steps"


@dataclass
class MemoryConfig:
    """`memory.*`: the CUDA allocator's history (trainer/telemetry/snapshot.py, docs/faults.md)."""

    snapshot: SnapshotMode = SnapshotMode.off
    """off; oom: each rank records the allocator's history and dumps it when it runs out; steps: dumps it
    after each of `snapshot_steps`. CUDA only (torch.cuda.memory._record_memory_history); on CPU one
    line says so and the tensor tracker's figures by category are written instead."""
    snapshot_steps: list[int] = field(default_factory=list)
    """memory.snapshot=steps: the optimizer steps (1-based) after which each rank dumps a snapshot."""
    snapshot_max_entries: int = 100_000
    """Allocator events kept (a ring): bounds the recording's memory and the dump's size."""

    def __post_init__(self) -> None:
        _require(
            self.snapshot_max_entries >= 1,
            f"memory.snapshot_max_entries must be >= 1, got {self.snapshot_max_entries}",
        )
        _require(
            all(step >= 1 for step in self.snapshot_steps),
            f"memory.snapshot_steps must be steps >= 1, got {self.snapshot_steps}",
        )
        _require(
            self.snapshot != SnapshotMode.steps or bool(self.snapshot_steps),
            "memory.snapshot=steps needs memory.snapshot_steps=[N,...]",
        )


@dataclass
class PlanConfig:
    """conf/train.yaml `plan:`: the memory plan made before launch (trainer/plan)."""

    enforce: bool = True
    """Refuse to start a job whose predicted peak does not fit; false: warn and try anyway."""
    accelerator: str | None = None
    """Plan for this accelerator's memory (a name of trainer/devices.py, any case: h100, H200, l40s) instead of this host's."""
    cpu_rank_runtime_gib: float = 0.4
    """Host memory each CPU rank's process holds before its first tensor (Python, torch, gloo, threads;
    0.32-0.44 GiB measured with torch 2.13 on CPU), counted per rank against the host (trainer/plan/host.py)."""
    cuda_rank_runtime_gib: float = 2.0
    """Host memory each CUDA rank's process holds besides offloaded tensors (torch's CUDA libraries, the
    CUDA runtime, NCCL's host side): assumed (pytorch/pytorch#12873 measured 1.1 GiB of RSS at the first
    CUDA tensor and 0.6 GiB more at the first cuDNN call) until the GPU check's host row measures it."""
    host_memory_gib: float | None = None
    """Host memory of each node, for a plan made for another machine (null: this host's available memory
    when the job runs here, else unknown and only the need is printed)."""
    network_bus_gbps: float | None = None
    """mode=advise with plan.accelerator: a cluster's own bus bandwidth across nodes, GB/s, as nccl-tests'
    all_reduce_perf reports it over whole nodes (null: the node's NICs, trainer/advise/calibrate.py)."""
    nvlink_bus_gbps: float | None = None
    """mode=advise with plan.accelerator: the bus bandwidth inside a node, GB/s, as nccl-tests reports it on
    one node (null: trainer/advise/calibrate.py's figure for the accelerator)."""

    def __post_init__(self) -> None:
        from trainer.devices import accelerator_names, find_accelerator  # devices imports torch only

        for key in ("network_bus_gbps", "nvlink_bus_gbps"):
            value = getattr(self, key)
            _require(value is None or value > 0, f"plan.{key} must be > 0 (GB/s) or null, got {value}")

        _require(
            self.cpu_rank_runtime_gib >= 0,
            f"plan.cpu_rank_runtime_gib must be >= 0, got {self.cpu_rank_runtime_gib}",
        )
        _require(
            self.cuda_rank_runtime_gib >= 0,
            f"plan.cuda_rank_runtime_gib must be >= 0, got {self.cuda_rank_runtime_gib}",
        )
        _require(
            self.host_memory_gib is None or self.host_memory_gib > 0,
            f"plan.host_memory_gib must be > 0 (GiB per node) or null, got {self.host_memory_gib}",
        )
        if self.accelerator is not None:
            _require(
                find_accelerator(self.accelerator) is not None,
                f"plan.accelerator={self.accelerator} is unknown; allowed (any case): {', '.join(accelerator_names())}",
            )
            self.accelerator = self.accelerator.strip().lower()


@dataclass
class AdviseConfig:
    """conf/train.yaml `advise:`: mode=advise, which configuration to run (trainer/advise/advisor.py, docs/advisor.md)."""

    stages: list[Stage] = field(default_factory=lambda: list(Stage))
    """ZeRO stages to consider."""
    checkpointing: list[CheckpointMode] = field(default_factory=lambda: list(CheckpointMode))
    """Activation checkpointing modes to consider (selective uses checkpointing.every_n_layers)."""
    offload: list[OffloadTarget] = field(default_factory=lambda: list(OffloadTarget))
    """Offload targets to consider; cpu only with stage2/3 and only on a GPU (on a CPU host it moves nothing)."""
    reduce_dtypes: list[ReduceDType] = field(default_factory=lambda: list(ReduceDType))
    """Gradient-reduction dtypes (zero.reduce_dtype) to consider."""
    reduce_every: list[ReduceEvery] = field(default_factory=lambda: list(ReduceEvery))
    """When gradients are reduced (zero.reduce_every) to consider where grad_accum > 1; at grad_accum 1
    both are one reduction, and the stage's default is planned."""
    reshard_after_backward: list[bool] = field(default_factory=lambda: [True, False])
    """zero.reshard_after_backward choices to consider where stage2/3 accumulate (grad_accum > 1); elsewhere
    only true (it changes nothing there)."""
    compression: list[Compression] = field(default_factory=lambda: [Compression.powersgd, Compression.topk])
    """Gradient compression (zero.compression, with zero.powersgd_rank and zero.topk_ratio as set) to list
    beside each stage0/1 candidate whose step waits on the network; marked as changing the optimisation
    and never ranked in the leading tie ([] or [none]: none listed)."""
    micro_batches: list[int] | None = None
    """Micro-batches to consider; None: every power of two dividing global_batch / ranks."""
    headroom: float = 0.2
    """Fraction of each rank's memory the predicted peak must leave free."""
    top: int = 12
    """Rows of the ranked table printed (advice.json keeps every candidate)."""
    verify: int = 0
    """Run the K best configurations on this host as real jobs and show measured next to predicted."""
    verify_steps: int = 10
    """Optimizer steps of each verification job."""
    cache_dir: str = "~/.cache/zerolab"
    """Where this host's calibration (matmul, Adam and collective rates) is kept, with its date and host."""
    recalibrate: bool = False
    """Measure this host again even when a cached calibration matches it."""

    def __post_init__(self) -> None:
        for key in (
            "stages",
            "checkpointing",
            "offload",
            "reduce_dtypes",
            "reduce_every",
            "reshard_after_backward",
        ):
            _require(len(getattr(self, key)) >= 1, f"advise.{key} must list at least one option")
        _require(
            self.micro_batches is None or (len(self.micro_batches) >= 1 and min(self.micro_batches) >= 1),
            f"advise.micro_batches must be null or a list of integers >= 1, got {self.micro_batches}",
        )
        _require(0 <= self.headroom < 1, f"advise.headroom must be in [0, 1), got {self.headroom}")
        _require(self.top >= 1, f"advise.top must be >= 1, got {self.top}")
        _require(self.verify >= 0, f"advise.verify must be >= 0, got {self.verify}")
        _require(self.verify_steps >= 2, f"advise.verify_steps must be >= 2, got {self.verify_steps}")


@dataclass
class TrainConfig:
    """conf/train.yaml: one training job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    advise: AdviseConfig = field(default_factory=AdviseConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    micro_batch: Any = 8
    """Sequences per rank per forward pass (an integer), or `auto`: the largest the plan says fits,
    confirmed by probe runs (trainer/job.py `choose_micro_batch`), with grad_accum from global_batch
    where that is given; the job replaces it by the integer before anything is planned or run."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; the global batch is micro_batch * grad_accum * world size."""
    seq_len: int = 128
    """Tokens per sequence."""
    steps: int = 200
    """Optimizer steps."""
    seed: int = 0
    """Seed of initialisation and data order."""
    nproc: str = "auto"
    """Ranks on this host: auto (every visible GPU, else 2 CPU ranks) or a positive integer."""
    device: DeviceKind = DeviceKind.auto
    """auto (CUDA when present), cpu or cuda."""
    mode: Mode = Mode.train
    """train; plan: print the memory plan and train nothing; advise: rank configurations for global_batch."""
    global_batch: int | None = None
    """mode=advise, or micro_batch=auto: sequences per optimizer step, over all ranks (the advisor, or
    auto, chooses micro_batch and grad_accum); otherwise train and plan take micro_batch and grad_accum
    and refuse it."""
    resume: str = "false"
    """false, true (the newest save of this config) or a path to a save."""
    max_restarts: int = 0
    """Times the launcher restarts all ranks after one dies."""
    nonfinite: NonFinitePolicy = NonFinitePolicy["raise"]  # type: ignore[valid-type]
    """raise (stop, naming the step and ranks) or skip (skip the optimizer step)."""
    max_nonfinite_skips: int = 3
    """nonfinite=skip stops the run once this many steps in a row were non-finite."""
    device_memory_gib: float | None = None
    """Cap each rank's memory to rehearse a smaller device; None uses what the device has."""
    fail_fast: bool = False
    """Multirun: stop the sweep (exit 1) at the first point that does not end `ok`; false records it and goes on."""
    log_every: int = 10
    """Optimizer steps between log lines (each one gathers every rank's figures)."""
    nodes: int = 1
    """Hosts the job spans, `nproc` ranks on each (trainer/cluster.py); the world size is nodes * nproc."""
    node_rank: int = 0
    """This host's place among `nodes` (0 .. nodes-1); under SLURM it comes from the allocation."""
    rdzv_endpoint: str | None = None
    """host:port where every node's elastic launcher meets (c10d); under SLURM derived from the allocation."""
    compile: bool = False
    """torch.compile each transformer block in place (after activation checkpointing, before sharding)."""
    compile_backend: str = "inductor"
    """compile=true only: the torch.compile backend (inductor; aot_eager checks composition without generating code)."""
    attention: AttentionKernel = AttentionKernel.auto
    """SDPA kernel (torch.nn.attention.sdpa_kernel): auto picks flash, else efficient (K/V repeated), as trainer/model/attention.py says; math materialises the scores."""

    def __post_init__(self) -> None:
        _require(
            self.micro_batch == AUTO or (type(self.micro_batch) is int and self.micro_batch >= 1),
            f"micro_batch must be an integer >= 1 or auto, got {self.micro_batch}",
        )
        for key in ("grad_accum", "seq_len", "steps", "log_every"):
            _require(getattr(self, key) >= 1, f"{key} must be >= 1, got {getattr(self, key)}")
        _require(self.max_restarts >= 0, f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.resume.lower() in ("true", "false"):
            self.resume = (
                self.resume.lower()
            )  # `resume=true` on the command line arrives as the bool's str "True"
        _require(
            self.max_nonfinite_skips >= 1, f"max_nonfinite_skips must be >= 1, got {self.max_nonfinite_skips}"
        )
        _require(
            self.nproc == "auto" or (self.nproc.isdigit() and int(self.nproc) >= 1),
            f"nproc must be auto or an integer >= 1, got {self.nproc}",
        )
        _require(
            self.seq_len <= self.model.max_seq_len,
            f"seq_len ({self.seq_len}) must be <= model.max_seq_len ({self.model.max_seq_len}) of model={self.model.name}",
        )
        _require(
            self.offload.target == OffloadTarget.none or self.zero.uses_fsdp,
            f"offload=cpu needs zero=stage2 or zero=stage3 (FSDP2 CPUOffloadPolicy), got zero={self.zero.stage.value}",
        )
        _require(
            self.device_memory_gib is None or self.device_memory_gib > 0,
            f"device_memory_gib must be > 0, got {self.device_memory_gib}",
        )
        _require(self.save.every == 0 or self.save.every >= 1, "save.every must be >= 0")
        _require(self.nodes >= 1, f"nodes must be an integer >= 1, got {self.nodes}")
        _require(
            0 <= self.node_rank < self.nodes,
            f"node_rank must be in 0..{self.nodes - 1} (nodes={self.nodes}), got {self.node_rank}",
        )
        _require(
            self.rdzv_endpoint is None or is_endpoint(self.rdzv_endpoint),
            f"rdzv_endpoint must be host:port (port 0-65535; 0: any free port, one node only), got {self.rdzv_endpoint}",
        )
        backends = ("inductor", "aot_eager", "eager")
        _require(
            self.compile_backend in backends,
            f"compile_backend must be one of {', '.join(backends)}, got {self.compile_backend}",
        )
        self._check_global_batch()
        if self.data.kind == DataKind.text and not self.data.tokenizer and self.model.name.startswith("hf:"):
            self.data.tokenizer = str(
                Path(self.model.name[3:]).parent
            )  # model=hf's directory: its own tokenizer
        _require(
            self.data.kind != DataKind.text or bool(self.data.tokenizer),
            "data.tokenizer must name a tokenizer.json or a model directory when data=text "
            "(model=hf: the directory of model.config, by default)",
        )
        _require(
            self.eval.every == 0 or self.data.kind != DataKind.tokens,
            "eval.every needs held-out data: data=text (data.validation_files or data.validation_fraction) or data=synthetic",
        )
        _require(
            self.eval.every == 0 or self.data.kind != DataKind.text or self.data.has_validation,
            "eval.every with data=text needs data.validation_files or data.validation_fraction > 0",
        )
        self.parallel.check_model(self.model, self.seq_len)
        self.parallel.check_composition(self)
        self.parallel.check_pipeline(self.model, self.grad_accum)

    def _check_global_batch(self) -> None:
        if self.micro_batch == AUTO:
            _require(
                self.mode != Mode.advise, "mode=advise chooses micro_batch itself: drop micro_batch=auto"
            )
            _require(
                self.global_batch is None or self.global_batch >= 1,
                f"global_batch must be >= 1, got {self.global_batch}",
            )
            return
        if self.mode != Mode.advise:
            _require(
                self.global_batch is None,
                f"global_batch is read by mode=advise only; mode={self.mode.value} takes micro_batch and grad_accum "
                "(global batch = micro_batch * grad_accum * ranks)",
            )
            return
        _require(
            self.global_batch is not None,
            "mode=advise needs global_batch=N (sequences per optimizer step, over all ranks)",
        )
        _require(self.global_batch >= 1, f"global_batch must be >= 1, got {self.global_batch}")

    def sequences_per_step(self, world_size: int) -> int:
        """The global batch: sequences per optimizer step, over all ranks (not the `global_batch`
        key, which mode=advise reads to choose micro_batch and grad_accum)."""
        return global_batch(self.micro_batch, self.grad_accum, self.parallel.dp(world_size))


AUTO = "auto"
"""micro_batch=auto (TrainConfig.micro_batch)."""


def is_endpoint(value: str) -> bool:
    """`host:port` with a TCP port (c10d's rendezvous endpoint)."""
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and int(port) <= 65535


def validate(cfg: DictConfig) -> TrainConfig:
    """The composed config as a typed, checked `TrainConfig`; raises ConfigError naming the key."""
    try:
        config = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as err:  # OmegaConf wraps errors raised inside __post_init__
        cause = err.__cause__ or err.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise
    assert isinstance(config, TrainConfig)
    _reject_unknown_keys(config)
    return config


def _reject_unknown_keys(node: Any, prefix: str = "") -> None:
    """`+foo=1` adds a key the schema lacks and OmegaConf.to_object keeps it as a stray attribute:
    a typo'd option would be silently ignored, so it is refused instead."""
    known = {f.name for f in dataclasses.fields(node)}
    for name in vars(node):
        _require(
            name in known, f"{prefix}{name} is not a config key; `python -m trainer --cfg job` shows them all"
        )
    for name in known:
        value = getattr(node, name)
        if dataclasses.is_dataclass(value):
            _reject_unknown_keys(value, f"{prefix}{name}.")


def to_plain(config: TrainConfig) -> dict[str, Any]:
    """The config as plain data (enums as strings) to hand to ranks and loggers."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True, enum_to_str=True)  # type: ignore[return-value]


def from_plain(plain: dict[str, Any]) -> TrainConfig:
    """Rebuild a checked `TrainConfig` from `to_plain`'s output (inside a rank)."""
    return validate(OmegaConf.merge(OmegaConf.structured(TrainConfig), plain))  # type: ignore[arg-type]


def uses_fused(optim: OptimConfig, device_kind: str) -> bool:
    """AdamW's fused kernel: `optim.fused`, else on CUDA (one kernel per step instead of a loop of
    small ones; torchtitan's default too). On CPU the per-tensor loop stays the default: the
    memory plan (trainer/plan/moments.py) and its CPU measurements are of that loop, and the ranks
    (trainer/rank/loop.py) step with the same choice."""
    return optim.fused if optim.fused is not None else device_kind == "cuda"


def global_batch(micro_batch: int, grad_accum: int, world_size: int) -> int:
    """Sequences per optimizer step over all ranks: always micro_batch * grad_accum * world size
    (the data stream, the saves' progress and the throughput all count steps in it)."""
    return micro_batch * grad_accum * world_size
