"""Start the ranks of one job with torch's elastic launcher (or join the ranks torchrun started)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import multiprocessing
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainer.config import OffloadTarget, from_plain
from trainer.console import first_line, one_line
from trainer.faults.failures import apply_memory_cap, explain, killed_by, recording_failures
from trainer.faults.stop import AGENT_SIGNALS, RankStop
from trainer.rank.cuda import apply_tf32, set_launcher_environment
from trainer.telemetry.comm import enable_recording
from trainer.telemetry.keys import Status
from trainer.world import init_world, shutdown_world


def fork_server() -> str:
    """The ranks' start method: each rank forks from multiprocessing's fork server, which has
    imported the ranks' modules once (trainer/rank/preload.py). Under spawn every rank imported
    torch and the trainer afresh, which cost more than a short job's training. The server is a
    fresh, single-threaded process that never touches a device, so CUDA is as safe as under
    spawn; it lives as long as this process, so the later jobs of a sweep fork from it at once."""
    multiprocessing.set_forkserver_preload(["trainer.rank.preload"])
    return "forkserver"


@dataclass
class RankFailure(Exception):
    """A rank died or raised; `cause` is one readable line; where the rank's record says, the step and phase."""

    rank: int
    exitcode: int
    cause: str
    oom: bool = False
    step: int | None = None
    phase: str | None = None
    node: int | None = None
    """The node the rank ran on, in a multi-node job (None: a one-node job)."""

    def __str__(self) -> str:
        where = f" at step {self.step} ({self.phase})" if self.step is not None else ""
        on = f" on node {self.node}" if self.node is not None else ""
        return f"rank {self.rank}{on} {'ran out of memory' if self.oom else 'failed'}{where}: {self.cause}"


@record
def rank_main(
    plain: dict[str, Any], out_dir: str, device_kind: str, predicted: dict[str, float]
) -> dict[str, Any] | None:
    """The entry point of every rank: plain config and the job's plan figures in, rank 0's final figures out."""
    from trainer.rank.loop import train  # imported in the rank: the job process never builds a model
    from trainer.rank.nonfinite import NonFiniteError

    # Before anything slow: from here a signal is a request to stop at a step boundary (trainer/faults/stop.py).
    stop = RankStop(Path(out_dir), watches_request=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    config = from_plain(plain)
    enable_recording(config, int(os.environ["WORLD_SIZE"]), device_kind)  # before the process group exists
    world = init_world(
        device_kind, offload_to_cpu=config.offload.target == OffloadTarget.cpu, out_dir=Path(out_dir)
    )
    if world.device.type == "cuda":
        apply_tf32(config.precision.tf32)
    apply_memory_cap(
        config.device_memory_gib, world.device
    )  # after init: the runtime is not the rank's budget
    with recording_failures(Path(out_dir), world.rank):  # failures/rank{r}.json: oom or not, step, phase
        try:
            result = train(config, world, Path(out_dir), stop, predicted)
        except NonFiniteError as err:
            # Every rank stops here together (they agreed), so this is an ending, not a crash: no
            # traceback, no elastic restart; the job records status `diverged` with this line.
            result = {"status": Status.diverged, "error": str(err)}
    # Not in a `finally`: a rank that raised must leave without the shutdown barrier, which its
    # peers (inside another collective) would never reach; the launcher stops them instead.
    shutdown_world()
    return result


def launch_local(
    plain: dict[str, Any],
    out_dir: Path,
    device_kind: str,
    nproc: int,
    max_restarts: int,
    predicted: dict[str, float],
) -> dict[str, Any] | None:
    """Run `nproc` ranks on this host, joining the other nodes' (`nodes`, `rdzv_endpoint`: trainer/cluster.py);
    returns the lowest local rank's result or raises RankFailure."""
    nodes = plain["nodes"]
    launch_config = LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        # Every node must name the same rendezvous: the shared output directory does; one node alone
        # gets a fresh id per job.
        run_id=hashlib.sha1(str(out_dir.resolve()).encode()).hexdigest()[:12]
        if nodes > 1
        else uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        # One node: localhost:0, the OS picks a free port, so concurrent jobs (sweeps) on one host
        # never collide. Several: the endpoint every node was given or derived from the allocation.
        rdzv_endpoint=plain["rdzv_endpoint"] or "localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=fork_server(),
        # SIGINT, SIGTERM and SIGUSR1 are the job's (trainer/faults/stop.py): the agent would turn them
        # into a SignalException and SIGTERM the ranks mid-step.
        signals_to_handle=",".join(AGENT_SIGNALS),
    )
    # The launcher logs every failed rank's whole traceback at ERROR level; the job reports the
    # failure in one line instead and keeps the traceback in failures/rank{r}.json.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(
        logging.ERROR
    )  # "Terminating process ... via SIGTERM"
    # With restarts, each attempt's ranks need a store of their own: the c10d rendezvous shares one
    # TCPStore across attempts by default, and a restarted rank can then read the dead attempt's
    # gloo/NCCL addresses and hang or fail to connect (pytorch/pytorch#135712; seen here as
    # "Gloo connectFullMesh failed ... Connection refused"). Rank 0 of each attempt hosts a fresh
    # store instead. Without restarts the shared store (no port race) stays.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1" if max_restarts > 0 else "0"
    set_launcher_environment()  # NCCL's error handling, which the agent would otherwise set for the ranks
    try:
        results = elastic_launch(launch_config, rank_main)(plain, str(out_dir), device_kind, predicted)
    except ChildFailedError as err:
        failure = with_record(first_failure(err), err, out_dir, capped=plain["device_memory_gib"] is not None)
        raise dataclasses.replace(failure, node=plain["node_rank"]) if nodes > 1 else failure from None
    except RendezvousConnectionError as err:
        # Another node ended and took the rendezvous store it hosted with it, while this node's
        # ranks were still running (they are stopped now): which rank failed is that node's to say.
        cause = one_line(err)
        raise RankFailure(rank=-1, exitcode=1, cause=cause, node=plain["node_rank"]) from None
    return results[
        min(results)
    ]  # rank 0's on its node; every rank returns the job's ending (diverged or not)


def with_record(failure: RankFailure, err: ChildFailedError, out_dir: Path, capped: bool) -> RankFailure:
    """The failure as the ranks' own records tell it (trainer/faults/failures.py): out of memory or not, step, phase."""
    exitcodes = {rank: f.exitcode for rank, f in err.failures.items()}
    record = explain(failure.rank, exitcodes, out_dir, capped)
    if record is None:
        return failure
    exitcode = exitcodes.get(record["rank"], failure.exitcode)
    return RankFailure(
        record["rank"], exitcode, record["message"], record["oom"], record["step"], record["phase"]
    )


def first_failure(err: ChildFailedError) -> RankFailure:
    """The failed rank with the earliest timestamp, with its exception message or its signal."""
    rank, failure = err.get_first_failure()
    cause = (
        killed_by(failure.exitcode)
        if failure.exitcode < 0
        else first_line(failure.message) or f"exit code {failure.exitcode}"
    )
    return RankFailure(rank=rank, exitcode=failure.exitcode, cause=cause)
