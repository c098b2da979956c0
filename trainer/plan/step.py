"""The walk of one optimizer step: what a rank holds at each moment of it, on top of its states.

A step is a list of moments: the last block's forward, the output head's (FSDP2), the loss, the
output head's backward, the start, end and reduce-scatter of each block's backward (the worst of
each over every block), the optimizer step. Each moment is the rank's model states at rest (from
trainer/plan/states.py; its gradients replaced where the step holds others) plus the
activations saved so far, the temporaries alive then, and `other`; trainer/plan/build.py calls the
largest the peak.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1) are 34·s·b·h + 5·a·s²·b bytes per layer for GPT-3 in fp16 with dropout,
s = sequence, b = micro-batch, h = width, a = heads. zerolab's block is different, so the
formula is re-derived from what its autograd graph saves (checked by listing saved tensors,
see docs/memory_plan.md), per token, in bytes:

    attention: norm input x, x·rstd, norm output, q, k, v, SDPA output, SDPA logsumexp (4·H)
    MLP:       norm input h, h·rstd, norm output, w1 out, w3 out, silu out, their product
    fp32                        4·(8D + 2·KQ + 4M) + 4H + 8
    bf16/fp16, stages 0-1       30D + 4·KQ + 8M + 4H + 8   (autocast: residual and norms fp32,
                                the norm output cast once per projection: 3 copies, then 2)
    bf16/fp16, stages 2-3       24D + 4·KQ + 8M + 4H + 8   (FSDP2: everything in bf16 except
                                RMSNorm, which upcasts its input to fp32 and saves that)

On CUDA, RMSNorm runs torch's fused kernel, which saves its input and rstd only (no fp32 upcast,
no x·rstd: `fused_norm_saving`): per block 8D less in fp32 and under autocast, 12D less under
FSDP2 (12D + 4·KQ + 8M + 4H + 8).

No dropout (Korthikanti's 2 masks), no attention matrix: by default SDPA runs the flash kernel
(saves q, k, v, output and a logsumexp; grouped K/V are not repeated), hence no 5·a·s²·b
term; other kernels (`attention=`, and fp32 on CUDA) add what `attention_extra_per_token` says; SwiGLU saves 4 M-wide tensors where GELU saves 2. After the blocks: the final norm and
the fp32 log-softmax of the logits (4·V per token; `logits.float()` adds a transient fp32
copy in bf16). Activation checkpointing (non-reentrant) keeps only a block's input (D values
in the residual dtype) and recomputes the block in backward, so the last block's full set
comes back at the start of backward. Per-operator checkpointing (checkpointing=op) also keeps
the outputs its policy saves (`op_checkpointed_bytes_per_token`); the one its recompute never
reads (w2's) stays through the block's backward on top of the full set.

Temporaries, the part estimators leave out and where stages differ most:
- stage2 keeps every block's parameters unsharded (param dtype) from forward to backward;
  stage3 one block at a time (plus the prefetched next one in backward); the root
  (embeddings, final norm, output head) stays unsharded in both, as sharding.py asks.
- FSDP2's flat all-gather output lives next to the unsharded copy until the next copy-out;
  the reduce-scatter input (reduce dtype, padded), its output (the new gradient shard; a bf16
  output is cast to a new fp32 one) and on gloo a second input-sized buffer; the root's
  unsharded output-head gradient lives from the head's backward until the root's
  reduce-scatter at the very end of backward.
- DDP under autocast caches a 2-byte copy of every matmul weight for forward and backward, and
  casts w2's bf16 weight gradient to fp32 only once the B·T·M input gradient is consumed.
- The loss: log_softmax and its backward hold 2-3 fp32 B·T·V tensors at once.
- Adam: the per-tensor loop (CPU's default) makes 2 temporaries of a tensor while the previous
  tensor's is still alive; the fused kernel (CUDA's default, `optim.fused`) makes none.
- Gradient accumulation (grad_accum > 1), as `zero.reduce_every` chooses:
  step: micro-batches before the last keep a full unsharded gradient (DDP no_sync: fp32, outside
  its buckets; FSDP2 without reduce-scatter: `unsharded_accumulated_grad`, in the reduce dtype,
  torch's _fsdp_param.py to_accumulated_grad_if_needed);
  micro_batch: every backward reduces. DDP accumulates in its buckets (no extra memory); FSDP2
  adds each new shard into the one it holds, so from the second micro-batch on every gradient
  shard is alive all step long and each reduce-scatter's output is a transient.

CPU offload: FSDP2 keeps parameters, gradients and optimizer state in host memory; on a GPU
they leave the device figure (reported as `offloaded_gib`); on a CPU device nothing moves.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainer.config import (
    CheckpointMode,
    DataConfig,
    DType,
    LossKind,
    ModelConfig,
    OffloadTarget,
    PrecisionConfig,
    ReduceEvery,
    Stage,
    TrainConfig,
    ZeroConfig,
    uses_fused,
)
from trainer.model.attention import run_choice, sdpa_op
from trainer.model.checkpointing import op_saved_matmuls, op_saves, should_checkpoint
from trainer.plan.comm import REDUCE_BYTES
from trainer.plan.states import ModelShape, RankStates, padded_numel

BATCH_BYTES_PER_TOKEN = 16  # int64 inputs and targets
NLL_TOTAL_WEIGHT = 4  # nll_loss's fp32 total weight, saved for its backward


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Precisions:
    """Bytes per element where the compute dtype shows, for one stage and precision."""

    regime: str  # fp32 | autocast (stages 0-1, bf16/fp16) | fsdp_mp (stages 2-3, bf16/fp16)
    compute: int  # matmul outputs, attention
    residual: int  # the residual stream between blocks
    param: int  # the weights matmuls read (FSDP2's unsharded copy; autocast's cached cast)


def precisions(precision: PrecisionConfig, zero: ZeroConfig) -> Precisions:
    if precision.compute_dtype == DType.float32:
        return Precisions("fp32", 4, 4, 4)
    if zero.uses_fsdp:
        return Precisions("fsdp_mp", 2, 2, 2)
    return Precisions("autocast", 2, 4, 2)  # embedding output and residual adds stay fp32


def block_bytes_per_token(m: ModelConfig, regime: str, device_kind: str = "cpu") -> int:
    """Saved activations of one transformer block, per token (see the module docstring).

    q and the SDPA output are H·Q wide (HQ, = D unless `head_dim` sets Q apart). q/k RMSNorm
    (Qwen3) saves, in every regime, its fp32 input (upcast) and x·rstd of each head and an fp32
    rstd per head: 8·(HQ + KQ) + 4·(H + K); its output only passes through the rotary embedding.
    On CUDA the block's two RMSNorms run the fused kernel and save less (`fused_norm_saving`); the
    q/k norms are counted as on CPU (not yet checked against the CUDA kernel).
    """
    D, M, H, HQ, KQ = m.dim, m.ffn_dim, m.n_heads, m.n_heads * m.head_width, m.n_kv_heads * m.head_width
    stats = 4 * H + 8  # SDPA logsumexp (fp32 per head) and the two RMSNorm rstd (fp32)
    qk_norm = 8 * (HQ + KQ) + 4 * (H + m.n_kv_heads) if m.qk_norm else 0
    fused = 2 * fused_norm_saving(D, regime) if device_kind == "cuda" else 0
    if regime == "fp32":
        return 4 * (6 * D + 2 * HQ + 2 * KQ + 4 * M) + stats + qk_norm - fused
    if regime == "autocast":
        return 26 * D + 4 * HQ + 4 * KQ + 8 * M + stats + qk_norm - fused
    return 20 * D + 4 * HQ + 4 * KQ + 8 * M + stats + qk_norm - fused


def fused_norm_saving(dim: int, regime: str) -> int:
    """Bytes per token one RMSNorm saves less on CUDA than on CPU.

    nn.RMSNorm calls torch.rms_norm, which dispatches to aten::_fused_rms_norm whenever the
    weight's dtype matches the input's (aten/src/ATen/native/layer_norm.cpp, rms_norm_symint), as it
    does in every regime here (autocast: fp32 residual and fp32 weight; FSDP2: both bf16). On CUDA
    that op has its own kernel, and autograd saves its input (in the input's dtype), the fp32 rstd
    and the weight (tools/autograd/derivatives.yaml, `_fused_rms_norm`: input, weight, result1). On
    CPU builds it is CompositeImplicitAutograd (torch._C._dispatch_dump('aten::_fused_rms_norm')):
    the decomposition upcasts the input to fp32 and saves that copy and x·rstd (both fp32).
    CPU per norm: 4D + 4D; CUDA: the input itself, D in the residual dtype.
    """
    residual = 2 if regime == "fsdp_mp" else 4
    return 8 * dim - residual * dim


def head_bytes_per_token(m: ModelConfig, regime: str, device_kind: str = "cpu", chunked: bool = False) -> int:
    """Saved after the blocks, per token: final RMSNorm (input, x·rstd, output; on CUDA the fused
    kernel's input only, `fused_norm_saving`) and log_softmax (fp32).

    loss=chunked saves no log-softmax (each chunk's is recomputed in backward) and, as the chunks'
    checkpoint input, the norm output itself: fp32 under autocast, where the full loss saves the
    head's bf16 cast of it.
    """
    fused = fused_norm_saving(m.dim, regime) if device_kind == "cuda" else 0
    if chunked:
        return 4 * m.dim + 4 * m.dim + (2 if regime == "fsdp_mp" else 4) * m.dim + 4 - fused
    norm_output = 4 * m.dim if regime == "fp32" else 2 * m.dim
    return 4 * m.dim + 4 * m.dim + norm_output + 4 + 4 * m.vocab_size - fused


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch on one rank."""

    blocks: tuple[int, ...]  # saved by each block in forward (its input only when checkpointed)
    full_block: int  # one block's full set (a checkpointed block recomputes it in backward)
    head: int  # final norm + fp32 log-softmax
    log_softmax: int
    batch: int
    unread: int = 0  # checkpointing=op: a block's saved outputs its recompute stops before reading (w2's)
    inputs_kept: tuple[int, ...] = ()  # per block: its checkpointed input, alive beside its recompute

    @property
    def in_backward(self) -> int:
        """What a block holds at the start of its backward: its full set back, and what stays unread
        until its backward ends (the policy's storage lives as long as the block's graph)."""
        return self.full_block + self.unread

    def in_backward_of(self, block: int) -> int:
        """in_backward, plus block `block`'s checkpointed input where its recompute does not save the
        input itself (`checkpoint_input_kept`)."""
        return self.in_backward + (self.inputs_kept[block] if self.inputs_kept else 0)

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.head + self.batch

    @property
    def before_last_block(self) -> int:
        """Saved by every block but the last, plus the batch: what the last block adds to."""
        return sum(self.blocks[:-1]) + self.batch


def attention_extra_per_token(config: TrainConfig, device_kind: str) -> int:
    """What the run's SDPA kernel (trainer/model/attention.py) saves per token beyond the flash kernel's
    q, k, v, output and logsumexp, which block_bytes_per_token counts.

    K/V repeated for a kernel that cannot group heads: 2·(H - K)·Q more values. Math: its scaled
    q, the repeated K and V and the B·H·T·T softmax output, and no logsumexp; on CPU it computes
    half dtypes in fp32 (torch upcasts them there), on CUDA in the compute dtype. (Math's
    transient pre-softmax scores, alive for one op in forward, are not modelled.)
    """
    m, prec = config.model, precisions(config.precision, config.zero)
    choice = run_choice(config.attention, config.model, config.precision.compute_dtype, device_kind)
    HQ, H, KQ, T = m.n_heads * m.head_width, m.n_heads, m.n_kv_heads * m.head_width, config.seq_len
    flash = prec.compute * (HQ + 2 * KQ) + 4 * H
    if choice.saves_scores:
        width = 4 if device_kind == "cpu" else prec.compute
        return width * (3 * HQ + H * T) - flash
    return 2 * (HQ - KQ) * prec.compute if choice.repeat_kv else 0


def op_checkpointed_bytes_per_token(config: TrainConfig, device_kind: str) -> int:
    """checkpointing=op: what a block keeps from its forward to its backward, per token.

    Its input (as every checkpointed block) and the outputs the policy saves
    (trainer/model/checkpointing.py): the 1st, 3rd, 5th and 7th matmul (wq, wv, w1, w2) when the
    save list has aten.mm, and the SDPA op's output and fp32 logsumexp when it has the op the
    run's kernel runs (math has none: its composite op decomposes first). The saved outputs are
    kept whether or not backward needs them (w2's output, which no backward reads, included).
    """
    m, prec = config.model, precisions(config.precision, config.zero)
    HQ, KQ = m.n_heads * m.head_width, m.n_kv_heads * m.head_width  # HQ = D unless `head_dim` sets it apart
    widths = {"wq": HQ, "wk": KQ, "wv": KQ, "wo": m.dim, "w1": m.ffn_dim, "w3": m.ffn_dim, "w2": m.dim}
    save_ops = config.checkpointing.save_ops
    kept = prec.residual * m.dim + sum(prec.compute * widths[name] for name in op_saved_matmuls(save_ops))
    choice = run_choice(config.attention, m, config.precision.compute_dtype, device_kind)
    if op_saves(save_ops, sdpa_op(choice, device_kind)):
        kept += prec.compute * HQ + 4 * m.n_heads
    return kept


def checkpoint_input_kept(prec: Precisions, device_kind: str) -> int:
    """Bytes per element of a checkpointed block's input that stay alive beside its recomputed set.

    Non-reentrant checkpoint keeps the block's inputs for its recompute in its frame
    (torch 2.13 torch/utils/checkpoint.py, `_checkpoint_without_reentrant_generator` calls
    `_CheckpointFrame.save_inputs`), which lives as long as the block's saved-tensor holders, so the
    input is alive through the block's backward, next to the recomputed set. The full set counts
    the attention norm's saved input as its fp32 upcast: in fp32 and under autocast (fp32 residual)
    `x.float()` is x itself, and CUDA's fused RMSNorm saves x as it is (`fused_norm_saving`), so only
    FSDP2's half-precision residual on CPU keeps a second copy: the bf16 input next to its fp32 upcast
    (measured on 2 CPU ranks, tiny model, micro_batch 8 x seq_len 64, bf16, checkpointing=full: the
    block's 131,072-byte input alive at the MLP's backward in the recompute).
    """
    return prec.residual if prec.regime == "fsdp_mp" and device_kind == "cpu" else 0


def activations(config: TrainConfig, device_kind: str = "cpu") -> Activations:
    m, prec = config.model, precisions(config.precision, config.zero)
    tokens = config.micro_batch * config.seq_len
    full = (
        block_bytes_per_token(m, prec.regime, device_kind) + attention_extra_per_token(config, device_kind)
    ) * tokens
    checkpointed, unread = (
        prec.residual * m.dim * tokens,
        0,
    )  # non-reentrant checkpoint keeps the block's input
    if config.checkpointing.mode == CheckpointMode.op:
        checkpointed = op_checkpointed_bytes_per_token(config, device_kind) * tokens
        # Early stop ends the recompute once w2's input is back, before w2 runs: its saved output is never read.
        unread = (
            prec.compute * m.dim * tokens if "w2" in op_saved_matmuls(config.checkpointing.save_ops) else 0
        )
    blocks = tuple(
        checkpointed if should_checkpoint(i, config.checkpointing) else full for i in range(m.n_layers)
    )
    kept = checkpoint_input_kept(prec, device_kind) * m.dim * tokens
    inputs_kept = tuple(kept if should_checkpoint(i, config.checkpointing) else 0 for i in range(m.n_layers))
    batch = BATCH_BYTES_PER_TOKEN * tokens
    if config.loss.kind == LossKind.chunked:  # nothing of the loss is saved: recomputed per chunk
        head = head_bytes_per_token(m, prec.regime, device_kind, chunked=True) * tokens
        return Activations(blocks, full, head, 0, batch, unread, inputs_kept)
    head = head_bytes_per_token(m, prec.regime, device_kind) * tokens + NLL_TOTAL_WEIGHT
    return Activations(blocks, full, head, 4 * m.vocab_size * tokens, batch, unread, inputs_kept)


# ----------------------------------------------------------------------------- moments of a step


@dataclass(frozen=True)
class Moment:
    """The tensors alive at one point of a training step, by kind (bytes)."""

    name: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class StepContext:
    """Everything the moments of one rank's step are computed from."""

    config: TrainConfig
    shape: ModelShape
    states: RankStates
    acts: Activations
    prec: Precisions
    world_size: int  # the ranks model states are sharded over: FSDP2's shard group (HSDP: zero.shard_ranks)
    device_kind: str
    other: int  # rotary tables, data tables, Adam's step counters

    @property
    def tokens(self) -> int:
        return self.config.micro_batch * self.config.seq_len

    @property
    def offloaded(self) -> bool:
        """States in host memory while compute runs on the GPU (FSDP2 CPUOffloadPolicy)."""
        return self.config.offload.target == OffloadTarget.cpu and self.device_kind == "cuda"

    def moment(self, name: str, grads: int | None = None, activations: int = 0, temporary: int = 0) -> Moment:
        """Model states at rest plus what the moment adds; `grads` replaces the at-rest gradients."""
        if self.offloaded:  # on the host: not in the device's figure
            params = grads = optimizer = 0
        else:
            params, optimizer = self.states.params, self.states.optimizer
            grads = self.states.grads if grads is None else grads
        parts = dict(
            params=params, grads=grads, optimizer=optimizer, activations=activations, temporary=temporary
        )
        return Moment(name, {**parts, "other": self.other})


def loss_forward_temporary(ctx: StepContext) -> int:
    """Logits, their fp32 copy (`logits.float()`, none in fp32) and the log-softmax being written."""
    nv = ctx.tokens * ctx.config.model.vocab_size
    return 4 * nv if ctx.prec.regime == "fp32" else 2 * nv + 4 * nv


def loss_backward_temporary(ctx: StepContext) -> int:
    """log_softmax's backward: the incoming gradient and the outgoing one, both fp32 B·T·V."""
    return 8 * ctx.tokens * ctx.config.model.vocab_size


def chunked_loss_moments(
    ctx: StepContext, fixed: int, weight_grad: int, head_end: int, prefetched: int = 0
) -> list[Moment]:
    """loss=chunked (trainer/model/loss.py): the moments of the loss and the output head, chunk by chunk.

    c tokens a chunk, k chunks, the last r tokens. Forward and each chunk's recompute hold the chunk's
    logits, their fp32 copy (half precision) and log-softmax: 8·c·V fp32, 10·c·V bf16. Its backward
    holds the log-softmax and its two gradients (12·c·V), then the logits' gradient, the chunk's input
    gradient and a new head weight gradient (`weight_grad`). Backward runs the chunks last to first and
    autograd buffers what each passed on until every chunk is done: the chunks' input gradients
    (residual dtype) and one head weight gradient, to which each chunk's is added. The first addition
    (the second chunk run) is out of place (the first gradient is a transposed view): three weight
    gradients at once; later ones add in place: two. Then the input gradients are concatenated (two
    copies) and `head_end` runs (the weight gradient's last form: autocast's fp32 cast next to its
    bf16, DDP's copy into the bucket).

    `prefetched` is held through the whole loss backward: at stage3, the last block's all-gather output.
    The root's forward returns the loss itself, so FSDP2's pre-backward hook on that output
    (torch/distributed/fsdp/_fully_shard/_fsdp_state.py:331 `_register_pre_backward_hook`) fires
    before the first chunk's backward, and the root's `_backward_prefetch` (_fsdp_param_group.py:795)
    unshards the block before it in post-forward order: `foreach_all_gather` allocates the flat output
    (_fsdp_collectives.py:351) and only the block's own pre-backward copies it out and frees it.
    """
    m, n, prec, acts = ctx.config.model, ctx.tokens, ctx.prec, ctx.acts
    c = min(ctx.config.loss.chunk_tokens, n)
    k, V, D, res = -(-n // c), m.vocab_size, m.dim, prec.residual
    r = n - (k - 1) * c
    held = (weight_grad if k > 1 else 0) + res * (n - c) * D  # before chunk 0 (run last): the most
    logits = (8 if prec.regime == "fp32" else 10) * c * V
    chunk_head = prec.compute * c * (V + D) + weight_grad
    # The additions: the second chunk run (its own input gradient still in the compute dtype), and chunk 0.
    added = [3 * weight_grad + res * r * D + prec.compute * c * D] if k > 1 else [0]
    if k > 2:
        added.append(2 * weight_grad + res * (n - c) * D + prec.compute * c * D)
    back = fixed + prefetched
    return [
        ctx.moment("forward: loss", activations=acts.total, temporary=fixed + logits),
        ctx.moment("backward: loss recompute", activations=acts.total, temporary=back + held + logits),
        ctx.moment("backward: loss", activations=acts.total, temporary=back + held + 12 * c * V),
        ctx.moment("backward: output head", activations=acts.total, temporary=back + held + chunk_head),
        ctx.moment("backward: head gradient added", activations=acts.total, temporary=back + max(added)),
        ctx.moment(
            "backward: loss end",
            activations=acts.total,
            temporary=back + max(2 * res * n * D + weight_grad, head_end),
        ),
    ]


def block_backward_temporary(ctx: StepContext, weight_grad_bytes: int, weight_grad_held: bool) -> int:
    """Early in a block's backward: the gradient arriving from above and the MLP's gradients.

    w2's backward holds the gradient of the SwiGLU product (B·T·M) and of w2's weight; then
    the product's backward holds two B·T·M gradients while w2's saved input is already gone.
    DDP copies each weight gradient into its bucket at once (a transient); FSDP2 keeps the
    block's unsharded weight gradients until the block's reduce-scatter.
    """
    m, n = ctx.config.model, ctx.tokens
    incoming = ctx.prec.residual * n * m.dim
    nm, w2_grad = ctx.prec.compute * n * m.ffn_dim, weight_grad_bytes * m.dim * m.ffn_dim
    if weight_grad_held:
        return incoming + 2 * nm + w2_grad
    if ctx.prec.regime == "autocast":
        # The bf16 weight gradient's fp32 cast (6 bytes per element at once) comes once the B·T·M
        # input gradient is consumed: measured with MemTracker on DDP, B·T of 16, 128 and 1024.
        return incoming + max(w2_grad, 2 * nm)
    return incoming + max(nm + w2_grad, 2 * nm)


def block_end_temporary(ctx: StepContext) -> int:
    """The end of a block's backward: its attention RMSNorm's backward, beside the gradient arriving
    down the residual (the block's weight gradients are counted by the caller).

    On CPU RMSNorm is torch's composite (aten/src/ATen/native/layer_norm.cpp `rms_norm_composite`:
    x_f = input.to(fp32); rstd = rsqrt(pow(x_f, 2).mean(-1) + eps); x_f.mul(rstd).mul(weight)).
    Its backward peaks in pow's (torch/csrc/autograd/FunctionsManual.cpp `pow_backward`:
    grad * (2 * x_f.pow(1))), with five fp32 B·T·D tensors at once: mean's backward (its input
    gradient), x_f.pow(1), 2 * that, their product, and the gradient x_f.mul(rstd)'s backward gave
    x_f, waiting in autograd's input buffer; x_f itself is still saved (pow's input; in fp32 and
    under autocast the block's input itself). Measured with MemTracker on 2 CPU ranks, tiny model,
    1 x 32 tokens, stage3: 5 x 16,384 bytes of fp32 temporaries, the 16,384-byte fp32 input and the
    residual's incoming gradient at block 2's end. CUDA runs the fused kernel
    (`fused_norm_saving`); there the incoming gradient and the norm's input gradient are counted.
    """
    incoming = ctx.prec.residual * ctx.tokens * ctx.config.model.dim
    if ctx.device_kind == "cuda":
        return 2 * incoming
    return incoming + 6 * 4 * ctx.tokens * ctx.config.model.dim


def optimizer_temporary(ctx: StepContext) -> int:
    """Adam's temporaries: the fused kernel (trainer/rank/optim.py's default on CUDA) updates in place
    and makes none; the per-tensor loop (CPU's default) makes `loop_temporary`. Offloaded states
    are updated on the host."""
    if ctx.offloaded or uses_fused(ctx.config.optim, ctx.device_kind):
        return 0
    return 4 * ctx.states.loop_temporary


def accumulates_sharded(ctx: StepContext) -> bool:
    """FSDP2 under reduce_every=micro_batch with grad_accum > 1: from the second micro-batch on,
    every gradient shard is held all step long (the peak is that micro-batch's)."""
    c = ctx.config
    return c.grad_accum > 1 and c.zero.uses_fsdp and c.zero.reduce_every == ReduceEvery.micro_batch


def accumulation_grads(ctx: StepContext) -> int:
    """reduce_every=step: micro-batches before the last keep an unsharded gradient outside buckets
    and shards: DDP in the fp32 parameters' dtype, FSDP2 in the reduce dtype."""
    c = ctx.config
    if c.grad_accum == 1 or c.zero.reduce_every == ReduceEvery.micro_batch:
        return 0
    width = REDUCE_BYTES[c.zero.reduce_dtype] if c.zero.uses_fsdp else 4
    return width * ctx.shape.num_params


def ddp_moments(ctx: StepContext) -> list[Moment]:
    """Stages 0-1: DDP holds replicated fp32 params and its gradient buckets all step long."""
    m, n, acts, prec = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec
    vd = m.vocab_size * m.dim
    linear = ctx.shape.block_linear_numel * m.n_layers + vd  # blocks' matmuls + output head
    # Autocast caches its cast of every weight from first use until the autocast region (which
    # wraps forward and backward in loop.py) exits.
    fixed = (2 * linear if prec.regime == "autocast" else 0) + accumulation_grads(ctx)
    if prec.regime == "autocast":  # bf16 weight gradient, then its fp32 cast; or with the logits' gradient
        head = max(2 * n * m.vocab_size + 2 * n * m.dim + 2 * vd, 2 * n * m.dim + 6 * vd)
    else:
        head = 4 * n * m.vocab_size + 4 * n * m.dim + 4 * vd
    weight_grad = 6 if prec.regime == "autocast" else 4
    # A tied head's fp32 weight gradient waits in autograd's buffer for the embedding's (one parameter,
    # one AccumulateGrad) through every block's backward; then the two and their sum are alive at once.
    tied = 4 * vd if m.tie_embeddings else 0
    embedding = 12 * vd if m.tie_embeddings else 4 * vd + prec.residual * n * m.dim
    if ctx.config.loss.kind == LossKind.chunked:
        # autocast: bf16 weight gradients, cast to fp32 once all chunks are done; fp32: copied into the bucket
        grad, end = (2 * vd, 6 * vd) if prec.regime == "autocast" else (4 * vd, 4 * vd)
        loss = chunked_loss_moments(ctx, fixed, grad, end)
    else:
        loss = [
            ctx.moment(
                "forward: loss", activations=acts.total, temporary=fixed + loss_forward_temporary(ctx)
            ),
            ctx.moment(
                "backward: loss", activations=acts.total, temporary=fixed + loss_backward_temporary(ctx)
            ),
            ctx.moment(
                "backward: output head", activations=acts.total - acts.log_softmax, temporary=fixed + head
            ),
        ]
    return [
        ctx.moment(
            "forward: last block", activations=acts.before_last_block + acts.full_block, temporary=fixed
        ),
        *loss,
        ctx.moment(
            "backward: last block",
            activations=acts.before_last_block + acts.in_backward,
            temporary=fixed + tied + block_backward_temporary(ctx, weight_grad, weight_grad_held=False),
        ),
        ctx.moment("backward: embedding", activations=acts.batch, temporary=fixed + embedding),
        ctx.moment("optimizer step", temporary=optimizer_temporary(ctx)),
    ]


@dataclass(frozen=True)
class FsdpSizes:
    """FSDP2 buffers of one rank (bytes)."""

    root: int  # the root's unsharded parameters (= its flat all-gather output), param dtype
    block: int  # one block's
    root_rs: int  # the root's reduce-scatter input (reduce dtype, padded)
    block_rs: int
    block_grad_shard: int  # one block's gradient shard (fp32: the reduce-scatter output, cast back)
    root_grad_shard: int
    block_rs_out: int  # the reduce-scatter output in the reduce dtype (bf16: cast to a new fp32 shard)
    root_rs_out: int
    output_grad: int  # the output head's unsharded weight gradient (+ final norm's)
    gloo_copy: bool  # gloo's reduce-scatter works on a copy of its input
    secondary: int = 0  # hpZ: one block's secondary shard, kept from its forward to its backward all-gather


def fsdp_sizes(ctx: StepContext) -> FsdpSizes:
    s, w, p, r = ctx.shape, ctx.world_size, ctx.prec.param, REDUCE_BYTES[ctx.config.zero.reduce_dtype]
    root_padded = sum(padded_numel(t, w) for t in s.root)
    block_padded = sum(padded_numel(t, w) for t in s.block)
    m = ctx.config.model
    return FsdpSizes(
        root=p * root_padded,
        block=p * block_padded,
        root_rs=r * root_padded,
        block_rs=r * block_padded,
        block_grad_shard=4 * block_padded // w,
        root_grad_shard=4 * root_padded // w,
        block_rs_out=r * block_padded // w,
        root_rs_out=r * root_padded // w,
        output_grad=p * (m.vocab_size * m.dim + m.dim),
        gloo_copy=ctx.device_kind == "cpu",
        secondary=p * block_padded // ctx.config.zero.hpz_ranks if ctx.config.zero.hpz_ranks else 0,
    )


def secondaries(f: FsdpSizes, blocks: int) -> int:
    """hpZ's secondary shards of `blocks` blocks (FSDP2's to_sharded_post_forward clones 1/hpz_ranks of
    each block's all-gather output after its forward and frees it once backward's all-gather copied out)."""
    return max(0, blocks) * f.secondary


@dataclass(frozen=True)
class Accumulation:
    """What gradient accumulation adds to an FSDP2 step (bytes; nothing at grad_accum=1)."""

    shards: int | None  # micro_batch, from the second micro-batch: every gradient shard, all step long
    full: int  # step: the unsharded accumulated gradient, before the last micro-batch reduces any of it
    per_block: int  # step: what one block's reduce-scatter frees of it
    width: int  # step: its bytes per element (the reduce dtype's)
    in_place: bool  # step: autograd adds a later micro-batch's gradient into the held one (same dtype)

    def left(self, blocks_reduced: int) -> int:
        """The accumulated gradient still held once `blocks_reduced` blocks have reduced theirs."""
        return self.full - blocks_reduced * self.per_block

    def built(self, blocks_done: int) -> int:
        """step, the first micro-batch: what `blocks_done` blocks' backwards have accumulated so far."""
        return blocks_done * self.per_block

    def fresh(self, unsharded_grad: int) -> int:
        """A new unsharded gradient, kept beside the accumulated one until its group's post-backward
        adds it in (torch's accumulate_unsharded_grad_if_needed); none where autograd adds in place."""
        return 0 if self.in_place else unsharded_grad


def accumulation(ctx: StepContext, f: FsdpSizes) -> Accumulation:
    """reduce_every=step keeps `unsharded_accumulated_grad` (in the reduce dtype; where that is the
    param dtype, the unsharded gradient itself) until its block reduces in the last micro-batch;
    reduce_every=micro_batch keeps every shard the first micro-batch made (accumulates_sharded)."""
    full = accumulation_grads(ctx)
    width = REDUCE_BYTES[ctx.config.zero.reduce_dtype] if full else 0
    shards = ctx.config.model.n_layers * f.block_grad_shard + f.root_grad_shard
    return Accumulation(
        shards if accumulates_sharded(ctx) else None,
        full,
        width * sum(math.prod(s) for s in ctx.shape.block),
        width,
        full > 0 and width == ctx.prec.param,
    )


def fsdp_moments(ctx: StepContext, micro: MicroBatch | None = None) -> list[Moment]:
    """Stages 2-3: FSDP2 gathers parameters per block and reduce-scatters gradients per block.

    zero_grad frees the gradient shards at the start of the step, so forward-time moments hold
    none, unless reduce_every=micro_batch made them in an earlier micro-batch. With grad_accum > 1
    the moments are the worst micro-batch's: the second and later (and, for reduce_every=step,
    the last, which reduces, and one before it, which holds the whole accumulated gradient).
    zero.reshard_after_backward=false makes the micro-batches differ: kept_fsdp_moments walks each
    kind (`micro`) and its moments are named after it.
    """
    if micro is None and keeps_parameters(ctx.config):
        return kept_fsdp_moments(ctx)
    L = ctx.config.model.n_layers
    f = fsdp_sizes(ctx)
    acc = accumulation(ctx, f)
    if micro is not None and micro.first:
        # nothing of an earlier micro-batch yet: no shards held, no accumulated gradient to add into
        acc = dataclasses.replace(acc, shards=None, full=0, in_place=False)
    gathered = micro is not None and not micro.first  # forward starts with every group unsharded
    keeps = micro is not None and not micro.last  # backward reshards nothing
    reduces = micro is None or micro.last or ctx.config.zero.reduce_every == ReduceEvery.micro_batch
    stage3 = ctx.config.zero.stage == Stage.stage3
    after_forward = (
        f.root + (secondaries(f, L) if stage3 else L * f.block) + acc.full
    )  # unsharded at the loss
    # The last block's flat all-gather output outlives the blocks: FSDP2 defers its free to the next
    # copy-out (torch 2.13 _fsdp_param_group.py:476-485, comm_ctx.all_gather_state; not on a 1-rank
    # shard group, which gathers nothing), and the next is the root's post-forward
    # (_fsdp_state.py:335-342), after the final norm and the output head ran.
    last_gathered = f.block if ctx.world_size > 1 and not gathered else 0
    held = acc.shards or 0
    earlier = (
        fsdp_block_moments(ctx, f, acc, reduces=False)
        if micro is None and acc.full and ctx.config.grad_accum > 2
        else []
    )
    forward = (
        gathered_forward_moments(ctx, f, held, acc.full)
        if gathered
        else fsdp_forward_moments(ctx, f, held, acc.full)
    )
    moments = [
        *forward,
        *fsdp_loss_moments(ctx, f, held, after_forward, last_gathered),
        *fsdp_block_moments(ctx, f, acc, reduces=reduces, keeps=keeps),
        *earlier,
        *fsdp_root_backward_moments(ctx, f, acc, reduces=reduces, keeps=keeps),
    ]
    if micro is None:
        return [*moments, ctx.moment("optimizer step", temporary=optimizer_temporary(ctx))]
    return [dataclasses.replace(moment, name=f"{moment.name} ({micro.name})") for moment in moments]


def fsdp_forward_moments(ctx: StepContext, f: FsdpSizes, held: int, accumulated: int) -> list[Moment]:
    """The last block's all-gather and forward, the worst of a forward that gathers block by block."""
    acts, L = ctx.acts, ctx.config.model.n_layers
    stage3 = ctx.config.zero.stage == Stage.stage3
    # The last block's forward: its unsharded copy and its flat all-gather output (kept until the
    # next copy-out; during its own copy-out the block before's is still there too); stage2
    # still holds every earlier block unsharded. Offloaded shards are staged on the device first.
    forward = f.root + (2 * f.block + secondaries(f, L - 1) if stage3 else (L + 1) * f.block) + accumulated
    staging = (4 + ctx.prec.param) * f.block // ctx.world_size // ctx.prec.param if ctx.offloaded else 0
    return [
        ctx.moment(
            "forward: last block all-gather", held, acts.before_last_block, forward + f.block + staging
        ),
        ctx.moment("forward: last block", held, acts.before_last_block + acts.full_block, forward),
    ]


def fsdp_loss_moments(
    ctx: StepContext, f: FsdpSizes, held: int, after_forward: int, last_gathered: int
) -> list[Moment]:
    """The output head and the loss, forward and backward, with `after_forward` unsharded (and, at the
    head's forward, the last block's flat all-gather output, `last_gathered`)."""
    m, n, acts, prec = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec
    if ctx.config.loss.kind == LossKind.chunked:
        grad = prec.param * m.vocab_size * m.dim  # the unsharded head's gradient, kept until the root reduces
        # stage3: the root prefetches the last block's all-gather as the loss's backward begins
        prefetched = f.block if ctx.config.zero.stage == Stage.stage3 else 0
        return [
            dataclasses.replace(moment, parts={**moment.parts, "grads": held})
            for moment in chunked_loss_moments(ctx, after_forward, grad, grad, prefetched=prefetched)
        ]
    # The head's new weight gradient is alive as mm writes it, also where autograd then adds it into the
    # accumulated one in place and frees it (AccumulateGrad, torch/csrc/autograd/functions/accumulate_grad.h).
    head = prec.compute * n * (m.vocab_size + m.dim) + f.output_grad
    return [
        ctx.moment(
            "forward: output head",
            held,
            acts.total - acts.log_softmax - NLL_TOTAL_WEIGHT,
            after_forward + last_gathered + prec.compute * n * m.vocab_size,  # + the logits being written
        ),
        ctx.moment("forward: loss", held, acts.total, after_forward + loss_forward_temporary(ctx)),
        ctx.moment("backward: loss", held, acts.total, after_forward + loss_backward_temporary(ctx)),
        ctx.moment("backward: output head", held, acts.total - acts.log_softmax, after_forward + head),
    ]


def fsdp_root_backward_moments(
    ctx: StepContext, f: FsdpSizes, acc: Accumulation, *, reduces: bool, keeps: bool
) -> list[Moment]:
    """The embedding's backward and, where this micro-batch reduces, the root's reduce-scatter."""
    m, n, acts, prec, L = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec, ctx.config.model.n_layers
    kept_blocks = L * f.block if keeps else 0  # zero.reshard_after_backward=false: every block unsharded
    # The embedding's backward, before the root reduce-scatters: every block's gradient shard,
    # block 0's retained reduce-scatter input, the root unsharded with its gradients: the embedding's
    # and the gradient arriving from block 0, or with tied embeddings the embedding's and its sum
    # with the head's (which waited in autograd's buffer: one parameter, one AccumulateGrad).
    vd = prec.param * m.vocab_size * m.dim
    incoming = vd if m.tie_embeddings else prec.residual * n * m.dim
    embedding = f.root + acc.fresh(f.output_grad) + vd + incoming + kept_blocks
    if reduces:
        embedding += f.block_rs + acc.left(L)
    else:  # nothing reduced: the blocks' whole accumulated gradient
        embedding += acc.full or acc.built(L)
    block_grads = acc.shards or (L * f.block_grad_shard if reduces else 0)
    moments = [ctx.moment("backward: embedding", block_grads, acts.batch, embedding)]
    if reduces:
        root = root_reduce(ctx, f, acc) + kept_blocks + (f.root if keeps else 0)
        moments.append(ctx.moment("backward: root reduce-scatter", block_grads, acts.batch, root))
    return moments


@dataclass(frozen=True)
class MicroBatch:
    """A kind of micro-batch where zero.reshard_after_backward=false makes them differ."""

    name: str
    first: bool  # its forward gathers; nothing of an earlier micro-batch is held
    last: bool  # its backward reshards (and, under reduce_every=step, is the one that reduces)


def keeps_parameters(config: TrainConfig) -> bool:
    """zero.reshard_after_backward=false changes anything only where a backward is followed by
    another micro-batch's forward: FSDP2 with grad_accum > 1."""
    return config.zero.uses_fsdp and not config.zero.reshard_after_backward and config.grad_accum > 1


def micro_batch_kinds(grad_accum: int) -> list[MicroBatch]:
    """The first (gathers in forward, keeps in backward), the middle ones (grad_accum > 2: gathered
    forward, keeps; all alike) and the last (gathered forward, reshards in backward)."""
    middle = [MicroBatch(f"micro-batches 2..{grad_accum - 1}", False, False)] if grad_accum > 2 else []
    return [
        MicroBatch("micro-batch 1", True, False),
        *middle,
        MicroBatch(f"micro-batch {grad_accum}", False, True),
    ]


def kept_fsdp_moments(ctx: StepContext) -> list[Moment]:
    """zero.reshard_after_backward=false: every kind of micro-batch's walk, then the optimizer step
    (after the last micro-batch resharded, as with true)."""
    moments = [
        moment for micro in micro_batch_kinds(ctx.config.grad_accum) for moment in fsdp_moments(ctx, micro)
    ]
    return [*moments, ctx.moment("optimizer step", temporary=optimizer_temporary(ctx))]


def gathered_forward_moments(ctx: StepContext, f: FsdpSizes, held: int, accumulated: int) -> list[Moment]:
    """A forward that starts with every group unsharded (kept by the backward before): no all-gather
    and no flat all-gather output. stage2 holds every block to the end of forward; stage3 reshards
    each block after its forward (reshard_after_forward=True), so block i runs with blocks i.. held:
    the worst of those moments."""
    acts, L = ctx.acts, ctx.config.model.n_layers
    if ctx.config.zero.stage != Stage.stage3:
        params = f.root + L * f.block + accumulated
        return [ctx.moment("forward: last block", held, acts.before_last_block + acts.full_block, params)]
    moments = (
        ctx.moment(
            f"forward: block {i}",
            held,
            sum(acts.blocks[:i]) + acts.batch + acts.full_block,
            f.root + (L - i) * f.block + accumulated,
        )
        for i in range(L)
    )
    return [max(moments, key=lambda moment: moment.total)]


def copy_out_extra(f: FsdpSizes) -> int:
    """What a stage3 block's pre-backward copy-out holds beyond its unsharded copy: the flat all-gather
    output it copies from, freed only after the copy-out (torch 2.13 _fsdp_param_group.py
    `wait_for_unshard`: `foreach_all_gather_copy_out` writes into the unsharded parameters, then
    `self._all_gather_result = None`; in backward the free is not deferred), and under hpZ the block's
    own secondary shard, freed once its all-gather output is copied out. Before its own prefetch of the
    block below, so nothing prefetched; the start moment, with the prefetched block, is larger for every
    block but block 0."""
    return f.block + f.secondary


def cast_shard(rs_out: int, grad_shard: int) -> int:
    """The fp32 shard FSDP2 casts a bf16 reduce-scatter output to (alive next to it); none in fp32."""
    return grad_shard if rs_out != grad_shard else 0


def root_reduce(ctx: StepContext, f: FsdpSizes, acc: Accumulation) -> int:
    """The root's reduce-scatter: its input (reduce dtype) and either the unsharded gradients being
    copied in, or the output with gloo's copy of the input or with its fp32 cast (bf16 reduction),
    which becomes the root's gradient shard (a transient under reduce_every=micro_batch, added into
    the held one). FSDP2 still holds the last gradient it reduced (a loop variable in
    foreach_reduce): the output head's, accumulated under reduce_every=step."""
    m, L = ctx.config.model, ctx.config.model.n_layers
    if acc.full:
        source, last = acc.left(L), acc.width * (m.vocab_size * m.dim + m.dim)
    else:
        # tied embeddings have no head parameter: the last gradient reduced is the final norm's
        last = ctx.prec.param * m.dim if m.tie_embeddings else f.output_grad
        source = last + ctx.prec.param * m.vocab_size * m.dim
    gloo = f.root_rs if f.gloo_copy else 0
    out = f.root_rs_out + max(gloo, cast_shard(f.root_rs_out, f.root_grad_shard))
    return f.root_rs + max(source, last + out)


def fsdp_block_moments(
    ctx: StepContext, f: FsdpSizes, acc: Accumulation, reduces: bool = True, keeps: bool = False
) -> list[Moment]:
    """The worst block backward and the worst block reduce-scatter, over every block.

    Going down the blocks, activations shrink while gradient shards grow, and from the
    second-to-last block on, the block above's reduce-scatter input is retained (FSDP2 frees it
    at the next post-backward), so the worst block is not always the last one. reduces=False:
    a micro-batch before the last under reduce_every=step, which reduces nothing and holds the
    whole accumulated gradient (or, in the first micro-batch, the part its blocks above made).
    keeps (zero.reshard_after_backward=false, a micro-batch before the last): every block above
    stays unsharded, and the block itself after its reduce-scatter.
    """
    m, n, acts, prec, L = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec, ctx.config.model.n_layers
    stage3 = ctx.config.zero.stage == Stage.stage3
    prefix = "backward" if reduces else "backward (micro-batch before the last)"
    gloo = f.block_rs if f.gloo_copy else 0
    out = f.block_rs_out + max(gloo, cast_shard(f.block_rs_out, f.block_grad_shard))
    # FSDP2 keeps a block's new weight gradients until its post-backward, unless autograd adds
    # them into an accumulated gradient of the same dtype (reduce_every=step), freeing each at once.
    compute = block_backward_temporary(ctx, prec.param, weight_grad_held=not acc.in_place)
    incoming = prec.residual * n * m.dim
    worst: dict[str, Moment] = {}
    for i in reversed(range(L)):
        below = sum(acts.blocks[:i]) + acts.batch
        reduced = L - 1 - i if reduces else 0  # blocks above this one, reduced already
        grads = acc.shards or reduced * f.block_grad_shard
        retained = f.block_rs if reduced else 0
        accumulated = acc.left(reduced) if acc.full or reduces else acc.built(L - 1 - i)
        above = (L - 1 - i) * f.block if keeps else 0  # blocks above, kept unsharded
        prefetched = f.block if i > 0 else 0  # stage3 gathers the block below while this one runs
        # hpZ: every block below holds its secondary shard, the prefetched one too: it is freed only
        # when its all-gather output is copied out, at that block's own pre-backward.
        held = secondaries(f, i)
        # stage3: this block re-gathered; stage2: blocks 0..i never resharded after forward.
        params = (
            f.root
            + (f.block + prefetched + held if stage3 else (i + 1) * f.block)
            + acc.fresh(f.output_grad)
            + retained
            + accumulated
            + above
        )
        moments = [
            # its start: all its activations back (recomputed if checkpointed), the MLP's gradients
            (
                "start",
                ctx.moment(f"{prefix}: block {i}", grads, below + acts.in_backward_of(i), params + compute),
            ),
            # its end: its activations gone, every unsharded weight gradient of the block held
            (
                "end",
                ctx.moment(
                    f"{prefix}: block {i} end",
                    grads,
                    below,
                    params + acc.fresh(f.block) + block_end_temporary(ctx),
                ),
            ),
        ]
        if stage3:
            # its pre-backward re-gather (block 0: with nothing prefetched below, but the blocks above kept)
            copy_out = params - prefetched + copy_out_extra(f)
            moments.append(
                (
                    "copy-out",
                    ctx.moment(
                        f"{prefix}: block {i} all-gather copy-out",
                        grads,
                        below + acts.blocks[i],
                        copy_out + incoming,
                    ),
                )
            )
        if reduces:
            # its reduce-scatter: the block resharded, the retained input of the block above freed;
            # its unsharded (or accumulated) gradient copied into the input, then freed
            source = accumulated if acc.full else f.block
            after_copy = out + accumulated - acc.per_block
            reduce_scatter = (
                "reduce",
                ctx.moment(
                    f"{prefix}: block {i} reduce-scatter",
                    grads,
                    below,
                    f.root
                    + (prefetched + held if stage3 else i * f.block)
                    + (above + f.block if keeps else 0)
                    + acc.fresh(f.output_grad)
                    + incoming
                    + f.block_rs
                    + max(source, after_copy),
                ),
            )
            moments.append(reduce_scatter)
        for kind, moment in moments:
            if kind not in worst or moment.total > worst[kind].total:
                worst[kind] = moment
    return list(worst.values())


# ----------------------------------------------------------------------------- other tensors


def other_bytes(m: ModelConfig, data: DataConfig, states: RankStates) -> int:
    """Rotary tables (fp32 cos and sin of every position), synthetic data's transition tables
    (int64 successors, float64 probabilities, float64 stationary distribution) and Adam's steps."""
    rope = 2 * m.max_seq_len * (m.head_width // 2) * 4
    tables = 16 * m.vocab_size * data.branching + 8 * m.vocab_size if data.kind.value == "synthetic" else 0
    return rope + tables + states.step_counters
