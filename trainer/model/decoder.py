"""A Llama-style decoder in one file: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Shapes are suffixed on names: B batch, T time (sequence), D model width, H query heads,
K key/value heads, Q head width, F rotary frequencies (Q / 2), V vocabulary, M MLP hidden width.

The model is meant to be built on the meta device (no memory), wrapped (activation
checkpointing) and sharded (FSDP2), and only then materialised: `materialize` allocates the
storage where each parameter now lives and `init_weights` fills it. Initialisation is drawn
per parameter from a seed derived from the parameter's canonical name, so every rank, whatever
slice it holds, sees the same full weights as a single unsharded process would. A dense model
holds no buffers: the rotary tables are computed on first use and cached per device (see
`Transformer.__init__`); a mixture of experts (model.n_experts > 0, trainer/model/moe.py) holds one per
block, its router's aux-loss-free bias, which materialising zeroes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.overrides import TorchFunctionMode

from trainer.config import LossConfig, ModelConfig, RopeScaling
from trainer.model.attention import SdpaChoice
from trainer.model.loss import chunked_cross_entropy
from trainer.model.moe import MoE, RouterLog

if TYPE_CHECKING:
    from trainer.model.context_parallel import ContextParallel

INIT_STD = 0.02
"""Standard deviation of every linear and embedding weight (GPT-2 / Llama)."""

# Name segments that wrappers insert into parameter names: checkpoint_wrapper, torch.compile,
# and DDP / other `.module` wrappers. They never name a parameter of the model itself.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "module"})

# Projections that write into the residual stream; scaled down by 1/sqrt(2 * n_layers) so the
# residual's variance does not grow with depth (GPT-2, section 2.3).
_RESIDUAL_PROJECTIONS = (
    "attention.wo.weight",
    "feed_forward.w2.weight",
    "feed_forward.experts.w2",
    "feed_forward.shared.w2.weight",
)


# ----------------------------------------------------------------------------- rotary embeddings


def build_rope_table(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device, config: ModelConfig | None = None
) -> torch.Tensor:
    """e^(i·angle) of the rotation angle of every (position, frequency) pair: complex64, T x F (the
    bytes of an fp32 cos and sin); `config`'s rope_scaling (Llama-3.1) rescales the frequencies. One
    complex table as torchtitan keeps it (pytorch/torchtitan torchtitan/models/llama3/model/model.py
    `precompute_freqs_cis`)."""
    inv_freq_F = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if config is not None and config.rope_scaling == RopeScaling.llama3:
        inv_freq_F = llama3_scaled_frequencies(inv_freq_F, config)
    pos_T = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles_TF = torch.outer(pos_T, inv_freq_F)
    return torch.polar(torch.ones_like(angles_TF), angles_TF)


def llama3_scaled_frequencies(inv_freq_F: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Llama-3.1's frequency scaling: wavelengths longer than original_max_seq_len / low_freq_factor
    are divided by `factor`, shorter than original / high_freq_factor kept, those between blended.

    Written out because torch has no rotary embeddings and transformers is an optional extra; the
    rule is Meta's `apply_scaling` (meta-llama/llama-models, models/llama3/reference_impl/model.py),
    also transformers' `_compute_llama3_parameters` (src/transformers/modeling_rope_utils.py).
    """
    factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    original = config.rope_original_max_seq_len
    wavelen_F = 2 * math.pi / inv_freq_F
    smooth_F = (original / wavelen_F - low) / (high - low)
    blended_F = (1 - smooth_F) * inv_freq_F / factor + smooth_F * inv_freq_F
    scaled_F = torch.where(wavelen_F > original / low, inv_freq_F / factor, blended_F)
    return torch.where(wavelen_F < original / high, inv_freq_F, scaled_F)


def apply_rope(x_BTHQ: torch.Tensor, cis_TF: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2i], x[2i+1]) of every head by its position's angle: the pair as one
    complex number times e^(i·angle), one multiply (torchtitan's `apply_rotary_emb`) where the real form
    took seven kernels. Autograd saves the table only (it needs no gradient)."""
    # In fp32 whatever the compute dtype: bf16 angles at position ~4000 lose whole radians.
    x_BTHF = torch.view_as_complex(x_BTHQ.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(x_BTHF * cis_TF[None, :, None, :]).flatten(-2).type_as(x_BTHQ)


# ----------------------------------------------------------------------------- modules


class Attention(nn.Module):
    """Causal grouped-query self-attention: n_kv_heads key/value heads shared by n_heads queries."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.head_width
        bias = config.qkv_bias  # Qwen2: biases on q, k, v only
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        # Qwen3: RMSNorm of each query and key head (one weight of head_dim shared by the heads).
        # Registered only when asked for, so other models' state-dict keys are unchanged.
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        self.sdpa = SdpaChoice()  # the run's kernel (apply_sdpa_choice below)
        self.context: ContextParallel | None = None  # parallel.cp (apply_context_parallel below)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cis_TF: torch.Tensor,
        mask_B1TT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`mask_B1TT` (data.packing=document): True where a query may attend a key; None: causal."""
        B, T, _ = x_BTD.shape
        # -1 heads: under tensor parallelism the projections give this rank's H / tp and K / tp heads.
        q_BTHQ = self.wq(x_BTD).view(B, T, -1, self.head_dim)
        k_BTKQ = self.wk(x_BTD).view(B, T, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q_BTHQ, k_BTKQ = self.q_norm(q_BTHQ), self.k_norm(k_BTKQ)
        q_BTHQ = apply_rope(q_BTHQ, cis_TF)
        k_BTKQ = apply_rope(k_BTKQ, cis_TF)
        v_BTKQ = self.wv(x_BTD).view(B, T, -1, self.head_dim)
        if self.context is None:
            o_BTHQ = self.core(q_BTHQ, k_BTKQ, v_BTKQ, mask_B1TT)
        else:  # this rank's T / cp queries over the whole sequence (trainer/model/context_parallel.py)
            o_BTHQ = self.context.attend(self.core, q_BTHQ, k_BTKQ, v_BTKQ, mask_B1TT)
        return self.wo(o_BTHQ.reshape(B, T, -1))

    def core(
        self, q_BTHQ: torch.Tensor, k_BSKQ: torch.Tensor, v_BSKQ: torch.Tensor, mask_B1TS: torch.Tensor | None
    ) -> torch.Tensor:
        """SDPA of T queries over S keys (S = T but under parallel.cp=allgather), heads after time in and
        out; `mask_B1TS` None: causal."""
        q_BHTQ, k_BKSQ, v_BKSQ = q_BTHQ.transpose(1, 2), k_BSKQ.transpose(1, 2), v_BSKQ.transpose(1, 2)
        grouped = q_BHTQ.shape[1] != k_BKSQ.shape[1]
        if grouped and self.sdpa.repeat_kv:  # the chosen kernel cannot group heads: give it H of them
            k_BKSQ = k_BKSQ.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v_BKSQ = v_BKSQ.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            grouped = False
        # SDPA wants heads before time. enable_gqa shares each K/V head among n_heads/n_kv_heads
        # queries without materialising repeated K/V; asked for only when grouped, because some
        # fused CUDA kernels do not take the flag at all.
        with sdpa_kernel(self.sdpa.backend) if self.sdpa.backend is not None else contextlib.nullcontext():
            o_BHTQ = F.scaled_dot_product_attention(
                q_BHTQ, k_BKSQ, v_BKSQ, attn_mask=mask_B1TS, is_causal=mask_B1TS is None, enable_gqa=grouped
            )
        return o_BHTQ.transpose(1, 2)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x), hidden width exactly `ffn_dim`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h_BTM = F.silu(self.w1(x_BTD)) * self.w3(x_BTD)
        return self.w2(h_BTM)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + feed_forward(norm(h))."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward: nn.Module = MoE(config, layer) if config.is_moe else FeedForward(config)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cis_TF: torch.Tensor,
        mask_B1TT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cis_TF, mask_B1TT)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class Transformer(nn.Module):
    """Token embedding, `n_layers` blocks, a final RMSNorm and an output head, untied unless
    `tie_embeddings` (then one parameter, registered as `tok_embeddings.weight`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Rotary tables are derived from the config, never trained or saved, so they are neither
        # parameters nor buffers: computed on first use on the device of the tokens and cached per
        # device. As buffers they would be garbage after `to_empty`, be stranded on the CPU when
        # FSDP2 offloads states to host memory but computes on the GPU, be rounded by
        # `model.to(bfloat16)`, and be broadcast by DDP (broadcast_buffers) on every forward.
        self._rope_cache: dict[torch.device, torch.Tensor] = {}
        self.loss_chunk_tokens = 1024  # tokens per chunk when forward is given targets (apply_loss_choice)
        self.loss_z_weight = 0.0  # loss.z_loss, when forward is given targets (apply_loss_choice)
        self.context: ContextParallel | None = None  # parallel.cp (apply_context_parallel)
        # model.n_experts > 0: what the routers do, written by every MoE layer (trainer/model/moe.py).
        self.router_log = RouterLog(config.n_layers, config.n_experts) if config.is_moe else None
        for module in self.modules():
            if isinstance(module, MoE):
                module.log = self.router_log

    def rope_table(self, device: torch.device) -> torch.Tensor:
        """The complex64 rotary table of all `max_seq_len` positions on `device`, computed once per device.
        Complex, it is not a floating-point tensor: FSDP2's MixedPrecisionPolicy, which casts a block's
        floating-point forward inputs to param_dtype (torch's _fully_shard/_fsdp_common.py `_cast_fp_tensor`),
        hands it to every block as it is, in full precision and without a copy."""
        if device not in self._rope_cache:
            c = self.config
            # Built outside inference mode even when first asked for inside it (an eval before
            # training): an inference tensor could never be saved for a later backward.
            with torch.inference_mode(False):
                table = build_rope_table(c.head_width, c.max_seq_len, c.rope_theta, device, c)
            self._rope_cache[device] = table
        return self._rope_cache[device]

    def rotary_and_mask(
        self, T: int, documents_BT: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rotary angles of the `T` positions this rank holds of each row, and the mask its attention takes
        (None: causal). Under parallel.cp they are the rank's T of the row's T x cp (`documents_BT` the whole
        rows'): the angles read at its own positions, the mask its exchange's (trainer/model/
        context_parallel.py); shared by the decoder and a pipeline stage (trainer/model/pipeline_split.py)."""
        table_TF, context = self.rope_table(device), self.context
        if context is None:
            return table_TF[:T], None if documents_BT is None else block_causal_mask(documents_BT)
        row = T * context.size
        return table_TF.index_select(0, context.positions(row, device).mine), context.mask(
            documents_BT, row, device
        )

    def cached_rope_tables(self) -> list[torch.Tensor]:
        """Every table `rope_table` has made so far (one per device)."""
        return list(self._rope_cache.values())

    def forward(
        self,
        tokens_BT: torch.Tensor,
        targets_BT: torch.Tensor | None = None,
        documents_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token logits in the compute dtype, for the caller to take the loss in fp32; or, given
        `targets_BT`, the mean loss by chunks (`loss_chunk_tokens`, trainer/model/loss.py; with the z-loss
        beside it when `loss_z_weight` > 0), inside
        forward so that FSDP2's root hooks see the output head's use. `documents_BT` (data.packing=
        document): each token's document; a token attends only to earlier tokens of its own."""
        hidden_BTD = self.hidden(tokens_BT, documents_BT)
        if targets_BT is None:
            return self.output(hidden_BTD)
        return chunked_cross_entropy(
            hidden_BTD, self.output.weight, targets_BT, self.loss_chunk_tokens, self.loss_z_weight
        )

    def hidden(self, tokens_BT: torch.Tensor, documents_BT: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output, what the output head projects. Under parallel.cp `tokens_BT` are this
        rank's T / cp positions of each row (`documents_BT` the whole rows')."""
        context, T = self.context, tokens_BT.shape[1]
        row = T if context is None else T * context.size
        if row > self.config.max_seq_len:
            max_len = self.config.max_seq_len
            raise ValueError(f"sequence length {row} exceeds model.max_seq_len ({max_len}); lower seq_len")
        x_BTD = self.tok_embeddings(tokens_BT)
        cis_TF, mask_B1TT = self.rotary_and_mask(T, documents_BT, tokens_BT.device)
        with recording(self.router_log):
            for layer in self.layers:
                x_BTD = layer(x_BTD, cis_TF, mask_B1TT)
        return self.norm(x_BTD)


def rope_cache(model: nn.Module) -> list[torch.Tensor]:
    """The rotary tables the model (or pipeline stage) holds in its per-device cache: memory a rank keeps
    all step, which a memory tracker must be told of (under parallel.cp no op makes a view of them). An
    interleaved pipeline rank's module holds its stages' parts, not the stages (trainer/rank/pipeline.py
    `rank_model`), and names them in `stage_modules`."""
    roots = (model, *getattr(model, "stage_modules", ()))
    modules = {id(m): m for root in roots for m in root.modules() if isinstance(m, Transformer)}
    return [table for m in modules.values() for table in m.cached_rope_tables()]


def block_causal_mask(documents_BT: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean attn_mask for packed documents: query t attends key s <= t of the same document.

    Rotary positions stay the row's: attention scores depend on q - k positions only, so a document
    placed later in a row scores as it would alone. The mask is B·T·T bools, made once per forward
    and shared by every layer."""
    T = documents_BT.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=documents_BT.device).tril()
    same_BTT = documents_BT[:, :, None] == documents_BT[:, None, :]
    return (same_BTT & causal_TT)[:, None]


# ----------------------------------------------------------------------------- build and initialise


def apply_sdpa_choice(model: nn.Module, choice: SdpaChoice) -> None:
    """Give every attention layer the run's kernel choice (trainer/model/attention.py; before compile:
    it is traced with it)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.sdpa = choice


def apply_context_parallel(model: nn.Module, context: ContextParallel | None) -> None:
    """Give the model, every attention layer and every MoE layer (its balance loss) the rank's cp group
    (parallel.cp > 1), or None."""
    for module in model.modules():
        if isinstance(module, (Attention, Transformer, MoE)):
            module.context = context


def apply_loss_choice(model: Transformer, loss: LossConfig) -> None:
    """Give the model the run's chunk size and z-loss weight (loss=chunked: the loop passes targets to forward)."""
    model.loss_chunk_tokens = loss.chunk_tokens
    model.loss_z_weight = loss.z_loss


def build_model(config: ModelConfig, device: str | torch.device = "meta") -> Transformer:
    """The decoder with storage on `device`; on meta (the default) it allocates nothing.

    Weights are not initialised here: call `materialize` (or `init_weights`) once the model
    is wrapped and sharded, so that each rank fills only its own shard.
    """
    with (
        torch.device(device),
        NoInitOnMeta() if torch.device(device).type == "meta" else contextlib.nullcontext(),
    ):
        return Transformer(config)


class NoInitOnMeta(TorchFunctionMode):
    """Skips torch.nn.init on meta tensors: nn.Linear and nn.Embedding initialise in their
    constructors, which on meta fills nothing, yet the first meta normal_/uniform_ (Python
    decompositions) imports torch._dynamo, about a second per process. `init_weights` draws
    every weight anyway."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = kwargs.get("tensor", args[0] if args else None)  # nn.init passes it by keyword
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def canonical_name(name: str) -> str:
    """A parameter's name with wrapper segments removed: the same before and after wrapping."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


@contextlib.contextmanager
def recording(log: RouterLog | None) -> Iterator[None]:
    """The MoE layers' routing is recorded (model.n_experts > 0) during a forward's blocks only, not during a
    checkpointed block's recompute in backward."""
    if log is not None:
        log.open = True
    try:
        yield
    finally:
        if log is not None:
            log.open = False


def find_transformer(model: nn.Module) -> Transformer:
    for module in model.modules():
        if isinstance(module, Transformer):
            return module
    raise TypeError(
        f"init_weights needs a model containing a trainer.model.decoder.Transformer, got {type(model).__name__}"
    )


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name` (canonical) under run seed `seed`: 32 bits."""
    # crc32, not hash(): Python salts str hashes per process, and every rank must agree.
    # Seed and name go into one 32-bit value because the CPU generator (mt19937) silently
    # keeps only the low 32 bits of its seed: `seed * 2**32 + crc` would ignore the seed.
    return zlib.crc32(f"{seed}:{name}".encode())


def _draw_full(name: str, shape: torch.Size, seed: int, n_layers: int) -> torch.Tensor:
    """The full fp32 value of parameter `name`, on CPU, from a generator seeded by (seed, name)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):  # Qwen2's q, k, v biases
        return torch.zeros(shape)
    std = INIT_STD / math.sqrt(2 * n_layers) if name.endswith(_RESIDUAL_PROJECTIONS) else INIT_STD
    generator = torch.Generator(device="cpu")
    generator.manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` into `param`, or only this rank's slice of it when `param` is sharded."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # ranks only: the plan builds no storage

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank slices its own identical copy, so no communication.
        # (distribute_tensor moves `full` to the mesh's device first: transient, one parameter.)
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter deterministically (the model has no buffers to fill).

    Each parameter is drawn whole, on CPU in fp32, from its own generator seeded by `seed` and
    its canonical name, then only the local shard is kept. So the weights do not depend on
    wrapping (checkpoint_wrapper, torch.compile), on sharding (FSDP2 DTensors on any number
    of ranks) or on parameter order, and the transient memory is one parameter, never the model.
    Linear and embedding weights ~ N(0, 0.02), wo and w2 scaled by 1/sqrt(2 * n_layers); norms 1.
    """
    n_layers = find_transformer(model).config.n_layers
    for name, param in model.named_parameters():
        copy_full_into(param, _draw_full(canonical_name(name), param.shape, seed, n_layers))
    zero_buffers(model)


@torch.no_grad()
def zero_buffers(model: nn.Module) -> None:
    """The only buffers are the routers' aux-loss-free biases, which start at zero (whatever fills the weights)."""
    for buffer in model.buffers():
        buffer.zero_()


def materialize(
    model: nn.Module, device: str | torch.device, seed: int, load: Callable[[nn.Module], None] | None = None
) -> None:
    """Allocate the (possibly sharded) meta model's storage on `device`, then initialise it, or fill
    it with `load` instead (model.weights: trainer/model/hf_weights.py `load_weights`)."""
    model.to_empty(device=device)
    retie_embeddings(model)
    if load is None:
        init_weights(model, seed)
    else:
        zero_buffers(model)
        load(model)


def retie_embeddings(model: nn.Module) -> None:
    """Tie the output head to the embedding again: `to_empty` replaces each module's parameters one by
    one (meta to real storage cannot be swapped in place), which leaves a tied head a second tensor.
    FSDP2 keeps shared parameters shared itself; there this assigns the one parameter to itself."""
    transformer = find_transformer(model)
    if (
        transformer.config.tie_embeddings
        and transformer.output.weight is not transformer.tok_embeddings.weight
    ):
        transformer.output.weight = transformer.tok_embeddings.weight


# ----------------------------------------------------------------------------- size and cost


def num_params(config: ModelConfig) -> int:
    """Exact parameter count, counted on a meta-device build (allocates nothing; cached per shape: the
    advisor and checks/plan_vs_published.py count the same model hundreds of times)."""
    return _num_params(config.shape_key())


@functools.lru_cache(maxsize=64)
def _num_params(key: tuple[Any, ...]) -> int:
    return sum(p.numel() for p in build_model(ModelConfig(**dict(key)), device="meta").parameters())


def idle_expert_params(config: ModelConfig) -> int:
    """The routed experts' parameters a token does not go through: (n_experts - top_k) experts per block."""
    if not config.is_moe:
        return 0
    return config.n_layers * (config.n_experts - config.top_k) * 3 * config.dim * config.expert_width


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12 L H Q T (PaLM, appendix B; torchtitan).

    6N is forward (2N) plus backward (4N) through the weights; 12 L H Q T is the attention
    scores and the weighted sum of values, which have no parameters. N excludes the token
    embedding: it is a table lookup, not a matmul (the output head is a matmul and counts; a tied
    head is the embedding's one parameter, counted once, as the head). Q is the head width. In a mixture of
    experts N counts the experts a token goes through: top_k of the n_experts (and the router and shared ones).
    """
    embedding = 0 if config.tie_embeddings else config.vocab_size * config.dim
    n_matmul = num_params(config) - embedding - idle_expert_params(config)
    return 6.0 * n_matmul + 12.0 * config.n_layers * config.n_heads * config.head_width * seq_len
