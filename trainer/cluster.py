"""Beyond one host: where this node stands in a multi-node job, and Hydra's submitit launchers.

Multi-node: each node's Hydra job starts its own `nproc` ranks with torch's elastic launcher,
and every node's launcher meets the others at one c10d rendezvous endpoint (`rdzv_endpoint`,
`nodes`), which assigns the global ranks. By hand the endpoint and `node_rank` are given on
the command line; inside a submitit job (conf/hydra/launcher/slurm.yaml) they come from the
allocation through submitit's own helpers: the first host of SLURM_JOB_NODELIST and a port
derived from the job id (submitit.helpers.TorchDistributedEnvironment), the node's SLURM_NODEID.

The launchers (hydra_plugins/zerolab_launchers: Hydra takes launchers only from the
`hydra_plugins` package) are hydra-submitit-launcher's, with `Requeueing` added. On preemption or
time-out the cluster signals the job (submitit's signal, USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise);
submitit's own handler would checkpoint and requeue at once, while the ranks are mid-step. Here
the job is first allowed to end as `preempted` (every rank saves), and only then submitit's
handler runs: it calls `checkpoint` below, which resubmits the same sweep point with
`resume=<its run directory>`, and requeues the job (`scontrol requeue`; the local executor
restarts it in place).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from trainer.config import ConfigError, TrainConfig
from trainer.faults.failures import FAILURES_DIR, weakness
from trainer.overrides import split_override
from trainer.telemetry.keys import Status

if TYPE_CHECKING:  # trainer/launch.py imports the elastic launcher, which only a job that trains needs
    from trainer.launch import RankFailure

# One node needs no agreed endpoint: port 0 lets the OS pick a free port for each job.
LOCAL_ENDPOINT = "localhost:0"
# How long a node whose ranks only lost a peer (or aborted) waits for the other nodes to say what happened.
PEER_WAIT_S = 30.0


@dataclass(frozen=True)
class Placement:
    """Where this node's ranks stand among every node's: how many nodes, which one, where they meet."""

    nodes: int
    node_rank: int
    """Node 0 plans, writes summary.json and owns the W&B run (trainer/job.py)."""
    rdzv_endpoint: str


def submitit_environment() -> Any | None:
    """submitit's view of the job this process runs in (SLURM or local executor), None outside one."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    import submitit

    return submitit.JobEnvironment()


def resolve_placement(config: TrainConfig) -> Placement:
    """This node's placement: from the allocation inside a submitit job, else from the command line."""
    job = submitit_environment()
    if job is None:
        if config.nodes > 1 and config.rdzv_endpoint is None:
            raise ConfigError(
                f"nodes={config.nodes} needs rdzv_endpoint=host:port (where every node's launcher meets) "
                "and node_rank on each node, or hydra/launcher=slurm"
            )
        return Placement(config.nodes, config.node_rank, config.rdzv_endpoint or LOCAL_ENDPOINT)
    if job.num_tasks != job.num_nodes:
        raise ConfigError(
            f"hydra.launcher.tasks_per_node must be 1 (got {job.num_tasks // job.num_nodes}): each node's one task starts its nproc ranks"
        )
    if job.num_nodes != config.nodes:
        raise ConfigError(
            f"nodes={config.nodes} but the allocation has {job.num_nodes} node(s); set hydra.launcher.nodes=${{nodes}}"
        )
    if config.nodes == 1:
        return Placement(1, 0, config.rdzv_endpoint or LOCAL_ENDPOINT)
    from submitit.helpers import TorchDistributedEnvironment

    derived = TorchDistributedEnvironment()  # first host of the allocation, a port seeded by the job id
    return Placement(
        config.nodes, job.node, config.rdzv_endpoint or f"{derived.master_addr}:{derived.master_port}"
    )


def place_node(config: TrainConfig) -> TrainConfig:
    """The config with this node's placement filled in (resolve_placement); torchrun placed its ranks itself."""
    from trainer.world import is_under_torchrun

    if is_under_torchrun():
        return config
    placement = resolve_placement(config)
    return dataclasses.replace(config, node_rank=placement.node_rank, rdzv_endpoint=placement.rdzv_endpoint)


def node_failure_path(out_dir: Path, node: int) -> Path:
    return out_dir / FAILURES_DIR / f"node{node}.json"


def job_failure(out_dir: Path, own: RankFailure, nodes: int) -> RankFailure:
    """The failure that ended a multi-node job, as every node tells it.

    Each node sees only its own ranks: when a rank on one node dies, the ranks of the others fail
    on the broken connection a moment later, raising a lost peer or aborting (trainer/faults/failures.py
    `weakness`). So each node writes its own failure to the shared output directory
    (failures/node{n}.json); a node whose ranks only lost a peer or aborted waits (at most
    PEER_WAIT_S, or until every node has written) for a node whose rank began it, and names the
    earliest of the strongest causes. The waiting also keeps this node's process, which may host the
    rendezvous store, alive: had the aborted node ended at once, the killed rank's node could have
    found the store gone before its launcher saw its own rank end, and known only that.
    """
    from trainer.launch import RankFailure  # a job that trains: the caller has imported it already

    if nodes == 1:
        return own
    path = node_failure_path(out_dir, own.node)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**dataclasses.asdict(own), "time": time.time()}) + "\n")
    if weakness(own.cause) == 0:
        return own
    deadline = time.monotonic() + PEER_WAIT_S
    while True:
        records = [json.loads(p.read_text()) for p in sorted((out_dir / FAILURES_DIR).glob("node*.json"))]
        strongest = min(weakness(r["cause"]) for r in records)
        if strongest == 0 or len(records) == nodes or time.monotonic() > deadline:
            first = min((r for r in records if weakness(r["cause"]) == strongest), key=lambda r: r["time"])
            return RankFailure(**{k: v for k, v in first.items() if k != "time"})
        time.sleep(0.2)


def gpus_per_node(nproc: str, device: Any, auto: int | None = None) -> int:
    """The `gpus_per_node` a launcher preset asks for: nproc GPUs, none for device=cpu; nproc=auto
    is `auto` GPUs (slurm: a typical 8-GPU node) or, with auto unset, every GPU this host sees."""
    if getattr(device, "value", device) == "cpu":  # the DeviceKind enum, or its name
        return 0
    if str(nproc).isdigit():
        return int(nproc)
    if auto is not None:
        return int(auto)
    import torch

    return torch.cuda.device_count()


def register_resolvers() -> None:
    """`${zerolab.gpus_per_node:${nproc},${device}[,auto]}` for conf/hydra/launcher/*.yaml (conf/zero's
    `${zerolab.reduce_every:...}` is registered by trainer/config/zero.py, which every composition imports)."""
    if not OmegaConf.has_resolver("zerolab.gpus_per_node"):
        OmegaConf.register_new_resolver("zerolab.gpus_per_node", gpus_per_node)


def resumed_overrides(overrides: list[str], run_dir: Path | None) -> list[str]:
    """A preempted point's overrides for its requeued run: resume from its own run directory's newest
    save (`resume=<run dir>`, the exact form of resume=true: that directory and its W&B run go on);
    unchanged when it had saved nothing."""
    from trainer.saves.dcp import latest_save
    from trainer.sweep import hydra_quote

    if run_dir is None or latest_save(run_dir) is None:
        return list(overrides)
    kept = [o for o in overrides if split_override(o)[0] != "resume"]
    return [*kept, f"resume={hydra_quote(str(run_dir))}"]  # quoted: a point's directory name has `=` and `,`


class Requeueing:
    """The requeue half of preemption, mixed into hydra-submitit-launcher's launchers (module docstring).

    submitit runs `__call__` in the job, with its own signal handler set: it would checkpoint and
    requeue on its signal at once. trainer/faults/stop.py takes the signal over while the job runs, so the
    ranks finish their step and save; once the job has ended `preempted`, `requeue_if_preempted`
    hands over to submitit's handler, which calls `checkpoint`, writes the resubmission and
    requeues (on SLURM only the allocation's first task does; the others just end).
    """

    run_dir: Path | None = None

    def __call__(self, sweep_overrides: list[str], *args: Any) -> Any:
        try:
            result = super().__call__(sweep_overrides, *args)  # type: ignore[misc]
        except SystemExit:  # a point stopped by a signal ends its sweep (trainer/sweep.py): here, its job
            self.requeue_if_preempted()
            raise
        self.requeue_if_preempted()
        return result

    def requeue_if_preempted(self) -> None:
        """Requeue through submitit when the job that just ran ended `preempted` (exits; else returns)."""
        from trainer.faults import stop
        from trainer.private_apis.of_submitit import requeue_signal
        from trainer.sweep import read_status

        job = stop.LAST
        if job is None or read_status(job.run_dir) != Status.preempted:
            return
        self.run_dir = job.run_dir
        signum = requeue_signal()
        handler = signal.getsignal(signum)  # submitit's SignalHandler.checkpoint_and_try_requeue
        if callable(handler):
            handler(signum, None)

    def checkpoint(self, sweep_overrides: list[str], *args: Any, **kwargs: Any) -> Any:
        """submitit's checkpoint hook: the same point again, resuming where it stopped."""
        import submitit

        return submitit.helpers.DelayedSubmission(
            self, resumed_overrides(sweep_overrides, self.run_dir), *args, **kwargs
        )
