"""`offload:` (OffloadConfig): FSDP2's CPU offload."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.enums import OffloadTarget


@dataclass
class OffloadConfig:
    """conf/offload/*.yaml: FSDP2 CPUOffloadPolicy."""

    target: OffloadTarget = OffloadTarget.none
    """none, or cpu: parameters, gradients and optimizer state live in host memory."""
    pin_memory: bool = True
    """cpu only: pin the offloaded tensors for faster host-device copies (GPU only)."""
