"""offload=nvme in the plan: Adam's moments in a file per rank, what the files take and what a step moves.

The runtime (trainer/rank/nvme.py) keeps each rank's `exp_avg` and `exp_avg_sq` (fp32) in
`<offload.path>/zerolab-rank<R>.adam`: for every parameter, in the optimizer's order, a region of
exp_avg then exp_avg_sq, each of the parameter's local-shard numel n (the DTensor's to_local(): FSDP2's
unpadded shard) rounded up to a multiple of 1024 elements (4 KiB, a page). So, per rank:

    file bytes      F = Σ_p 2 · 4 · ⌈n_p / 1024⌉ · 1024
    read per step   R = 8 · Σ_p n_p   (each moment chunk read once: the plan's RankStates.optimizer)
    written         W = R
    stall per step  S = Σ_node (R + W) / disk bandwidth   (the node's ranks share its disk)

The step streams the moments through one host buffer per rank of `offload.buffer_mib` MiB, made once,
split in two halves (m and v) of `chunk` elements each:

    chunk = max(1024, ⌊offload.buffer_mib · 2^20 / 8 / 1024⌋ · 1024)

and runs torch's per-tensor AdamW on each chunk, whose temporaries (`exp_avg_sq.sqrt()` and its
quotient) are 2 · 4 · min(chunk, n) bytes and freed before the next chunk.

The bandwidth is `plan.disk_gbps` (GB/s, 10^9 bytes, per node), else, for a job that trains on this
host, one measurement of `offload.path` per process (`measure_disk`: a file of MEASURE_BYTES written,
fsync'd, evicted from the page cache and read back with os.pwrite/os.pread, then deleted), else unknown
and the traffic is printed without a stall. For scale: DeepNVMe measured 10 GB/s reads and 5 GB/s writes on
4 PCIe Gen4 NVMe drives, 48/26 GB/s on 8 Gen5 (DeepSpeed, blogs/deepnvme).

`check_offload_path` refuses, before any rank starts, a path that does not exist, is not a writable
directory, or has less free space than the files of this node's ranks.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.config import ConfigError, Mode, OffloadTarget, TrainConfig
from trainer.layout import Layout
from trainer.plan.pipeline import rank_model_shapes
from trainer.plan.states import ModelShape, RankStates, model_shape, shard_rows
from trainer.units import GIB, MIB

PAGE_ELEMENTS = 1024
"""Each moment's region in a rank's file is rounded up to this many fp32 elements (4 KiB)."""
MEASURE_BYTES = 256 * MIB
"""The file `measure_disk` writes and reads back: large enough to pass the drive's own cache."""
GB = 1e9


# ----------------------------------------------------------------------------- the runtime's arithmetic


def nvme_chunk(buffer_mib: int) -> int:
    """Elements of one moment chunk: half the buffer's fp32 elements, whole pages, at least one page."""
    return max(PAGE_ELEMENTS, (buffer_mib * MIB // 8) // PAGE_ELEMENTS * PAGE_ELEMENTS)


def nvme_buffer_bytes(buffer_mib: int) -> int:
    """The rank's one host buffer, allocated with the optimizer and kept for the run."""
    return buffer_mib * MIB


def chunk_temporary_bytes(buffer_mib: int, largest_numel: int) -> int:
    """AdamW's temporaries on one chunk (sqrt and its quotient), at the rank's largest tensor."""
    return 2 * 4 * min(nvme_chunk(buffer_mib), largest_numel)


def region_bytes(numel: int) -> int:
    """One moment of one parameter in the file: its elements rounded up to whole pages."""
    return 4 * -(-numel // PAGE_ELEMENTS) * PAGE_ELEMENTS


def file_bytes(shape: ModelShape, shard_size: int, place: int) -> int:
    """The file of the rank at `place` in a shard group of `shard_size`: both moments of every parameter."""
    counts = Counter(shape.order)
    return sum(
        n * 2 * region_bytes(shard_rows(s[0], shard_size, place) * math.prod(s[1:]))
        for s, n in counts.items()
    )


def rank_file(path: str | Path, rank: int) -> Path:
    """Rank R's file (trainer/rank/nvme.py names it so)."""
    return Path(path) / f"zerolab-rank{rank}.adam"


def shard_size(config: TrainConfig, world_size: int) -> int:
    """The ranks FSDP2 shards over: the world, or HSDP's shard group, times parallel.cp (trainer/plan/build.py's
    `sharded_over`, trainer/layout.py `shard_size`)."""
    return Layout.from_config(config, world_size).shard_size()


def node_file_bytes(config: TrainConfig, world_size: int, node: int) -> dict[int, int]:
    """Each rank of `node` and the bytes of its file (under parallel.pp, of its stages' parameters)."""
    layout, size = Layout.from_config(config, world_size), shard_size(config, world_size)
    shapes, per_node = rank_model_shapes(config, model_shape(config.model)), world_size // config.nodes
    ranks = range(node * per_node, (node + 1) * per_node)
    return {r: file_bytes(shapes[layout.coords(r)["pp"]], size, layout.shard_index(r)) for r in ranks}


# ----------------------------------------------------------------------------- the disk's bandwidth


@dataclass(frozen=True)
class DiskRate:
    """The disk's bandwidth for the stall (bytes/s, None: unknown) and where the figure comes from."""

    bytes_per_s: float | None
    source: str


@functools.lru_cache(maxsize=8)
def measure_disk(path: str, size: int | None = None) -> DiskRate:
    """Write then read back a file of `size` bytes (MEASURE_BYTES) at `path` in the runtime's chunks, fsync'd
    and evicted from the page cache before the read, then delete it; once per path in a process. The rate
    is the bytes moved over the time both took, 2·size / (t_write + t_read): the stall's formula moves as
    many bytes each way. Prints the figures."""
    size = size or MEASURE_BYTES
    block = bytes(min(size, 32 * MIB))
    fd, name = tempfile.mkstemp(prefix="zerolab-disk-", suffix=".tmp", dir=path)
    try:
        start = time.perf_counter()
        for offset in range(0, size, len(block)):
            os.pwrite(fd, block[: size - offset], offset)
        os.fsync(fd)
        written = time.perf_counter()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the disk, not the page cache
        begun = time.perf_counter()
        for offset in range(0, size, len(block)):
            os.pread(fd, len(block), offset)
        read = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(name)
    write_s, read_s = written - start, read - begun
    rate = 2 * size / (write_s + read_s)
    print(
        f"disk: measured offload.path={path}: {size / MIB:.0f} MiB written at {size / write_s / GB:.2f} GB/s "
        f"(fsync'd), read back at {size / read_s / GB:.2f} GB/s; {rate / GB:.2f} GB/s both ways for the stall "
        "(set plan.disk_gbps to use another figure)",
        flush=True,
    )
    return DiskRate(rate, f"measured on {path}: {rate / GB:.2f} GB/s")


def disk_rate(config: TrainConfig) -> DiskRate:
    """plan.disk_gbps, else a measurement of offload.path when the job trains on this host, else unknown."""
    if config.plan.disk_gbps is not None:
        return DiskRate(config.plan.disk_gbps * GB, f"plan.disk_gbps={config.plan.disk_gbps:g}")
    if config.mode != Mode.train or config.plan.accelerator is not None or config.offload.path is None:
        return DiskRate(None, "unknown: give plan.disk_gbps")
    try:
        return measure_disk(config.offload.path)
    except OSError as err:
        return DiskRate(None, f"unknown: could not measure offload.path ({err}); give plan.disk_gbps")


# ----------------------------------------------------------------------------- the plan's part


@dataclass(frozen=True)
class DiskPlan:
    """offload=nvme: node 0's ranks' files (every node holds alike or less), their traffic, the stall."""

    path: str
    file_bytes: tuple[int, ...]
    """Each rank's file, node 0's ranks in order."""
    moment_bytes: tuple[int, ...]
    """Each rank's moments, 8 B an element, unpadded: what its step reads, and writes, once."""
    buffer_bytes: int
    chunk: int
    rate: DiskRate

    @property
    def file_bytes_per_rank(self) -> int:
        return max(self.file_bytes)

    @property
    def file_bytes_per_node(self) -> int:
        return sum(self.file_bytes)

    @property
    def read_bytes_per_rank(self) -> int:
        """Bytes one rank reads per optimizer step (as many as it writes)."""
        return max(self.moment_bytes)

    @property
    def written_bytes_per_rank(self) -> int:
        return max(self.moment_bytes)

    @property
    def traffic_bytes_per_node(self) -> int:
        """Read plus written by the node's ranks per optimizer step: what its disk carries."""
        return 2 * sum(self.moment_bytes)

    @property
    def stall_s(self) -> float | None:
        """Seconds per optimizer step the node's disk needs for it (None: no bandwidth known)."""
        rate = self.rate.bytes_per_s
        return None if rate is None else self.traffic_bytes_per_node / rate

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "ranks_per_node": len(self.file_bytes),
            "file_bytes_per_rank": self.file_bytes_per_rank,
            "file_bytes_per_node": self.file_bytes_per_node,
            "read_bytes_per_rank_per_step": self.read_bytes_per_rank,
            "written_bytes_per_rank_per_step": self.written_bytes_per_rank,
            "traffic_bytes_per_node_per_step": self.traffic_bytes_per_node,
            "buffer_bytes_per_rank": self.buffer_bytes,
            "chunk_elements": self.chunk,
            "disk_bytes_per_s": self.rate.bytes_per_s,
            "disk_source": self.rate.source,
            "stall_s_per_step": self.stall_s,
        }


def build_disk_plan(
    config: TrainConfig, world_size: int, shape: ModelShape, states: Sequence[RankStates], *, shard: int
) -> DiskPlan | None:
    """Node 0's files and traffic under offload=nvme (None otherwise); `states` every rank's, in rank order,
    `shard` the ranks FSDP2 shards over; under parallel.pp each rank's file holds its stages' parameters'."""
    if config.offload.target != OffloadTarget.nvme:
        return None
    layout = Layout.from_config(config, world_size)
    ranks = range(world_size // config.nodes)
    shapes = rank_model_shapes(config, shape)
    return DiskPlan(
        str(config.offload.path),
        tuple(file_bytes(shapes[layout.coords(r)["pp"]], shard, layout.shard_index(r)) for r in ranks),
        tuple(states[r].optimizer for r in ranks),
        nvme_buffer_bytes(config.offload.buffer_mib),
        nvme_chunk(config.offload.buffer_mib),
        disk_rate(config),
    )


# ----------------------------------------------------------------------------- refusals before any rank


def check_offload_path(config: TrainConfig, world_size: int) -> None:
    """A job that trains here under offload=nvme: offload.path must be an existing, writable directory with room
    for the files of this node's ranks (files of the same names there already count as room: they are
    overwritten). ConfigError, one line, otherwise."""
    if (
        config.offload.target != OffloadTarget.nvme
        or config.mode != Mode.train
        or config.offload.path is None
    ):
        return
    path = Path(config.offload.path)
    if not path.exists():
        raise ConfigError(
            f"offload.path={path} does not exist: offload=nvme keeps Adam's moments in files there; "
            "give an existing directory on local disk"
        )
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"offload.path={path} is not a writable directory: offload=nvme writes a file per rank there; "
            "give a directory this user can write"
        )
    files = node_file_bytes(config, world_size, config.node_rank)
    need = sum(files.values())
    there = sum(rank_file(path, r).stat().st_size for r in files if rank_file(path, r).is_file())
    free = shutil.disk_usage(path).free + there
    if free < need:
        raise ConfigError(
            f"offload.path={path} has {size_text(free)} free, but the files of Adam's moments of this node's "
            f"{len(files)} ranks take {size_text(need)} ({size_text(max(files.values()))} per rank): free space "
            "there, give a larger disk, or more nodes"
        )


def size_text(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    unit, size = ("GiB", GIB) if n >= GIB else ("MiB", MIB)
    return f"{n / size:.2f} {unit}"
