"""trainer/rank/precision.py: the loss-scale floor GradScaler lacks, and where autocast applies."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn
from torch.amp import GradScaler

from trainer.config import DType, PrecisionConfig, Stage, ZeroConfig
from trainer.rank.precision import build_autocast, build_grad_scaler, update_loss_scale

FP16 = PrecisionConfig(name="fp16", compute_dtype=DType.float16, loss_scale_init=8.0, backoff_factor=0.5)


def overflowing_steps(min_loss_scale: float, steps: int) -> list[float]:
    """The scale after each of `steps` steps whose gradients overflow."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = build_grad_scaler(FP16, ZeroConfig(), torch.device("cpu"))
    scales = []
    for _ in range(steps):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
        scaler.step(optimizer)  # skipped: the gradients are inf
        update_loss_scale(scaler, min_loss_scale)
        scales.append(scaler.get_scale())
    return scales


def test_the_scale_backs_off_on_overflow_and_stops_at_the_floor() -> None:
    assert overflowing_steps(min_loss_scale=0.01, steps=4) == [4.0, 2.0, 1.0, 0.5]  # GradScaler alone
    assert overflowing_steps(min_loss_scale=2.0, steps=4) == [4.0, 2.0, 2.0, 2.0]


def test_the_floor_is_applied_without_reading_the_scale_on_the_host(monkeypatch) -> None:
    """fp16 must not sync the host every step (issue 27, item 8): no host read in the update."""

    def host_read(self: torch.Tensor, *args: object) -> float:
        raise AssertionError("the loss scale was read on the host")

    def update_on_the_device(scaler: GradScaler, min_loss_scale: float, update=update_loss_scale) -> None:
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__float__"):
                m.setattr(torch.Tensor, name, host_read)
            update(scaler, min_loss_scale)

    monkeypatch.setattr(sys.modules[__name__], "update_loss_scale", update_on_the_device)
    assert overflowing_steps(min_loss_scale=2.0, steps=4) == [4.0, 2.0, 2.0, 2.0]


def test_the_scaler_is_enabled_only_for_fp16() -> None:
    assert build_grad_scaler(FP16, ZeroConfig(), torch.device("cpu")).is_enabled()
    assert not build_grad_scaler(PrecisionConfig(), ZeroConfig(), torch.device("cpu")).is_enabled()


def test_autocast_wraps_ddp_stages_in_low_precision_only() -> None:
    bf16 = PrecisionConfig(name="bf16", compute_dtype=DType.bfloat16)
    cpu = torch.device("cpu")
    with build_autocast(bf16, ZeroConfig(stage=Stage.stage1), cpu):
        assert (torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu")) == (torch.bfloat16, True)
    assert isinstance(
        build_autocast(bf16, ZeroConfig(stage=Stage.stage3), cpu), contextlib.nullcontext
    )  # FSDP2 casts itself
    assert isinstance(build_autocast(PrecisionConfig(), ZeroConfig(), cpu), contextlib.nullcontext)  # fp32
