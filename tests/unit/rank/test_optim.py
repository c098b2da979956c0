"""trainer/rank/optim.py: the warmup + cosine schedule as the optimizer sees it, clipping, the local optimizer."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.config import OptimConfig, ZeroConfig
from trainer.rank.optim import (
    build_optimizer,
    build_scheduler,
    clip_gradients,
    lr_multiplier,
)
from trainer.rank.trainee import local_optimizer


def test_warmup_is_linear_from_the_first_step_and_reaches_the_peak() -> None:
    optim = OptimConfig(warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_multiplier(step, optim, total_steps=12) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_decays_from_the_peak_to_min_lr_ratio_at_the_last_step() -> None:
    optim = OptimConfig(warmup_steps=4, min_lr_ratio=0.1)
    assert lr_multiplier(4, optim, total_steps=12) == 1.0  # decay starts at the peak
    assert lr_multiplier(8, optim, total_steps=12) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos = 0
    assert lr_multiplier(12, optim, total_steps=12) == pytest.approx(0.1)
    assert lr_multiplier(50, optim, total_steps=12) == pytest.approx(
        0.1
    )  # past the end it stays at the floor


def test_no_warmup_starts_at_the_peak() -> None:
    optim = OptimConfig(warmup_steps=0, min_lr_ratio=0.0)
    assert lr_multiplier(0, optim, total_steps=10) == 1.0
    assert lr_multiplier(10, optim, total_steps=10) == pytest.approx(0.0)


def test_the_scheduler_hands_the_optimizer_lr_times_the_multiplier() -> None:
    optim = OptimConfig(lr=0.01, warmup_steps=2, min_lr_ratio=0.1)
    optimizer = build_optimizer(nn.Linear(2, 2), optim, ZeroConfig())
    scheduler = build_scheduler(optimizer, optim, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [0.01 * lr_multiplier(step, optim, 6) for step in range(6)]
    assert lrs == pytest.approx(expected) and lrs[1] == pytest.approx(0.01)
    assert (
        isinstance(optimizer, torch.optim.AdamW) and local_optimizer(optimizer) is optimizer
    )  # stage0: no wrapper


def test_clipping_returns_the_norm_before_clipping_and_zero_disables_it() -> None:
    model = nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[3.0, 4.0]])
    assert clip_gradients(model, max_norm=0.0).item() == pytest.approx(5.0)
    assert model.weight.grad.tolist() == [[3.0, 4.0]]  # 0: no clipping
    assert clip_gradients(model, max_norm=1.0).item() == pytest.approx(5.0)
    assert math.hypot(*model.weight.grad[0].tolist()) == pytest.approx(1.0)
