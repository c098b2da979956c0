"""`optim:` (OptimConfig): AdamW and its schedule."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.errors import _require


@dataclass
class OptimConfig:
    """conf/optim/*.yaml: AdamW with linear warmup, cosine decay and gradient clipping."""

    name: str = "adamw"
    """Optimizer name."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    """Linear warmup from 0 to lr over this many optimizer steps."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    fused: bool | None = None
    """AdamW's fused kernel (and the non-finite skip decided on the device, trainer/rank/nonfinite.py); null: fused on CUDA only."""

    def __post_init__(self) -> None:
        _require(self.name == "adamw", f"optim.name must be adamw, got {self.name}")
        _require(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        _require(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(
            0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
        )
        _require(self.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {self.grad_clip}")
