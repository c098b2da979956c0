"""What CPU ranks cost the host they share, beyond the tensors the memory plan counts.

Every CPU rank is a process that holds its Python interpreter, torch's libraries, gloo's buffers
and thread pools before it allocates a tensor (about 0.3-0.45 GiB with torch 2.13 on CPU; the
plan's figure is `plan.cpu_rank_runtime_gib`). The plan's per-rank tensor peak is small beside
that at small scale, so a job of many CPU ranks can exhaust the host while every rank "fits".
This module adds that runtime per rank against the host's available memory, refuses before any
process starts what cannot fit, and flags more ranks than the cores they may run on.

Under torchrun the ranks exist already when the plan is made (their memory is no longer
available): nothing is checked there.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from trainer.config import PlanConfig
from trainer.units import GIB
from trainer.world import is_under_torchrun, usable_cores


@dataclass(frozen=True)
class HostBudget:
    """This host's CPU ranks against its memory and cores."""

    ranks: int
    runtime_bytes: int
    """Each rank's process runtime (plan.cpu_rank_runtime_gib)."""
    tensor_bytes: int
    """The worst rank's planned tensor peak."""
    available_bytes: int
    cores: int

    @property
    def need_bytes(self) -> int:
        return self.ranks * (self.runtime_bytes + self.tensor_bytes)

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.available_bytes

    def most_ranks(self) -> int:
        """The most ranks whose runtime and tensors fit (the tensors of a rank held at their planned size)."""
        return self.available_bytes // (self.runtime_bytes + self.tensor_bytes)

    def describe(self) -> str:
        """The plan's line for the host: the per-rank runtime as its own figure, the total, the cores."""
        return (
            f"host: {self.ranks} CPU ranks x ({self.runtime_bytes / GIB:.2f} GiB process runtime per rank "
            f"(plan.cpu_rank_runtime_gib) + {self.tensor_bytes / GIB:.3f} GiB tensors) = {self.need_bytes / GIB:.2f} GiB "
            f"of {self.available_bytes / GIB:.1f} GiB available; {self.cores} cores"
        )


def host_budget(
    plan: PlanConfig, nodes: int, device_kind: str, world_size: int, tensor_bytes: int
) -> HostBudget | None:
    """The budget of CPU ranks this job would start on this host (None: GPU ranks, or ranks torchrun started)."""
    if device_kind != "cpu" or is_under_torchrun():
        return None
    cores = usable_cores()
    return HostBudget(
        ranks=world_size // nodes,  # this node's ranks; the other nodes are other hosts
        runtime_bytes=int(plan.cpu_rank_runtime_gib * GIB),
        tensor_bytes=tensor_bytes,
        available_bytes=psutil.virtual_memory().available,
        cores=cores,
    )


def host_refusal(budget: HostBudget | None) -> str | None:
    """One line when the ranks' processes would not fit the host's available memory, with a way out."""
    if budget is None or budget.fits:
        return None
    most = budget.most_ranks()
    way_out = f"Try nproc={most} (the most that fit here), or" if most >= 1 else "Free host memory, or"
    return (
        f"does not fit this host: {budget.ranks} CPU ranks each hold {budget.runtime_bytes / GIB:.2f} GiB of process "
        f"runtime (plan.cpu_rank_runtime_gib) + {budget.tensor_bytes / GIB:.3f} GiB of tensors = {budget.need_bytes / GIB:.1f} GiB, "
        f"but the host has {budget.available_bytes / GIB:.1f} GiB available. {way_out} plan.enforce=false to try anyway."
    )


def cores_warning(budget: HostBudget | None) -> str | None:
    """A warning when ranks outnumber the cores they may run on: they take turns, every step waits for the slowest."""
    if budget is None or budget.ranks <= budget.cores:
        return None
    return f"{budget.ranks} CPU ranks share {budget.cores} cores: they take turns; nproc={budget.cores} or fewer runs faster here"
