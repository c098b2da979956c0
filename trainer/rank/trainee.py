"""What one rank trains with: the model, its optimizer, the LR schedule and the loss scaler.

A leaf module (it imports nothing from trainer/), so the save (trainer/saves/dcp.py) can name the
type it saves without importing the loop that builds it (trainer/rank/loop.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.amp import GradScaler


@dataclass
class Trainee:
    """What one rank trains with, built once (loop.build_trainee)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: GradScaler
