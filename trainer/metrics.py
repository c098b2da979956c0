"""Measuring a rank's training and gathering every rank's figures on log steps."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from trainer.config import TrainConfig
from trainer.world import World

GIB = 2**30


@dataclass
class StepStats:
    """One optimizer step as the loop saw it; tensors stay on the device until a log step."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    loss_scale: float
    overflow: bool
    data_s: float


class Meter:
    """Accumulates a log window on each rank; on log steps gathers the ranks and rank 0 writes.

    metrics.jsonl (in the job's output directory) gets one JSON object per log step; the job
    process turns it into W&B history and summary.json.
    """

    def __init__(self, config: TrainConfig, world: World, out_dir: Path, flops_per_token: float) -> None:
        self.config, self.world = config, world
        self.tokens_per_step = config.global_batch(world.world_size) * config.seq_len
        self.flops_per_token = flops_per_token
        self.path = out_dir / "metrics.jsonl"
        self.skipped_steps = 0
        self.last_record: dict[str, Any] | None = None
        self._open_window()

    def _open_window(self) -> None:
        self.window_start = time.perf_counter()
        self.window_steps = 0
        self.window_data_s = 0.0
        self.window_overflows = 0
        self.last: StepStats | None = None

    def update(self, step: int, stats: StepStats) -> None:
        self.window_steps += 1
        self.window_data_s += stats.data_s
        self.window_overflows += int(stats.overflow)
        self.skipped_steps += int(stats.overflow)
        self.last = stats

    def should_log(self, step: int) -> bool:
        return step % self.config.log_every == 0 or step == self.config.steps

    def log(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Gather this window from every rank (a collective: every rank calls it) and write it."""
        assert self.last is not None
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)  # the window's time must include its kernels
        elapsed = time.perf_counter() - self.window_start
        states = model_state_bytes(model, optimizer)
        row = [self.last.loss.item(), elapsed, self.window_data_s, *states, self.last.loss_scale, self.skipped_steps]
        per_rank = gather_rows(torch.tensor(row, dtype=torch.float64), self.world)
        if self.world.is_main:
            self.last_record = self.build_record(step, per_rank)
            self.write(self.last_record)
        self._open_window()

    def build_record(self, step: int, per_rank: torch.Tensor) -> dict[str, Any]:
        assert self.last is not None
        # Every rank must have taken (or skipped) the same steps with the same scale.
        assert (per_rank[:, 6:8] == per_rank[0, 6:8]).all(), f"ranks disagree on loss scale: {per_rank[:, 6:8].tolist()}"
        # The slowest rank sets the pace: every rank waits for it at the collectives.
        window_s = per_rank[:, 1].max().item()
        step_s = window_s / self.window_steps
        tokens_per_s = self.tokens_per_step / step_s
        record: dict[str, Any] = {
            "step": step,
            "loss/train": per_rank[:, 0].mean().item(),
            "optim/lr": self.last.lr,
            "optim/grad_norm": float(self.last.grad_norm.item()),
            "throughput/tokens_per_s": tokens_per_s,
            "throughput/tokens_per_s_per_rank": tokens_per_s / self.world.world_size,
            "time/step_s": step_s,
            "time/data_s": per_rank[:, 2].max().item() / self.window_steps,
        }
        for rank, (params, grads, optimizer) in enumerate(per_rank[:, 3:6].tolist()):
            record[f"memory/rank{rank}/params_gib"] = params / GIB
            record[f"memory/rank{rank}/grads_gib"] = grads / GIB
            record[f"memory/rank{rank}/optimizer_gib"] = optimizer / GIB
        if self.config.precision.is_fp16:
            record["precision/loss_scale"] = self.last.loss_scale
            record["precision/overflow"] = self.window_overflows
            record["precision/skipped_steps"] = self.skipped_steps
        return record

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")
        print(progress_line(record, self.config.steps), flush=True)

    def finish(self) -> dict[str, Any] | None:
        return self.last_record


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for a tensor: its shard when the tensor is a DTensor."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds right now.

    Optimizer state counts Adam's moment tensors; the per-parameter 0-dim `step` counters
    (4 bytes each, never sharded) are left out so that the ZeRO arithmetic is exact.
    """
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    # ZeroRedundancyOptimizer wraps a local optimizer over this rank's partition only.
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    moments = sum(
        local_bytes(value)
        for state in inner.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.dim() > 0
    )
    return params, grads, moments


def gather_rows(local: torch.Tensor, world: World) -> torch.Tensor:
    """Stack one row per rank (rank order); the collective runs on the backend's device."""
    device_row = local.to(world.device)
    rows = [torch.empty_like(device_row) for _ in range(world.world_size)]
    dist.all_gather(rows, device_row)
    return torch.stack(rows).cpu()


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    parts = [
        f"step {record['step']:>{len(str(total_steps))}}/{total_steps}",
        f"loss {record['loss/train']:.4f}",
        f"lr {record['optim/lr']:.2e}",
        f"{record['throughput/tokens_per_s']:,.0f} tok/s",
    ]
    if "precision/loss_scale" in record:
        parts.append(f"scale {record['precision/loss_scale']:g}")
    return " | ".join(parts)
