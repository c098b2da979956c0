"""The training loop of one rank, top to bottom."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.amp import GradScaler

from trainer.activation_checkpointing import apply_activation_checkpointing
from trainer.config import FaultConfig, FaultKind, TrainConfig
from trainer.data import build_batches
from trainer.memory import next_micro_batch
from trainer.metrics import Meter, StepStats
from trainer.model import build_model, flops_per_token
from trainer.nonfinite import NonFiniteError, NonFiniteGuard, find_nonfinite
from trainer.oom import mark_phase
from trainer.optim import build_optimizer, build_scheduler, clip_gradients
from trainer.precision import build_autocast, build_grad_scaler, update_loss_scale
from trainer.resume import resume_training
from trainer.save import Progress, SaveSpec, first_attempt, save_last_good, save_training_state, should_save
from trainer.sharding import apply_zero, gradient_sync
from trainer.trainee import Trainee
from trainer.world import World

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


def build_trainee(config: TrainConfig, world: World) -> Trainee:
    model = build_model(config.model, device="meta")
    apply_activation_checkpointing(model, config.checkpointing)  # before sharding: wraps blocks
    model = apply_zero(model, config.zero, config.precision, config.offload, world, config.seed)  # shard, then materialise only this rank's part
    optimizer = build_optimizer(model, config.optim, config.zero)
    scheduler = build_scheduler(optimizer, config.optim, config.steps)
    scaler = build_grad_scaler(config.precision, config.zero, world.device)  # disabled unless fp16
    return Trainee(model, optimizer, scheduler, scaler)


def train(config: TrainConfig, world: World, out_dir: Path, predicted: dict[str, float]) -> dict[str, Any] | None:
    """Train up to config.steps optimizer steps, from a save when resuming; rank 0 returns the run's figures.

    `predicted` holds the job's plan figures (trainer/job.py rank_predictions), written beside
    what the ranks measure.
    """
    torch.manual_seed(config.seed)
    trainee = build_trainee(config, world)
    spec = SaveSpec.of(config)
    start = resume_training(trainee, spec, config.resume, world, out_dir)  # step 0 unless resuming or restarted
    batches = build_batches(config, world.rank, world.world_size, start_step=start.step)
    meter = Meter(config, world, out_dir, flops_per_token(config.model, config.seq_len), predicted)
    meter.skipped_steps = start.overflow_skipped  # the fp16 skip count goes on across a resume
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, world, skipped=start.nonfinite_skipped)
    for step in range(start.step + 1, config.steps + 1):
        try:
            with meter.measure(step, trainee.model, trainee.optimizer):  # tensor-level memory, on chosen steps
                stats = train_step(trainee, batches, config, world, step, guard)
        except NonFiniteError:  # every rank raises together: they agreed in train_step
            save_last_good(trainee, spec, world, out_dir, progress(step - 1, guard, meter))
            raise
        meter.update(stats)  # device tensors, no sync
        if meter.should_log(step):
            # Gathers every rank's figures: the host syncs of a log step. train_step has one more on
            # every step, the non-finite check's all-reduce (trainer/nonfinite.py), and under fp16
            # GradScaler.step reads its overflow flag on the host.
            meter.log(step, trainee.model, trainee.optimizer)
        if should_save(config.save, config.steps, step):
            save_training_state(trainee, spec, world, out_dir, progress(step, guard, meter))
    return meter.finish()


def progress(step: int, guard: NonFiniteGuard, meter: Meter) -> Progress:
    """What a save records besides the trainee: the step (= data position) and the skip counters."""
    return Progress(step=step, nonfinite_skipped=guard.skipped, overflow_skipped=meter.skipped_steps)


def train_step(trainee: Trainee, batches: Batches, config: TrainConfig, world: World, step: int, guard: NonFiniteGuard) -> StepStats:
    """One optimizer step over grad_accum micro-batches (skipped, or NonFiniteError, when non-finite)."""
    model, optimizer, scaler = trainee.model, trainee.optimizer, trainee.scaler
    # Gradients are freed here rather than after the step, so they can be measured between steps.
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=world.device)
    data_s = 0.0
    for micro in range(config.grad_accum):
        if micro > 0:
            next_micro_batch()  # lets the tensor-level memory tracker see the next forward
        start = time.perf_counter()
        inputs, targets = (t.to(world.device, non_blocking=True) for t in next(batches))
        data_s += time.perf_counter() - start
        is_last = micro == config.grad_accum - 1
        # Backward runs inside autocast, against PyTorch's AMP guidance (and nanoGPT's habit) of
        # leaving the region before it. The numbers are the same either way: backward ops run in the
        # dtype autocast chose for their forward ops, and a checkpointed block's recompute restores
        # the autocast state itself. What differs is memory, and the memory plan is fitted to this
        # placement (trainer/plan/step.py ddp_moments, measured within 0.15% in docs/memory_plan.md):
        # autocast's cache keeps the 2-byte cast of every matmul weight until the region exits, here
        # through backward. Outside, the casts of checkpointed blocks would be freed after forward
        # and made again during their recompute, and every cast freed once its block's backward has
        # run; a change of peaks (stages 0-1, bf16/fp16, most with checkpointing) that needs the plan
        # re-fitted and benchmarks/plan_accuracy.py run again before it is made.
        with gradient_sync(model, enabled=is_last), build_autocast(config.precision, config.zero, world.device):
            mark_phase(step, "forward")  # where an out-of-memory failure is reported to have happened
            loss = inject_fault(cross_entropy(model(inputs), targets), config.fault, world, step, is_last)
            loss_sum += loss.detach()
            mark_phase(step, "backward")
            scaler.scale(loss / config.grad_accum).backward()
    mark_phase(step, "optimizer")
    scaler.unscale_(optimizer)  # clipping must see true gradients
    grad_norm = clip_gradients(model, config.optim.grad_clip)
    # Every rank agrees (one all-reduce) before stepping; under fp16 a gradient overflow is the scaler's.
    if guard.check(find_nonfinite(loss_sum, grad_norm, step, world, scaler.is_enabled())):
        scaler.step(optimizer)  # skipped (on every rank) when a gradient overflowed
    overflow = found_overflow(scaler, optimizer)
    update_loss_scale(scaler, config.precision.min_loss_scale)
    trainee.scheduler.step()
    return StepStats(
        loss=loss_sum / config.grad_accum,
        grad_norm=grad_norm.detach(),
        lr=trainee.scheduler.get_last_lr()[0],
        # fp16 only: GradScaler.step has already synchronised with the host this step.
        loss_scale=scaler.get_scale() if scaler.is_enabled() else 1.0,
        overflow=overflow,
        data_s=data_s,
        nonfinite_skipped=guard.skipped,
    )


def cross_entropy(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())


def found_overflow(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether scaler.step skipped the step.

    GradScaler exposes no public flag; comparing scales misses an overflow at the scale floor.
    Its per-optimizer found_inf record (filled by unscale_, cleared by update) is the truth.
    """
    if not scaler.is_enabled():
        return False
    return sum(v.item() for v in scaler._found_inf_per_device(optimizer).values()) > 0


def inject_fault(loss: torch.Tensor, fault: FaultConfig, world: World, step: int, is_last: bool) -> torch.Tensor:
    """Rehearse a failure on one rank at one step (tests and drills; `fault.kind=none` in real runs)."""
    if fault.kind in (FaultKind.none, FaultKind.kill_during_save) or fault.step != step or fault.rank != world.rank:
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
    if fault.kind == FaultKind.raise_error:
        raise RuntimeError(f"injected fault at step {step}")
    os.kill(os.getpid(), signal.SIGKILL)
    return loss
