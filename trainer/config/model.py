"""`model:` (ModelConfig: a Llama-style decoder's shape, or model=hf's config.json) and `loss:` (LossConfig)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from trainer.config.enums import LossKind, RopeScaling, RouterScore
from trainer.config.errors import ConfigError, _require


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
    n_experts: int = 0
    """Routed experts per block (a mixture of experts, trainer/model/moe.py); 0: a dense SwiGLU MLP."""
    top_k: int = 2
    """n_experts > 0: the experts each token is routed to (token choice)."""
    moe_ffn_dim: int | None = None
    """n_experts > 0: each expert's SwiGLU hidden width; None: ffn_dim (Qwen3-MoE sets it apart, 768 at 30B-A3B)."""
    n_shared_experts: int = 0
    """n_experts > 0: experts every token goes through besides its routed ones (DeepSeek), as one SwiGLU MLP
    of n_shared_experts * moe_ffn_dim."""
    router_score: RouterScore = RouterScore.softmax
    """n_experts > 0: softmax over the experts' logits (Mixtral, Qwen3-MoE) or a sigmoid of each (DeepSeek-V3)."""
    route_norm: bool = True
    """n_experts > 0: the top_k scores of a token are divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    config: str | None = None
    """model=hf only: a Hugging Face config.json (or a directory holding one) whose shapes replace the keys
    above (trainer/model/hf_config.py); LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    and the mixtures of experts MixtralForCausalLM and Qwen3MoeForCausalLM."""
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
        self._check_experts()
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

    def _check_experts(self) -> None:
        _require(
            self.n_experts == 0 or self.n_experts >= 2,
            f"model.n_experts must be 0 (a dense MLP) or >= 2, got {self.n_experts}",
        )
        if self.n_experts == 0:
            return
        _require(
            1 <= self.top_k <= self.n_experts,
            f"model.top_k must be in 1..model.n_experts ({self.n_experts}), got {self.top_k}",
        )
        _require(
            self.moe_ffn_dim is None or self.moe_ffn_dim >= 1,
            f"model.moe_ffn_dim must be >= 1 or null, got {self.moe_ffn_dim}",
        )
        _require(
            self.n_shared_experts >= 0, f"model.n_shared_experts must be >= 0, got {self.n_shared_experts}"
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

        own = self.weights is not None and self.config == self.weights  # model.weights' own config.json
        _require(
            not own or (Path(self.config or "") / "config.json").is_file(),
            f"model.weights={self.weights}: no config.json there, and model=hf builds the model its config.json "
            "describes; give a directory written by transformers' save_pretrained, or model.config=<a config.json>",
        )
        try:
            path = config_path(self.config or "")
            fields = model_fields(path)
            absent = absent_shape_fields(path)
        except HfConfigError as err:
            own_file = own and err.path is not None
            raise ConfigError(
                f"model.weights={self.weights}: its config.json: {err.detail}" if own_file else str(err)
            ) from None
        source = f"model.weights={self.weights} (its config.json)" if own else f"model.config={path}"
        # The file is the model: a shape key set beside it would be dropped, so it is refused instead.
        defaults = ModelConfig.__dataclass_fields__
        for key in sorted(set(fields) & {*SHAPE_FIELDS.values(), "head_dim"}):
            _require(
                getattr(self, key) == defaults[key].default,
                f"model.{key}={getattr(self, key)} beside model=hf: the shapes come from {source}; "
                "edit that config.json, or drop the override",
            )
        if absent:
            warn(
                f"{source}: {', '.join(absent)} absent: transformers' defaults taken "
                f"({', '.join(f'{k}={fields[SHAPE_FIELDS[k]]}' for k in absent)}), likely not the checkpoint's model"
            )
        for key, value in fields.items():
            setattr(self, key, value)
        self.rope_scaling = RopeScaling(self.rope_scaling)
        self.router_score = RouterScore(self.router_score)
        self.name, self.config = f"hf:{path.resolve()}", None

    @property
    def is_moe(self) -> bool:
        """Whether every block's MLP is a mixture of experts (n_experts > 0)."""
        return self.n_experts > 0

    @property
    def expert_width(self) -> int:
        """Each expert's hidden width: `moe_ffn_dim`, else ffn_dim."""
        return self.moe_ffn_dim if self.moe_ffn_dim is not None else self.ffn_dim

    @property
    def head_width(self) -> int:
        """Each attention head's width: `head_dim`, else dim / n_heads."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def shape_key(self) -> tuple[tuple[str, Any], ...]:
        """ModelConfig's fields, sorted: the key of the caches of shapes built from them (a TpLocalModel's
        `tp` is not one: its dims are the shard's already)."""
        return tuple(sorted((field.name, getattr(self, field.name)) for field in fields(ModelConfig)))


@dataclass
class TpLocalModel(ModelConfig):
    """Not a config group: the decoder one tensor-parallel rank holds, as the memory plan counts it
    (trainer/plan/tensor_parallel.py `tp_local_model`: heads, hidden width and vocabulary divided by `tp`).
    It keeps `tp` so that what torch or torchao decides on the whole model before sharding, which linears
    precision=fp8 converts (trainer/model/fp8.py), is decided on the whole shapes in the plan too."""

    tp: int = 1


@dataclass
class LossConfig:
    """conf/loss/*.yaml: how the output projection and the cross-entropy are computed (trainer/model/loss.py)."""

    kind: LossKind = LossKind.full
    """full: all logits at once (fp32 B x T x V); chunked: chunk_tokens at a time, each recomputed in backward."""
    chunk_tokens: int = 1024
    """chunked only: tokens (of micro_batch x seq_len) per chunk of the output projection and loss."""
    z_loss: float = 0.0
    """The z-loss's weight: z_loss * mean over the tokens of logsumexp(logits)^2, added to the training loss and
    logged apart (`loss/z_loss`); 0: off (PaLM's 1e-4, OLMo-core's 1e-5; docs/stability.md, "z-loss")."""

    def __post_init__(self) -> None:
        _require(self.chunk_tokens >= 1, f"loss.chunk_tokens must be >= 1, got {self.chunk_tokens}")
        _require(self.z_loss >= 0, f"loss.z_loss must be >= 0, got {self.z_loss}")
