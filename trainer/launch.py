"""Start the ranks of one job with torch's elastic launcher; what each rank runs is trainer/rank/main.py."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import psutil
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainer.console import first_line, one_line, warn
from trainer.cuda import set_launcher_environment
from trainer.faults.failures import explain, killed_by
from trainer.faults.failures import where as failure_where
from trainer.faults.leftovers import Leftover, mark_job, reap
from trainer.faults.stop import AGENT_SIGNALS
from trainer.private_apis.of_torch import name_rendezvous_events_cheaply
from trainer.rank.main import fork_server, rank_main


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
    who: str | None = None
    """What failed when it was not one rank (the ranks' fork server); None: rank `rank`."""
    record: dict[str, Any] | None = None
    """The rank's failure record (trainer/faults/failures.py), where it left one."""

    def __str__(self) -> str:
        where = f" at step {self.step} ({self.phase})" if self.step is not None else ""
        if self.oom and self.record and self.step is not None:  # the block and micro-batch too
            where = f" at {failure_where(self.record)}"
        on = f" on node {self.node}" if self.node is not None else ""
        who = self.who or f"rank {self.rank}"
        return f"{who}{on} {'ran out of memory' if self.oom else 'failed'}{where}: {self.cause}"


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
    name_rendezvous_events_cheaply()  # half a CPU-second of every job's launcher (of_torch)
    set_launcher_environment()  # NCCL's error handling, which the agent would otherwise set for the ranks
    marker = mark_job()  # before the fork server starts: it and every process below it inherit it
    start_method = fork_server(plain)  # sets what the server preloads: before it starts
    server = start_fork_server()
    # The launcher's directory for its ranks' error files (no output is redirected): left to itself,
    # torch makes a /tmp/torchelastic_* per job and never removes it; this one goes when the job ends.
    launcher_dir = Path(tempfile.mkdtemp(prefix="zerolab_launcher_"))
    try:
        launch_config = local_launch_config(plain, out_dir, nproc, max_restarts, start_method, launcher_dir)
        results = elastic_launch(launch_config, rank_main)(plain, str(out_dir), device_kind, predicted)
    except ChildFailedError as err:
        if not is_alive(server):  # its ranks died with it (trainer/faults/leftovers.py)
            raise fork_server_failure(server, reap(marker)) from None
        failure = with_record(first_failure(err), err, out_dir, capped=plain["device_memory_gib"] is not None)
        raise dataclasses.replace(failure, node=plain["node_rank"]) if nodes > 1 else failure from None
    except RendezvousConnectionError as err:
        # Another node ended and took the rendezvous store it hosted with it, while this node's
        # ranks were still running (they are stopped now): which rank failed is that node's to say.
        cause = one_line(err)
        raise RankFailure(rank=-1, exitcode=1, cause=cause, node=plain["node_rank"]) from None
    finally:
        if leftovers := reap(marker):  # none when the launcher stopped every rank, as it should
            warn(f"ended {len(leftovers)} processes that outlived the launcher: {killed_list(leftovers)}")
        shutil.rmtree(launcher_dir, ignore_errors=True)
    return results[
        min(results)
    ]  # rank 0's on its node; every rank returns the job's ending (diverged or not)


def local_launch_config(
    plain: dict[str, Any], out_dir: Path, nproc: int, max_restarts: int, start_method: str, launcher_dir: Path
) -> LaunchConfig:
    """The elastic launcher's settings for this node's `nproc` ranks."""
    nodes = plain["nodes"]
    return LaunchConfig(
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
        start_method=start_method,
        # SIGINT, SIGTERM and SIGUSR1 are the job's (trainer/faults/stop.py): the agent would turn them
        # into a SignalException and SIGTERM the ranks mid-step.
        signals_to_handle=",".join(AGENT_SIGNALS),
        logs_specs=DefaultLogsSpecs(log_dir=str(launcher_dir)),
    )


def start_fork_server() -> psutil.Process | None:
    """Start multiprocessing's fork server now (the launcher would at its first rank) and find it
    among this process's children, to tell later whether it is the process that died."""
    forkserver.ensure_running()
    servers = [
        child
        for child in psutil.Process().children()
        if "multiprocessing.forkserver" in " ".join(child.cmdline())
    ]
    return servers[-1] if servers else None


def is_alive(proc: psutil.Process | None) -> bool:
    """Whether `proc` runs (a zombie has ended; None: not known, taken as alive)."""
    try:
        return proc is None or proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def killed_list(leftovers: list[Leftover]) -> str:
    return ", ".join(f"{left.what} (pid {left.pid})" for left in leftovers)


def fork_server_failure(server: psutil.Process, leftovers: list[Leftover]) -> RankFailure:
    """The job's account when the fork server died under its ranks (the launcher only sees every
    rank's line to it break, as exit code 255)."""
    cause = "killed from outside (the OOM killer, or kill)"
    after = f"; ended what it left: {killed_list(leftovers)}" if leftovers else "; every rank died with it"
    return RankFailure(-1, 255, cause + after, who=f"the ranks' fork server (pid {server.pid})")


def with_record(failure: RankFailure, err: ChildFailedError, out_dir: Path, capped: bool) -> RankFailure:
    """The failure as the ranks' own records tell it (trainer/faults/failures.py): out of memory or not, step, phase."""
    exitcodes = {rank: f.exitcode for rank, f in err.failures.items()}
    record = explain(failure.rank, exitcodes, out_dir, capped)
    if record is None:
        return failure
    exitcode = exitcodes.get(record["rank"], failure.exitcode)
    return RankFailure(
        record["rank"],
        exitcode,
        record["message"],
        record["oom"],
        record["step"],
        record["phase"],
        record=record,
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
