"""Pipeline parallelism (parallel.pp) on torch.distributed.pipelining, composed with ZeRO over dp as
torchtitan composes it (pytorch/torchtitan torchtitan/distributed/pipeline_parallel.py):

- the mesh: the job's one mesh (trainer/rank/mesh.py), pp its outermost dim (trainer/layout.py), so a
  pipeline's stages are ranks dp * tp apart and every stage of one replica holds the same data-parallel
  coordinates;
- each rank builds its stages' modules only (trainer/model/pipeline_split.py: `stage_blocks` decides the
  split), as a manual `PipelineStage`; under interleaved_1f1b it holds stages pp_index, pp_index + pp, ...
  (torchtitan's "loop" style);
- each stage module goes through the same `parallelize` as a whole model (trainer/rank/parallelize.py), as
  torchtitan's `pipeline_llm` runs its `parallelize_fn` on every part: ZeRO over dp is DDP (with its
  buckets and hook, over the stage's replicas) or FSDP2 per stage module; at stage1 the rank's optimizer is a
  ZeroRedundancyOptimizer over the same replicas (trainer/rank/loop.py `replica_group`). PipelineStage itself skips the dp reduction for every
  backward but the step's last, then reduces once (`backward_maybe_with_nosync`, `perform_reduce_grad`);
- the schedules ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B stream the step's grad_accum
  micro-batches; the loss is the schedule's loss_fn on the last stage, and gradients are divided by the
  micro-batches' count (scale_grads), as the loop divides each micro-batch's loss by grad_accum;
- under parallel.cp (torchtitan's composition: every stage's forward runs on its cp rank's share of the
  micro-batch) each stage is a cp rank's, with its group's exchanges in its blocks' attention (trainer/model/
  pipeline_split.py), the first stage fed its positions of the tokens and the loss_fn the whole rows' targets,
  of which it takes its own, its loss its share of the group's mean (`cp_feed`, `PipelineLoss.cp_terms`);
- one loss scale for the whole pipeline: under fp16 the scaler is ShardedGradScaler over every rank, so the
  overflow flag is all-reduced over pp (and dp) before any rank steps; the gradient norm is the whole model's
  (each stage's squared norm summed over the pp group).

What it measures (StageClock): the time each rank's stages spend in their own forward and backward, against
the wall time of the schedule's step: the rest is waiting (the bubble, sends and receives, and the dp
reduction after the last backward), `time/pp/stage{i}/idle_share`; and the bytes of the tensors each stage
hands to torch.distributed to send (activations forward, input gradients backward),
`comm/pp/measured_bytes_per_step`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.amp import GradScaler
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.nn.parallel import DistributedDataParallel

from trainer.config import LossKind, ParallelConfig, TrainConfig
from trainer.data import to_device
from trainer.model.context_parallel import ContextParallel
from trainer.model.decoder import find_transformer, recording
from trainer.model.loss import IGNORE_INDEX, LossTerms
from trainer.model.moe import RouterLog, moe_layers
from trainer.model.pipeline_split import StageBlocks, build_stage, split_line
from trainer.private_apis.of_torch import scale_on_device
from trainer.rank.precision import build_autocast
from trainer.rank.tensor_parallel import local_loss, loss_context
from trainer.telemetry.memory import next_stage_forward
from trainer.world import World

PP = "pp"
"""The pipeline's mesh dim; DeviceMesh describes its process group as `mesh_pp`."""
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
"""parallel.pp_schedule -> torch's single-stage schedule (interleaved_1f1b: ScheduleInterleaved1F1B)."""


def rank_stages(pp_index: int, parallel: ParallelConfig) -> list[int]:
    """The stages a rank holds: its own, or under interleaved_1f1b one in every pp (its 'loop')."""
    return list(range(pp_index, parallel.stages, parallel.pp))


class StageClock:
    """One rank's pipeline figures over a log window: its stages' compute time, the schedule's wall time,
    the bytes its stages sent. CUDA: events on the compute stream (read after the log step's sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.compute_s = self.step_s = 0.0
        self.sent_bytes = 0
        self.events: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def timing(self, what: str) -> Iterator[None]:
        """Add the time of the block to `compute` or `step`."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((what, start, end))
            return
        began = time.perf_counter()
        yield
        self.add(what, time.perf_counter() - began)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What runs inside is not this window's (the held-out pass, eval.every): its forwards' time and
        sends are dropped, so the step's idle share and bytes stay the training step's."""
        compute_s, step_s, sent, events = self.compute_s, self.step_s, self.sent_bytes, len(self.events)
        try:
            yield
        finally:
            self.compute_s, self.step_s, self.sent_bytes = compute_s, step_s, sent
            del self.events[events:]

    def add(self, what: str, seconds: float) -> None:
        if what == "compute":
            self.compute_s += seconds
        else:
            self.step_s += seconds

    def read(self, steps: int) -> list[float]:
        """[idle share of the schedule's wall time, bytes sent per step]; the window starts again."""
        for what, start, end in self.events:
            self.add(what, start.elapsed_time(end) / 1000.0)
        idle = 1.0 - self.compute_s / self.step_s if self.step_s > 0 else float("nan")
        row = [idle, self.sent_bytes / steps]
        self.compute_s = self.step_s = 0.0
        self.sent_bytes, self.events = 0, []
        return row


class MeasuredStage(PipelineStage):
    """torch's PipelineStage, timing its own forward and backward and counting what it sends: the tensors
    of the send ops it hands the schedule (which passes them to dist.batch_isend_irecv unchanged)."""

    def __init__(
        self, *args: Any, clock: StageClock, router_log: RouterLog | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.router_log = router_log  # a mixture of experts: the rank's one log (`shared_router_log`)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        next_stage_forward(self.submod)  # the tensor-level memory tracker, on its steps
        # A mixture of experts' routing is recorded in a micro-batch's forward only: not in the forward torch
        # runs on placeholder inputs to infer the stages' shapes in the first step (with gradients on), nor in
        # a checkpointed block's recompute.
        with self.clock.timing("compute"), recording(self.router_log):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.timing("compute"):
            return super().backward_one_chunk(*args, **kwargs)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self.counted(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self.counted(super().get_bwd_send_ops(bwd_chunk_id))

    def counted(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        self.clock.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops

    def receive_buffers(self) -> list[torch.Tensor]:
        """The buffers PipelineStage receives activations and gradients into, one per micro-batch and input,
        allocated in its first step and kept (stage.py `args_recv_info`, `grad_recv_info`)."""
        infos = [*self.args_recv_info.values(), *self.grad_recv_info.values()]
        buffers = (getattr(info, "buffer", None) for group in infos for info in group)
        return [buffer for buffer in buffers if isinstance(buffer, torch.Tensor)]


@dataclass
class PipelineLoss:
    """The schedule's loss_fn: the micro-batch's mean loss (its z-loss added under loss.z_loss), scaled under
    fp16 (GradScaler.scale); it keeps each micro-batch's z-loss, which the schedule's `losses` hold only inside
    the objective, to be logged apart (loss/z_loss) as the loop does without a pipeline."""

    loss: Callable[[torch.Tensor, torch.Tensor, float], LossTerms]
    scaler: GradScaler
    z_weight: float = 0.0
    kept: list[LossTerms] = field(default_factory=list)
    """loss.z_loss > 0: each micro-batch's terms since the last `unscaled`."""
    fault: Callable[[torch.Tensor], torch.Tensor] | None = None
    """This step's fault injection into the loss (fault.kind in LOSS_FAULTS, the loop's inject_fault), or None."""
    context: ContextParallel | None = None
    """parallel.cp > 1: the last stage's cp group. The schedule then hands the loss_fn whole rows of targets,
    of which the stage's output holds this rank's positions (`cp_feed`)."""

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        terms = self.cp_terms(logits, targets)
        if terms.z_loss is not None:
            self.kept.append(LossTerms(*(local_loss(term).detach().float() for term in terms)))
        objective = terms.cross_entropy if terms.z_loss is None else terms.cross_entropy + terms.z_loss
        return self.scaler.scale(objective if self.fault is None else self.fault(objective))

    def cp_terms(self, logits: torch.Tensor, targets: torch.Tensor) -> LossTerms:
        """The micro-batch's terms; under parallel.cp this rank's part of its group's mean, as the loop's
        compute_loss takes it without a pipeline (ContextParallel.loss_factor needs the whole rows' targets)."""
        if self.context is None:
            return self.loss(logits, targets, self.z_weight)
        mine = self.context.local(targets)
        terms = self.loss(logits, mine, self.z_weight)
        return terms.scaled(self.context.loss_factor(mine, targets, IGNORE_INDEX))

    def unscaled(self, losses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's summed cross-entropy and z-loss (None when off), of the micro-batches in the schedule's
        `losses`. torch also calls the loss_fn while it infers the stages' shapes on the first step, on
        uninitialized tensors: without the z-loss the schedule's losses are read (scaled back: the scale is a
        power of two, exact), with it the terms of the loss_fn's last len(losses) calls, the real ones."""
        if self.kept:
            real, self.kept = self.kept[len(self.kept) - len(losses) :], []
            ce_sum, z_sum = (torch.stack(column).sum() for column in zip(*real))
            return ce_sum, z_sum
        total = torch.stack([local_loss(loss).detach().float() for loss in losses]).sum()
        if self.scaler.is_enabled():
            total = total / scale_on_device(self.scaler)
        return total, None


@dataclass
class Pipeline:
    """One rank's part of the pipeline: its schedule, what it measures, and where it stands."""

    schedule: Any
    clock: StageClock
    loss: PipelineLoss
    group: dist.ProcessGroup
    """The pp group: this replica's stages."""
    first: bool
    """Holds stage 0: feeds the tokens."""
    last: bool
    """Holds the last stage: takes the loss."""
    stages: list[MeasuredStage] = field(default_factory=list)
    """This rank's stages (their receive buffers are what the memory probe registers beside the model's)."""
    context: ContextParallel | None = None
    """parallel.cp > 1: this rank's cp group, the same on each of its stages (trainer/rank/parallelize.py)."""
    router_log: RouterLog | None = None
    """model.n_experts > 0: one RouterLog for every stage of this rank (`shared_router_log`)."""

    def receive_buffers(self) -> list[torch.Tensor]:
        """Every receive buffer of this rank's stages (empty before the first step allocates them)."""
        return [buffer for stage in self.stages for buffer in stage.receive_buffers()]


def build_stage_parts(config: TrainConfig, pp_index: int) -> list[nn.Module]:
    """This rank's stage modules on the meta device, each the decoder less what other stages hold; the
    caller parallelizes each as it would the whole model (trainer/rank/parallelize.py)."""
    parts = [
        build_stage(config.model, stage, config.parallel.stages)
        for stage in rank_stages(pp_index, config.parallel)
    ]
    p = config.parallel
    for part in parts:  # under SP a stage receives its TP rank's sequence shard (StageModel.forward)
        part.sequence_shards = p.tp if p.tp > 1 and p.sequence_parallel else 1
    return parts


def rank_model(parts: list[nn.Module]) -> nn.Module:
    """One module over this rank's stages, for the optimizer, the saves and telemetry: the stage itself,
    or (interleaved) a module holding every stage's embedding, blocks, norm and head under the decoder's
    own names."""
    if len(parts) == 1:
        return parts[0]
    held = nn.Module()
    held.layers = StageBlocks()
    # The stage modules themselves, not registered (their children are, under the decoder's names): what they
    # keep outside parameters and buffers, their rotary tables (trainer/model/decoder.py `rope_cache`)
    held.stage_modules = tuple(parts)
    for part in parts:
        stage = part.module if isinstance(part, DistributedDataParallel) else part
        for name, child in stage.named_children():
            if name == "layers":
                held.layers.update(child.named_children())
            elif child is not None:
                held.add_module(name, child)
    return held


def build_pipeline(
    config: TrainConfig,
    world: World,
    parts: list[nn.Module],
    mesh: DeviceMesh,
    loss: PipelineLoss,
) -> Pipeline:
    """Each stage a MeasuredStage on the pp group; the schedule over the step's grad_accum micro-batches."""
    parallel, clock = config.parallel, StageClock(world.device)
    indices = rank_stages(mesh[PP].get_local_rank(), parallel)
    group = mesh[PP].get_group()
    router_log = shared_router_log(parts)
    stages = [
        MeasuredStage(
            part, index, parallel.stages, world.device, group=group, clock=clock, router_log=router_log
        )
        for part, index in zip(parts, indices)
    ]
    if parallel.pp_schedule == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=config.grad_accum, loss_fn=loss)
    else:
        schedule = SCHEDULES[parallel.pp_schedule](stages[0], n_microbatches=config.grad_accum, loss_fn=loss)
    if world.is_main:
        print(split_line(config.model.n_layers, parallel.stages, parallel.pp), flush=True)
    context = find_transformer(parts[0]).context  # parallel.cp > 1, else None
    loss.context = context
    return Pipeline(
        schedule,
        clock,
        loss,
        group,
        first=0 in indices,
        last=parallel.stages - 1 in indices,
        stages=stages,
        context=context,
        router_log=router_log,
    )


def shared_router_log(parts: list[nn.Module]) -> RouterLog | None:
    """A mixture of experts: the first stage's RouterLog, given to every stage of this rank (interleaved
    schedules hold several), so that the loop reads the rank's layers in one; None for a dense model."""
    log = find_transformer(parts[0]).router_log
    for part in parts[1:]:
        stage = find_transformer(part)
        stage.router_log = log
        for layer in moe_layers(stage):
            layer.log = log
    return log


def schedule_batch(micro: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """The micro-batches' inputs and targets (and, data.packing=document, document ids) as one batch each: the
    schedule splits a batch along dim 0 into grad_accum equal chunks, the micro-batches again."""
    return tuple(torch.cat([batch[i] for batch in micro]) for i in range(len(micro[0])))


def stage_kwargs(
    batch: tuple[torch.Tensor, ...], pipeline: Pipeline, config: TrainConfig
) -> dict[str, torch.Tensor]:
    """What this rank's stages take besides their input (StageModel.forward), which the schedule splits into
    micro-batches as it does the inputs: data.packing=document's ids, for every stage (whole rows under
    parallel.cp: the mask is the rows'); loss=chunked's targets, for the last, whose output is then the loss
    (this cp rank's positions of them)."""
    kwargs = {"documents_BT": batch[2]} if len(batch) > 2 else {}
    if pipeline.last and config.loss.kind == LossKind.chunked:
        kwargs["targets_BT"] = batch[1] if pipeline.context is None else pipeline.context.local(batch[1])
    return kwargs


def cp_feed(batch: tuple[torch.Tensor, ...], pipeline: Pipeline) -> tuple[torch.Tensor, ...]:
    """The schedule's positional input: the first stage's tokens, under parallel.cp this rank's positions of
    each row (the ranks of a cp group read the same rows: trainer/layout.py); nothing on the other stages.
    The target stays whole: the loss_fn takes its positions and needs the rows' counted targets
    (PipelineLoss.cp_terms)."""
    if not pipeline.first:
        return ()
    return (batch[0] if pipeline.context is None else pipeline.context.local(batch[0]),)


def chunked_terms(loss: torch.Tensor, targets: torch.Tensor, z_weight: float) -> LossTerms:
    """loss=chunked's loss_fn: the last stage's output is the loss already (StageModel.forward given targets)."""
    return LossTerms.of_chunked(loss, z_weight)


def pipeline_forward_backward(
    pipeline: Pipeline, batches: Iterator[tuple[torch.Tensor, ...]], config: TrainConfig, world: World
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """The step's grad_accum micro-batches through the schedule: the summed loss and z-loss (every rank's,
    over the pp group; None without loss.z_loss) and the host time spent waiting for data."""
    start = time.perf_counter()
    micro = [[to_device(t, world.device) for t in next(batches)] for _ in range(config.grad_accum)]
    data_s = time.perf_counter() - start
    batch = schedule_batch(micro)
    targets, losses = batch[1], []
    if pipeline.router_log is not None:  # the router losses' gradient through their layers' outputs (moe.py)
        scaler = pipeline.loss.scaler
        unscaled = not scaler.is_enabled()  # bf16, fp32: the objective's own gradient, 1
        pipeline.router_log.backward_scale = (
            torch.ones((), device=world.device) if unscaled else scale_on_device(scaler)
        )
    # return_outputs=False: the last stage does not keep each micro-batch's logits in `output_chunks` to the
    # step's end and merge them (stage.py forward_one_chunk(save_forward_output=...)); the loop reads only the
    # losses. Each micro-batch's logits then live in `fwd_cache` until its backward.
    # Under TP the last stage's logits are vocabulary-sharded: loss_parallel around the whole schedule, whose
    # loss_fn and backwards both run inside it (torchtitan wraps its pp_schedule.step in its train_context so).
    with (
        build_autocast(config.precision, config.zero, world.device),
        loss_context(config.parallel.tp),
        pipeline.clock.timing("step"),
    ):
        pipeline.schedule.step(
            *cp_feed(batch, pipeline),
            target=targets if pipeline.last else None,
            losses=losses,
            return_outputs=False,
            **stage_kwargs(batch, pipeline, config),
        )
    zeros = [torch.zeros((), device=world.device) for _ in range(2)]  # two tensors: each is all-reduced
    loss_sum, z_sum = pipeline.loss.unscaled(losses) if pipeline.last else zeros
    dist.all_reduce(loss_sum, group=pipeline.group)  # the last stage's figures, on every stage
    if config.loss.z_loss > 0:
        dist.all_reduce(z_sum, group=pipeline.group)
    return loss_sum, (z_sum if config.loss.z_loss > 0 else None), data_s


def pipeline_evaluate(
    pipeline: Pipeline, batches: list[tuple[torch.Tensor, ...]], config: TrainConfig, world: World
) -> torch.Tensor:
    """The summed loss of this rank's held-out micro-batches through the schedule's forward only (torch's
    `eval()`: the step's order without backwards), grad_accum micro-batches a call as training streams them;
    the last stage's sum, on every stage of the pipeline (trainer/rank/evaluate.py divides)."""
    total = torch.zeros((), dtype=torch.float64, device=world.device)
    m = config.grad_accum
    with (
        torch.no_grad(),
        pipeline.clock.paused(),
        build_autocast(config.precision, config.zero, world.device),
        loss_context(config.parallel.tp),
    ):
        for start in range(0, len(batches), m):
            batch = schedule_batch(
                [[to_device(t, world.device) for t in batch] for batch in batches[start : start + m]]
            )
            losses: list[torch.Tensor] = []
            pipeline.schedule.eval(
                *cp_feed(batch, pipeline),
                target=batch[1] if pipeline.last else None,
                losses=losses,
                **stage_kwargs(batch, pipeline, config),
            )
            if pipeline.last:
                total += pipeline.loss.unscaled(losses)[0].double()  # the cross-entropy: loss/val's
    dist.all_reduce(total, group=pipeline.group)
    return total
