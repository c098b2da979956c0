"""`offload:` (OffloadConfig): FSDP2's CPU offload, and Adam's moments on local disk (nvme)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.enums import OffloadTarget
from trainer.config.errors import _require


@dataclass
class OffloadConfig:
    """conf/offload/*.yaml: FSDP2 CPUOffloadPolicy; under nvme, Adam's moments in per-rank files as well."""

    target: OffloadTarget = OffloadTarget.none
    """none; cpu: parameters, gradients and optimizer state live in host memory; nvme: as cpu, but Adam's
    moments live in a file per rank under `offload.path`, streamed through `offload.buffer_mib` at each step."""
    pin_memory: bool = True
    """cpu and nvme: pin the offloaded tensors for faster host-device copies (GPU only)."""
    path: str | None = None
    """nvme only: an existing, writable directory on local disk; rank R's moments are `<path>/zerolab-rank<R>.adam`."""
    buffer_mib: int = 64
    """nvme only: the host buffer the optimizer step streams the moments through, MiB per rank."""

    def __post_init__(self) -> None:
        _require(
            self.buffer_mib >= 1, f"offload.buffer_mib must be >= 1 (MiB per rank), got {self.buffer_mib}"
        )
        _require(
            self.target != OffloadTarget.nvme or self.path is not None,
            "offload=nvme needs offload.path: an existing, writable directory on local disk for the ranks' files",
        )

    @property
    def on_host(self) -> bool:
        """Whether FSDP2 keeps the sharded states in host memory (CPUOffloadPolicy): cpu and nvme."""
        return self.target != OffloadTarget.none
