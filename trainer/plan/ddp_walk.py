"""The walk of a DDP step (zero=stage0, and stage1 with ZeroRedundancyOptimizer): replicated fp32
parameters and gradient buckets all step long, autocast's cached casts, and what a gradient
compression hook or local SGD holds (docs/memory_plan.md)."""

from __future__ import annotations

import dataclasses
import math

from trainer.config import Compression, LossKind, ZeroConfig
from trainer.model.fp8 import converted_numel
from trainer.plan.activations import norm_bytes_per_token
from trainer.plan.comm import powersgd_elements
from trainer.plan.loss import chunked_loss_moments, full_loss_temporaries
from trainer.plan.moe import expert_shapes
from trainer.plan.moments import (
    Moment,
    StepContext,
    accumulation_grads,
    block_backward_temporary,
    incoming_gradient,
    optimizer_temporary,
)
from trainer.plan.states import ModelShape
from trainer.private_apis.of_torch import ddp_bucket_assignment


def ddp_moments(ctx: StepContext, buckets: bool = True) -> list[Moment]:
    """Stages 0-1: DDP holds replicated fp32 params and its gradient buckets all step long. Without
    `buckets`, one replica's later micro-batches (trainer/plan/replica_walk.py): the gradients held all
    along, and no second copy accumulated beside them."""
    m, n, acts, prec = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec
    vd = m.vocab_size * m.dim
    # Autocast caches its cast of every weight from first use until the autocast region (which
    # wraps forward and backward in loop.py) exits; under fp8 not of the block linears torchao converted.
    converted = converted_numel(m, ctx.config.precision) if ctx.config.precision.is_fp8 else 0
    linear = (ctx.shape.block_linear_numel - converted) * m.n_layers + vd  # blocks' matmuls + output head
    fixed = (2 * linear if prec.regime == "autocast" else 0) + (accumulation_grads(ctx) if buckets else 0)
    weight_grad = 6 if prec.regime == "autocast" else 4
    # A tied head's fp32 weight gradient waits in autograd's buffer for the embedding's (one parameter,
    # one AccumulateGrad) through every block's backward; then the two and their sum are alive at once.
    tied = 4 * vd if m.tie_embeddings else 0
    embedding = 12 * vd if m.tie_embeddings else 4 * vd + prec.residual * n * m.dim
    held = hook_results(ctx)
    early = ctx.states.grads - expert_grads(ctx)  # the gradients held before the first expert's backward
    moments = [
        ctx.moment(
            "forward: last block",
            early,
            activations=acts.before_last_block + acts.full_block,
            temporary=fixed,
        ),
        *ddp_loss_moments(ctx, fixed, early),
        *block_backwards(
            ctx, early, fixed + tied + block_backward_temporary(ctx, weight_grad, weight_grad_held=False)
        ),
        ctx.moment("backward: embedding", activations=acts.batch, temporary=fixed + embedding + held),
        ctx.moment("optimizer step", temporary=optimizer_temporary(ctx) + held),
    ]
    moments += powersgd_hook_moments(ctx, moments, fixed + tied)
    if ctx.config.zero.sync_every > 1:
        # PeriodicModelAverager's average_parameters all-reduces one flat fp32 copy of every parameter
        # (torch.cat), made after the optimizer's step while the gradients are still held.
        moments.append(ctx.moment("local SGD: parameter average", temporary=4 * ctx.shape.num_params))
    state = hook_state(ctx.config.zero, ctx.shape)
    return [dataclasses.replace(mo, parts={**mo.parts, "other": mo.parts["other"] + state}) for mo in moments]


def block_backwards(ctx: StepContext, early: int, temporary: int) -> list[Moment]:
    """The blocks' backwards at their peak, with `temporary` beside each: the last block's, whose saved sets
    below it are the most (the step's largest at ep = 1, where every block's is the same but for them); under
    parallel.ep every block's, each holding the expert gradients of the blocks after it (`expert_grads`), which
    under checkpointing outweigh the saved sets (tiny-moe at ep = 2, checkpointing=full: block 0's)."""
    acts, layers = ctx.acts, ctx.config.model.n_layers
    per_layer = expert_grads(ctx) // layers
    below = acts.before_last_block - sum(acts.blocks[:-1])  # the batch, less a stage's received input
    moments = []
    for block in range(layers - 1 if per_layer == 0 else 0, layers):
        name = "backward: last block" if block == layers - 1 else f"backward: block {block}"
        grads = early + (layers - 1 - block) * per_layer
        saved = below + sum(acts.blocks[:block]) + acts.in_backward
        moments.append(ctx.moment(name, grads, activations=saved, temporary=temporary))
    return moments


def expert_grads(ctx: StepContext) -> int:
    """parallel.ep: the experts' fp32 gradients (E / ep of each MoE layer's), which DDP leaves out of its buckets
    (trainer/rank/experts.py): zero_grad frees them, and each layer's is made in its backward (the last block's
    while it is accumulated there, `moe_backward_peak`'s temporary), so until then the rank holds only the
    buckets. At ep = 1 they are bucket views, held all step; and with grad_accum > 1 the worst micro-batch, a later
    one, holds the experts' gradients accumulated from the first all step (none is counted apart: 0)."""
    m, ep = ctx.config.model, ctx.config.parallel.ep
    if ep == 1 or ctx.config.grad_accum > 1:
        return 0
    return 4 * m.n_layers * sum(math.prod(s) for s in expert_shapes(m)) // ep


def hook_state(zero: ZeroConfig, shape: ModelShape) -> int:
    """What a compression hook keeps from one step to the next (trainer/rank/compression.py), fp32:
    TopK's residual of every gradient; PowerSGD's error feedback (one per bucket, every gradient) and
    the P and Q of every compressed matrix (warm start). Counted as `other`, as the memory tracker
    counts state registered from outside the step."""
    numel = shape.num_params
    if zero.compression == Compression.topk:
        return 4 * numel
    if zero.compression == Compression.powersgd:
        compressed = [s for s in shape.order if powersgd_elements(s, zero) < math.prod(s)]
        return 4 * numel + 4 * sum(powersgd_elements(s, zero) for s in compressed)
    return 0


def powersgd_hook_moments(ctx: StepContext, moments: list[Moment], held: int) -> list[Moment]:
    """PowerSGD's hook at work on one bucket (torch's powerSGD_hook.py): a copy of the bucket
    (`input_tensor_cp`, to compute the error later), the uncompressed tensors concatenated for their
    all-reduce, and, made in its last callback while the previous one is still held, the new error
    feedback (`input_tensor_cp - input_tensor`): 4 * (2 * bucket + uncompressed) bytes beyond the
    state (hook_state) until the hook returns. P and Q are written in place (warm start), the
    decompression into the bucket too. The last bucket, the embedding's, runs at the end of backward
    (`backward: embedding`). A bucket whose last gradient is a block's last (wq's: the hook runs once
    it is ready) is planned at that block's end (`hook_at_block_end`); any other during the blocks'
    backward at the last block's moment: an upper bound, as less activation memory is left when a
    later block finishes. `held`: the temporaries alive all backward long (autocast's casts, a tied head's
    gradient)."""
    zero = ctx.config.zero
    if zero.compression != Compression.powersgd:
        return []
    buckets = ddp_buckets(ctx.shape, zero)
    transients = [  # per tensor: its copy and its new error; an uncompressed one is concatenated too
        4 * sum((2 if powersgd_elements(s, zero) < math.prod(s) else 3) * math.prod(s) for s in bucket)
        for bucket in buckets
    ]
    at = {mo.name: mo for mo in moments}
    hooks = [("backward: embedding", transients[-1])]
    at_block_ends = []
    ready = 0  # gradients ready before the bucket's, in the plan's ready order (ddp_buckets)
    for bucket, transient in zip(buckets[:-1], transients[:-1]):
        ready += len(bucket)
        block = block_ended_by(ctx.shape, ready - 1)
        if block is None:
            hooks.append(("backward: last block", transient))
        else:
            at_block_ends.append(hook_at_block_end(ctx, block, held + transient))
    return [
        dataclasses.replace(
            at[name],
            name=f"{name} + PowerSGD hook",
            parts={**at[name].parts, "temporary": at[name].parts["temporary"] + extra},
        )
        for name, extra in hooks
    ] + at_block_ends


def block_ended_by(shape: ModelShape, ready_index: int) -> int | None:
    """The block whose backward a gradient ends, where the gradient at `ready_index` of the plan's ready
    order (the parameters' reversed: output head, final norm, the last block's, ..., the embedding) is a
    block's last (wq's); None otherwise."""
    per_block = len(shape.block)
    blocks = (len(shape.order) - len(shape.root)) // per_block
    tail = len(shape.root) - 1  # the final norm and the output head come before the blocks' gradients
    position = ready_index - tail
    if position < 0 or position >= blocks * per_block or position % per_block != per_block - 1:
        return None
    return blocks - 1 - position // per_block


def hook_at_block_end(ctx: StepContext, block: int, temporary: int) -> Moment:
    """A bucket's hook at the end of block `block`'s backward, once wq's gradient is ready: the blocks below
    it keep their saved sets, the block itself its attention RMSNorm's (norm_bytes_per_token) and the norm's
    output that wk and wv saved (4·D per token: one fp32 tensor, or two bf16 casts under autocast); beside
    the gradient down the residual and the one into the norm's output (2 x B·T·D, residual dtype). Measured
    with MemTracker (tiny, fp32, stage0, 2 CPU ranks, T = 64, micro_batch=2; the first bucket ends at the
    last block's wq): activations and temporaries of the step's peak to within 0.1%, where the last block's
    moment planned it 6.2% high."""
    acts, m = ctx.acts, ctx.config.model
    attention_head = (norm_bytes_per_token(m.dim, ctx.prec.regime, ctx.device_kind) + 4 * m.dim) * ctx.tokens
    activations = sum(acts.blocks[:block]) + acts.batch - acts.received + attention_head
    return ctx.moment(
        f"backward: end of block {block} + PowerSGD hook",
        activations=activations,
        temporary=temporary + 2 * incoming_gradient(ctx),
    )


def ddp_buckets(shape: ModelShape, zero: ZeroConfig) -> list[list[tuple[int, ...]]]:
    """The shapes in each of DDP's buckets after its rebuild, in the order their hooks run. The rebuilt
    buckets follow the order gradients became ready in the first backward, which the plan takes as
    the reverse of the parameters' (measured on the tiny model: the same first bucket but for the last
    block's attention norm, 128 elements), filled by torch's own assignment."""
    ready = list(reversed(shape.order))
    return [[ready[i] for i in bucket] for bucket in ddp_bucket_assignment(ready, zero.bucket_cap_mb)]


def hook_results(ctx: StepContext) -> int:
    """TopK's decompressed gradient: each bucket's hook returns a new dense tensor, which DDP's reducer
    keeps (its views are the bucket's output) until the next backward: every gradient again, fp32
    (measured: it is alive at the optimizer step). DDP's own all-reduce returns the bucket itself."""
    return 4 * ctx.shape.num_params if ctx.config.zero.compression == Compression.topk else 0


def ddp_loss_moments(ctx: StepContext, fixed: int, grads: int | None = None) -> list[Moment]:
    """The loss and the output head's backward, with `fixed` (autocast's cached casts, the gradient
    accumulated outside the buckets) alive throughout: the full loss's (loss_parallel's under TP,
    trainer/plan/loss.py) or the chunked loss's. `grads`: StepContext.moment's (0 without DDP's buckets,
    trainer/plan/replica_walk.py, where the head's own gradient is the temporary counted here)."""
    m, n, acts, prec = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec
    vd = m.vocab_size * m.dim
    if ctx.config.loss.kind == LossKind.chunked:
        # autocast: bf16 weight gradients, cast to fp32 once all chunks are done; fp32: copied into the bucket
        # (without DDP: accumulated in place, the same bytes)
        grad, end = (2 * vd, 6 * vd) if prec.regime == "autocast" else (4 * vd, 4 * vd)
        return chunked_loss_moments(ctx, fixed, grad, end, grads=grads)
    forward, backward = full_loss_temporaries(ctx)
    if prec.regime == "autocast":  # bf16 weight gradient, then its fp32 cast; or with the logits' gradient
        head = max(2 * n * m.vocab_size + 2 * n * m.dim + 2 * vd, 2 * n * m.dim + 6 * vd)
    else:
        head = 4 * n * m.vocab_size + 4 * n * m.dim + 4 * vd
    return [
        ctx.moment("forward: loss", grads, activations=acts.total, temporary=fixed + forward),
        ctx.moment("backward: loss", grads, activations=acts.total, temporary=fixed + backward),
        ctx.moment(
            "backward: output head", grads, activations=acts.total - acts.log_softmax, temporary=fixed + head
        ),
    ]
