"""What a plan is for: the device kind and the world size, resolved from the config without
checking them against this host (mode=plan plans for any cluster)."""

from __future__ import annotations

import torch

from trainer.config import DeviceKind, PlanConfig
from trainer.world import resolve_device_kind


def planned_device_kind(plan: PlanConfig, device: DeviceKind) -> str:
    """The device the plan is for: a named accelerator or device=cuda plan for a GPU even
    where none is visible (mode=plan); auto is a GPU when one is visible."""
    if plan.accelerator is not None:
        return "cuda"
    return resolve_device_kind(device, must_be_visible=False)


def planned_world_size(nproc: str, device_kind: str) -> int:
    """nproc as given, never checked against this host (mode=plan plans for any cluster).

    auto: every visible GPU, else 2 CPU ranks, as a training run here would start; planning
    for a GPU where none is visible, one node of 8.
    """
    if nproc != "auto":
        return int(nproc)
    if device_kind == "cpu":
        return 2
    return torch.cuda.device_count() if torch.cuda.is_available() else 8
