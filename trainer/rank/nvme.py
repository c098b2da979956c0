"""offload=nvme: AdamW whose moments live in a file per rank, streamed through one bounded host buffer.

torch has no disk tier for FSDP2 (DeepSpeed's ZeRO-Infinity and ColossalAI each ship their own, over
their own aio libraries), so the streaming is written here. The update itself is torch's: each chunk
goes through torch.optim.adamw.adamw's per-tensor path (foreach=False, the path torch's AdamW takes for
CPU tensors), which is elementwise, so a step in chunks gives the bits of one whole-tensor step: a run
under offload=nvme is bitwise the run under offload=cpu (tests/integration/test_nvme.py).

The file, `<offload.path>/zerolab-rank<R>.adam`, holds for each parameter (in the optimizer's order) its
exp_avg then its exp_avg_sq, each the size of the parameter's local shard rounded up to 1024 elements
(4 KiB, a page: every region starts page-aligned). It is made when the optimizer is built, its space
reserved (posix_fallocate: a full disk fails here, not mid-run), and unlinked at once: the open
descriptor and the mapping keep it, and its space returns to the disk when the rank exits, however it
exits. It is scratch space: saves hold the moments through torch.distributed.checkpoint.

A step reads each parameter's moments chunk by chunk into the buffer (`offload.buffer_mib`, allocated
once, half for exp_avg, half for exp_avg_sq), updates the chunk, and writes it back: 8 bytes read and 8
written per element of the rank's shards, counted and timed per step (`traffic`). The reads and writes
go through the page cache (buffered pread/pwrite); the rank's own memory holds the buffer and the
chunk's temporaries only.

Saves and resumes see the moments as tensors: the optimizer's state holds views of one shared mapping of
the file (MAP_SHARED, so coherent with pread/pwrite), wrapped as DTensors of the parameter's placement.
DCP reads them to save and writes into them to load: a save never copies the moments into memory, and a
save from offload=cpu or any world size loads into them (DCP reshards as for any DTensor). The mapping is
made by numpy and registered in trainee.ON_DISK, so the CPU cap and the memory figures leave it out (it is disk,
paged in and out by the kernel).
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from trainer.rank.trainee import ON_DISK

ALIGN = 1024
"""Elements per region rounding: 4 KiB of fp32, one page."""
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def file_name(rank: int) -> str:
    return f"zerolab-rank{rank}.adam"


def aligned(numel: int) -> int:
    return -(-numel // ALIGN) * ALIGN


def chunk_elements(buffer_bytes: int) -> int:
    """Elements per chunk: half the buffer each for exp_avg and exp_avg_sq, whole pages of fp32."""
    return max(ALIGN, buffer_bytes // 8 // ALIGN * ALIGN)


@dataclass
class DiskTraffic:
    """What one optimizer step moved between the buffer and the file."""

    read_bytes: int = 0
    written_bytes: int = 0
    wait_s: float = 0.0
    """Seconds in pread/pwrite: the step does nothing else meanwhile, so all of it is waiting on the disk."""


@dataclass(frozen=True)
class Region:
    """Where one parameter's moments sit in the file, in elements."""

    offset: int
    numel: int

    def start(self, key: str) -> int:
        """Byte offset of `key`'s region."""
        return 4 * (self.offset + (aligned(self.numel) if key == "exp_avg_sq" else 0))


class MomentsFile:
    """The rank's moments file: pread/pwrite of fp32 runs, and one shared mapping for DCP."""

    def __init__(self, directory: Path, rank: int, numel: int) -> None:
        path = directory / file_name(rank)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            reserve(self.fd, max(4, 4 * numel))
            self.mapping = torch.empty(0)
            if numel:  # (an empty tensor's address is 0, every freed storage's too: never registered)
                mapped = np.memmap(path, dtype=np.float32, mode="r+", shape=(numel,))
                # Registered before torch sees it: torch.from_numpy is an op the CPU cap would count.
                ON_DISK.add(mapped.ctypes.data)
                self.mapping = torch.from_numpy(mapped)
        finally:
            path.unlink()  # the descriptor and the mapping keep the file until the rank exits
        self.traffic = DiskTraffic()

    def read(self, into: torch.Tensor, offset: int) -> None:
        self._move(os.preadv, into, offset)
        self.traffic.read_bytes += into.nbytes

    def write(self, source: torch.Tensor, offset: int) -> None:
        self._move(os.pwritev, source, offset)
        self.traffic.written_bytes += source.nbytes

    def _move(self, call, tensor: torch.Tensor, offset: int) -> None:  # noqa: ANN001 (os.preadv / os.pwritev)
        view = memoryview(tensor.numpy()).cast("B")
        began = time.perf_counter()
        while view:  # both may move fewer bytes than asked
            moved = call(self.fd, [view], offset)
            if moved <= 0:
                raise OSError(f"offload=nvme: the moments file ended at byte {offset}")
            view, offset = view[moved:], offset + moved
        self.traffic.wait_s += time.perf_counter() - began


def reserve(fd: int, nbytes: int) -> None:
    """The file at its full size, zeros: its blocks allocated now (posix_fallocate), so that a disk too full
    fails here and not mid-run; where the file system cannot (EOPNOTSUPP, EINVAL: some network ones), sized
    sparse, as the job process's free-space check (trainer/plan/disk.py) then stands alone."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)


class NvmeAdamW(torch.optim.AdamW):
    """torch's AdamW with exp_avg and exp_avg_sq in a file (MomentsFile), stepped chunk by chunk."""

    def __init__(self, params, directory: Path, rank: int, buffer_bytes: int, **adamw) -> None:  # noqa: ANN001
        super().__init__(params, foreach=False, **adamw)
        params = [p for group in self.param_groups for p in group["params"]]
        self.regions: dict[torch.Tensor, Region] = {}
        offset = 0
        for p in params:
            self.regions[p] = Region(offset, local(p).numel())
            offset += 2 * aligned(local(p).numel())
        self.file = MomentsFile(directory, rank, offset)
        chunk = chunk_elements(buffer_bytes)
        self.buffer = torch.empty(buffer_bytes // 4)  # held for the run: the plan's offload.buffer_mib
        self.halves = (self.buffer[:chunk], self.buffer[chunk : 2 * chunk])
        for p in params:  # made now, not at the first step: DCP's state dict needs them before it
            self.state[p] = {"step": torch.tensor(0.0), **self._mapped(p)}

    def _mapped(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """exp_avg and exp_avg_sq as views of the mapping, shaped and placed like the parameter."""
        region, shape = self.regions[p], local(p).shape
        views = {
            key: self.file.mapping[region.start(key) // 4 :][: region.numel].view(shape) for key in STATE_KEYS
        }
        if not isinstance(p, DTensor):
            return views
        return {
            key: DTensor.from_local(
                view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            for key, view in views.items()
        }

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch.optim.Optimizer.step's signature)
        assert closure is None, "offload=nvme: AdamW takes no closure"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group)
        return None

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        param, grad = local(p).view(-1), local(p.grad).view(-1)
        region, counter = self.regions[p], self.state[p]["step"]
        size = len(self.halves[0])
        for start in range(0, region.numel, size):
            stop = min(region.numel, start + size)
            moments = [half[: stop - start] for half in self.halves]
            for key, half in zip(STATE_KEYS, moments):
                self.file.read(half, region.start(key) + 4 * start)
            adamw(
                [param[start:stop]],
                [grad[start:stop]],
                *([m] for m in moments),
                [],
                [counter.clone()],  # adamw counts it up: each chunk starts from the step's count
                foreach=False,
                amsgrad=False,
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
            for key, half in zip(STATE_KEYS, moments):
                self.file.write(half, region.start(key) + 4 * start)
        counter += 1

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then the moments into the file: DCP loaded them there in place already (the
        state's tensors are the mapping's views), but a state dict from elsewhere is copied in."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            mapped = self._mapped(p)
            for key in STATE_KEYS:
                loaded = local(state[key])
                if loaded.untyped_storage().data_ptr() != self.file.mapping.untyped_storage().data_ptr():
                    local(mapped[key]).copy_(loaded)
            state.update(mapped)

    def take_traffic(self) -> DiskTraffic:
        """The reads, writes and wait since the last call (a skipped step's: none), counting afresh."""
        traffic, self.file.traffic = self.file.traffic, DiskTraffic()
        return traffic

    def in_memory(self) -> list[torch.Tensor]:
        """What this optimizer holds in memory: the buffer and the step counters (what memory tracking registers)."""
        return [self.buffer, *(state["step"] for state in self.state.values())]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own elements: a DTensor's local shard (a view of it, under no_grad), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
