"""The walk of one pipeline rank's step (parallel.pp > 1; what a stage holds: trainer/plan/pipeline.py).

The moments are the last block of the forward that ends holding the most (`pipeline.worst_of` with
forward=True: under interleaving a forward after backwards of the rank's other stage, beside that stage's
unsharded parameters and the gradient accumulated so far; under sequence parallelism at w2's reduce-scatter
where that holds more than the residual add); the loss of the micro-batch whose backward starts holding the
most activations (`pipeline.worst_of`) where the stage has the head; the worst of every backward's start of its
last block (the other micro-batches' stages held beside it; at stage3 over dp > 1 the block below prefetched)
and of every backward's reach of its stage's first block (the first backward's later blocks' gradients made, a
later one's whole gradient held); at stage3 over dp > 1 the worst copy-out of a last block's all-gather (under
hpZ beside every block's secondary shard: `last_block_copy_out`) and of a first block's, every later block
unsharded beside it (`first_block_copy_out`); then the optimizer step. Throughout, the stage holds its model states, its
send/recv buffers, its share of the step's batch and its DDP hook's state (zero.compression: ddp_walk.py
`hook_state`, of the stage's parameters) as `other`, and what PipelineStage's accumulation keeps:
the unsharded gradient of the stage (every backward but the last runs without gradient sync), under autocast
the cached casts of its weights, and under FSDP2 its parameters unsharded (set_reshard_after_backward(False)).
Under zero=stage1 the states are the rank's ZeroRedundancyOptimizer partition of its stage's tensors (the optimizer
works over the stage's replicas, trainer/rank/loop.py `replica_group`); under zero.sync_every local SGD's average
is a moment of its own after the step.

Under offload=cpu (and nvme) on a GPU the states at rest leave every moment (StepContext.moment), as at pp = 1;
what the accumulation keeps stays: FSDP2 unshards into device memory and accumulates the unsharded gradient
there until the last backward's reduce-scatter, whose shards it copies to the host.

Not modelled: PowerSGD's transients inside its hook at the stage's one reduction (docs/memory_plan.md); the
forward's own temporaries inside a block but those at its last residual add and (SP) w2's
reduce-scatter (under interleaving a forward can be the peak), and at stage2 the first forward's all-gather
output of the stage's last block (stage3's is counted: `forward_gathered`); under offload, each shard's
copy to the device (fp32, then cast) as its block is gathered, which in a backward comes before the block's
temporaries exist (the pp = 1 walk counts it at the forward's last all-gather; neither is measured on a GPU here).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from trainer.config import LossKind, Stage, TrainConfig
from trainer.plan.activations import Activations, Precisions, norm_upcasts_input, sequence_shards
from trainer.plan.comm import PARAM_BYTES, REDUCE_BYTES, fp8_gathered_numel, gathered_block_bytes
from trainer.plan.context_parallel import cp_positions, per_forward_kept, row_length
from trainer.plan.ddp_walk import hook_results, hook_state
from trainer.plan.loss import chunked_loss_moments, full_loss_temporaries
from trainer.plan.moments import (
    Moment,
    StepContext,
    block_backward_temporary,
    incoming_gradient,
    optimizer_temporary,
    other_bytes,
    rope_table_bytes,
)
from trainer.plan.pipeline import (
    InFlight,
    Pipeline,
    boundary_bytes,
    build_pipeline,
    rank_model_shapes,
    rank_stages,
    stage_activations,
    stage_blocks,
    stage_config,
)
from trainer.plan.states import ModelShape, RankStates, rank_states
from trainer.plan.tp_walk import (
    replicated_embedding_gradient,
    sequence_gather_temporary,
)


class Forward(NamedTuple):
    """A forward's end: the moment, its stage's activations, and whether that stage has the head."""

    moment: InFlight
    acts: Activations
    last: bool


class Backward(NamedTuple):
    """A backward on a rank: the moment of its start, its stage's activations, whether that stage has the head,
    its blocks, and in the step's first backward the gradients its later blocks (and, on the last stage, the
    final norm and head) have made by the time it reaches its stage's first block (0 in a later one, which
    holds the whole accumulated gradient)."""

    moment: InFlight
    acts: Activations
    last: bool
    blocks: int
    made: int


@dataclass(frozen=True)
class Kept:
    """What a stage keeps through its backwards beside its states: `always` from the step's start, `growth` from
    the end of its first backward (its gradient, accumulated from then on), `grads_at_rest` whether the states'
    gradients exist while it runs (DDP's buckets; FSDP2's shards and plain .grad come after the last backward)."""

    always: int
    growth: int
    grads_at_rest: bool
    block: int = 0  # stage3: the block whose forward or backward runs, unsharded (FSDP2 reshards it after)


def kept(
    config: TrainConfig, prec: Precisions, shape: ModelShape, blocks: int, dp: int, first: bool = False
) -> Kept:
    """FSDP2 under set_requires_gradient_sync(False): its parameters unsharded (at stage2 all of them, never
    resharded; at stage3 the root, and the block whose forward or backward runs, as each forward reshards its
    block again: measured on CPU ranks, no prefetched block beside it), and from the first backward the
    unsharded gradient (reduce dtype). DDP (applied
    where dp > 1): its buckets, and under no_sync the gradient beside them (fp32). One rank per stage: plain
    .grad (fp32) from the first backward. Autocast caches the cast of each of the stage's weights (the schedule
    runs inside one autocast region)."""
    numel = shape.num_params
    if config.zero.uses_fsdp:
        root = sum(math.prod(s) for s in shape.root)
        block = shape.block_numel
        param, reduce = PARAM_BYTES[config.precision.compute_dtype], REDUCE_BYTES[config.zero.reduce_dtype]
        grads = reduce * numel + (replicated_embedding_gradient(config, reduce) if first else 0)
        if config.zero.stage == Stage.stage2:
            return Kept(unsharded_stage_bytes(config, shape, blocks), grads, False)
        return Kept(param * root, grads, False, gathered_block_bytes(config, block) if blocks else 0)
    head = config.model.vocab_size * config.model.dim if len(shape.root) > 1 else 0
    casts = 2 * (shape.block_linear_numel * blocks + head) if prec.regime == "autocast" else 0
    if dp > 1:
        return Kept(casts, 4 * numel if config.grad_accum > 1 else 0, True)
    return Kept(casts, 4 * numel + (replicated_embedding_gradient(config, 4) if first else 0), False)


def unsharded_stage_bytes(config: TrainConfig, shape: ModelShape, blocks: int) -> int:
    """A stage's parameters unsharded under FSDP2: the compute dtype's bytes, but 1 byte for each weight
    precision.fp8_all_gather gathers in float8 (trainer/plan/comm.py `fp8_gathered_numel`)."""
    param = PARAM_BYTES[config.precision.compute_dtype]
    return param * shape.num_params - (param - 1) * fp8_gathered_numel(config) * blocks


def within_step(config: TrainConfig, shape: ModelShape, keeps: Kept, blocks: int) -> tuple[int, int]:
    """What a stage holds from its first backward to the step's end beyond its states at rest (the pipeline's
    law): under FSDP2 every parameter unsharded in the compute dtype, the float8-gathered weights in 1 byte
    (stage3's backwards leave each block so), and the unsharded gradient in the reduce dtype; under DDP and on one rank per stage, the fp32 gradient DDP's
    buckets do not hold (`Kept.growth`). So at ZeRO-3 a stage holds, per parameter of its TP shard, 2 + 4 bytes
    beside its 12 / dp of master weights and Adam: 6 + 12/dp (Megatron-LM's distributed optimizer's figure)."""
    params = unsharded_stage_bytes(config, shape, blocks) if config.zero.uses_fsdp else 0
    return params, keeps.growth


def stage_output(acts: Activations, last: bool) -> int:
    """What a stage's table holds beside its blocks through its last block's forward and backward: on every
    stage but the last, its output (stage_activations' `head`), which PipelineStage keeps in `fwd_cache` and
    its backward starts from; the last stage's head (final norm, loss) comes after its last block and is gone
    by the last block's backward."""
    return 0 if last else acts.head


class Held(NamedTuple):
    """What a backward holds beside what each of its rank's moments holds alike (the states at rest, the
    gradients the walk gives them, `other`: `StepContext.moment`)."""

    activations: int
    temporary: int


def first_block_backward(keeps: Kept, first: Backward, made: int) -> Held:
    """A backward at its stage's first block, where the stage's gradients are made during the step (FSDP2, one
    rank per stage; not DDP's buckets), and at stage3 every block unsharded (each backward leaves its block so,
    set_reshard_after_backward(False)), where the later blocks' activations are freed, not the stage's output.
    The step's first backward has its later blocks' gradients made (`first.made`), w2's beside them. Measured
    with MemTracker on GPipe's stages at zero=stage3 fp32, where it is the peak: both blocks unsharded, the later
    one's gradients beside w2's. A later backward holds the stage's whole gradient (`Kept.growth`) and adds w2's
    new one into it (`weight_gradient`): measured on Schedule1F1B's first stage at zero=stage3 fp32, dp 1,
    micro_batch 1, where it is the peak (the third backward, with the fourth micro-batch in flight). `made`:
    w2's gradient as the block makes it (`first_block_temporary`)."""
    made += keeps.growth if first.moment.done else first.made
    # a stage left unsharded by its previous backward has its blocks in the walk's `kept` already
    blocks = 0 if first.moment.unsharded else keeps.block * first.blocks
    temporary = keeps.always + first.moment.kept + blocks + made
    # The stage's output is held through its whole backward: backward_one_chunk pops it from `fwd_cache` and
    # stage_backward holds it (`stage_output_tensors`) across torch.autograd.backward
    output = stage_output(first.acts, first.last)
    activations = first.moment.held + first.acts.in_backward - first.acts.received + output
    return Held(activations, temporary)


def first_block_copy_out(ctx: StepContext, keeps: Kept, first: Backward, secondary: int) -> Held | None:
    """stage3 over dp > 1: the copy-out of a stage's first block's all-gather, at its pre-backward in a backward
    whose stage a forward resharded (_fsdp_param_group.py `wait_for_unshard`): every block of the stage unsharded
    (the later ones kept since their backward, the running one just allocated) beside the all-gather output it is
    copied from, the later blocks' gradients made (a later backward: the whole gradient held), the gradient
    arriving into the block, the block's own saved set and the stage's output; under hpZ the block's secondary
    shard, freed once copied. Measured with MemTracker on GPipe's stages at zero=stage3 fp32, dp 4, micro_batch
    1, with hpZ (hpz_ranks 2) and without: the peak of both stages, where every micro-batch is in flight. None
    where nothing is gathered: one block (its copy-out is the last block's), one rank, or a stage left
    unsharded by its previous backward."""
    if keeps.block == 0 or ctx.world_size == 1 or first.blocks < 2 or first.moment.unsharded:
        return None
    made = keeps.growth if first.moment.done else first.made
    unsharded = keeps.block * (first.blocks + 1)  # the stage's blocks, and the flat all-gather output
    temporary = keeps.always + first.moment.kept + unsharded + made + incoming_gradient(ctx) + secondary
    acts = first.acts
    saved = acts.blocks[0] + acts.batch - acts.received  # the first block's set: the later ones' are freed
    return Held(first.moment.held + saved + stage_output(acts, first.last), temporary)


def first_block_temporary(ctx: StepContext, keeps: Kept, done: bool) -> int:
    """w2's gradient at a backward's first block (`first_block_backward`): a later backward (`done`) adds its new
    one into the held gradient (`weight_gradient`); the step's first makes it, FSDP2's in its param dtype, else
    the fp32 .grad."""
    if done:
        return block_backward_temporary(ctx, *weight_gradient(ctx, keeps, done=True))
    weight_grad = ctx.prec.param if ctx.config.zero.uses_fsdp else 4
    return block_backward_temporary(ctx, weight_grad, weight_grad_held=True)


def forward_moment(ctx: StepContext, keeps: Kept, grads: int | None, forward_end: Forward) -> Moment:
    """The worst forward's end, in its last block: at the residual add, w2's output beside the output it makes
    (the stage's, `stage_output`) and, where the ffn norm saved an upcast rather than its input, the attention's
    residual sum; under sequence parallelism, where it holds more, at w2's reduce-scatter (`w2_scattered`)."""
    fwd, acts, last = forward_end
    fixed = keeps.always + (keeps.growth if fwd.done else 0) + fwd.kept + keeps.block
    fixed += forward_gathered(ctx, keeps, fwd)
    held = fwd.held + acts.before_last_block + acts.full_block
    residual = incoming_gradient(ctx)
    residual_sum = residual if norm_upcasts_input(ctx.prec, ctx.device_kind) else 0  # alive until the add
    residual_add = residual * ctx.prec.compute // ctx.prec.residual + residual_sum
    at_add = ctx.moment("forward: last block", grads, held + stage_output(acts, last), fixed + residual_add)
    scattered = w2_scattered(ctx)
    if not scattered:
        return at_add
    at_scatter = ctx.moment("forward: last block", grads, held, fixed + residual_sum + scattered)
    return max(at_add, at_scatter, key=lambda moment: moment.total)


def forward_gathered(ctx: StepContext, keeps: Kept, fwd: InFlight) -> int:
    """stage3 over dp > 1: the last block's flat all-gather output, alive through the rest of the forward of a
    stage whose blocks FSDP2 gathered (not left unsharded by a backward): in forward FSDP2 defers its free to
    the next all-gather (_fsdp_param_group.py `wait_for_unshard` keeps it as `comm_ctx.all_gather_state`), and
    the stage's last block has none after it (the pp = 1 walk's `last_gathered`). Measured with MemTracker on
    ScheduleInterleaved1F1B's first rank at zero=stage3 fp32, dp 4, micro_batch 1 (one block a stage), where a
    forward is the peak: a 787,456-byte ACT storage (tiny's block)."""
    return keeps.block if fwd.gathered and ctx.world_size > 1 else 0


def w2_scattered(ctx: StepContext) -> int:
    """Under sequence parallelism, w2's reduce-scatter in a block's forward (RowwiseParallel to Shard(1)): w2's
    partial output, all T positions (B·T·D, compute dtype), its copy with the sequence chunks concatenated along
    dim 0 (_functional_collectives.py `reduce_scatter_single` runs `_chunk_or_narrow_cat` for a scatter_dim
    other than 0) and the output, T / tp positions; beside them the feed-forward's input, the ffn norm's output
    over T / tp positions, which FeedForward.forward's argument holds until it returns (w1 and w3 save its
    all-gathered copy, not it). Measured with MemTracker on interleaved_1f1b's first rank at tp 2, pp 2,
    zero=stage3 fp32, where it is the peak (the forward of the rank's later stage after three backwards).
    0 without SP."""
    shards = sequence_shards(ctx.config)
    if shards == 1:
        return 0
    full = ctx.prec.compute * ctx.tokens * ctx.config.model.dim
    return 2 * full + full // shards + incoming_gradient(ctx)


def weight_gradient(ctx: StepContext, keeps: Kept, done: int) -> tuple[int, bool]:
    """The bytes per element of w2's weight gradient as a block's backward makes it, and whether it stays held
    (block_backward_temporary's `weight_grad_held`). Where the weights' gradient is their fp32 .grad (one rank
    per stage, no DDP; FSDP2 without a half-precision param_dtype), the stage's first backward makes w2's .grad,
    which stays beside the SwiGLU product's backward; later backwards (`done`) add a transient (autocast's bf16
    one and its fp32 cast) into it in place (AccumulateGrad). FSDP2's half-precision gradients wait for its
    post-backward to be added into the fp32 accumulated one (`to_accumulated_grad_if_needed`)."""
    fsdp = ctx.config.zero.uses_fsdp
    weight_grad = ctx.prec.param if fsdp else (6 if ctx.prec.regime == "autocast" else 4)
    if not keeps.grads_at_rest and (not fsdp or ctx.prec.param == 4):
        return (weight_grad, False) if done else (4, True)
    return weight_grad, fsdp


def prefetched(ctx: StepContext, keeps: Kept, peak: InFlight, blocks: int) -> int:
    """The all-gather output of the block below, beside the last block's backward of a stage whose blocks a
    forward resharded: FSDP2's pre-backward unshards the running block and prefetches the next one in reverse
    forward order (_fsdp_param_group.py `pre_backward`, `_backward_prefetch`, `_prefetch_unshard`), whose
    `foreach_all_gather` allocates its whole flat output in the parameter dtype (`all_gather_comm.allocate`), kept
    in `_all_gather_result` until that block's own pre-backward copies it out. Over one rank (dp 1) FSDP2 skips
    the all-gather and copies the shard at the copy-out; a stage left unsharded by its previous backward has
    nothing to gather; the root's parameters are never resharded. Measured with MemTracker on Schedule1F1B's
    stages at zero=stage3 fp32, dp 2, micro_batch 1: a 787,456-byte TEMP (tiny's block) from `_prefetch_unshard`
    at the peak."""
    return keeps.block if ctx.world_size > 1 and blocks > 1 and not peak.unsharded else 0


def last_block_backward(ctx: StepContext, keeps: Kept, backward: Backward, block: int) -> Held:
    """The start of the last block's backward of `backward`'s micro-batch (`block`: the block's temporaries,
    `last_block_temporary`)."""
    peak, acts = backward.moment, backward.acts
    fixed = keeps.always + (keeps.growth if peak.done else 0) + peak.kept
    running = 0 if peak.unsharded else keeps.block  # else counted in peak.kept with the stage's other blocks
    held = peak.held + acts.before_last_block + acts.in_backward + stage_output(acts, backward.last)
    running += prefetched(ctx, keeps, peak, backward.blocks)
    return Held(held, fixed + running + block)


def secondary_bytes(config: TrainConfig, shape: ModelShape) -> int:
    """hpZ (zero.hpz_ranks): one block's secondary shard, 1/H of its unsharded parameters (compute dtype), which
    FSDP2 keeps from the block's forward to the copy-out of its next all-gather (fsdp_buffers.py `secondaries`);
    0 without hpZ."""
    hpz = config.zero.hpz_ranks
    return gathered_block_bytes(config, shape.block_numel) // hpz if hpz else 0


def last_block_copy_out(ctx: StepContext, keeps: Kept, backward: Backward, secondary: int) -> Held | None:
    """stage3 over dp > 1: the copy-out of the last block's all-gather at the start of a backward whose stage a
    forward resharded (_fsdp_param_group.py `wait_for_unshard`): the block unsharded beside the all-gather output
    it is copied from, under hpZ every block of the stage still holding its secondary shard (the running one's is
    freed after the copy), the block's activations, the stage's output and the gradient arriving into the block
    (beyond the last stage the receive buffer, counted with the buffers: `last_block_temporary`). Measured with
    MemTracker at zero=stage3 fp32, dp 4, micro_batch 1: on Schedule1F1B's stages with hpz_ranks 2, and on
    ScheduleInterleaved1F1B's last stage (one block a stage, so nothing prefetched it), where it is the peak.
    None where nothing is gathered: one rank, or a stage left unsharded by its previous backward."""
    peak, acts = backward.moment, backward.acts
    if keeps.block == 0 or ctx.world_size == 1 or peak.unsharded:
        return None
    fixed = keeps.always + (keeps.growth if peak.done else 0) + peak.kept
    held = peak.held + acts.before_last_block + acts.full_block + stage_output(acts, backward.last)
    arriving = incoming_gradient(ctx) if backward.last else 0
    return Held(held, fixed + 2 * keeps.block + backward.blocks * secondary + arriving)


def last_block_temporary(ctx: StepContext, keeps: Kept, done: bool, last: bool) -> int:
    """What the last block's backward makes at its start (`last_block_backward`), after an earlier backward of
    the step (`done`) or not, on the last stage (`last`) or not. Beyond the last stage the gradient arriving into
    the last block is the receive buffer itself, counted with the buffers: the backward reads the buffer in place
    (stage.py `_retrieve_recv_grads`, `_map_tensor_from_recv_info` returns `info.buffer`; _backward.py
    `stage_backward` passes it as grad_tensors)."""
    received = 0 if last else incoming_gradient(ctx)
    weight_grad, held = weight_gradient(ctx, keeps, done)
    block = max(
        block_backward_temporary(ctx, weight_grad, weight_grad_held=held),
        w2_gathered(ctx, ctx.config.zero.uses_fsdp),
    )
    return block - received + (head_gradient_waiting(ctx) if last else 0)


def head_gradient_waiting(ctx: StepContext) -> int:
    """On the last stage under FSDP2 with a half-precision param_dtype: the head's and final norm's gradient in
    that dtype, which waits for the stage's root post-backward (at the end of its backward) to be added into the
    fp32 accumulated one (`to_accumulated_grad_if_needed`), alive through the blocks' backward. Measured with
    loss=chunked (whose loss moments no longer hide it: zero=stage3 bf16, 1F1B on 2 CPU ranks): the last stage
    held 2·V·D bytes more than the walk at its last block's backward (V·D = 65,536 and 131,072: tiny at dim 128
    and 256)."""
    if not ctx.config.zero.uses_fsdp or ctx.prec.param == 4:
        return 0
    m = ctx.config.model
    return ctx.prec.param * (m.vocab_size * m.dim + m.dim)


def w2_gathered(ctx: StepContext, fsdp: bool) -> int:
    """Under sequence parallelism, w2's backward (the phase block_backward_temporary's SwiGLU phase follows):
    the gradient arriving, its all-gather over the TP group (and under autocast its cast;
    tp_walk.sequence_gather_temporary), w2's input gradient (B·T·M/tp) and its weight gradient being written
    (the compute dtype under autocast, FSDP2's parameter dtype, else fp32). 0 without SP."""
    gathered = sequence_gather_temporary(ctx)
    if not gathered:
        return 0
    m, prec = ctx.config.model, ctx.prec
    written = prec.param if fsdp else prec.compute
    return (
        incoming_gradient(ctx)
        + gathered
        + prec.compute * ctx.tokens * m.ffn_dim
        + written * m.dim * m.ffn_dim
    )


def stage_loss_moments(ctx: StepContext, fixed: int, total: int, grads: int | None) -> list[Moment]:
    """The last stage's loss, beside `total` activations and `fixed` temporaries: loss=full's log-softmax,
    forward and backward; loss=chunked's chunks (trainer/plan/loss.py), the head's gradient made by each
    chunk in the compute dtype under FSDP2 (its param dtype) or autocast, added into the fp32 .grad else."""
    if ctx.config.loss.kind == LossKind.full:
        forward, backward = full_loss_temporaries(ctx)
        return [
            ctx.moment("forward: loss", grads, total, fixed + forward),
            ctx.moment("backward: loss", grads, total, fixed + backward),
        ]
    m = ctx.config.model
    vd = m.vocab_size * m.dim
    if ctx.config.zero.uses_fsdp:
        grad = end = ctx.prec.param * vd
    else:
        grad, end = (2 * vd, 6 * vd) if ctx.prec.regime == "autocast" else (4 * vd, 4 * vd)
    return chunked_loss_moments(ctx, fixed, grad, end, activations=total, grads=grads)


def stage_moments(
    ctx: StepContext,
    acts: Activations,
    peak: InFlight,
    last: bool,
    keeps: Kept,
    forward_end: Forward,
    backwards: list[Backward],
) -> list[Moment]:
    """One pipeline rank's moments. `acts`: one micro-batch's activations of the stage whose backward starts
    holding the most (`peak`), `last` whether that stage has the head and loss (its loss moments are that
    micro-batch's), `keeps` what the stage keeps through its backwards; `forward_end`: the worst forward's end;
    `backwards`: every backward of the rank, each planned at its last block's start and, where its stage has
    several blocks and makes its gradients during the step, at its first block (the worst of each is kept: a
    backward beside fewer micro-batches can gather more parameters)."""
    grads = None if keeps.grads_at_rest else 0
    moments = [forward_moment(ctx, keeps, grads, forward_end)]
    if last:
        fixed = keeps.always + (keeps.growth if peak.done else 0) + peak.kept
        total = peak.held + acts.total
        moments += stage_loss_moments(ctx, fixed, total, grads)
    # A rank runs tens of backwards (grad_accum x virtual stages), alike but for what each holds beside its
    # states, gradients and `other` (`Held`): the worst is the largest of those sums, and only it is made a
    # moment (max keeps the first of equal ones, as over the moments themselves, whose totals add the same
    # integers to each). A block's temporaries depend on the backward only through whether one ran before it
    # in the step and (last block) whether its stage has the head, so each is worked out once per rank: the
    # caches live for this call, where ctx and keeps are fixed, and key on those bools.
    last_temporary = functools.cache(functools.partial(last_block_temporary, ctx, keeps))
    lasts = (
        last_block_backward(ctx, keeps, b, last_temporary(bool(b.moment.done), b.last)) for b in backwards
    )
    moments.append(ctx.moment("backward: last block", grads, *max(lasts, key=sum)))
    secondary = secondary_bytes(ctx.config, ctx.shape)
    copy_outs = [held for b in backwards if (held := last_block_copy_out(ctx, keeps, b, secondary))]
    if copy_outs:
        moments.append(
            ctx.moment("backward: last block all-gather copy-out", grads, *max(copy_outs, key=sum))
        )
    first_copy_outs = [held for b in backwards if (held := first_block_copy_out(ctx, keeps, b, secondary))]
    if first_copy_outs:
        moments.append(
            ctx.moment("backward: first block all-gather copy-out", grads, *max(first_copy_outs, key=sum))
        )
    if not keeps.grads_at_rest:
        first_temporary = functools.cache(functools.partial(first_block_temporary, ctx, keeps))
        firsts = [
            first_block_backward(keeps, b, first_temporary(bool(b.moment.done)))
            for b in backwards
            if b.blocks > 1
        ]
        if firsts:
            moments.append(ctx.moment("backward: first block", 0, *max(firsts, key=sum)))
    # TopK's decompressed gradient, which the stage's DDP keeps from its one reduction (ddp_walk.py)
    moments.append(ctx.moment("optimizer step", temporary=optimizer_temporary(ctx) + hook_results(ctx)))
    if ctx.config.zero.sync_every > 1:
        # PeriodicModelAverager's flat fp32 copy of the stage's parameters, after the step (ddp_walk.py)
        moments.append(ctx.moment("local SGD: parameter average", temporary=4 * ctx.shape.num_params))
    return moments


@dataclass(frozen=True)
class StageRanks:
    """One pipeline rank's plan, for each of the dp shards zero splits its stage into."""

    shards: list[RankStates]  # per position in the shard group
    moments: dict[RankStates, tuple[Moment, ...]]
    activations: int  # at the peak: every micro-batch stage in flight
    shape: ModelShape  # the parameters of its stages (what offload=cpu keeps in host memory, sharded)


def pipeline_stage_plans(
    config: TrainConfig,
    shape: ModelShape,
    acts: Activations,
    prec: Precisions,
    device_kind: str,
    sharded_over: int,
    dp: int,
) -> tuple[Pipeline, list[StageRanks]]:
    """The pipeline and the plan of each pipeline rank (`config`: one TP rank's job, under parallel.cp one cp
    rank's: T / cp positions); `dp` a stage's data-parallel replicas, dp x cp (DDP wraps a stage over them)."""
    p, m, last_stage = config.parallel, config.grad_accum, config.parallel.stages - 1
    split = stage_blocks(config.model.n_layers, p.stages)
    blocks = [sum(len(split[s]) for s in rank_stages(p, rank)) for rank in range(p.pp)]
    ends = [(0 in rank_stages(p, r), last_stage in rank_stages(p, r)) for r in range(p.pp)]
    locals_ = rank_model_shapes(config, shape)
    keeps = [kept(config, prec, locals_[r], blocks[r], dp, first=ends[r][0]) for r in range(p.pp)]
    regathered, gathered = None, 0
    if config.zero.stage == Stage.stage3:  # each stage's blocks, left unsharded by its backward
        block = gathered_block_bytes(config, shape.block_numel)
        regathered = {s: block * len(split[s]) for s in range(p.stages)}
        gathered = block if sharded_over > 1 else 0  # `forward_gathered`
    growth = tuple(k.growth for k in keeps)
    upcast = norm_upcasts_input(prec, device_kind)
    pipe = build_pipeline(config, acts, prec.residual, prec.compute, growth, regathered, upcast, gathered)
    pipe = dataclasses.replace(
        pipe, within_step=tuple(within_step(config, locals_[r], k, blocks[r]) for r, k in enumerate(keeps))
    )
    boundary = boundary_bytes(config, prec.residual)
    # The step's int64 inputs and targets on every rank, twice: the loaded micro-batches and their
    # concatenation, which the schedule splits again (trainer/rank/pipeline.py). On CPU the loaded ones are the
    # collated tensors themselves (to_device keeps them); of one sample each, `.contiguous()` returns the row
    # slices of the stacked B x (T + 1) tokens (data.py split_inputs_targets), which they then share.
    # Under parallel.cp (`config` a cp rank's job) every rank loads whole rows; the first stage feeds the schedule
    # its own positions of the inputs besides (int64, trainer/rank/pipeline.py `cp_feed`).
    row = row_length(config)
    tokens = config.micro_batch * row
    one_row = device_kind == "cpu" and config.micro_batch == 1
    batch = m * (8 * (row + 1) if one_row else 16 * tokens) + 16 * tokens * m
    fed = 8 * config.micro_batch * config.seq_len * m if config.parallel.cp > 1 else 0
    out = []
    forward_kept = per_forward_kept(config)
    # One micro-batch's activations per stage: a function of the stage alone, read at every moment of the walk
    per_stage = [
        stage_activations(acts, pipe.blocks[s], s == 0, s == last_stage, boundary, upcast, forward_kept)
        for s in range(p.stages)
    ]

    def stage_acts(moment: InFlight) -> Activations:
        return per_stage[moment.stage]

    def backward(rank: int, moment: InFlight) -> Backward:
        count = len(pipe.blocks[moment.stage])
        made = 0
        if moment is pipe.first_backwards[rank] and count > 1:
            # the gradient's bytes per element: FSDP2's unsharded one in the reduce dtype, else the fp32 .grad
            width = REDUCE_BYTES[config.zero.reduce_dtype] if config.zero.uses_fsdp else 4
            head = sum(math.prod(s) for s in shape.root[1:]) if moment.stage == last_stage else 0
            made = width * (shape.block_numel * (count - 1) + head)
        return Backward(moment, stage_acts(moment), moment.stage == last_stage, count, made)

    for rank in range(p.pp):
        peak, forward_end = pipe.in_flight[rank], pipe.forward_peaks[rank]
        acts_peak = stage_acts(peak)
        stage = stage_config(config, blocks[rank])
        shards = rank_states(locals_[rank], config.zero.stage, sharded_over)
        # each stage module the rank runs keeps its own rotary table (other_bytes counts one)
        tables = (len(rank_stages(p, rank)) - 1) * rope_table_bytes(config.model)
        # the rank's forward end and backwards are its schedule's, alike for each of its shards' states
        forward = Forward(forward_end, stage_acts(forward_end), forward_end.stage == last_stage)
        backwards = [backward(rank, moment) for moment in pipe.backwards[rank]]
        moments = {}
        for states in dict.fromkeys(shards):
            other = other_bytes(config.model, config.data, states) + tables + pipe.buffers[rank] + batch
            other += cp_positions(config) + (fed if ends[rank][0] else 0)  # parallel.cp's indices and feed
            other += hook_state(config.zero, locals_[rank]) if dp > 1 else 0  # the stage's DDP's hook
            ctx = StepContext(stage, locals_[rank], states, acts_peak, prec, sharded_over, device_kind, other)
            moments[states] = tuple(
                stage_moments(ctx, acts_peak, peak, peak.stage == last_stage, keeps[rank], forward, backwards)
            )
        out.append(StageRanks(shards, moments, peak.held + acts_peak.total, locals_[rank]))
    return pipe, out
