"""Pipeline parallelism in the plan (parallel.pp, parallel.pp_schedule, parallel.pp_virtual_stages).

The split is the ranks' own (trainer/model/pipeline_split.py `stage_blocks`): `parallel.stages` consecutive
runs of blocks (pp, times pp_virtual_stages when interleaved), the earlier stages taking the extra block;
the embedding is on the first stage, the final norm, the output head and the loss on the last. Rank i of
a pipeline holds stage i, and under interleaved_1f1b stages i, i + pp, i + 2·pp, ... (torch's
ScheduleInterleaved1F1B places them so).

Each rank's plan is its stage's (`StagePlan`), its states sharded by zero over the dp ranks as at pp=1:

- model states: its blocks, plus the embedding (first stage) or the final norm and output head (last);
- activations, one micro-batch's per stage: its blocks' saved tensors (trainer/plan/activations.py), the
  head's on the last stage, and on every other stage its output, which PipelineStage keeps in `fwd_cache`
  for the backward that the next stage's gradient starts, and past it while the schedule keeps the Work of
  the send that carried it (`Sends`);
- how many micro-batches' activations the schedule holds at each backward's start and forward's end
  (`walk_in_flight`; the worst of each: `worst_of`), read from the order in
  which torch runs a rank's work: GPipe every forward before any backward (all grad_accum micro-batches);
  Schedule1F1B min(m, pp - i) warm-up forwards on stage i, then one backward before each further forward
  (torch/distributed/pipelining/schedules.py `warmup_chunks`); ScheduleInterleaved1F1B its
  `_get_warmup_ops` forwards, then a forward before each backward (its own order, trainer/private_apis);
- the send/recv buffers PipelineStage allocates once, per micro-batch (stage.py `_setup_forward_recv_info`,
  `_create_grad_recv_info`): on every stage but the first one received activation each, on every stage but
  the last one received gradient each, B·T·D in the residual stream's dtype (the gradient of a received
  activation is dropped once read: _backward.py `stage_backward` sets `val.grad = None`);
- on the last stage, each micro-batch's logits (B·T·V, compute dtype), its output, which PipelineStage keeps
  in `fwd_cache` from its forward to the end of its backward (stage.py `forward_one_chunk`,
  `backward_one_chunk` pops it); the runtime steps with return_outputs=False, so they are not also kept in
  `output_chunks` to the step's end and merged (`save_forward_output`);
- the whole step's batch on every rank, twice: the micro-batches as loaded and their concatenation, which
  the schedule splits again (trainer/rank/pipeline.py).

Under parallel.cp the job is one cp rank's (trainer/plan/context_parallel.py `cp_local`: T / cp positions a stage),
its stages' replicas dp x cp; every rank loads whole rows and the first stage feeds its own positions besides, and
each micro-batch in flight keeps the rotary angles of those positions (`per_forward_kept`).

PipelineStage runs every backward but the last without gradient sync (DDP no_sync; FSDP2
set_requires_gradient_sync(False) and set_reshard_after_backward(False)), and reduces once after the last
(`perform_reduce_grad`): the stage accumulates a whole unsharded gradient, and under FSDP2 keeps its
parameters unsharded from its first backward to the end of the step. The worst stage sets the job's peak.

The bubble: the share of a step a stage waits, (pp - 1) / (m + pp - 1) for GPipe and 1F1B and
(pp - 1) / (v·m + pp - 1) interleaved (m = grad_accum micro-batches, v = pp_virtual_stages; Narayanan et
al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainer.config import LossKind, ParallelConfig, TrainConfig
from trainer.layout import Layout
from trainer.model.pipeline_split import stage_blocks
from trainer.plan.activations import Activations, sequence_shards
from trainer.plan.context_parallel import per_forward_kept
from trainer.plan.groups import INTRA_NODE, NETWORK
from trainer.plan.states import ModelShape
from trainer.private_apis.of_torch import interleaved_1f1b_order

GPIPE, ONE_F_ONE_B, INTERLEAVED = "gpipe", "1f1b", "interleaved_1f1b"


def rank_stages(parallel: ParallelConfig, rank: int) -> tuple[int, ...]:
    """The stages pipeline rank `rank` holds: its own, and under interleaved_1f1b every pp-th after it."""
    return tuple(range(rank, parallel.stages, parallel.pp))


def bubble(parallel: ParallelConfig, micro_batches: int) -> float:
    """The share of a step each stage waits (module docstring); 0 without a pipeline."""
    pp = parallel.pp
    rounds = (
        parallel.pp_virtual_stages * micro_batches if parallel.pp_schedule == INTERLEAVED else micro_batches
    )
    return (pp - 1) / (rounds + pp - 1)


def schedule_order(parallel: ParallelConfig, micro_batches: int, rank: int) -> list[tuple[int, bool]]:
    """(stage, forward?) for each forward and backward pipeline rank `rank` runs in one step, in order."""
    pp, m = parallel.pp, micro_batches
    if parallel.pp_schedule == GPIPE:
        return [(rank, True)] * m + [(rank, False)] * m
    if parallel.pp_schedule == ONE_F_ONE_B:  # Schedule1F1B._step_microbatches: warm-up, then 1B1F
        warmup = min(m, pp - rank)
        steady = [action for _ in range(m - warmup) for action in ((rank, False), (rank, True))]
        return [(rank, True)] * warmup + steady + [(rank, False)] * warmup
    return list(interleaved_order(pp, parallel.pp_virtual_stages, m, rank))


@functools.lru_cache(maxsize=1024)
def interleaved_order(
    pp: int, local_stages: int, micro_batches: int, rank: int
) -> tuple[tuple[int, bool], ...]:
    """torch's interleaved order (a pure function of four integers), computed once per point: an advisor's
    search asks for the same few thousands of times."""
    return tuple(interleaved_1f1b_order(pp, local_stages, micro_batches, rank))


@dataclass(frozen=True)
class InFlight:
    """A moment of a rank's step: at the start of backward `stage` (or at the end of its forward, `forward`),
    `held` bytes of other micro-batches' stages beside the one that runs, `count` micro-batch stages in all,
    `kept` bytes of the last stage's outputs in flight (PipelineStage keeps each micro-batch's logits in
    `fwd_cache` until its backward ends) and of what the walk keeps beside, after `done` backwards (from the
    first one's end, the stage's gradient is held)."""

    stage: int
    held: int
    count: int
    kept: int = 0
    done: int = 0
    unsharded: bool = False
    """Whether the stage whose backward begins is still unsharded from its previous backward (no forward of
    it between to reshard it): every block's parameters, its running one among them, are in `kept`."""
    forward: bool = False
    output_sent: bool = False
    """A backward whose stage output a send's Work keeps beyond it (`Sends`)."""
    gathered: bool = False
    """A forward whose stage was sharded when it began (stage3: not left unsharded by a backward), so that FSDP2
    all-gathered its blocks."""

    def total(self, per_stage: dict[int, int], growth: int) -> int:
        return self.held + per_stage[self.stage] + self.kept + (growth if self.done else 0)


@dataclass(frozen=True)
class Sends:
    """What a rank's point-to-point sends keep alive past the tensors' own use, per stage: the input gradient
    each backward sends back (`gradients`) and the output each forward sends on (`outputs`), B·T·D each.
    ScheduleGPipe and the runtime schedules (interleaved_1f1b) keep every send's Work, which holds its tensor,
    until the step's end (schedules.py `fwd_sends_to_wait`, `bwd_sends_to_wait`, `_PipelineScheduleRuntime`'s
    `send_ops`): `keeps_all`. Schedule1F1B keeps its last backward's send (its `bwd_sends` list) and the Work of
    its second-to-last warm-up forward's send (`send_work`, not reassigned until the cool-down), so that output
    outlives its backward until the second backward after the step's last forward."""

    gradients: dict[int, int] = field(default_factory=dict)
    outputs: dict[int, int] = field(default_factory=dict)
    keeps_all: bool = False


def walk_in_flight(
    order: list[tuple[int, bool]],
    per_stage: dict[int, int],
    kept: dict[int, int],
    sends: Sends = Sends(),
    regathered: dict[int, int] | None = None,
) -> Iterator[InFlight]:
    """Walk the order, one moment per forward's end and per backward's start: a forward adds its stage's
    activations (and `kept`, its output, held apart from them), a backward frees both once it ends, less what
    its sends keep (`sends`). `regathered`: stage3's parameters of each stage (beyond the root) that its
    backward leaves unsharded (set_reshard_after_backward(False)) until its next forward reshards them block
    by block."""
    alive: list[int] = []
    # Running sums of what `alive` and `unsharded` hold (integers: the same totals as summing them afresh at
    # every moment, which an advisor's search of a deep pipeline does millions of times)
    outputs = done = grads = sent = alive_bytes = unsharded_bytes = 0
    unsharded: set[int] = set()
    regathered = regathered or {}
    backwards: dict[int, int] = {}  # per stage, the backwards run so far (each stage's in micro-batch order)
    warmup = sum(1 for _ in itertools.takewhile(lambda action: action[1], order))  # the leading forwards
    pinned = -1 if sends.keeps_all else warmup - 2  # Schedule1F1B's `send_work` micro-batch
    forwards_left, after_last, pinned_bytes = sum(forward for _, forward in order), 0, 0
    for stage, forward in order:
        if forward:  # at its last block: every other stage's parameters as they were, its own resharded
            forwards_left -= 1
            gathered = stage not in unsharded
            if stage in unsharded:
                unsharded.discard(stage)
                unsharded_bytes -= regathered.get(stage, 0)
            yield InFlight(
                stage,
                alive_bytes,
                len(alive) + 1,
                outputs + grads + sent + unsharded_bytes,
                done,
                forward=True,
                gathered=gathered,
            )
            alive.append(stage)
            alive_bytes += per_stage[stage]
            outputs += kept.get(stage, 0)
            continue
        after_last += forwards_left == 0
        if after_last == 2:  # Schedule1F1B's cool-down replaces the send Work it kept
            sent, pinned_bytes = sent - pinned_bytes, 0
        held = alive_bytes - per_stage[stage]
        micro_batch = backwards[stage] = backwards.get(stage, -1) + 1
        output_sent = sends.keeps_all or micro_batch == pinned
        kept_now = outputs + grads + sent + unsharded_bytes
        yield InFlight(stage, held, len(alive), kept_now, done, stage in unsharded, output_sent=output_sent)
        if stage not in unsharded:
            unsharded.add(stage)
            unsharded_bytes += regathered.get(stage, 0)
        alive.remove(stage)
        alive_bytes -= per_stage[stage]
        outputs -= kept.get(stage, 0)
        done += 1
        gradient = sends.gradients.get(stage, 0)
        grads = grads + gradient if sends.keeps_all else gradient
        if output_sent:
            sent += sends.outputs.get(stage, 0)
            pinned_bytes = 0 if sends.keeps_all else sends.outputs.get(stage, 0)


def worst_of(
    moments: Iterable[InFlight],
    per_stage: dict[int, int],
    growth: int = 0,
    forward: bool = False,
    gathered: int = 0,
) -> InFlight:
    """The walk's (`walk_in_flight`) worst backward start, or with `forward` its worst forward end; from the
    first backward's end the stage holds `growth` (its gradient, accumulated from then on), and a forward that
    all-gathered its stage `gathered` more (stage3 over dp > 1: its last block's all-gather output,
    pipeline_walk.py `forward_gathered`)."""
    chosen = [m for m in moments if m.forward == forward]
    assert chosen, "a schedule runs a backward for every forward"
    return max(chosen, key=lambda m: m.total(per_stage, growth) + (gathered if m.gathered else 0))


def stage_model_shape(shape: ModelShape, blocks: int, first: bool, last: bool) -> ModelShape:
    """The parameters one pipeline stage holds: its blocks, the embedding on the first, the final norm
    and output head on the last (the root's registration order: tok_embeddings, norm, output)."""
    root = (shape.root[:1] if first else ()) + (shape.root[1:] if last else ())
    order = (shape.root[:1] if first else ()) + shape.block * blocks + (shape.root[1:] if last else ())
    model = dataclasses.replace(shape.config, n_layers=blocks)
    return dataclasses.replace(shape, config=model, root=root, order=order)


def rank_model_shapes(config: TrainConfig, shape: ModelShape) -> list[ModelShape]:
    """The parameters each pipeline rank holds, by pp coordinate: its stages' blocks, the embedding where it
    holds the first stage, the final norm and head where it holds the last (`shape` at pp = 1)."""
    p, last = config.parallel, config.parallel.stages - 1
    if p.pp == 1:
        return [shape]
    split = stage_blocks(config.model.n_layers, p.stages)
    shapes = []
    for rank in range(p.pp):
        mine = rank_stages(p, rank)
        blocks = sum(len(split[s]) for s in mine)
        shapes.append(stage_model_shape(shape, blocks, 0 in mine, last in mine))
    return shapes


def stage_config(config: TrainConfig, blocks: int) -> TrainConfig:
    """The job as one pipeline rank runs it: its blocks only (the config itself at pp = 1)."""
    local = copy.copy(config)  # not dataclasses.replace: the stage's model must not meet the job's checks
    local.model = dataclasses.replace(config.model, n_layers=blocks)
    return local


def stage_activations(
    acts: Activations,
    blocks: range,
    first: bool,
    last: bool,
    output: int,
    upcast: bool = False,
    cp_kept: int = 0,
) -> Activations:
    """One micro-batch's activations on a stage (module docstring): its blocks' share of the model's table,
    the head on the last stage, the kept output (`output` bytes) elsewhere; the batch is the stage's own.
    Beyond the first stage the first block's saved input is the receive buffer, counted with the buffers
    (`received`: `output` bytes less here, at every moment the first block's set is held), except where
    nothing saves it: a block whose RMSNorm saves an fp32 upcast instead (`upcast`, activations.py
    `norm_upcasts_input`) and that is not checkpointed (a checkpointed block's frame keeps its input;
    measured with MemTracker, zero=stage3 bf16: each micro-batch's receive buffer and the fp32 upcast both
    alive on the last stage). `cp_kept`: parallel.cp's per-forward tensors each micro-batch keeps
    (trainer/plan/context_parallel.py `per_forward_kept`), in place of the batch."""
    if last:
        head, log_softmax = acts.head, acts.log_softmax
    else:
        head, log_softmax = output, 0
    input_saved = not upcast or bool(acts.inputs_kept and acts.inputs_kept[blocks.start])
    return dataclasses.replace(
        acts,
        blocks=acts.blocks[blocks.start : blocks.stop],
        inputs_kept=acts.inputs_kept[blocks.start : blocks.stop] if acts.inputs_kept else (),
        head=head,
        log_softmax=log_softmax,
        batch=cp_kept,
        received=0 if first or not input_saved else output,
    )


@dataclass(frozen=True)
class Pipeline:
    """The job's pipeline: the split, each rank's stages and what they hold in flight, the bubble."""

    parallel: ParallelConfig
    micro_batches: int
    blocks: tuple[range, ...]  # per stage
    in_flight: tuple[InFlight, ...]  # per pipeline rank: its worst backward start
    forward_peaks: tuple[InFlight, ...]  # per pipeline rank: its worst forward end
    first_backwards: tuple[InFlight, ...]  # per pipeline rank: the start of its step's first backward
    activations: tuple[int, ...]  # one micro-batch's activation bytes, per stage
    buffers: tuple[int, ...]  # send/recv buffers per pipeline rank
    within_step: tuple[tuple[int, int], ...] = ()
    """Per pipeline rank, what PipelineStage's accumulation holds from its first backward to the step's end
    beyond the rank's states at rest: (unsharded parameters, unsharded gradient) bytes (pipeline_walk.py)."""
    backwards: tuple[tuple[InFlight, ...], ...] = ()
    """Per pipeline rank, every backward's start in its schedule's order: the walk plans each (pipeline_walk.py),
    as a later one's blocks can be held otherwise than at the worst one by activations (`in_flight`)."""

    @property
    def bubble(self) -> float:
        return bubble(self.parallel, self.micro_batches)

    def stage_range(self, rank: int) -> list[range]:
        return [self.blocks[s] for s in rank_stages(self.parallel, rank)]

    def to_json(self, peaks: dict[int, int], worst: int, members: dict[int, list[int]]) -> dict[str, Any]:
        """plan.json's `pipeline` section (docs/design.md); `peaks`: each pipeline rank's peak bytes;
        `members`: the global ranks at each pipeline coordinate (every dp and tp rank of the stage)."""
        p = self.parallel
        return {
            "pp": p.pp,
            "schedule": p.pp_schedule,
            "virtual_stages": p.pp_virtual_stages if p.pp_schedule == INTERLEAVED else 1,
            "micro_batches": self.micro_batches,
            "bubble": self.bubble,
            "worst_stage": worst,
            "stages": [
                {
                    "rank": r,
                    "global_ranks": members[r],
                    "stages": list(rank_stages(p, r)),
                    "blocks": [[b.start, b.stop] for b in self.stage_range(r)],
                    "embedding": r == 0,
                    "head": r == p.pp - 1,
                    "in_flight_micro_batches": self.in_flight[r].count,
                    "activations_per_micro_batch_bytes": sum(self.activations[s] for s in rank_stages(p, r)),
                    "buffers_bytes": self.buffers[r],
                    **self.within_step_json(r),
                    "peak_bytes": peaks[r],
                }
                for r in range(p.pp)
            ],
        }

    def within_step_json(self, rank: int) -> dict[str, int]:
        if not self.within_step:
            return {}
        params, grads = self.within_step[rank]
        return {"within_step_unsharded_params_bytes": params, "within_step_unsharded_grads_bytes": grads}


def boundary_bytes(config: TrainConfig, residual_bytes: int) -> int:
    """One micro-batch's tensor across a stage boundary: B·T·D in the residual stream's dtype (an
    activation forward, its gradient back); under sequence parallelism each TP rank's T / tp positions,
    which it sends to the same TP rank of the next stage (trainer/rank/tensor_parallel.py)."""
    tokens = config.micro_batch * config.seq_len // sequence_shards(config)
    return tokens * config.model.dim * residual_bytes


def logits_bytes(config: TrainConfig, compute_bytes: int) -> int:
    """One micro-batch's logits, the last stage's output: B·T·V in the compute dtype; under loss=chunked its
    output is the loss, a scalar (two with the z-loss) whose bytes the walk leaves out."""
    if config.loss.kind == LossKind.chunked:
        return 0
    return config.micro_batch * config.seq_len * config.model.vocab_size * compute_bytes


def build_pipeline(
    config: TrainConfig,
    acts: Activations,
    residual_bytes: int,
    compute_bytes: int,
    growth: tuple[int, ...] = (),
    regathered: dict[int, int] | None = None,
    upcast: bool = False,
    gathered: int = 0,
) -> Pipeline:
    """The split, what each pipeline rank holds in flight, its buffers and what it sends per step (`upcast`:
    stage_activations'; `gathered`: what a forward that all-gathers its stage keeps beside, `worst_of`'s)."""
    p, m = config.parallel, config.grad_accum
    blocks = tuple(stage_blocks(config.model.n_layers, p.stages))
    boundary = boundary_bytes(config, residual_bytes)
    logits = logits_bytes(config, compute_bytes)
    last_stage = p.stages - 1
    kept = per_forward_kept(config)
    per_stage = {
        s: stage_activations(acts, blocks[s], s == 0, s == last_stage, boundary, upcast, kept).total
        for s in range(p.stages)
    }
    in_flight, forward_peaks, first_backwards, buffers, backwards = [], [], [], [], []
    for rank in range(p.pp):
        mine = rank_stages(p, rank)
        order = schedule_order(p, m, rank)
        sends = Sends(
            gradients={s: boundary for s in range(1, p.stages)},
            outputs={s: boundary for s in range(last_stage)},
            keeps_all=p.pp_schedule != ONE_F_ONE_B,
        )
        moments = list(walk_in_flight(order, per_stage, {last_stage: logits}, sends, regathered))
        rank_growth = growth[rank] if growth else 0
        in_flight.append(worst_of(moments, per_stage, rank_growth))
        forward_peaks.append(worst_of(moments, per_stage, rank_growth, forward=True, gathered=gathered))
        first_backwards.append(next(moment for moment in moments if not moment.forward))
        backwards.append(tuple(moment for moment in moments if not moment.forward))
        receives = sum(s > 0 for s in mine) + sum(s < last_stage for s in mine)
        buffers.append(receives * m * boundary)  # one per micro-batch, allocated once (module docstring)
    activations = tuple(per_stage[s] for s in range(p.stages))
    return Pipeline(
        p,
        m,
        blocks,
        tuple(in_flight),
        tuple(forward_peaks),
        tuple(first_backwards),
        activations,
        tuple(buffers),
        backwards=tuple(backwards),
    )


@dataclass(frozen=True)
class P2PPlan:
    """What crosses the stage boundaries per optimizer step: each micro-batch's activation forward and its
    gradient back, B·T·D each (`boundary`), by send (torch's batch_isend_irecv, one P2POp per tensor)."""

    boundary: int  # bytes of one tensor across one boundary
    sent: tuple[int, ...]  # bytes each pipeline rank sends per step
    sends: tuple[int, ...]  # its sends per step
    links: tuple[str, ...]  # per boundary, stage s to s + 1: intra-node or network

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes_per_micro_batch_per_boundary": self.boundary,
            "sent_bytes_per_step": list(self.sent),
            "sends_per_step": list(self.sends),
            "boundary_links": list(self.links),
        }

    @property
    def network(self) -> bool:
        return NETWORK in self.links


def plan_p2p(config: TrainConfig, world_size: int, residual_bytes: int) -> P2PPlan:
    """Bytes and sends per pipeline rank per step, and the link each boundary crosses: stage s of the first
    replica is the rank at pp coordinate s mod pp (trainer/layout.py: pp outermost, s·dp·tp)."""
    p, m = config.parallel, config.grad_accum
    boundary = boundary_bytes(config, residual_bytes)
    last = p.stages - 1
    sends = [m * sum((s < last) + (s > 0) for s in rank_stages(p, r)) for r in range(p.pp)]
    layout = Layout.from_config(config, world_size)

    def node(stage: int) -> int:
        return layout.node(layout.rank_at(pp=stage % p.pp))

    links = tuple(INTRA_NODE if node(s) == node(s + 1) else NETWORK for s in range(last))
    return P2PPlan(boundary, tuple(n * boundary for n in sends), tuple(sends), links)
