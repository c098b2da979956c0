"""Stand-ins shared by unit tests: a tiny config and a one-rank World, fake saves, an allocator's out-of-memory message."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from trainer.config import TrainConfig, from_plain, to_plain
from trainer.world import World

# What torch's CPU allocator says when an allocation fails (trainer/faults/failures.py OOM_MARKERS).
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 8388608 bytes. Error code 12 (Cannot allocate memory)"
)

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def tiny_config(**overrides: object) -> TrainConfig:
    plain = to_plain(TrainConfig())
    plain.update(seq_len=32, micro_batch=2, steps=6, nproc="1", device="cpu", log_every=1)
    plain["model"].update(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=64, max_seq_len=64
    )
    plain["optim"].update(warmup_steps=2)
    plain["logger"]["backend"] = "none"
    for dotted, value in overrides.items():
        *path, key = dotted.split("__")
        node = plain
        for part in path:
            node = node[part]
        node[key] = value
    return from_plain(plain)


def fake_save(run_dir: Path, step: int, complete: bool = True, tmp: bool = False) -> Path:
    name = f"{'.tmp_' if tmp else ''}step_{step:08d}"
    path = run_dir / "checkpoints" / name
    path.mkdir(parents=True)
    if complete:  # a real, whole DCP save: resume checks a save's files against its metadata
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # no process group: intended
            dcp.save({"x": torch.zeros(1)}, checkpoint_id=path, no_dist=True)
    return path
