"""The loss's moments and temporaries: the full loss's log-softmax, and loss=chunked chunk by chunk
(trainer/model/loss.py; docs/memory_plan.md, "The chunked loss")."""

from __future__ import annotations

from trainer.plan.activations import sequence_shards
from trainer.plan.moments import Moment, StepContext
from trainer.plan.tp_walk import (
    LOSS_PARALLEL_TARGET_BYTES,
    parallel_loss_backward_temporary,
    parallel_loss_temporary,
)

Z_LOSS_FORWARD_BYTES = 21
"""loss.z_loss > 0 (trainer/model/loss.py `cross_entropy_and_z_sums`), per token, as log_softmax is written: the
row and target indices the logits are indexed by (int64 each, kept for the index's backward), the
indexed logits (fp32) and the mask of the targets that count (bool)."""
Z_LOSS_BACKWARD_BYTES = 20
"""loss.z_loss > 0, per token, through log_softmax's backward: the two int64 indices and the indexed logits'
fp32 gradient, waiting for the index's backward, which autograd runs after log_softmax's (measured: the
default job's peak, fp32 or bf16, stage0 or stage3, grew by 20 bytes a token and 12, its scalars)."""


def z_loss_bytes(ctx: StepContext, per_token: int, tokens: int | None = None) -> int:
    """What the z-loss adds to a moment of the loss, `per_token` bytes for each of `tokens` (the step's)."""
    if ctx.config.loss.z_loss <= 0:
        return 0
    return per_token * (ctx.tokens if tokens is None else tokens)


def loss_forward_temporary(ctx: StepContext) -> int:
    """Logits, their fp32 copy (`logits.float()`, none in fp32) and the log-softmax being written."""
    nv = ctx.tokens * ctx.config.model.vocab_size
    z = z_loss_bytes(ctx, Z_LOSS_FORWARD_BYTES)
    return z + (4 * nv if ctx.prec.regime == "fp32" else 2 * nv + 4 * nv)


def loss_backward_temporary(ctx: StepContext) -> int:
    """log_softmax's backward: the incoming gradient and the outgoing one, both fp32 B·T·V."""
    return 8 * ctx.tokens * ctx.config.model.vocab_size + z_loss_bytes(ctx, Z_LOSS_BACKWARD_BYTES)


def full_loss_temporaries(ctx: StepContext) -> tuple[int, int]:
    """The full loss's forward and backward temporaries: over vocabulary-sharded logits (parallel.tp > 1)
    loss_parallel's, which hold more than log_softmax's (trainer/plan/tp_walk.py), whatever wraps the model."""
    if ctx.config.parallel.tp > 1:
        return parallel_loss_temporary(ctx), parallel_loss_backward_temporary(ctx)
    return loss_forward_temporary(ctx), loss_backward_temporary(ctx)


def chunked_loss_moments(
    ctx: StepContext,
    fixed: int,
    weight_grad: int,
    head_end: int,
    prefetched: int = 0,
    activations: int | None = None,
    grads: int | None = None,
) -> list[Moment]:
    """loss=chunked (trainer/model/loss.py): the moments of the loss and the output head, chunk by chunk.

    c tokens a chunk, k chunks, the last r tokens; what each moment holds, and why, is in
    docs/memory_plan.md ("The chunked loss"). `weight_grad` is a chunk's new head weight gradient,
    `head_end` its last form once every chunk is done (autocast's fp32 cast next to its bf16, DDP's
    copy into the bucket), `fixed` what the walk holds throughout, and `prefetched` what it holds
    through the whole loss backward: at stage3, the last block's all-gather output. A pipeline's last stage
    gives its own `activations` (its micro-batches in flight) and `grads` (StepContext.moment's). Under
    parallel.tp > 1 each chunk's loss is loss_parallel's, and the final norm's backward a moment of its own
    (docs/memory_plan.md, "loss=chunked under TP").
    """
    m, n, prec = ctx.config.model, ctx.tokens, ctx.prec
    saved = ctx.acts.total if activations is None else activations
    c = min(ctx.config.loss.chunk_tokens, n)
    k, V, D, res = -(-n // c), m.vocab_size, m.dim, prec.residual
    held = (weight_grad if k > 1 else 0) + res * (n - c) * D  # before chunk 0 (run last): the most
    logits = (8 if prec.regime == "fp32" else 10) * c * V + z_loss_bytes(ctx, Z_LOSS_FORWARD_BYTES, c)
    recompute, backward = logits, 12 * c * V + z_loss_bytes(ctx, Z_LOSS_BACKWARD_BYTES, c)
    if ctx.config.parallel.tp > 1:  # loss_parallel's, chunk by chunk (`parallel_chunk_temporaries`)
        logits, recompute, backward = parallel_chunk_temporaries(ctx, c)
    chunk_head = prec.compute * c * (V + D) + weight_grad
    added, freed = head_additions(ctx, c, weight_grad)
    back = fixed + prefetched
    moments = [
        ctx.moment("forward: loss", grads=grads, activations=saved, temporary=fixed + logits),
        ctx.moment(
            "backward: loss recompute", grads=grads, activations=saved, temporary=back + held + recompute
        ),
        ctx.moment(
            "backward: loss",
            grads=grads,
            activations=saved,
            temporary=back + held + backward,
        ),
        ctx.moment(
            "backward: output head", grads=grads, activations=saved, temporary=back + held + chunk_head
        ),
        ctx.moment(
            "backward: head gradient added", grads=grads, activations=saved, temporary=back + max(added)
        ),
        ctx.moment(
            "backward: loss end",
            grads=grads,
            activations=saved,
            temporary=back + max(2 * res * n * D + weight_grad, head_end) - freed,
        ),
    ]
    if ctx.config.parallel.tp > 1:  # the head's gradient in its last form: autocast's bf16 one freed by then
        head = head_end - (weight_grad if prec.regime == "autocast" else 0)
        moments.append(final_norm_backward(ctx, back, head, saved, grads))
    return moments


def head_additions(ctx: StepContext, c: int, weight_grad: int) -> tuple[list[int], int]:
    """What the head's weight gradient additions hold beyond the walk's (`chunked_loss_moments`' c, k, r), and
    what the last chunk's backward has freed of the activations by then (parallel.tp > 1 only).

    Without TP: the second chunk run's out-of-place addition (its own input gradient still in the compute
    dtype) and chunk 0's in place. Under TP the gradients are DTensors, which autograd's buffer never adds
    in place: every addition holds three V·D gradients, the worst the run before chunk 0's and chunk 0's,
    by when the chunks' whole input (res·T·D; under SP also the final norm's T / tp output) is freed
    with the last chunk's projection backward (measured with MemTracker at tp=2, four chunks: the
    gradient added at chunk 0 peaks that much under the run before it)."""
    n, D, res, compute = ctx.tokens, ctx.config.model.dim, ctx.prec.residual, ctx.prec.compute
    k = -(-n // c)
    r = n - (k - 1) * c
    if k == 1:
        return [0], 0 if ctx.config.parallel.tp == 1 else freed_by_last_chunk(ctx)
    if ctx.config.parallel.tp == 1:
        added = [3 * weight_grad + res * r * D + compute * c * D]
        if k > 2:
            added.append(2 * weight_grad + res * (n - c) * D + compute * c * D)
        return added, 0
    freed = freed_by_last_chunk(ctx)
    added = [3 * weight_grad + res * (n - c) * D + compute * c * D - freed]
    if k > 2:
        added.append(3 * weight_grad + res * (n - 2 * c) * D + compute * c * D)
    return added, freed


def final_norm_backward(ctx: StepContext, back: int, head: int, saved: int, grads: int | None) -> Moment:
    """parallel.tp > 1: the final norm's backward, after the loss's (the chunks' input and the norm's output
    freed, `freed_by_last_chunk`). The norm's output gradient arrives whole (its local sum under TP without
    SP, all-reduced only at the norm's input), so its D-wide temporaries, which no block's M / tp-wide
    backward shares, can pass every block's: torch's composite RMSNorm backward (CPU) peaks in pow's backward
    with the incoming gradient and four fp32 B·T·D tensors, its x·rstd and rstd freed by then; beside them
    the head's gradient in its last form (`head`) and the norm's own. Under SP all of it is T / tp positions
    (the gradient reduce-scattered first). Measured with MemTracker at tp=2 without SP, bf16, 5 chunks: the
    plan 16 bytes under the peak, the offset of every TP moment on the tiny model. CUDA runs the fused kernel,
    which saves neither x·rstd nor the composite's temporaries: there the moment is the incoming gradient and the
    kernel's output gradient, as `block_end_temporary` counts a block's norm (not measured under TP)."""
    n, D, shards = ctx.tokens, ctx.config.model.dim, sequence_shards(ctx.config)
    fused = ctx.device_kind == "cuda"
    norm_saved = 0 if fused else (4 * D + 4) * n // shards  # x·rstd and rstd
    acts = saved - freed_by_last_chunk(ctx) - norm_saved
    temporary = back + head + 4 * D + (2 if fused else 5) * 4 * n * D // shards
    return ctx.moment("backward: final norm", grads=grads, activations=acts, temporary=temporary)


def freed_by_last_chunk(ctx: StepContext) -> int:
    """parallel.tp > 1: the chunks' input, all T positions, and under SP the final norm's own T / tp output,
    both freed once the last chunk's projection backward has run (`head_additions`)."""
    whole = ctx.prec.residual * ctx.tokens * ctx.config.model.dim
    return whole + whole // sequence_shards(ctx.config) if ctx.config.parallel.sequence_parallel else whole


def parallel_chunk_temporaries(ctx: StepContext, c: int) -> tuple[int, int, int]:
    """parallel.tp > 1: a chunk's loss over its vocabulary-sharded logits (c·V/tp, the local model's V) is
    loss_parallel's (trainer/plan/tp_walk.py), measured with MemTracker at tp=2 (fp32 and bf16, with and without
    SP, one chunk and several). Forward and the recompute: the logits (and under autocast their fp32 cast),
    the shifted logits and their exponential or the log-softmax being written (fp32 c·V each), and three fp32
    values a token (the max, the sum of exponentials, their log); nothing of it is saved but the log-softmax.
    Backward: that log-softmax beside loss_parallel's three fp32 c·V tensors and the target's bookkeeping,
    with, under autocast, the chunk input's bf16 cast the recompute's projection saved."""
    V, prec = ctx.config.model.vocab_size, ctx.prec
    cast = prec.compute * c * ctx.config.model.dim if prec.regime == "autocast" else 0
    logits = (4 if prec.regime == "fp32" else 6) * c * V
    forward = logits + 8 * c * V + 12 * c
    backward = 16 * c * V + LOSS_PARALLEL_TARGET_BYTES * c + 8 + cast
    z_recompute, z_backward = parallel_chunk_z_loss(ctx, c)
    return forward, forward + z_recompute, backward + z_backward


def parallel_chunk_z_loss(ctx: StepContext, c: int) -> tuple[int, int]:
    """loss.z_loss > 0 under parallel.tp > 1 (trainer/model/loss.py `sharded_squared_logsumexp_sum`, taken after
    the chunk's cross-entropy): what it adds to the recompute and to the backward, as `parallel_z_loss_temporary`
    to the full loss's. Forward writes the shifted logits and their exponential (fp32 c·V/tp each) once the
    cross-entropy's are freed: no more than the forward's own. The recompute writes them beside the log-softmax
    it saves, and keeps the exponential for exp's backward; whose output, the logits' gradient from the
    z-loss, is held while loss_parallel's backward runs. Measured at tp=2 on 2 CPU ranks with and without SP,
    chunks of 48 and 30 tokens, fp32 and bf16 (in bf16 the chunk's backward is the peak): the plan 28 to 36 bytes
    under every peak, 16 or 20 without the z-loss: its scalars, which the plan leaves out as it does loss=full's."""
    if ctx.config.loss.z_loss <= 0:
        return 0, 0
    cv = c * ctx.config.model.vocab_size
    return 4 * cv, 4 * cv
