"""FSDP2's buffers on one rank (unsharded copies, all-gather outputs, reduce-scatter inputs and
outputs, hpZ's secondary shards) and what gradient accumulation holds beside them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config import ReduceEvery
from trainer.plan.comm import REDUCE_BYTES, gathered_block_bytes
from trainer.plan.moe import expert_grad_bytes, expert_local_shapes, expert_shapes, expert_shard_ranks
from trainer.plan.moments import StepContext, accumulation_grads
from trainer.plan.states import padded_numel


@dataclass(frozen=True)
class FsdpSizes:
    """FSDP2 buffers of one rank (bytes)."""

    root: int  # the root's unsharded parameters (= its flat all-gather output), param dtype
    block: int  # one block's (its float8 weights 1 byte each under precision.fp8_all_gather)
    root_rs: int  # the root's reduce-scatter input (reduce dtype, padded)
    block_rs: int
    block_grad_shard: int  # one block's gradient shard (fp32: the reduce-scatter output, cast back)
    root_grad_shard: int
    block_rs_out: int  # the reduce-scatter output in the reduce dtype (bf16: cast to a new fp32 shard)
    root_rs_out: int
    output_grad: int  # the output head's unsharded weight gradient (+ final norm's)
    gloo_copy: bool  # gloo's reduce-scatter works on a copy of its input
    secondary: int = 0  # hpZ: one block's secondary shard, kept from its forward to its backward all-gather
    experts: int = 0  # an ep group inside the shard group: the experts' unit unsharded (in `block` too)
    experts_rs: int = 0  # and its reduce-scatter input (in `block_rs` too)
    experts_rs_out: int = 0  # its reduce-scatter output, reduce dtype
    experts_shard: int = 0  # its gradient shard (fp32)
    experts_grads: int = 0  # its unsharded gradients, as the experts' backward makes them
    block_grad: int = 0  # one block's new unsharded gradient, param dtype (`block`, but never float8)

    @property
    def dense(self) -> int:
        """The block's own group unsharded: `block` but for an experts unit inside it."""
        return self.block - self.experts

    @property
    def dense_rs(self) -> int:
        return self.block_rs - self.experts_rs


def fsdp_sizes(ctx: StepContext) -> FsdpSizes:
    s, w, p, r = ctx.shape, ctx.world_size, ctx.prec.param, REDUCE_BYTES[ctx.config.zero.reduce_dtype]
    root_padded = sum(padded_numel(t, w) for t in s.root)
    m = ctx.config.model
    # parallel.ep: FSDP2 leaves the experts' stacked weights alone (trainer/rank/experts.py: each rank holds its
    # E / ep whole, never gathered, never reduce-scattered); their shards are the rank's states all the same.
    # Under an ep group inside the shard group FSDP2 gathers and reduce-scatters them over the `ranks` holding
    # the same experts, their own unit inside the block's, counted with it (`expert_unit`).
    experts = set(expert_shapes(m)) if ctx.config.parallel.ep > 1 else set()
    block_padded = sum(padded_numel(t, w) for t in s.block if t not in experts)
    unit, ranks = expert_unit(ctx)
    expert_shard = 0 if ranks else sum(padded_numel(t, w) for t in s.block if t in experts) // w
    gathered = gathered_block_bytes(ctx.config, block_padded)  # float8 weights in 1 byte under fp8_all_gather
    return FsdpSizes(
        root=p * root_padded,
        block=gathered + p * unit,
        root_rs=r * root_padded,
        block_rs=r * (block_padded + unit),
        block_grad_shard=4 * (block_padded // w + expert_shard + (unit // ranks if ranks else 0)),
        root_grad_shard=4 * root_padded // w,
        block_rs_out=r * (block_padded // w + (unit // ranks if ranks else 0)),
        root_rs_out=r * root_padded // w,
        output_grad=p * (m.vocab_size * m.dim + m.dim),
        gloo_copy=ctx.device_kind == "cpu",
        secondary=gathered // hpz if (hpz := ctx.config.zero.hpz_ranks) else 0,
        experts=p * unit,
        experts_rs=r * unit,
        experts_rs_out=r * unit // ranks if ranks else 0,
        experts_shard=4 * unit // ranks if ranks else 0,
        experts_grads=expert_grad_bytes(ctx.prec.regime, apart=False) * unit,
        block_grad=p * (block_padded + unit),
    )


def expert_unit(ctx: StepContext) -> tuple[int, int]:
    """Under an ep group inside FSDP2's shard group: the elements of one block's experts unit unsharded (a rank's
    E / ep experts, the shard dim padded) and the ranks it is sharded over; (0, 0) elsewhere."""
    ranks = expert_shard_ranks(ctx.config, ctx.world_size)
    shapes = expert_local_shapes(ctx.config.model, ctx.config.parallel.ep, ranks) if ranks else ()
    return sum(math.prod(t) for t in shapes), ranks


def secondaries(f: FsdpSizes, blocks: int) -> int:
    """hpZ's secondary shards of `blocks` blocks (FSDP2's to_sharded_post_forward clones 1/hpz_ranks of
    each block's all-gather output after its forward and frees it once backward's all-gather copied out)."""
    return max(0, blocks) * f.secondary


def accumulates_sharded(ctx: StepContext) -> bool:
    """FSDP2 under reduce_every=micro_batch with grad_accum > 1: from the second micro-batch on,
    every gradient shard is held all step long (the peak is that micro-batch's)."""
    c = ctx.config
    return c.grad_accum > 1 and c.zero.uses_fsdp and c.zero.reduce_every == ReduceEvery.micro_batch


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


def copy_out_extra(f: FsdpSizes) -> int:
    """What a stage3 block's pre-backward copy-out holds beyond its unsharded copy: the flat all-gather
    output it copies from, freed only after the copy-out (torch 2.13 _fsdp_param_group.py
    `wait_for_unshard`: `foreach_all_gather_copy_out` writes into the unsharded parameters, then
    `self._all_gather_result = None`; in backward the free is not deferred), and under hpZ the block's
    own secondary shard, freed once its all-gather output is copied out. Before its own prefetch of the
    block below, so nothing prefetched; the start moment, with the prefetched block, is larger for every
    block but block 0. An experts unit inside the block gathers on its own (its all-gather output not here)."""
    return f.dense + f.secondary


def cast_shard(rs_out: int, grad_shard: int) -> int:
    """The fp32 shard FSDP2 casts a bf16 reduce-scatter output to (alive next to it); none in fp32."""
    return grad_shard if rs_out != grad_shard else 0
