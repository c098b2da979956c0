"""The walk of one optimizer step: what a rank holds at each moment of it, on top of its states.

A step is a list of moments: the last block's forward, the loss, the output head's backward,
the start, end and reduce-scatter of each block's backward (the worst of each over every
block), the optimizer step. Each moment is the rank's model states at rest (from
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
  the reduce-scatter input (fp32, padded), its output (the new gradient shard) and on gloo a
  second input-sized buffer; the root's unsharded output-head gradient lives from the head's
  backward until the root's reduce-scatter at the very end of backward.
- DDP under autocast caches a 2-byte copy of every matmul weight for forward and backward, and
  casts w2's bf16 weight gradient to fp32 only once the B·T·M input gradient is consumed.
- The loss: log_softmax and its backward hold 2-3 fp32 B·T·V tensors at once.
- Adam: the per-tensor loop (CPU's default) makes 2 temporaries of a tensor while the previous
  tensor's is still alive; the fused kernel (CUDA's default, `optim.fused`) makes none.
- Gradient accumulation: micro-batches before the last keep a full unsharded fp32 gradient
  (DDP no_sync outside its buckets; FSDP2 without reduce-scatter).

CPU offload: FSDP2 keeps parameters, gradients and optimizer state in host memory; on a GPU
they leave the device figure (reported as `offloaded_gib`); on a CPU device nothing moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import (
    CheckpointMode,
    DataConfig,
    DType,
    ModelConfig,
    OffloadTarget,
    PrecisionConfig,
    Stage,
    TrainConfig,
    ZeroConfig,
)
from trainer.model.attention import run_choice, sdpa_op
from trainer.model.checkpointing import op_saved_matmuls, op_saves, should_checkpoint
from trainer.plan.states import ModelShape, RankStates, padded_numel
from trainer.rank.optim import uses_fused

BATCH_BYTES_PER_TOKEN = 16  # int64 inputs and targets


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


def block_bytes_per_token(m: ModelConfig, regime: str) -> int:
    """Saved activations of one transformer block, per token (see the module docstring)."""
    D, M, H = m.dim, m.ffn_dim, m.n_heads
    KQ = m.n_kv_heads * (m.dim // m.n_heads)
    stats = 4 * H + 8  # SDPA logsumexp (fp32 per head) and the two RMSNorm rstd (fp32)
    if regime == "fp32":
        return 4 * (8 * D + 2 * KQ + 4 * M) + stats
    if regime == "autocast":
        return 30 * D + 4 * KQ + 8 * M + stats
    return 24 * D + 4 * KQ + 8 * M + stats


def head_bytes_per_token(m: ModelConfig, regime: str) -> int:
    """Saved after the blocks, per token: final RMSNorm (input, x·rstd, output) and log_softmax (fp32)."""
    norm_output = 4 * m.dim if regime == "fp32" else 2 * m.dim
    return 4 * m.dim + 4 * m.dim + norm_output + 4 + 4 * m.vocab_size


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch on one rank."""

    blocks: tuple[int, ...]  # saved by each block in forward (its input only when checkpointed)
    full_block: int  # one block's full set (a checkpointed block recomputes it in backward)
    head: int  # final norm + fp32 log-softmax
    log_softmax: int
    batch: int
    unread: int = 0  # checkpointing=op: a block's saved outputs its recompute stops before reading (w2's)

    @property
    def in_backward(self) -> int:
        """What a block holds at the start of its backward: its full set back, and what stays unread
        until its backward ends (the policy's storage lives as long as the block's graph)."""
        return self.full_block + self.unread

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
    D, H, KQ, T = m.dim, m.n_heads, m.n_kv_heads * (m.dim // m.n_heads), config.seq_len
    flash = prec.compute * (D + 2 * KQ) + 4 * H
    if choice.saves_scores:
        width = 4 if device_kind == "cpu" else prec.compute
        return width * (3 * D + H * T) - flash
    return 2 * (D - KQ) * prec.compute if choice.repeat_kv else 0


def op_checkpointed_bytes_per_token(config: TrainConfig, device_kind: str) -> int:
    """checkpointing=op: what a block keeps from its forward to its backward, per token.

    Its input (as every checkpointed block) and the outputs the policy saves
    (trainer/model/checkpointing.py): the 1st, 3rd, 5th and 7th matmul (wq, wv, w1, w2) when the
    save list has aten.mm, and the SDPA op's output and fp32 logsumexp when it has the op the
    run's kernel runs (math has none: its composite op decomposes first). The saved outputs are
    kept whether or not backward needs them (w2's output, which no backward reads, included).
    """
    m, prec = config.model, precisions(config.precision, config.zero)
    KQ = m.n_kv_heads * (m.dim // m.n_heads)
    widths = {"wq": m.dim, "wk": KQ, "wv": KQ, "wo": m.dim, "w1": m.ffn_dim, "w3": m.ffn_dim, "w2": m.dim}
    save_ops = config.checkpointing.save_ops
    kept = prec.residual * m.dim + sum(prec.compute * widths[name] for name in op_saved_matmuls(save_ops))
    choice = run_choice(config.attention, m, config.precision.compute_dtype, device_kind)
    if op_saves(save_ops, sdpa_op(choice, device_kind)):
        kept += prec.compute * m.dim + 4 * m.n_heads
    return kept


def activations(config: TrainConfig, device_kind: str = "cpu") -> Activations:
    m, prec = config.model, precisions(config.precision, config.zero)
    tokens = config.micro_batch * config.seq_len
    full = (block_bytes_per_token(m, prec.regime) + attention_extra_per_token(config, device_kind)) * tokens
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
    head = head_bytes_per_token(m, prec.regime) * tokens + 4  # + nll_loss's fp32 total weight
    return Activations(blocks, full, head, 4 * m.vocab_size * tokens, BATCH_BYTES_PER_TOKEN * tokens, unread)


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
    world_size: int
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


def optimizer_temporary(ctx: StepContext) -> int:
    """Adam's temporaries: the fused kernel (trainer/rank/optim.py's default on CUDA) updates in place
    and makes none; the per-tensor loop (CPU's default) makes `loop_temporary`. Offloaded states
    are updated on the host."""
    if ctx.offloaded or uses_fused(ctx.config.optim, ctx.device_kind):
        return 0
    return 4 * ctx.states.loop_temporary


def accumulation_grads(ctx: StepContext) -> int:
    """Micro-batches before the last keep an unsharded fp32 gradient outside buckets and shards."""
    return 4 * ctx.shape.num_params if ctx.config.grad_accum > 1 else 0


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
    return [
        ctx.moment(
            "forward: last block", activations=acts.before_last_block + acts.full_block, temporary=fixed
        ),
        ctx.moment("forward: loss", activations=acts.total, temporary=fixed + loss_forward_temporary(ctx)),
        ctx.moment("backward: loss", activations=acts.total, temporary=fixed + loss_backward_temporary(ctx)),
        ctx.moment(
            "backward: output head", activations=acts.total - acts.log_softmax, temporary=fixed + head
        ),
        ctx.moment(
            "backward: last block",
            activations=acts.before_last_block + acts.in_backward,
            temporary=fixed + block_backward_temporary(ctx, weight_grad, weight_grad_held=False),
        ),
        ctx.moment(
            "backward: embedding",
            activations=acts.batch,
            temporary=fixed + 4 * vd + prec.residual * n * m.dim,
        ),
        ctx.moment("optimizer step", temporary=optimizer_temporary(ctx)),
    ]


@dataclass(frozen=True)
class FsdpSizes:
    """FSDP2 buffers of one rank (bytes)."""

    root: int  # the root's unsharded parameters (= its flat all-gather output), param dtype
    block: int  # one block's
    root_rs: int  # the root's reduce-scatter input (fp32, padded)
    block_rs: int
    block_grad_shard: int  # one block's gradient shard (its reduce-scatter output)
    root_grad_shard: int
    output_grad: int  # the output head's unsharded weight gradient (+ final norm's)
    gloo_copy: bool  # gloo's reduce-scatter works on a copy of its input


def fsdp_sizes(ctx: StepContext) -> FsdpSizes:
    s, w, p = ctx.shape, ctx.world_size, ctx.prec.param
    root_padded = sum(padded_numel(t, w) for t in s.root)
    block_padded = sum(padded_numel(t, w) for t in s.block)
    m = ctx.config.model
    return FsdpSizes(
        root=p * root_padded,
        block=p * block_padded,
        root_rs=4 * root_padded,
        block_rs=4 * block_padded,
        block_grad_shard=4 * block_padded // w,
        root_grad_shard=4 * root_padded // w,
        output_grad=p * (m.vocab_size * m.dim + m.dim),
        gloo_copy=ctx.device_kind == "cpu",
    )


def fsdp_moments(ctx: StepContext) -> list[Moment]:
    """Stages 2-3: FSDP2 gathers parameters per block and reduce-scatters gradients per block.

    zero_grad frees the gradient shards at the start of the step, so forward-time moments hold none.
    """
    m, n, acts, prec, L = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec, ctx.config.model.n_layers
    f = fsdp_sizes(ctx)
    stage3 = ctx.config.zero.stage == Stage.stage3
    accum = accumulation_grads(ctx)
    after_forward = f.root + (0 if stage3 else L * f.block) + accum  # unsharded at the loss
    # The last block's forward: its unsharded copy and its flat all-gather output (kept until the
    # next copy-out; during its own copy-out the block before's is still there too); stage2
    # still holds every earlier block unsharded. Offloaded shards are staged on the device first.
    forward = f.root + (2 * f.block if stage3 else (L + 1) * f.block) + accum
    staging = (4 + prec.param) * f.block // ctx.world_size // prec.param if ctx.offloaded else 0
    head = prec.compute * n * (m.vocab_size + m.dim) + f.output_grad
    # The embedding's backward, before the root reduce-scatters: every block's gradient shard,
    # block 0's retained reduce-scatter input, the root unsharded with its gradients.
    embedding = (
        f.root + f.output_grad + prec.param * m.vocab_size * m.dim + prec.residual * n * m.dim + f.block_rs
    )
    # The root's reduce-scatter (its output is the root's gradient shard); FSDP2 still holds the
    # last gradient it reduced (a loop variable in foreach_reduce): the output head's.
    root_reduce = f.root_rs * (2 if f.gloo_copy else 1) + f.output_grad
    all_grads = L * f.block_grad_shard + f.root_grad_shard
    return [
        ctx.moment("forward: last block all-gather", 0, acts.before_last_block, forward + f.block + staging),
        ctx.moment("forward: last block", 0, acts.before_last_block + acts.full_block, forward),
        ctx.moment("forward: loss", 0, acts.total, after_forward + loss_forward_temporary(ctx)),
        ctx.moment("backward: loss", 0, acts.total, after_forward + loss_backward_temporary(ctx)),
        ctx.moment("backward: output head", 0, acts.total - acts.log_softmax, after_forward + head),
        *fsdp_block_moments(ctx, f),
        ctx.moment("backward: embedding", L * f.block_grad_shard, acts.batch, embedding + accum),
        ctx.moment("backward: root reduce-scatter", all_grads, acts.batch, root_reduce + accum),
        ctx.moment("optimizer step", temporary=optimizer_temporary(ctx)),
    ]


def fsdp_block_moments(ctx: StepContext, f: FsdpSizes) -> list[Moment]:
    """The worst block backward and the worst block reduce-scatter, over every block.

    Going down the blocks, activations shrink while gradient shards grow, and from the
    second-to-last block on, the block above's reduce-scatter input is retained (FSDP2 frees it
    at the next post-backward), so the worst block is not always the last one.
    """
    m, n, acts, prec, L = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec, ctx.config.model.n_layers
    stage3 = ctx.config.zero.stage == Stage.stage3
    accum = accumulation_grads(ctx)
    # Reduce-scatter: the fp32 input, then either the unsharded gradients being copied in, or
    # the output (the new shard) and gloo's copy of the input.
    rs_block = f.block_rs + max(f.block, f.block_grad_shard + (f.block_rs if f.gloo_copy else 0))
    compute = block_backward_temporary(ctx, prec.param, weight_grad_held=True)
    incoming = prec.residual * n * m.dim
    worst: dict[str, Moment] = {}
    for i in reversed(range(L)):
        below = sum(acts.blocks[:i]) + acts.batch
        grads = (L - 1 - i) * f.block_grad_shard
        retained = f.block_rs if i < L - 1 else 0
        prefetched = f.block if i > 0 else 0  # stage3 gathers the block below while this one runs
        # stage3: this block re-gathered; stage2: blocks 0..i never resharded after forward.
        params = (
            f.root
            + (f.block + prefetched if stage3 else (i + 1) * f.block)
            + f.output_grad
            + retained
            + accum
        )
        moments = [
            # its start: all its activations back (recomputed if checkpointed), the MLP's gradients
            ctx.moment(f"backward: block {i}", grads, below + acts.in_backward, params + compute),
            # its end: its activations gone, every unsharded weight gradient of the block held
            ctx.moment(f"backward: block {i} end", grads, below, params + f.block + 2 * incoming),
            # its reduce-scatter: the block resharded, the retained input of the block above freed
            ctx.moment(
                f"backward: block {i} reduce-scatter",
                grads,
                below,
                f.root
                + (prefetched if stage3 else i * f.block)
                + f.output_grad
                + incoming
                + rs_block
                + accum,
            ),
        ]
        for kind, moment in zip(("start", "end", "reduce"), moments):
            if kind not in worst or moment.total > worst[kind].total:
                worst[kind] = moment
    return list(worst.values())


# ----------------------------------------------------------------------------- other tensors


def other_bytes(m: ModelConfig, data: DataConfig, states: RankStates) -> int:
    """Rotary tables (fp32 cos and sin of every position), synthetic data's transition tables
    (int64 successors, float64 probabilities, float64 stationary distribution) and Adam's steps."""
    rope = 2 * m.max_seq_len * (m.dim // m.n_heads // 2) * 4
    tables = 16 * m.vocab_size * data.branching + 8 * m.vocab_size if data.kind.value == "synthetic" else 0
    return rope + tables + states.step_counters
