"""Start the ranks of one job with torch's elastic launcher (or join the ranks torchrun started)."""

from __future__ import annotations

import logging
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainer.config import from_plain
from trainer.world import init_world, shutdown_world


@dataclass
class RankFailure(Exception):
    """A rank died or raised; `cause` is one readable line."""

    rank: int
    exitcode: int
    cause: str

    def __str__(self) -> str:
        return f"rank {self.rank} failed: {self.cause}"


@record
def rank_main(plain: dict[str, Any], out_dir: str, device_kind: str) -> dict[str, Any] | None:
    """The entry point of every rank: plain config in, rank 0's final figures out."""
    from trainer.loop import train  # imported in the rank: the job process never builds a model

    config = from_plain(plain)
    world = init_world(device_kind)
    try:
        return train(config, world, Path(out_dir))
    finally:
        shutdown_world()


def launch_local(plain: dict[str, Any], out_dir: Path, device_kind: str, nproc: int, max_restarts: int) -> dict[str, Any] | None:
    """Run `nproc` ranks on this host; returns rank 0's result or raises RankFailure."""
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        # Port 0: the OS picks a free port, so concurrent jobs (sweeps) on one host never collide.
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    try:
        results = elastic_launch(launch_config, rank_main)(plain, str(out_dir), device_kind)
    except ChildFailedError as err:
        raise first_failure(err) from None
    return results.get(0)


def first_failure(err: ChildFailedError) -> RankFailure:
    """The failed rank with the earliest timestamp, with its exception message or its signal."""
    rank, failure = err.get_first_failure()
    if failure.exitcode < 0:
        name = signal.Signals(-failure.exitcode).name
        cause = f"killed by {name} (exit code {failure.exitcode})"
    else:
        cause = last_line(failure.message) or f"exit code {failure.exitcode}"
    return RankFailure(rank=rank, exitcode=failure.exitcode, cause=cause)


def last_line(message: Any) -> str:
    """The exception line of a recorded error (`message` is a dict or a string by torch version)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""
