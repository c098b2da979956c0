"""The walk of a step without DDP: one data-parallel replica (trainer/layout.py `Layout.replicas`), a
tensor-parallel model at dp = 1 or a one-rank job, at zero=stage0/1.

trainer/rank/parallelize.py wraps no DDP around one replica: each parameter's gradient is its own `.grad`,
freed by zero_grad(set_to_none=True) at the start of the step and made, layer by layer, as backward reaches it
(AccumulateGrad keeps the first gradient itself: no bucket, no copy). So forward holds no gradients, and
block i's backward holds those of the head, the final norm and the blocks after it: with whole activations
the last block's backward is the worst, with checkpointed ones block 0's. With grad_accum > 1 every
micro-batch after the first starts with every gradient held and AccumulateGrad adds into them in place: DDP's
walk (trainer/plan/ddp_walk.py), less the buckets' second copy of an accumulated gradient.
"""

from __future__ import annotations

from trainer.plan.ddp_walk import ddp_loss_moments, ddp_moments
from trainer.plan.moments import Moment, StepContext, optimizer_temporary
from trainer.plan.tp_walk import (
    autocast_casts,
    embedding_backward,
    replicated_embedding_gradient,
    worst_block_backward,
)


def replica_moments(ctx: StepContext) -> list[Moment]:
    """One data-parallel replica without DDP (module docstring): the moments of one step."""
    if ctx.config.grad_accum > 1 and ctx.config.parallel.tp == 1:
        return ddp_moments(ctx, buckets=False)
    m, acts = ctx.config.model, ctx.acts
    vd = m.vocab_size * m.dim
    fixed = autocast_casts(ctx)
    return [
        ctx.moment(
            "forward: last block",
            grads=0,
            activations=acts.before_last_block + acts.full_block,
            temporary=fixed,
        ),
        *ddp_loss_moments(ctx, fixed, grads=0),  # no gradient held yet: the head's is a temporary
        # A tied head's fp32 weight gradient waits in autograd's buffer for the embedding's (one parameter,
        # one AccumulateGrad) through every block's backward, as in DDP's walk.
        worst_block_backward(ctx, fixed + (4 * vd if m.tie_embeddings else 0)),
        ctx.moment(
            "backward: embedding",
            grads=ctx.states.grads - 4 * vd,
            activations=acts.batch,
            temporary=fixed + embedding_backward_temporary(ctx),
        ),
        # under TP the embedding's gradient is whole by now (`replicated_embedding_gradient`)
        ctx.moment(
            "optimizer step",
            grads=ctx.states.grads + replicated_embedding_gradient(ctx.config, 4),
            temporary=optimizer_temporary(ctx),
        ),
    ]


def embedding_backward_temporary(ctx: StepContext) -> int:
    """The embedding's backward: its new fp32 weight gradient and, under TP, what tp_walk.py measured beside it
    (`embedding_backward`); without TP the gradient arriving down the residual, or with a tied head its
    waiting gradient, the embedding's and their sum (3 x 4·V·D), as DDP's walk counts them (ddp_walk.py)."""
    m = ctx.config.model
    vd = m.vocab_size * m.dim
    if ctx.config.parallel.tp > 1:
        return 4 * vd + embedding_backward(ctx)
    if m.tie_embeddings:
        return 12 * vd
    return 4 * vd + ctx.prec.residual * ctx.tokens * m.dim
