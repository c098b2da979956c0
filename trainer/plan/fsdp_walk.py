"""The walk of an FSDP2 step (zero=stage2 and stage3): parameters gathered per block, gradients
reduce-scattered per block, every micro-batch kind where zero.reshard_after_backward=false makes them
differ (docs/memory_plan.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.config import LossKind, ReduceEvery, Stage, TrainConfig
from trainer.plan.activations import NLL_TOTAL_WEIGHT
from trainer.plan.fsdp_blocks import fsdp_block_moments
from trainer.plan.fsdp_buffers import (
    Accumulation,
    FsdpSizes,
    accumulation,
    cast_shard,
    fsdp_sizes,
    secondaries,
)
from trainer.plan.loss import chunked_loss_moments, full_loss_temporaries
from trainer.plan.moments import Moment, StepContext, optimizer_temporary


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
    f = fsdp_sizes(ctx)
    acc = accumulation(ctx, f)
    if micro is not None and micro.first:
        # nothing of an earlier micro-batch yet: no shards held, no accumulated gradient to add into
        acc = dataclasses.replace(acc, shards=None, full=0, in_place=False)
    gathered = micro is not None and not micro.first  # forward starts with every group unsharded
    keeps = micro is not None and not micro.last  # backward reshards nothing
    reduces = micro is None or micro.last or ctx.config.zero.reduce_every == ReduceEvery.micro_batch
    earlier = (
        fsdp_block_moments(ctx, f, acc, reduces=False)
        if micro is None and acc.full and ctx.config.grad_accum > 2
        else []
    )
    moments = [
        *fsdp_forward_and_loss_moments(ctx, f, acc, gathered),
        *fsdp_block_moments(ctx, f, acc, reduces=reduces, keeps=keeps),
        *earlier,
        *fsdp_root_backward_moments(ctx, f, acc, reduces=reduces, keeps=keeps),
    ]
    if micro is None:
        return [*moments, ctx.moment("optimizer step", temporary=optimizer_temporary(ctx))]
    return [dataclasses.replace(moment, name=f"{moment.name} ({micro.name})") for moment in moments]


def fsdp_forward_and_loss_moments(
    ctx: StepContext, f: FsdpSizes, acc: Accumulation, gathered: bool
) -> list[Moment]:
    """The forward (block by block, or `gathered`: every group still unsharded from the backward
    before) and the loss with the output head."""
    L, held = ctx.config.model.n_layers, acc.shards or 0
    stage3 = ctx.config.zero.stage == Stage.stage3
    after_forward = (
        f.root + (secondaries(f, L) if stage3 else L * f.block) + acc.full
    )  # unsharded at the loss
    # The last block's flat all-gather output outlives the blocks: FSDP2 defers its free to the next
    # copy-out (torch 2.13 _fsdp_param_group.py:476-485, comm_ctx.all_gather_state; not on a 1-rank
    # shard group, which gathers nothing), and the next is the root's post-forward
    # (_fsdp_state.py:335-342), after the final norm and the output head ran.
    # (an experts unit inside the block gathers after the block's own group: its output is the last)
    last_gathered = (f.experts or f.block) if ctx.world_size > 1 and not gathered else 0
    forward = (
        gathered_forward_moments(ctx, f, held, acc.full)
        if gathered
        else fsdp_forward_moments(ctx, f, held, acc.full)
    )
    return [*forward, *fsdp_loss_moments(ctx, f, held, after_forward, last_gathered)]


def fsdp_forward_moments(ctx: StepContext, f: FsdpSizes, held: int, accumulated: int) -> list[Moment]:
    """The last block's all-gather and forward, the worst of a forward that gathers block by block."""
    acts, L = ctx.acts, ctx.config.model.n_layers
    stage3 = ctx.config.zero.stage == Stage.stage3
    # The last block's forward: its unsharded copy and its flat all-gather output (kept until the
    # next copy-out; during its own copy-out the block before's is still there too); stage2
    # still holds every earlier block unsharded. Offloaded shards are staged on the device first.
    forward = f.root + (2 * f.block + secondaries(f, L - 1) if stage3 else (L + 1) * f.block) + accumulated
    staging = offload_staging(ctx, f) if ctx.offloaded else 0
    return [
        ctx.moment(
            "forward: last block all-gather", held, acts.before_last_block, forward + f.block + staging
        ),
        ctx.moment("forward: last block", held, acts.before_last_block + acts.full_block, forward),
    ]


def offload_staging(ctx: StepContext, f: FsdpSizes) -> int:
    """An offloaded unit's fp32 shard copied to the device, and its cast to the param dtype, before its
    all-gather. An experts unit inside the block (an ep group inside the shard group) gathers on its own, inside
    the block's forward: the larger of the two shards' staging, not their sum (not yet measured: a GPU's)."""
    p = ctx.prec.param
    dense = (4 + p) * f.dense // ctx.world_size // p
    return max(dense, (4 + p) * f.experts_shard // 4)


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
    loss_forward, loss_backward = full_loss_temporaries(ctx)
    return [
        ctx.moment(
            "forward: output head",
            held,
            acts.total - acts.log_softmax - NLL_TOTAL_WEIGHT,
            after_forward + last_gathered + prec.compute * n * m.vocab_size,  # + the logits being written
        ),
        ctx.moment("forward: loss", held, acts.total, after_forward + loss_forward),
        ctx.moment("backward: loss", held, acts.total, after_forward + loss_backward),
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
