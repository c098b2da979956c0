"""The walk of one pipeline rank's step (parallel.pp > 1; what a stage holds: trainer/plan/pipeline.py).

The moments are those of the micro-batch whose backward starts while the schedule holds the most
activations (`pipeline.peak_in_flight`): the other micro-batches' stages held beside it, its own
forward's last block, its loss where the stage has the head, the start of its last block's backward;
then the optimizer step. Throughout, the stage holds its model states, its send/recv buffers and its
share of the step's batch (`other`), and what PipelineStage's accumulation keeps: the unsharded gradient
of the stage (every backward but the last runs without gradient sync), under autocast the cached casts
of its weights, and under FSDP2 its parameters unsharded (set_reshard_after_backward(False)).

Not modelled: the forward's own temporaries inside a block (smaller than the backward's), and the
stage-2/3 all-gather buffers of one block beside the unsharded stage (FSDP2 frees them once copied out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config import LossKind, Stage, TrainConfig
from trainer.plan.activations import Activations, Precisions
from trainer.plan.comm import PARAM_BYTES, REDUCE_BYTES
from trainer.plan.loss import loss_backward_temporary, loss_forward_temporary
from trainer.plan.moments import (
    Moment,
    StepContext,
    block_backward_temporary,
    optimizer_temporary,
    other_bytes,
)
from trainer.plan.pipeline import (
    Pipeline,
    boundary_bytes,
    build_pipeline,
    logits_bytes,
    rank_stages,
    stage_activations,
    stage_config,
    stage_model_shape,
)
from trainer.plan.states import ModelShape, RankStates, rank_states


def accumulated(ctx: StepContext, shape: ModelShape, blocks: int, dp: int) -> int:
    """What the stage keeps through its backwards beside its states. FSDP2 (set_requires_gradient_sync(False)):
    the unsharded gradient (reduce dtype), and its parameters unsharded: at stage2 all of them (never resharded),
    at stage3 the root and the block whose backward runs and the one it prefetches (each forward reshards its
    block again). DDP (applied where dp > 1) under no_sync: the gradient outside its buckets (fp32). Autocast's
    cached casts of the stage's weights (the schedule runs inside one autocast region)."""
    c = ctx.config
    numel = shape.num_params
    if c.zero.uses_fsdp:
        root = sum(math.prod(s) for s in shape.root)
        block = sum(math.prod(s) for s in shape.block)
        unsharded = numel if c.zero.stage == Stage.stage2 else root + min(2, blocks) * block
        return PARAM_BYTES[c.precision.compute_dtype] * unsharded + REDUCE_BYTES[c.zero.reduce_dtype] * numel
    linear = shape.block_linear_numel * blocks + (
        c.model.vocab_size * c.model.dim if len(shape.root) > 1 else 0
    )
    casts = 2 * linear if ctx.prec.regime == "autocast" else 0
    return casts + (4 * numel if dp > 1 and c.grad_accum > 1 else 0)


def stage_moments(
    ctx: StepContext,
    acts: Activations,
    held: int,
    last: bool,
    kept: tuple[int, int],
    accumulated: int,
) -> list[Moment]:
    """One pipeline rank's moments. `acts`: one micro-batch's activations of the stage whose backward starts at
    the peak, `held` the other micro-batches' beside it, `last` whether it has the head and loss; `kept` the
    logits PipelineStage keeps, at the peak and at the step's end; `accumulated` what the stage keeps through its backwards."""
    fsdp = ctx.config.zero.uses_fsdp
    grads = 0 if fsdp else None  # FSDP2's shards come at the reduction after the last backward
    fixed = accumulated + kept[0]
    forward = held + acts.before_last_block + acts.full_block
    moments = [ctx.moment("forward: last block", grads, forward, fixed)]
    if last and ctx.config.loss.kind == LossKind.full:
        total = held + acts.total
        moments += [
            ctx.moment("forward: loss", grads, total, fixed + loss_forward_temporary(ctx)),
            ctx.moment("backward: loss", grads, total, fixed + loss_backward_temporary(ctx)),
        ]
    weight_grad = ctx.prec.param if fsdp else (6 if ctx.prec.regime == "autocast" else 4)
    backward = held + acts.before_last_block + acts.in_backward
    moments += [
        ctx.moment(
            "backward: last block",
            grads,
            backward,
            fixed + block_backward_temporary(ctx, weight_grad, weight_grad_held=fsdp),
        ),
        ctx.moment("optimizer step", temporary=optimizer_temporary(ctx) + kept[1]),
    ]
    if kept[
        1
    ]:  # the schedule's step returns the last stage's outputs merged: their concatenation beside them
        end = 2 * kept[1] + (accumulated if fsdp else 0)
        moments.append(ctx.moment("step end: outputs merged", grads, temporary=end))
    return moments


@dataclass(frozen=True)
class StageRanks:
    """One pipeline rank's plan, for each of the dp shards zero splits its stage into."""

    shards: list[RankStates]  # per position in the shard group
    moments: dict[RankStates, tuple[Moment, ...]]
    activations: int  # at the peak: every micro-batch stage in flight


def pipeline_stage_plans(
    config: TrainConfig,
    shape: ModelShape,
    acts: Activations,
    prec: Precisions,
    device_kind: str,
    sharded_over: int,
    dp: int,
) -> tuple[Pipeline, list[StageRanks]]:
    """The pipeline and the plan of each pipeline rank (`config`: one TP rank's job)."""
    pipe = build_pipeline(config, acts, prec.residual, prec.compute)
    p, m, last_stage = config.parallel, config.grad_accum, config.parallel.stages - 1
    boundary = boundary_bytes(config, prec.residual)
    # The step's int64 inputs and targets on every rank, twice: the loaded micro-batches and their
    # concatenation, which the schedule splits again (trainer/rank/pipeline.py)
    batch = 2 * 16 * config.micro_batch * config.seq_len * m
    logits = logits_bytes(config, prec.compute) if p.stages > 1 else 0
    out = []
    for rank in range(p.pp):
        mine = rank_stages(p, rank)
        first, last = 0 in mine, last_stage in mine
        blocks = sum(len(pipe.blocks[s]) for s in mine)
        local = stage_model_shape(shape, blocks, first, last)
        peak = pipe.in_flight[rank]
        acts_peak = stage_activations(
            acts, pipe.blocks[peak.stage], peak.stage == 0, peak.stage == last_stage, boundary
        )
        stage = stage_config(config, blocks)
        shards = rank_states(local, config.zero.stage, sharded_over)
        moments = {}
        for states in dict.fromkeys(shards):
            held_out = pipe.buffers[rank] + batch
            ctx = StepContext(
                stage,
                local,
                states,
                acts_peak,
                prec,
                sharded_over,
                device_kind,
                other_bytes(config.model, config.data, states) + held_out,
            )
            keeps = accumulated(ctx, local, blocks, dp)
            outputs = (peak.kept, m * logits if last else 0)
            moments[states] = tuple(
                stage_moments(ctx, acts_peak, peak.held, peak.stage == last_stage, outputs, keeps)
            )
        out.append(StageRanks(shards, moments, peak.held + acts_peak.total))
    return pipe, out
