"""The blocks' backward under FSDP2: one function per moment of a block's backward (its start,
its end, its pre-backward all-gather copy-out, its reduce-scatter) over a per-block record, and
the worst of each moment over every block."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import Stage
from trainer.plan.fsdp_buffers import Accumulation, FsdpSizes, cast_shard, copy_out_extra, secondaries
from trainer.plan.moe import expert_rows, router_gradients
from trainer.plan.moments import (
    Moment,
    StepContext,
    block_backward_temporary,
    block_end_temporary,
    ffn_norm_backward,
    incoming_gradient,
)


@dataclass(frozen=True)
class BlockBackward:
    """Block `index` in the backward: what each of its moments holds beyond that moment's own
    temporaries (bytes)."""

    index: int
    name: str  # "backward: block i", or "backward (micro-batch before the last): block i"
    reduces: bool  # this micro-batch reduce-scatters (false: before the last, under reduce_every=step)
    keeps: bool  # zero.reshard_after_backward=false: the block stays unsharded after its reduce-scatter
    grads: int  # gradient shards held: the blocks above, reduced already, or every shard (accumulated)
    below: int  # activations saved by the blocks below, and the batch
    params: int  # at its start: the unsharded groups, the retained reduce-scatter input, the gradients
    prefetched: int  # stage3: the block below, all-gathered while this one runs
    held: int  # hpZ: the secondary shards of the blocks below (the prefetched one's too)
    above: int  # zero.reshard_after_backward=false: the blocks above, kept unsharded
    accumulated: int  # reduce_every=step: the accumulated gradient still held


def block_backward(
    ctx: StepContext, f: FsdpSizes, acc: Accumulation, index: int, *, reduces: bool, keeps: bool
) -> BlockBackward:
    """The record of block `index` (blocks run backward from L-1 down to 0)."""
    L, acts = ctx.config.model.n_layers, ctx.acts
    stage3 = ctx.config.zero.stage == Stage.stage3
    prefix = "backward" if reduces else "backward (micro-batch before the last)"
    done = L - 1 - index  # blocks above, whose backward ran
    reduced = done if reduces else 0
    accumulated = acc.left(reduced) if acc.full or reduces else acc.built(done)
    above = done * f.block if keeps else 0
    # the block below's own groups; under an ep group inside the shard group not its experts unit, which its own
    # pre-backward gathers once the block's has run (FSDP2 prefetches in reverse post-forward order)
    prefetched = f.dense if index > 0 else 0
    # hpZ: every block below holds its secondary shard, the prefetched one too: it is freed only
    # when its all-gather output is copied out, at that block's own pre-backward.
    held = secondaries(f, index)
    # the block above's reduce-scatter input, freed at the next post-backward (its experts unit's, reduced before
    # the block's own, freed already)
    retained = f.dense_rs if reduced else 0
    # stage3: this block re-gathered; stage2: blocks 0..index never resharded after forward.
    unsharded = f.block + prefetched + held if stage3 else (index + 1) * f.block
    return BlockBackward(
        index=index,
        name=f"{prefix}: block {index}",
        reduces=reduces,
        keeps=keeps,
        grads=acc.shards or reduced * f.block_grad_shard,
        below=sum(acts.blocks[:index]) + acts.batch,
        params=f.root + unsharded + acc.fresh(f.output_grad) + retained + accumulated + above,
        prefetched=prefetched,
        held=held,
        above=above,
        accumulated=accumulated,
    )


def block_start_moment(ctx: StepContext, acc: Accumulation, b: BlockBackward) -> Moment:
    """Its start: all its activations back (recomputed if checkpointed), the MLP's gradients. FSDP2
    keeps a block's new weight gradients until its post-backward, unless autograd adds them into an
    accumulated gradient of the same dtype (reduce_every=step), freeing each at once."""
    compute = block_backward_temporary(ctx, ctx.prec.param, weight_grad_held=not acc.in_place)
    return ctx.moment(b.name, b.grads, b.below + ctx.acts.in_backward_of(b.index), b.params + compute)


def block_ffn_norm_moment(ctx: StepContext, acc: Accumulation, b: BlockBackward) -> Moment:
    """Its ffn_norm's backward (tensor parallelism only): the MLP's saved tensors and the norm's own gone,
    the new unsharded weight gradients of w1, w2, w3 and the norm held (param dtype), and the norm's
    backward temporaries. Under TP the freed MLP tensors are M / tp wide while the norm's temporaries
    stay D wide (all T without SP), so this moment can pass the block's start: at tp=2 dp=2 zero=stage3,
    bf16, no SP, checkpointing=full, MemTracker's peak is block 1's ffn_norm backward (pow's backward in
    torch's composite rms_norm). At tp = 1 it is the peak of none of checks/plan_snapshot.py's 3,552
    rank plans (checked when it was added), so it is listed under TP only and that snapshot stays as it was."""
    m = ctx.config.model
    freed, norm_temporary = ffn_norm_backward(ctx)
    grads = acc.fresh(ctx.prec.param * (3 * m.dim * m.ffn_dim + m.dim))
    activations = b.below + ctx.acts.in_backward_of(b.index) - freed
    return ctx.moment(f"{b.name} ffn_norm", b.grads, activations, b.params + grads + norm_temporary)


def block_end_moment(ctx: StepContext, f: FsdpSizes, acc: Accumulation, b: BlockBackward) -> Moment:
    """Its end: its activations gone, every unsharded weight gradient of the block held."""
    return ctx.moment(
        f"{b.name} end", b.grads, b.below, b.params + acc.fresh(f.block_grad) + block_end_temporary(ctx)
    )


def block_copy_out_moment(ctx: StepContext, f: FsdpSizes, b: BlockBackward) -> Moment:
    """stage3, its pre-backward re-gather: the flat all-gather output copied into the unsharded
    parameters, before its prefetch of the block below (block 0: the blocks above still kept)."""
    copy_out = b.params - b.prefetched + copy_out_extra(f)
    activations = b.below + ctx.acts.blocks[b.index]
    return ctx.moment(
        f"{b.name} all-gather copy-out", b.grads, activations, copy_out + incoming_gradient(ctx)
    )


def block_reduce_scatter_moment(
    ctx: StepContext, f: FsdpSizes, acc: Accumulation, b: BlockBackward
) -> Moment:
    """Its reduce-scatter: the block resharded (unless kept), the retained input of the block above
    freed; its unsharded (or accumulated) gradient copied into the input, then freed for the output
    (with gloo's copy of the input, or its fp32 cast under bf16 reduction)."""
    stage3 = ctx.config.zero.stage == Stage.stage3
    gloo = f.dense_rs if f.gloo_copy else 0
    out = f.block_rs_out + max(gloo, cast_shard(f.block_rs_out, f.block_grad_shard))
    source = b.accumulated if acc.full else f.dense  # an experts unit inside it reduced its own already
    after_copy = out + b.accumulated - acc.per_block
    unsharded = f.root + (b.prefetched + b.held if stage3 else b.index * f.block)
    kept = b.above + f.block if b.keeps else 0
    temporary = unsharded + kept + acc.fresh(f.output_grad) + incoming_gradient(ctx) + f.dense_rs
    return ctx.moment(f"{b.name} reduce-scatter", b.grads, b.below, temporary + max(source, after_copy))


def experts_reduce_scatter_moment(ctx: StepContext, f: FsdpSizes, b: BlockBackward) -> Moment:
    """parallel.ep inside the shard group: the block's experts unit's reduce-scatter, right after the experts'
    backward (FSDP2's post-backward runs on the gradient of the unit's input, before the dispatch's backward): the
    unit resharded, its unsharded gradients copied into the reduce-scatter input, then freed for the output and
    gloo's copy of the input (listed with a tracker over MemTracker's storages at the peak of a rank receiving no
    rows); the experts' saved rows and hidden tensors freed, the router's gradients waiting, the gradient down the
    residual held."""
    rows = expert_rows(ctx.config, ctx.ep_rank, shard_ranks=ctx.world_size)
    m, compute = ctx.config.model, ctx.prec.compute
    own = 4 * compute * rows.total * m.expert_width + compute * rows.total * m.dim  # the loop's saved set
    out = f.experts_rs_out + max(
        f.experts_rs if f.gloo_copy else 0, cast_shard(f.experts_rs_out, f.experts_shard)
    )
    # FSDP2 still holds the last gradient it reduced, a loop variable in foreach_reduce: w3's (the experts' three
    # weights are equal in size)
    reduce = f.experts_rs + max(f.experts_grads, f.experts_grads // 3 + out)
    held = incoming_gradient(ctx) + router_gradients(ctx.config, rows.sent) + compute * rows.total * m.dim
    activations = b.below + ctx.acts.in_backward_of(b.index) - own
    return ctx.moment(
        f"{b.name} experts reduce-scatter", b.grads, activations, b.params - f.experts + held + reduce
    )


def block_moments(ctx: StepContext, f: FsdpSizes, acc: Accumulation, b: BlockBackward) -> dict[str, Moment]:
    """Every moment of one block's backward, by kind."""
    moments = {"start": block_start_moment(ctx, acc, b), "end": block_end_moment(ctx, f, acc, b)}
    if f.experts:
        moments["experts"] = experts_reduce_scatter_moment(ctx, f, b)
    if ctx.config.parallel.tp > 1:
        moments["ffn_norm"] = block_ffn_norm_moment(ctx, acc, b)
    if ctx.config.zero.stage == Stage.stage3:
        moments["copy-out"] = block_copy_out_moment(ctx, f, b)
    if b.reduces:
        moments["reduce"] = block_reduce_scatter_moment(ctx, f, acc, b)
    return moments


def fsdp_block_moments(
    ctx: StepContext, f: FsdpSizes, acc: Accumulation, reduces: bool = True, keeps: bool = False
) -> list[Moment]:
    """The worst of each block moment over every block.

    Going down the blocks, activations shrink while gradient shards grow, and from the
    second-to-last block on, the block above's reduce-scatter input is retained (FSDP2 frees it
    at the next post-backward), so the worst block is not always the last one. reduces=False:
    a micro-batch before the last under reduce_every=step, which reduces nothing and holds the
    whole accumulated gradient (or, in the first micro-batch, the part its blocks above made).
    keeps (zero.reshard_after_backward=false, a micro-batch before the last): every block above
    stays unsharded, and the block itself after its reduce-scatter.
    """
    worst: dict[str, Moment] = {}  # the first block (L-1) sets the order; a later one replaces only if larger
    for index in reversed(range(ctx.config.model.n_layers)):
        b = block_backward(ctx, f, acc, index, reduces=reduces, keeps=keeps)
        for kind, moment in block_moments(ctx, f, acc, b).items():
            if kind not in worst or moment.total > worst[kind].total:
                worst[kind] = moment
    return list(worst.values())
