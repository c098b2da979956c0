"""The loss's moments and temporaries: the full loss's log-softmax, and loss=chunked chunk by chunk
(trainer/model/loss.py; docs/memory_plan.md, "The chunked loss")."""

from __future__ import annotations

from trainer.plan.moments import Moment, StepContext
from trainer.plan.tp_walk import parallel_loss_backward_temporary, parallel_loss_temporary

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
    gives its own `activations` (its micro-batches in flight) and `grads` (StepContext.moment's).
    """
    m, n, prec = ctx.config.model, ctx.tokens, ctx.prec
    saved = ctx.acts.total if activations is None else activations
    c = min(ctx.config.loss.chunk_tokens, n)
    k, V, D, res = -(-n // c), m.vocab_size, m.dim, prec.residual
    r = n - (k - 1) * c
    held = (weight_grad if k > 1 else 0) + res * (n - c) * D  # before chunk 0 (run last): the most
    logits = (8 if prec.regime == "fp32" else 10) * c * V + z_loss_bytes(ctx, Z_LOSS_FORWARD_BYTES, c)
    chunk_head = prec.compute * c * (V + D) + weight_grad
    # The additions: the second chunk run (its own input gradient still in the compute dtype), and chunk 0.
    added = [3 * weight_grad + res * r * D + prec.compute * c * D] if k > 1 else [0]
    if k > 2:
        added.append(2 * weight_grad + res * (n - c) * D + prec.compute * c * D)
    back = fixed + prefetched
    return [
        ctx.moment("forward: loss", grads=grads, activations=saved, temporary=fixed + logits),
        ctx.moment(
            "backward: loss recompute", grads=grads, activations=saved, temporary=back + held + logits
        ),
        ctx.moment(
            "backward: loss",
            grads=grads,
            activations=saved,
            temporary=back + held + 12 * c * V + z_loss_bytes(ctx, Z_LOSS_BACKWARD_BYTES, c),
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
            temporary=back + max(2 * res * n * D + weight_grad, head_end),
        ),
    ]
