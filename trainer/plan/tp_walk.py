"""What a step without DDP holds under tensor parallelism (parallel.tp > 1 at zero=stage0: one data-parallel
replica); the walk itself, shared with a one-rank job's, is trainer/plan/replica_walk.py.

The layers' shapes are one TP rank's (trainer/plan/tensor_parallel.py's local model); what sequence
parallelism and loss_parallel change is here and in trainer/plan/activations.py.
"""

from __future__ import annotations

import math

from trainer.config import TrainConfig
from trainer.model.fp8 import converted_numel
from trainer.plan.activations import sequence_shards
from trainer.plan.fp8_backward import fp8_w2_backward
from trainer.plan.moments import (
    Moment,
    StepContext,
    block_backward_temporary,
    ffn_norm_backward,
    incoming_gradient,
)

LOSS_PARALLEL_TARGET_BYTES = 33
"""Per token, loss_parallel's backward's target bookkeeping, alive beside its B·T·V/tp tensors
(torch/distributed/tensor/parallel/loss.py `_nll_loss_and_log_softmax_backward`): the safe target
(int64), its vocabulary-masked copy (int64, `_MaskPartial._partition_value`), the mask (bool), the
arange index (int64) and the update (the mask's fp32 cast and the fp32 difference)."""


def replicated_embedding_gradient(config: TrainConfig, width: int) -> int:
    """What a TP rank's embedding gradient holds beyond its shard: torch's DTensor embedding backward
    (RowwiseParallel over the vocabulary, torch 2.13) returns the weight's gradient Replicate, the whole
    V·D table on every TP rank, `width` bytes an element (measured on 2 gloo ranks: a [512, 128] Replicate
    gradient for a [256, 128] Shard(0) weight; at the optimizer step of tp=2 stage0, the plan less it was
    131,072 bytes short of the measured peak). `config` is one TP rank's (its vocab_size is V / tp)."""
    tp = config.parallel.tp
    return width * config.model.vocab_size * config.model.dim * (tp - 1)


def parallel_loss_temporary(ctx: StepContext) -> int:
    """loss_parallel's forward: the parallel log-softmax (torch/distributed/tensor/parallel/loss.py
    `_log_softmax`) writes the shifted logits and their exponential before its result (fp32, B·T·V/tp each),
    beside the logits (and, under autocast, their fp32 cast `logits.float()`); the result is the saved
    log-softmax in the activations."""
    nv = ctx.tokens * ctx.config.model.vocab_size
    return (4 * nv if ctx.prec.regime == "fp32" else 6 * nv) + 4 * nv + parallel_z_loss_temporary(ctx)


def parallel_loss_backward_temporary(ctx: StepContext) -> int:
    """loss_parallel's backward (`_nll_loss_and_log_softmax_backward`): `grad_input = zeros_like(x)`, then
    `(grad_input + exp(x)) * grad_output`: three fp32 B·T·V/tp tensors at once, and the target's bookkeeping."""
    nv = ctx.tokens * ctx.config.model.vocab_size
    return 3 * 4 * nv + LOSS_PARALLEL_TARGET_BYTES * ctx.tokens + 4 + parallel_z_loss_temporary(ctx)


def parallel_z_loss_temporary(ctx: StepContext) -> int:
    """loss.z_loss > 0 (trainer/model/loss.py `sharded_squared_logsumexp_sum`): its exponentials, fp32
    B·T·V/tp, written beside the shifted logits and the saved log-softmax, then kept for exp's backward,
    whose output the logits' gradient holds while loss_parallel's backward runs (measured: tp=2 on the
    default job, fp32 stage0, the peak grew by exactly these bytes and 12)."""
    return 4 * ctx.tokens * ctx.config.model.vocab_size if ctx.config.loss.z_loss > 0 else 0


def sequence_gather_temporary(ctx: StepContext) -> int:
    """What w2's backward holds under sequence parallelism beside block_backward_temporary's tensors (as
    `block_backward` below counts it): the all-gather of the gradient arriving down the residual (all T
    positions, the adjoint of RowwiseParallel's reduce-scatter) and, under autocast, its cast to the compute
    dtype (T / tp positions)."""
    shards = sequence_shards(ctx.config)
    if shards == 1:
        return 0
    n, d, prec = ctx.tokens, ctx.config.model.dim, ctx.prec
    cast = prec.compute * n * d // shards if prec.regime == "autocast" else 0
    return cast + prec.compute * n * d


def autocast_casts(ctx: StepContext) -> int:
    """Autocast's cached bf16 casts of the matmul weights (as ddp_walk.py counts them), of the local shards:
    the cast of a DTensor weight is a DTensor of its local shard's cast."""
    if ctx.prec.regime != "autocast":
        return 0
    m = ctx.config.model
    converted = converted_numel(m, ctx.config.precision) if ctx.config.precision.is_fp8 else 0
    return 2 * ((ctx.shape.block_linear_numel - converted) * m.n_layers + m.vocab_size * m.dim)


def worst_block_backward(ctx: StepContext, fixed: int) -> Moment:
    """The worst moment of any block's backward: block i holds the gradients of every parameter after it and
    the activations saved before it, its own whole again (recomputed if checkpointed); early in its backward
    (the MLP's), then at its ffn_norm's backward (`ffn_norm_backward`)."""
    m, L = ctx.config.model, ctx.config.model.n_layers
    per_block = 4 * sum(map(math.prod, ctx.shape.block))  # fp32 gradients of one block's parameters
    after = 4 * sum(map(math.prod, ctx.shape.root)) - 4 * m.vocab_size * m.dim  # the head's, the final norm's
    mlp_grads = 4 * 3 * m.dim * m.ffn_dim + 4 * m.dim  # w1's, w2's, w3's and ffn_norm's
    freed, norm_temporary = ffn_norm_backward(ctx)
    moments = []
    for i in range(L):
        grads = after + (L - 1 - i) * per_block
        acts = sum(ctx.acts.blocks[:i]) + ctx.acts.batch + ctx.acts.in_backward_of(i)
        if (
            m.is_moe
        ):  # the experts' loop backward, its weight gradients made in it (moments.py, trainer/plan/moe.py)
            moe = block_backward_temporary(
                ctx, 6 if ctx.prec.regime == "autocast" else 4, weight_grad_held=False
            )
            moments.append(
                ctx.moment(f"backward: block {i}", grads=grads, activations=acts, temporary=fixed + moe)
            )
            continue
        moments += [
            ctx.moment(
                f"backward: block {i}",
                grads=grads + 4 * m.dim * m.ffn_dim,  # w2's, made first
                activations=acts,
                temporary=fixed + block_backward(ctx),
            ),
            ctx.moment(
                f"backward: block {i} ffn_norm",
                grads=grads + mlp_grads,
                activations=acts - freed,
                temporary=fixed + norm_temporary,
            ),
        ]
    return max(moments, key=lambda moment: moment.total)


def block_backward(ctx: StepContext) -> int:
    """Early in a block's backward, the worst of two phases (w2's fp32 weight gradient counted in `grads`),
    each measured with MemTracker at tp=2, fp32 and bf16, with and without SP, to the byte:

    - w2's backward: the gradient arriving down the residual (T / tp positions under sequence parallelism;
      under autocast also its cast to the compute dtype, for w2's bf16 output), its all-gather (the adjoint
      of RowwiseParallel's reduce-scatter: all T, SP only), w2's input gradient (B·T·M/tp) and its weight
      gradient being written (under autocast the bf16 one, its fp32 cast not yet made);
    - the SwiGLU product's backward: the incoming gradient and two B·T·M/tp gradients, w2's saved input
      already freed (block_backward_temporary's accounting: the whole block stays in the activations);
    - under fp8, the float8 casts of w2's backward (trainer/plan/fp8_backward.py), measured at tp=2 with
      checkpointing none and full, SP on and off, within 0.2% (tests/integration/test_tp_fp8.py).
    """
    m, n, prec = ctx.config.model, ctx.tokens, ctx.prec
    shards = sequence_shards(ctx.config)
    incoming = incoming_gradient(ctx)
    cast = prec.compute * n * m.dim // shards if prec.regime == "autocast" else 0
    gathered = prec.compute * n * m.dim if shards > 1 else 0
    nm, md = prec.compute * n * m.ffn_dim, m.dim * m.ffn_dim
    w2 = incoming + cast + gathered + nm + prec.compute * md - 4 * md
    # fp8 (trainer/plan/fp8_backward.py, the all-gathered output gradient under SP included): w2's fp32
    # weight gradient, which the moment's `grads` count, is not made yet at its last cast.
    fp8 = fp8_w2_backward(ctx.config, prec.compute, prec.regime, incoming)  # 0 without fp8
    return max(incoming + 2 * nm, w2, fp8 - 4 * md if fp8 else 0)


def embedding_backward(ctx: StepContext) -> int:
    """The embedding's backward beside its new weight gradient: three fp32 B·T·D tensors, all T, with and
    without SP (the gradient arriving whole, under SP the all-gather's output, and what torch's CPU
    embedding backward makes of it), measured with MemTracker at tp=2 in fp32 and bf16; not yet traced to
    torch's source."""
    return 3 * 4 * ctx.tokens * ctx.config.model.dim
