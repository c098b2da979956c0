"""What one rank trains with: the model, its optimizer, the LR schedule and the loss scaler.

A leaf module (it imports nothing from trainer/), so the save (trainer/saves/dcp.py) and telemetry
can name the type and the optimizer state they save and measure without importing the loop that
builds them (trainer/rank/loop.py), which sits above them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.amp import GradScaler

ON_DISK: set[int] = set()
"""The addresses of the storages that map a file (offload=nvme's moments, trainer/rank/nvme.py): disk, paged
in and out by the kernel, not the rank's memory, so the CPU cap (trainer/faults/tensor_cap.py) and the memory
figures (trainer/telemetry) leave them out."""


@dataclass
class Trainee:
    """What one rank trains with, built once (loop.build_trainee)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: GradScaler
    pipeline: Any = None
    """parallel.pp > 1: this rank's part of the pipeline (trainer/rank/pipeline.py Pipeline), which runs the step's
    forward and backward; None otherwise."""
    router_log: Any = None
    """model.n_experts > 0: the model's RouterLog (trainer/model/moe.py), which the loop reads every forward;
    None otherwise."""


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeroRedundancyOptimizer's or PostLocalSGDOptimizer's
    (zero.sync_every > 1) `.optim`, else itself.

    `.optim` is a plain AdamW over this rank's partition, holding the same Parameter objects as
    the model: what tensor tracking (trainer/telemetry/memory.py), the state-bytes figures
    (trainer/telemetry/metrics.py) and DCP's state-dict helpers (trainer/saves/dcp.py) can name and measure;
    here, in a leaf module, so that they need not import the rank's package above them.
    """
    # Looked up, not imported: torch.distributed.optim imports FSDP and DTensor and scripts its
    # functional optimizers (about a second), the job process imports this module too
    # (trainer/saves/dcp.py, telemetry), and a rank that never imported it built neither wrapper.
    wrappers_module = sys.modules.get("torch.distributed.optim")
    if wrappers_module is None:
        return optimizer
    wrappers = (wrappers_module.ZeroRedundancyOptimizer, wrappers_module.PostLocalSGDOptimizer)
    return optimizer.optim if isinstance(optimizer, wrappers) else optimizer
