"""trainer/rank/evaluate.py: the held-out loss on the same batches every time and on any world size,
and its memory within the training step's peak (measured with torch's MemTracker on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import WORLD, materialized, tiny_config
from trainer.data import build_batches, validation_batches
from trainer.private_apis.of_torch import new_mem_tracker
from trainer.rank.evaluate import evaluate, evaluates_now
from trainer.rank.loop import compute_loss

pytestmark = pytest.mark.torch_versions  # MemTracker is a private torch tool

CONFIG = tiny_config(eval__every=3, eval__batches=2, grad_accum=2)


def test_evaluations_fall_every_n_steps_and_after_the_last() -> None:
    assert [s for s in range(1, CONFIG.steps + 1) if evaluates_now(CONFIG, s)] == [3, 6]
    assert not any(evaluates_now(tiny_config(steps=7), s) for s in range(1, 8))  # eval.every=0


def test_the_held_out_batches_are_the_same_on_one_rank_or_two() -> None:
    one = validation_batches(CONFIG, 0, 1)
    assert len(one) == 4 and all(
        torch.equal(a, b) for x, y in zip(one, validation_batches(CONFIG, 0, 1)) for a, b in zip(x, y)
    )
    half = tiny_config(eval__every=3, eval__batches=2, grad_accum=1)
    two = [validation_batches(half, rank, 2) for rank in range(2)]
    # Global batch b, micro-step m, rank r: the one-rank run's micro-batch 2b + m*2 + r = 2b + r here.
    assert [x[0].tolist() for x in one] == [two[r][b][0].tolist() for b in range(2) for r in range(2)]
    training = {tuple(row) for inputs, _ in build_batches(tiny_config(), 0, 1) for row in inputs.tolist()}
    assert not training & {tuple(row) for inputs, _ in one for row in inputs.tolist()}  # held out


def test_the_loss_is_trainings_and_needs_less_memory_than_a_step() -> None:
    config = tiny_config(eval__every=3, eval__batches=1)  # one forward: MemTracker tracks one iteration
    model = materialized(config.model)
    batches = validation_batches(config, 0, 1)
    tracker = new_mem_tracker()
    tracker.track_external(model)
    with tracker:
        loss = evaluate(model, batches, config, WORLD, compute_loss)
        eval_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with torch.no_grad():
        assert loss == compute_loss(model, list(batches[0]), config).cross_entropy.double().item()

    tracker = new_mem_tracker()
    tracker.track_external(model)
    with tracker:
        compute_loss(model, list(batches[0]), config).cross_entropy.backward()
        train_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert eval_peak <= train_peak - sum(
        p.numel() * 4 for p in model.parameters()
    )  # no gradients, no saved activations
