"""Where this process stands: its rank, the world size, its device and the process group."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import ConfigError, DeviceKind
from trainer.cuda import check_local_ranks, process_group_backend, set_rank_environment


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def usable_cores() -> int:
    """The cores this process may run on: taskset, a cgroup cpuset or a batch scheduler can allow
    fewer than the host has."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def rank_threads(local_world: int) -> int:
    """The intra-op threads of each of `local_world` ranks sharing this host: its usable cores, split."""
    return max(1, usable_cores() // local_world)


def resolve_device_kind(device: DeviceKind, must_be_visible: bool = True) -> str:
    """`auto` is CUDA when a GPU is visible, else CPU. Asking for CUDA without one is an error
    for a job that trains here; a plan (`must_be_visible=False`) may be for a GPU elsewhere."""
    if device == DeviceKind.auto:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == DeviceKind.cuda and must_be_visible and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; allowed here: auto, cpu")
    return device.value


def resolve_nproc(nproc: str, device_kind: str) -> int:
    """`auto` is every visible GPU, else 2 CPU ranks."""
    if nproc != "auto":
        count = int(nproc)
        if device_kind == "cuda" and count > torch.cuda.device_count():
            raise ConfigError(f"nproc={count} but only {torch.cuda.device_count()} CUDA devices are visible")
        return count
    return torch.cuda.device_count() if device_kind == "cuda" else 2


def is_under_torchrun() -> bool:
    """torchrun (or any elastic agent) sets these before starting this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def init_world(device_kind: str, offload_to_cpu: bool = False, out_dir: Path | None = None) -> World:
    """Join the process group the launcher described in the environment (RANK, MASTER_PORT, ...).

    On CUDA the group is bound to this rank's GPU (`device_id`: NCCL connects eagerly and knows
    its device) and has gloo beside NCCL under CPU offload (trainer/cuda.py says why).
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device_id = None
    if device_kind == "cuda":
        check_local_ranks(local_world)
        set_rank_environment(out_dir)  # before the allocator and NCCL start
        device = device_id = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Ranks sharing a host each take every core by default and thrash; split the usable ones. CUDA ranks
    # too: under offload=cpu each rank's AdamW steps its shard on the host.
    torch.set_num_threads(rank_threads(local_world))
    if not dist.is_initialized():
        backend = process_group_backend(device_kind, offload_to_cpu)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=10), device_id=device_id
        )
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown_world() -> None:
    """Leave the process group cleanly.

    gloo occasionally aborts at shutdown while tensors that reference the group are still
    alive; collecting them and meeting at a barrier first avoids it.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
