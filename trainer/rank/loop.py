"""The training loop of one rank, top to bottom."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.amp import GradScaler
from torch.distributed.device_mesh import DeviceMesh

from trainer.config import LOSS_FAULTS, FaultConfig, FaultKind, LossKind, TrainConfig, uses_fused
from trainer.data import build_batches, to_device, validation_batches
from trainer.faults.failures import mark_phase
from trainer.faults.stop import RankStop
from trainer.layout import Layout
from trainer.model.decoder import build_model, find_transformer, flops_per_token
from trainer.model.loss import IGNORE_INDEX, LossTerms, full_loss
from trainer.model.moe import RoutingWatch, moe_layers, update_expert_bias
from trainer.private_apis.of_torch import found_inf_per_device, scale_on_device
from trainer.rank.evaluate import evaluate, evaluates_now
from trainer.rank.mesh import build_mesh, data_parallel_mesh, secondary_mesh
from trainer.rank.nonfinite import NonFiniteError, NonFiniteGuard, agree, stop_request
from trainer.rank.optim import (
    build_optimizer,
    build_scheduler,
    clip_gradients,
    rewind_scheduler,
    step_unless,
)
from trainer.rank.parallelize import parallelize
from trainer.rank.pipeline import (
    PipelineLoss,
    build_pipeline,
    build_stage_parts,
    chunked_terms,
    pipeline_forward_backward,
    rank_model,
)
from trainer.rank.precision import (
    build_autocast,
    build_grad_scaler,
    precompute_fp8_scales,
    update_loss_scale,
)
from trainer.rank.sharding import gradient_sync, parameter_resharding, reduces_now, reshards_now
from trainer.rank.spikes import SpikeGuard, roll_back, skip_batches, untrained_steps
from trainer.rank.tensor_parallel import local_loss, loss_context
from trainer.rank.trainee import Trainee, local_optimizer
from trainer.saves.background import Saves
from trainer.saves.dcp import Progress, SaveSpec, first_attempt, save_last_good, should_save
from trainer.saves.resume import resume_training
from trainer.telemetry import keys
from trainer.telemetry.layer_norms import LayerNorms
from trainer.telemetry.memory import next_micro_batch
from trainer.telemetry.metrics import Meter, StepRouting, StepStats
from trainer.telemetry.snapshot import Snapshots
from trainer.telemetry.traces import Traces
from trainer.world import World

Batches = Iterator[tuple[torch.Tensor, ...]]
"""(inputs_BT, targets_BT), and documents_BT under data.packing=document (trainer/data.py)."""
LEAK_ENV = "ZEROLAB_TEST_LEAK_MIB"
"""Tests only (tests/integration/test_memory_creep.py): a rank keeps one tensor of this many MiB per
step, a deliberate leak for the creep report (trainer/telemetry/creep.py) to find. Unset in real runs."""
LOSS_SPIKE_FACTOR = 100.0
"""fault.kind=loss_spike: the chosen rank's loss at the chosen step is multiplied by this (its gradients
too), ten times stability.spike.factor's default."""


def build_trainee(config: TrainConfig, world: World, layout: Layout | None = None) -> Trainee:
    """The model this rank trains (trainer/rank/parallelize.py, on the job's one mesh), its optimizer,
    LR schedule and loss scaler; under parallel.pp > 1 each of its stages, and their schedule. `layout`:
    the job's (trainer/layout.py), made from `config` when not given."""
    layout = layout or Layout.from_config(config, world.world_size)
    mesh = build_mesh(layout, world.device.type, config.zero)
    if layout.enabled("pp"):
        return build_pipeline_trainee(config, world, layout, mesh)
    model = parallelize(
        build_model(config.model, device="meta"), config=config, layout=layout, mesh=mesh, world=world
    )
    optimizer, scheduler = build_optimization(model, config, world, replica_group(mesh, layout, config))
    scaler = build_grad_scaler(config.precision, config.zero, world.device)  # disabled unless fp16
    router_log = find_transformer(model).router_log  # model.n_experts > 0, else None
    return Trainee(model, optimizer, scheduler, scaler, router_log=router_log)


def build_optimization(
    model: torch.nn.Module, config: TrainConfig, world: World, group: dist.ProcessGroup | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over what this rank holds (fused where the device allows) and its LR schedule; `group`: the
    replicas of its parameters (`replica_group`)."""
    fused = uses_fused(config.optim, world.device.type, config.offload.target)
    optimizer = build_optimizer(model, config.optim, config.zero, fused, config.offload, world.rank, group)
    return optimizer, build_scheduler(optimizer, config.optim, config.steps)


def replica_group(mesh: DeviceMesh, layout: Layout, config: TrainConfig) -> dist.ProcessGroup | None:
    """zero=stage0/1: DDP's group (trainer/rank/mesh.py data_parallel_mesh), the ranks holding the same
    parameters, over which ZeroRedundancyOptimizer partitions and local SGD averages: the world without a
    pipeline (DeviceMesh reuses the default group), one stage's replicas under parallel.pp. None under FSDP2,
    whose optimizer needs no group."""
    return None if config.zero.uses_fsdp else data_parallel_mesh(mesh, layout, config.zero).get_group()


def build_pipeline_trainee(config: TrainConfig, world: World, layout: Layout, mesh: DeviceMesh) -> Trainee:
    """parallel.pp > 1: this rank's stages, each parallelized as a whole model is (trainer/rank/pipeline.py),
    one optimizer over them."""
    secondary = secondary_mesh(layout, world.device.type)  # hpZ: made once, by every rank
    parts = [
        parallelize(part, config=config, layout=layout, mesh=mesh, world=world, secondary=secondary)
        for part in build_stage_parts(config, layout.coords(world.rank)["pp"])
    ]
    model = rank_model(parts)
    optimizer, scheduler = build_optimization(model, config, world, replica_group(mesh, layout, config))
    scaler = build_grad_scaler(config.precision, config.zero, world.device, pipelined=True)
    # The scaler makes its scale on its first scale(); only the last stage scales a loss, yet every stage
    # unscales its gradients (public API: scaling a zero makes the scale, at the configured initial value).
    scaler.scale(torch.zeros((), device=world.device))
    terms = chunked_terms if config.loss.kind == LossKind.chunked else full_loss
    loss = PipelineLoss(terms, scaler, config.loss.z_loss)
    pipeline = build_pipeline(config, world, parts, mesh, loss)
    return Trainee(model, optimizer, scheduler, scaler, pipeline, router_log=pipeline.router_log)


def train(
    config: TrainConfig, world: World, out_dir: Path, stop: RankStop, predicted: dict[str, float]
) -> dict[str, Any] | None:
    """Train up to config.steps optimizer steps, from a save when resuming; rank 0 returns the run's figures
    (or, when the ranks agreed to stop on a signal, how they stopped: trainer/faults/stop.py).

    `predicted` holds the job's plan figures (trainer/job.py rank_predictions), written beside
    what the ranks measure.
    """
    torch.manual_seed(config.seed)
    # memory.snapshot: recording starts before the model exists, so its allocations are in the history.
    snapshots = Snapshots(config.memory, world.device, out_dir, world.rank)
    layout = Layout.from_config(config, world.world_size)
    trainee = build_trainee(config, world, layout)
    spec = SaveSpec.of(config)
    start = resume_training(
        trainee, spec, config.resume, world, out_dir
    )  # step 0 unless resuming or restarted
    batches = build_batches(config, layout.dp_index(world.rank), layout.dp, start_step=start.step)
    watch_routing(trainee, config, world, predicted)
    meter = Meter(config, world, out_dir, flops_per_token(config.model, config.seq_len), predicted)
    traces = Traces(config.telemetry, world.device, out_dir, world.rank)  # telemetry.trace_steps
    meter.pipeline = None if trainee.pipeline is None else trainee.pipeline.clock  # parallel.pp > 1
    if trainee.pipeline is not None and meter.memory is not None:
        meter.memory.held = trainee.pipeline.receive_buffers
    meter.skipped_steps = start.overflow_skipped  # the fp16 skip count goes on across a resume
    # A TP group's ranks read their data-parallel replica's held-out batches, as they read its training ones.
    held_out = validation_batches(config, layout.dp_index(world.rank), layout.dp) if config.eval.every else []
    spikes = SpikeGuard.of(config, world, out_dir, start.step)  # None unless stability.spike is on
    untrained = untrained_steps(config, out_dir, start.step)  # stability.skip_steps, and rollbacks' windows
    trained = start.step > 0  # the optimizer has state (a save before any step would make it)
    # A fused AdamW skips a non-finite step on the device: the host reads the agreement later.
    guard = NonFiniteGuard(
        config.nonfinite,
        config.max_nonfinite_skips,
        world,
        fp16=config.precision.is_fp16,
        skipped=start.nonfinite_skipped,
        defer=uses_fused(config.optim, world.device.type, config.offload.target) and spikes is None,
        spikes=spikes,
    )
    saves = Saves(spec, world, out_dir, trainee)  # in place or in the background (save.async_mode)
    leak_mib, leaked = int(os.environ.get(LEAK_ENV, "0")), []
    for step in range(start.step + 1, config.steps + 1):
        saves.poll()  # a background write that has completed becomes a save (rank 0 lists it)
        if leak_mib:
            leaked.append(torch.ones(leak_mib * 2**20, dtype=torch.uint8, device=world.device))
        if step in untrained:  # its batches read past: no forward, no optimizer step, no LR step
            skip_batches(batches, config.grad_accum)
            if should_save(config.save, config.steps, step) and trained:  # the state of the step before
                saves.save(trainee, progress(step, guard, meter))  # (before any step: no optimizer state yet)
            continue
        try:
            with (
                traces.record(step),  # outermost: a step the comm probe profiles too gets one profiler
                meter.measure(step, trainee.model, trainee.optimizer),  # tensor-level memory, on chosen steps
            ):
                norms = meter.layer_norms if meter.should_log(step) else None  # telemetry.layer_norms
                stats = train_step(trainee, batches, config, world, step, guard, stop, norms)
            trained = True
            if spikes is not None and spikes.rollback_at == step:  # every rank: they agreed
                roll_back(spikes, trainee, spec, step, saves)
                batches = build_batches(config, layout.dp_index(world.rank), layout.dp, start_step=step)
            snapshots.after_step(step, meter.memory.step_peak if meter.memory else None)
            if meter.should_log(step) or should_save(config.save, config.steps, step):
                guard.settle(stop)  # where the loop synchronises anyway: read the window's agreement
        except NonFiniteError as err:  # every rank raises together: they agreed on the flags
            saves.close()  # the save in flight first: it is of an earlier, good step
            rewind_scheduler(trainee.scheduler, err.step - 1)  # weights were held since err.step
            save_last_good(trainee, spec, world, out_dir, progress(err.step - 1, guard, meter))
            raise
        stopping = bool(stop.agreed) and step < config.steps  # agreed with the non-finite flags
        meter.update(dataclasses.replace(stats, nonfinite_skipped=guard.skipped))  # device tensors, no sync
        if evaluates_now(config, step):  # a log step too (Meter.should_log): the record carries it
            meter.val_loss = evaluate(trainee.model, held_out, config, world, compute_loss, trainee.pipeline)
        if meter.should_log(step) or stopping:
            # Gathers every rank's figures: the host syncs of a log step. With the per-tensor AdamW
            # (CPU's default) train_step reads the agreement (non-finite check and stop,
            # trainer/rank/nonfinite.py) on every step as well; with the fused one it does not.
            spiked = spikes.fields() if spikes is not None else {}
            meter.log(step, trainee.model, trainee.optimizer, extra={**saves.record_fields(), **spiked})
        save = None
        if should_save(config.save, config.steps, step) or (stopping and config.save.every > 0):
            save = saves.save(trainee, progress(step, guard, meter))
        if stopping:
            saves.close()  # the stop's save written and listed before the rank returns
            return {**stop.ending(step, save), **saves.summary()}
    saves.close()  # the last step's save too
    result = meter.finish()
    return None if result is None else {**result, **saves.summary()}


def progress(step: int, guard: NonFiniteGuard, meter: Meter) -> Progress:
    """What a save records besides the trainee: the step (= data position) and the skip counters."""
    return Progress(step=step, nonfinite_skipped=guard.skipped, overflow_skipped=int(meter.skipped_steps))


def train_step(
    trainee: Trainee,
    batches: Batches,
    config: TrainConfig,
    world: World,
    step: int,
    guard: NonFiniteGuard,
    stop: RankStop | None = None,
    norms: LayerNorms | None = None,
) -> StepStats:
    """One optimizer step over grad_accum micro-batches (skipped, or NonFiniteError, when non-finite);
    with `norms`, each layer's gradient and parameter norm too (trainer/telemetry/layer_norms.py)."""
    model, optimizer, scaler = trainee.model, trainee.optimizer, trainee.scaler
    if trainee.router_log is not None:
        skew_routing(model, config.fault, world, step)
        if trainee.router_log.watch is not None:
            trainee.router_log.watch.step = step  # the step its warning names
    # Gradients are freed here rather than after the step, so they can be measured between steps.
    optimizer.zero_grad(set_to_none=True)
    if trainee.pipeline is not None:
        trainee.pipeline.loss.fault = pipeline_fault(config.fault, world, step)
        loss_sum, z_sum, data_s = pipeline_forward_backward(trainee.pipeline, batches, config, world)
    else:
        loss_sum, z_sum, data_s = accumulate(trainee, batches, config, world, step)
    mark_phase(step, "optimizer")
    scaler.unscale_(optimizer)  # clipping must see true gradients
    grad_squares = None if norms is None else norms.squares(model, grads=True)  # before clipping
    stages = None if trainee.pipeline is None else trainee.pipeline.group
    grad_norm = clip_gradients(model, config.optim.grad_clip, stages)
    # Every rank agrees (one all-reduce) before stepping: on non-finite values, and on stopping after
    # this step (trainer/faults/stop.py); under fp16 a gradient overflow is the scaler's.
    spikes = guard.spikes  # stability.spike: this rank's loss-spike flag joins the agreement
    spike = None if spikes is None else spikes.detector.observe(loss_sum / config.grad_accum, grad_norm)
    flags = agree(loss_sum, grad_norm, world, stop=stop_request(stop), spike=spike)
    if guard.defer:
        step_unless(optimizer, scaler, guard.record(step, flags))  # decided on the device: no host sync
    elif guard.check_now(step, flags, stop):
        scaler.step(optimizer)  # skipped (on every rank) when a gradient overflowed
    overflow = found_overflow(scaler, optimizer)
    update_loss_scale(scaler, config.precision.min_loss_scale)
    precompute_fp8_scales(model, config.precision)  # fp8 all-gather: the next forward's scales, at once
    trainee.scheduler.step()
    routing = step_routing(trainee, config, world)
    return StepStats(
        loss=loss_sum / config.grad_accum,
        z_loss=None if z_sum is None else z_sum / config.grad_accum,
        layer_norms=None if grad_squares is None else norms.reduce(grad_squares, model),
        grad_norm=grad_norm.detach(),
        lr=trainee.scheduler.get_last_lr()[0],
        loss_scale=loss_scale(scaler),
        overflow=overflow,
        data_s=data_s,
        nonfinite_skipped=guard.skipped,
        disk=take_traffic(optimizer),
        routing=routing,
    )


def watch_routing(trainee: Trainee, config: TrainConfig, world: World, predicted: dict[str, float]) -> None:
    """A mixture of experts whose plan runs out of memory past some routing imbalance (trainer/job.py
    `routing_limit`): its layers warn, once, the first time a forward's routing passes it."""
    if trainee.router_log is not None and keys.MOE_OOM_IMBALANCE in predicted:
        trainee.router_log.watch = RoutingWatch(
            predicted[keys.MOE_OOM_IMBALANCE],
            config.moe.imbalance,
            predicted[keys.MOE_OOM_LIMIT_GIB],
            world.rank,
        )


def step_routing(trainee: Trainee, config: TrainConfig, world: World) -> StepRouting | None:
    """model.n_experts > 0: what the routers did this step (trainer/model/moe.py RouterLog); under
    moe.bias_rate > 0 their loads summed over every rank (one all-reduce) move each expert's bias. Under a
    pipeline the replica's layers are summed over its stages first (a layer's rows are zero elsewhere)."""
    log = trainee.router_log
    taken = None if log is None else log.take_step()
    if taken is None:
        return None
    loads, dropped, balance = taken
    summed = False
    if trainee.pipeline is not None:  # parallel.pp: each rank's log holds its own stages' layers
        stages = trainee.pipeline.group
        dist.all_reduce(dropped, group=stages)
        dist.all_reduce(balance, group=stages)
        if config.moe.bias_rate == 0:  # else summed over every rank below
            dist.all_reduce(loads, group=stages)
    if config.moe.bias_rate > 0:
        if world.world_size > 1:
            dist.all_reduce(loads)  # under a pipeline each layer's from its own stage's ranks
        update_expert_bias(trainee.model, loads, config.moe.bias_rate)
        summed = True
    return StepRouting(loads, dropped, balance / config.grad_accum, summed)


def take_traffic(optimizer: torch.optim.Optimizer) -> Any:
    """offload=nvme: what the step read from and wrote to the moments file (trainer/rank/nvme.py); else None."""
    stepped = local_optimizer(optimizer)
    return stepped.take_traffic() if hasattr(stepped, "take_traffic") else None


def accumulate(
    trainee: Trainee, batches: Batches, config: TrainConfig, world: World, step: int
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """The step's grad_accum forwards and backwards on this rank: the summed loss (the cross-entropy), the
    summed z-loss (loss.z_loss > 0, else None) and the data time."""
    model, scaler = trainee.model, trainee.scaler
    loss_sum = torch.zeros((), device=world.device)
    z_sum = torch.zeros((), device=world.device) if config.loss.z_loss > 0 else None
    data_s = 0.0
    for micro in range(config.grad_accum):
        if micro > 0:
            next_micro_batch()  # lets the tensor-level memory tracker see the next forward
        start = time.perf_counter()
        batch = [to_device(t, world.device) for t in next(batches)]  # host time only
        data_s += time.perf_counter() - start
        is_last = micro == config.grad_accum - 1
        # Backward runs inside autocast, against PyTorch's AMP guidance (and nanoGPT's habit) of
        # leaving the region before it. The numbers are the same either way: backward ops run in the
        # dtype autocast chose for their forward ops, and a checkpointed block's recompute restores
        # the autocast state itself. What differs is memory, and the memory plan is fitted to this
        # placement (trainer/plan/ddp_walk.py ddp_moments, measured within 0.15% in docs/memory_plan.md):
        # autocast's cache keeps the 2-byte cast of every matmul weight until the region exits, here
        # through backward. Outside, the casts of checkpointed blocks would be freed after forward
        # and made again during their recompute, and every cast freed once its block's backward has
        # run; a change of peaks (stages 0-1, bf16/fp16, most with checkpointing) that needs the plan
        # re-fitted and checks/plan_accuracy.py run again before it is made.
        parameter_resharding(model, enabled=reshards_now(config.zero, is_last))
        with (
            gradient_sync(model, enabled=reduces_now(config.zero, is_last)),
            build_autocast(config.precision, config.zero, world.device),
            loss_context(config.parallel.tp),  # vocabulary-sharded logits: forward and backward
        ):
            mark_phase(step, "forward", micro)  # where an out-of-memory failure is reported to have happened
            terms = compute_loss(model, batch, config)
            loss = inject_fault(terms.cross_entropy, config.fault, world, step, is_last)
            loss_sum += local_loss(loss).detach()
            if terms.z_loss is not None and z_sum is not None:  # the objective adds it; logged apart
                z_sum += local_loss(terms.z_loss).detach()
                loss = loss + terms.z_loss
            if trainee.router_log is not None:  # model.n_experts > 0: the balance and router z-losses
                router = trainee.router_log.take_losses()
                loss = loss if router is None else loss + router
            mark_phase(step, "backward")
            scaler.scale(loss / config.grad_accum).backward()
    return loss_sum, z_sum, data_s


def compute_loss(model: torch.nn.Module, batch: list[torch.Tensor], config: TrainConfig) -> LossTerms:
    """loss=full: the logits, then their loss; loss=chunked: the model takes the targets and returns the
    loss by chunks (trainer/model/loss.py), so that the whole logits never exist. A third tensor of
    the batch is each token's document (data.packing=document: block-causal attention). The z-loss
    (loss.z_loss > 0) comes beside the cross-entropy, from the same logits. Under parallel.cp the model
    takes this rank's positions of the rows (the documents whole), and the loss is its part of the group's
    (trainer/model/context_parallel.py)."""
    inputs, targets, *documents = batch
    context = find_transformer(model).context if config.parallel.cp > 1 else None
    if context is not None:
        rows, inputs, targets = targets, context.local(inputs), context.local(targets)
    if config.loss.kind == LossKind.chunked:
        terms = LossTerms.of_chunked(model(inputs, targets, *documents), config.loss.z_loss)
    else:
        terms = full_loss(model(inputs, None, *documents), targets, config.loss.z_loss)
    return terms if context is None else terms.scaled(context.loss_factor(targets, rows, IGNORE_INDEX))


def found_overflow(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> bool | torch.Tensor:
    """Whether the scaler skipped the step (fp16): a device tensor (1.0 or 0.0), read at log steps.

    GradScaler exposes no public flag; comparing scales misses an overflow at the scale floor.
    Its per-optimizer found_inf record (filled by unscale_, cleared by update) is the truth.
    """
    if not scaler.is_enabled():
        return False
    return sum(found_inf_per_device(scaler, optimizer).values()).reshape(()).clamp(max=1.0)


def loss_scale(scaler: GradScaler) -> float | torch.Tensor:
    """The scale after this step's update, left on the device (get_scale() would sync every step)."""
    if not scaler.is_enabled():
        return 1.0
    return scale_on_device(scaler).detach().clone()  # update() replaces it in place next step


def pipeline_fault(
    fault: FaultConfig, world: World, step: int
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """parallel.pp > 1: a fault on the rank itself (raise, kill, out of memory, hang) happens now, on any stage;
    one in the loss is handed to the last stage's loss_fn, which applies it to each micro-batch's objective
    (the job process refused it for a rank without the loss: trainer/rank/refusals.py check_pipeline_fault)."""
    if fault.kind == FaultKind.none or fault.step != step:  # every step of a real run: nothing to make
        return None
    if fault.kind not in LOSS_FAULTS:
        inject_fault(torch.zeros(()), fault, world, step, is_last=True)
        return None
    return functools.partial(inject_fault, fault=fault, world=world, step=step, is_last=True)


@torch.no_grad()
def skew_routing(model: torch.nn.Module, fault: FaultConfig, world: World, step: int) -> None:
    """fault.kind=route_skew: from `fault.step` on, this rank's routers put expert 0 first for every token."""
    if (
        fault.kind != FaultKind.route_skew
        or fault.step != step
        or fault.rank != world.rank
        or not first_attempt()
    ):
        return
    for layer in moe_layers(model):
        layer.router.expert_bias[0] = 1.0


def inject_fault(
    loss: torch.Tensor, fault: FaultConfig, world: World, step: int, is_last: bool
) -> torch.Tensor:
    """Rehearse a failure on one rank at one step (tests and drills; `fault.kind=none` in real runs)."""
    if (
        fault.kind
        in (FaultKind.none, FaultKind.kill_during_save, FaultKind.term_during_save, FaultKind.route_skew)
        or fault.step != step
        or fault.rank != world.rank
    ):
        return loss
    if not is_last or not first_attempt():  # a fault rehearses one failure, not one per restart
        return loss
    if fault.kind == FaultKind.inf_grad:
        # An overflow in backward: the loss value stays finite, every gradient of this rank
        # becomes inf/nan before reduction.
        loss.register_hook(lambda grad: grad * float("inf"))
        return loss
    if fault.kind == FaultKind.nan_loss:
        return loss * float("nan")
    if fault.kind == FaultKind.loss_spike:  # finite, far above the running median (stability.spike)
        return loss * LOSS_SPIKE_FACTOR
    if fault.kind == FaultKind.raise_error:
        raise RuntimeError(f"injected fault at step {step}")
    if fault.kind == FaultKind.oom:  # 2**60 bytes: the allocator itself refuses, nothing is taken
        torch.empty(2**60, dtype=torch.uint8, device=world.device)
    if fault.kind == FaultKind.hang:  # asleep, not spinning: a hung rank holds no core
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
    return loss
