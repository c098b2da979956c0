"""The entry point of every rank, and how the ranks start (trainer/launch.py starts them from the
job process; under torchrun, trainer/job.py calls `rank_main` in each process torchrun started).

Here, in the rank's package, so the fork server's preload (trainer/rank/preload.py) and the
advisor's calibration ranks (trainer/advise/calibrate.py) import it without importing the launcher
that sits above them.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from trainer.config import from_plain
from trainer.cuda import apply_tf32
from trainer.faults.failures import apply_memory_cap, recording_failures
from trainer.faults.leftovers import die_with_parent
from trainer.faults.stop import RankStop
from trainer.telemetry.comm import enable_recording
from trainer.telemetry.keys import Status
from trainer.world import init_world, shutdown_world


def fork_server(plain: dict[str, Any] | None = None) -> str:
    """The ranks' start method: each rank forks from multiprocessing's fork server, which has
    imported the ranks' modules once (trainer/rank/preload.py). Under spawn every rank imported
    torch and the trainer afresh, which cost more than a short job's training. The server is a
    fresh, single-threaded process that never touches a device, so CUDA is as safe as under
    spawn; it lives as long as this process, so the later jobs of a sweep fork from it at once.

    torch.distributed.optim is preloaded only for a job (`plain`, the first of a sweep) whose ranks
    wrap their optimizer in it (wraps_optimizer): it scripts its functional optimizers with
    TorchScript when imported, a third of a CPU-second that every other job's server skips."""
    wrapped = ["torch.distributed.optim"] if plain is not None and wraps_optimizer(plain) else []
    multiprocessing.set_forkserver_preload([*wrapped, "trainer.rank.preload"])
    return "forkserver"


def wraps_optimizer(plain: dict[str, Any]) -> bool:
    """The ranks build ZeroRedundancyOptimizer (zero=stage1) or PostLocalSGDOptimizer
    (zero.sync_every > 1), both from torch.distributed.optim (trainer/rank/optim.py)."""
    return plain["zero"]["stage"] == "stage1" or plain["zero"]["sync_every"] > 1


@record
def rank_main(
    plain: dict[str, Any], out_dir: str, device_kind: str, predicted: dict[str, float]
) -> dict[str, Any] | None:
    """The entry point of every rank: plain config and the job's plan figures in, rank 0's final figures out."""
    from trainer.rank.loop import train  # imported in the rank: the job process never builds a model
    from trainer.rank.nonfinite import NonFiniteError

    if (
        multiprocessing.parent_process() is not None
    ):  # launched here (not under torchrun): the fork server's child
        die_with_parent()  # a fork server that is killed takes its ranks with it (trainer/faults/leftovers.py)
    # Before anything slow: from here a signal is a request to stop at a step boundary (trainer/faults/stop.py).
    stop = RankStop(Path(out_dir), watches_request=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    config = from_plain(plain)
    enable_recording(config, int(os.environ["WORLD_SIZE"]), device_kind)  # before the process group exists
    world = init_world(device_kind, offload_to_cpu=config.offload.on_host, out_dir=Path(out_dir))
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
