"""The held-out loss (`loss/val`): the same validation batches every `eval.every` steps, under no_grad.

The batches are `eval.batches` global batches of the held-out stream, partitioned over data-parallel
ranks and micro-batches as training's first steps are (trainer/data.py `validation_batches`), read once
and kept. Each micro-batch's mean loss is summed over the ranks (one all-reduce) and divided by their
count: the mean training would report for those batches, the same on 1 rank or N. Under parallel.tp the
ranks of a TP group read the same batches and take the loss as training does, under `loss_parallel` of
the vocabulary-sharded logits (trainer/rank/tensor_parallel.py), each holding the same value: the sum
over all ranks counts each replica's tp times, and the count of ranks divides it out.

Memory: under no_grad no activation is kept for backward and no gradient is made, so an evaluation's
peak is a forward's working set on top of the states the step already holds, within the training
step's peak (which holds those states, the saved activations and the gradients at once).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from trainer.config import TrainConfig
from trainer.data import to_device
from trainer.model.loss import LossTerms
from trainer.rank.pipeline import Pipeline, pipeline_evaluate
from trainer.rank.precision import build_autocast
from trainer.rank.tensor_parallel import local_loss, loss_context
from trainer.world import World


def evaluates_now(config: TrainConfig, step: int) -> bool:
    """Every eval.every steps, and after the last."""
    every = config.eval.every
    return every > 0 and (step % every == 0 or step == config.steps)


LossFn = Callable[[torch.nn.Module, list[torch.Tensor], TrainConfig], LossTerms]


def evaluate(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, ...]],
    config: TrainConfig,
    world: World,
    compute_loss: LossFn,
    pipeline: Pipeline | None = None,
) -> float:
    """The mean loss over every rank's held-out micro-batches (a collective: every rank calls it);
    `compute_loss` is the loop's own (trainer/rank/loop.py), so eval takes training's loss. Under
    parallel.pp the micro-batches go through the schedule's forward (`pipeline_evaluate`), and every stage of
    a pipeline holds their sum, as every rank of a TP group does."""
    if pipeline is not None:
        total = pipeline_evaluate(pipeline, batches, config, world)
        dist.all_reduce(total)
        return total.item() / (len(batches) * world.world_size)
    total = torch.zeros((), dtype=torch.float64, device=world.device)
    with (
        torch.no_grad(),
        build_autocast(config.precision, config.zero, world.device),
        loss_context(config.parallel.tp),  # vocabulary-sharded logits under TP, as in training's loss
    ):
        for batch in batches:
            # The held-out loss is the cross-entropy alone, as loss/train is (the z-loss is logged apart).
            loss = compute_loss(model, [to_device(t, world.device) for t in batch], config).cross_entropy
            total += local_loss(loss).double()
    if world.world_size > 1:
        dist.all_reduce(total)
    return total.item() / (len(batches) * world.world_size)
