"""`memory.snapshot`: the CUDA allocator's history, dumped per rank when it runs out (`oom`) or after
named steps (`steps`), for pytorch.org/memory_viz; torchtitan's `--profiler.enable_memory_snapshot` is
the model. On CPU there is no allocator history: one line says so, and the tensor tracker's figures by
category (trainer/telemetry/memory.py) are written instead, as JSON beside where a snapshot would be.

Files: `memory_snapshots/rank{r}_oom.pickle` / `rank{r}_step{n}.pickle` (CUDA), `.json` (CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer.config import MemoryConfig, SnapshotMode
from trainer.private_apis.of_torch import dump_memory_snapshot, record_memory_history
from trainer.units import GIB

SNAPSHOT_DIR = "memory_snapshots"
VIEW = "drag it into https://pytorch.org/memory_viz to see every allocation over time with its stack"
CPU_LINE = (
    "memory.snapshot: snapshots need CUDA (the allocator's history); writing the tensor tracker's "
    "figures by category instead"
)


class Snapshots:
    """One rank's snapshots: recording started at construction where the device has a history."""

    def __init__(self, config: MemoryConfig, device: torch.device, out_dir: Path, rank: int) -> None:
        self.mode, self.steps = config.snapshot, set(config.snapshot_steps)
        self.cuda = device.type == "cuda"
        self.dir, self.rank = out_dir / SNAPSHOT_DIR, rank
        if self.mode == SnapshotMode.off:
            return
        if self.cuda:
            record_memory_history(config.snapshot_max_entries)
        elif rank == 0:
            print(CPU_LINE, flush=True)
        ACTIVE[:] = [self]  # the failure path finds it (trainer/faults/failures.py)

    def tracks(self, step: int) -> bool:
        """Whether a CPU rank must track tensors on this step to write its figures."""
        return not self.cuda and self.mode == SnapshotMode.steps and step in self.steps

    def after_step(self, step: int, categories: dict[str, float] | None) -> Path | None:
        """After a named step: the snapshot (CUDA) or the step's peak by category (CPU)."""
        if self.mode != SnapshotMode.steps or step not in self.steps:
            return None
        return self._write(f"step{step}", categories)

    def on_oom(self, categories: dict[str, float] | None) -> Path | None:
        """When this rank ran out: what it held by category (CPU) or the allocator's history (CUDA)."""
        return None if self.mode == SnapshotMode.off else self._write("oom", categories)

    def _write(self, tag: str, categories: dict[str, float] | None) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.cuda:
            path = self.dir / f"rank{self.rank}_{tag}.pickle"
            dump_memory_snapshot(str(path))
            print(f"memory snapshot of rank {self.rank}: {path}; {VIEW}", flush=True)
            return path
        path = self.dir / f"rank{self.rank}_{tag}.json"
        gib = {name: value / GIB for name, value in (categories or {}).items()}
        path.write_text(json.dumps({"rank": self.rank, "at": tag, "gib": gib}, indent=1) + "\n")
        return path


ACTIVE: list[Snapshots] = []
"""This rank's Snapshots, once the loop made it (one per rank process)."""
