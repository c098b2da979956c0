"""Every save of a rank's run, written in place or in the background (`save.async_mode`), and timed.

`off`: trainer/saves/dcp.py's save_training_state, every rank waits for the write.
`thread` / `process`: torch.distributed.checkpoint.async_save, with torch's own DefaultStager:

1. the save in flight, if any, is waited for first: at most one in flight (its staging copy is
   the one the next save reuses, and two writers would only contend for the disk); the wait
   counts in this save's blocking time, and a wait of a second or more is said on the console;
2. rank 0 clears `.tmp_step_k`, a barrier, then `async_save` stages the state (a copy of every
   tensor into host memory: pinned on CUDA, shared with the writer process in `process` mode;
   the stager keeps these buffers for the next save) and returns; the step loop goes on while a
   thread of the rank (`thread`) or a process of its own (`process`, spawned by torch at the first
   save) writes the staged copy into `.tmp_step_k`;
3. the save becomes one only on rank 0, once its write has completed: DCP's coordinator writes
   `.metadata` only after it has gathered every rank's write results, so by then every rank's
   data is on disk. Rank 0 then checks the files against the metadata (integrity.py) and renames
   the directory into place (dcp.publish). A job killed before that leaves a `.tmp_*` directory,
   never listed, and resumes from the save before.

The first save's one-time costs are paid beside the steps, after the first step (the optimizer's
state exists from then, and building its state dict earlier would make torch initialise it with a
step of its own): `prepare` hands the stager the whole state once on a thread of this module (it
allocates, and on CUDA pins, the staging copy every save reuses: at 125m, 1 GiB of shared memory
per rank in `process` mode), and in `process` mode starts torch's save process with an empty save
(its start is a fresh Python importing torch, 20-30 s on a loaded 2-core host). The first save
waits for what is left of it (in its blocking time, as for a save in flight); its own figures
are `time/save_prepare_blocking_s` and `time/save_prepare_total_s`.

The write runs its collectives on a gloo group of its own (torchtitan does the same): in a thread
beside the step loop's own collectives on the default group, the two would interleave differently
on different ranks. The last step, a stop on a signal and a non-finite stop wait for the save in
flight (`drain`) before the rank returns.

Times per save (`SaveTimes`): what the step loop waited (`time/save_blocking_s`) and the time from
the save's start until it was complete and listed (`time/save_total_s`); in metrics.jsonl (the
next record after each), and every save's in summary.json through rank 0's result.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from trainer.config import SaveAsync
from trainer.faults.failures import mark_phase
from trainer.rank.trainee import Trainee
from trainer.saves.dcp import (
    Progress,
    SaveSpec,
    kill_if_rehearsing,
    prune,
    publish,
    save_name,
    save_training_state,
    saves_root,
    term_if_rehearsing,
    training_state,
)
from trainer.saves.integrity import SaveError, prepare_error, save_error, save_problem
from trainer.telemetry import keys
from trainer.world import World

CHECKPOINTER = {
    SaveAsync.thread: AsyncCheckpointerType.THREAD,
    SaveAsync.process: AsyncCheckpointerType.PROCESS,
}
SAY_WAIT_S = 1.0  # a wait for the save in flight this long or longer is said on the console
START_DIR = ".tmp_save_process_start"
"""The empty save that starts torch's save process (process mode): never listed, removed once written."""


@dataclass
class SaveTimes:
    """One save's figures, in seconds."""

    step: int
    blocking_s: float
    total_s: float | None = None
    """From the save's start until it was complete and listed (None: still in flight)."""


@dataclass
class Preparation:
    """The one-time set-up of background saves, under way beside the steps."""

    futures: list[Future]
    """The staging copy's allocation, and in process mode the empty save that starts the save process."""
    started: float
    blocking_s: float = 0.0
    """What the step loop waited to start it (the state dict; in process mode a broadcast)."""
    total_s: float | None = None
    """From its start until the staging copy was allocated and the save process ready."""


@dataclass
class InFlight:
    """The save being written in the background."""

    times: SaveTimes
    future: Future
    tmp: Path
    final: Path
    started: float


def staging_options(mode: SaveAsync, device_kind: str) -> StagingOptions:
    """Pinned staging where a GPU copies to the host; shared memory where a process writes it."""
    cuda = device_kind == "cuda"
    return StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=mode == SaveAsync.process,
        use_async_staging=False,  # staged before async_save returns: the next step may change every tensor
        use_non_blocking_copy=cuda,
    )


class Saves:
    """A rank's saves: `save` at a save step, `poll` at every step, `drain` before the rank returns."""

    def __init__(self, spec: SaveSpec, world: World, run_dir: Path, trainee: Trainee) -> None:
        self.spec, self.world, self.run_dir, self.trainee = spec, world, run_dir, trainee
        self.mode = spec.save.async_mode
        self.in_flight: InFlight | None = None
        self.done: list[SaveTimes] = []
        self.unlogged: list[SaveTimes] = []
        self.writing = False
        """Whether a background write (or the preparation) ran during the current log window."""
        self.group = None
        self.stager = None
        self.polls = 0
        self.preparation: Preparation | None = None
        self.prepared: Preparation | None = None
        """Set once the preparation has completed."""
        self.prepared_unlogged = False
        if self.mode != SaveAsync.off and spec.save.every > 0:
            self.group = dist.new_group(backend="gloo")  # a collective: every rank builds its saver
            self.stager = DefaultStager(staging_options(self.mode, world.device.type))

    def save(self, trainee: Trainee, progress: Progress) -> Path:
        """Save the state after `progress.step` steps (a collective); returns the save's final path."""
        start = time.perf_counter()
        if self.mode == SaveAsync.off:
            path = save_training_state(trainee, self.spec, self.world, self.run_dir, progress)
            blocking = time.perf_counter() - start
            self.finished(SaveTimes(progress.step, blocking, blocking))
            return path
        prepared = self.finish_preparation()
        waited = self.drain()
        if self.world.is_main and prepared >= SAY_WAIT_S:
            print(
                f"save of step {progress.step}: waited {prepared:.1f} s for the staging copy and save process",
                flush=True,
            )
        if waited >= SAY_WAIT_S and self.world.is_main:
            print(f"save of step {progress.step}: waited {waited:.1f} s for the save in flight", flush=True)
        state = training_state(trainee, self.spec, self.world, progress)
        self.in_flight = self.start(progress.step, state, start)
        kill_if_rehearsing(self.spec.fault, self.world, progress.step)  # while it is written
        term_if_rehearsing(self.spec.fault, self.world, progress.step)
        self.in_flight.times.blocking_s = time.perf_counter() - start
        self.writing = True
        return self.in_flight.final

    def prepare(self) -> None:
        """After the first step, before any save: the staging copy and the save process, in the background.

        The stager fills its copy on a thread of its own here: what it copies is thrown away (the next
        steps change the tensors under it; the first save copies them again, into the same buffers),
        only the allocation is wanted. torch's DefaultStager could stage on its own thread
        (use_async_staging), but then every save would need a wait before the next optimizer step.
        """
        start = time.perf_counter()
        state = training_state(self.trainee, self.spec, self.world, Progress())
        staging = ThreadPoolExecutor(max_workers=1, thread_name_prefix="save-staging")
        futures = [staging.submit(self.stage_once, state)]
        staging.shutdown(wait=False)  # the thread ends once the copy is allocated
        if self.mode == SaveAsync.process:
            futures.append(self.start_save_process())
        self.preparation = Preparation(futures, start, blocking_s=time.perf_counter() - start)

    def stage_once(self, state: dict[str, Any]) -> None:
        """The stager's first copy of `state`, on the preparation's thread."""
        if self.world.device.type == "cuda":
            torch.cuda.set_device(self.world.device)  # a new thread starts on device 0
        assert self.stager is not None
        self.stager.stage(state)

    def start_save_process(self) -> Future:
        """torch starts its save process at a rank's first async_save (an empty one here) and keeps
        it for every later one: this rank's save process, started now."""
        tmp = saves_root(self.run_dir) / START_DIR
        if self.world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
        # async_save's first collective (the save process's address, broadcast from rank 0) orders
        # the other ranks' writes after this clean-up.
        return dcp.async_save(
            {}, checkpoint_id=tmp, process_group=self.group, async_checkpointer_type=CHECKPOINTER[self.mode]
        )

    def finish_preparation(self) -> float:
        """Wait for the preparation, if under way; returns the seconds waited."""
        if self.preparation is None:
            return 0.0
        start = time.perf_counter()
        preparation, self.preparation = self.preparation, None
        root = saves_root(self.run_dir)
        try:
            for future in preparation.futures:
                future.result()  # its error, if any, raised here in the step loop
        except Exception as err:  # the stager's (host memory, /dev/shm) or the save process's
            raise prepare_error(err, root) from err
        if self.world.is_main:
            shutil.rmtree(root / START_DIR, ignore_errors=True)
        preparation.total_s = time.perf_counter() - preparation.started
        preparation.futures = []
        self.prepared, self.prepared_unlogged = preparation, True
        return time.perf_counter() - start

    def start(self, step: int, state: dict[str, Any], start: float) -> InFlight:
        root = saves_root(self.run_dir)
        final, tmp = root / save_name(step), root / f".tmp_{save_name(step)}"
        mark_phase(step, "save")
        try:
            if self.world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                root.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            future = dcp.async_save(
                state,
                checkpoint_id=tmp,
                process_group=self.group,
                async_checkpointer_type=CHECKPOINTER[self.mode],
                async_stager=self.stager,
            )
        except (OSError, CheckpointException) as err:
            raise save_error(err, root, step) from err
        return InFlight(SaveTimes(step, 0.0), future, tmp, final, start)

    def poll(self) -> None:
        """At a step boundary: prepare after the first step; make the save in flight a save if its
        write has completed (local, no sync)."""
        self.polls += 1
        if self.stager is not None and self.polls == 2 and not self.done and self.in_flight is None:
            self.prepare()
        if self.preparation is not None and all(f.done() for f in self.preparation.futures):
            self.finish_preparation()
        if self.in_flight is not None and self.in_flight.future.done():
            self.complete()
        self.writing = self.in_flight is not None or self.preparation is not None

    def drain(self) -> float:
        """Wait for the save in flight, if any, and make it a save; returns the seconds waited."""
        if self.in_flight is None:
            return 0.0
        start = time.perf_counter()
        self.complete()
        return time.perf_counter() - start

    def complete(self) -> None:
        """Wait for the write in flight; rank 0 checks it whole and renames it into place."""
        flight, self.in_flight = self.in_flight, None
        assert flight is not None
        root = saves_root(self.run_dir)
        try:
            flight.future.result()
        except Exception as err:  # the write's own error, raised here in the step loop
            if self.world.is_main:
                shutil.rmtree(flight.tmp, ignore_errors=True)
            raise save_error(err, root, flight.times.step) from err
        if self.world.is_main:
            if (problem := save_problem(flight.tmp)) is not None:
                raise SaveError(f"the save of step {flight.times.step} under {root} is not whole: {problem}")
            publish(flight.tmp, flight.final)
            prune(root, self.spec.save.keep, flight.times.step)
        # Until listed: rank 0 notices the write's end at the first step boundary after it.
        flight.times.total_s = time.perf_counter() - flight.started
        self.finished(flight.times)

    def finished(self, times: SaveTimes) -> None:
        self.done.append(times)
        self.unlogged.append(times)

    def record_fields(self) -> dict[str, Any]:
        """What the next metrics.jsonl record carries: the saves completed since the last one (the
        latest, if several), and whether a background write ran during its steps."""
        fields: dict[str, Any] = {}
        if self.unlogged:
            last = self.unlogged[-1]
            fields = {
                keys.SAVE_STEP: last.step,
                keys.SAVE_BLOCKING_S: last.blocking_s,
                keys.SAVE_TOTAL_S: last.total_s,
            }
        if self.prepared_unlogged:
            fields.update(self.prepare_fields())
            self.prepared_unlogged = False
        if self.mode != SaveAsync.off and self.spec.save.every > 0:
            fields[keys.SAVE_WRITING] = int(
                self.writing or self.in_flight is not None or self.preparation is not None
            )
        self.unlogged = []
        self.writing = self.in_flight is not None or self.preparation is not None
        return fields

    def prepare_fields(self) -> dict[str, Any]:
        if self.prepared is None:
            return {}
        return {
            keys.SAVE_PREPARE_BLOCKING_S: self.prepared.blocking_s,
            keys.SAVE_PREPARE_TOTAL_S: self.prepared.total_s,
        }

    def summary(self) -> dict[str, Any]:
        """Every save's figures and their preparation's, for rank 0's result (summary.json)."""
        return (
            {keys.SAVES: [asdict(times) for times in self.done], **self.prepare_fields()} if self.done else {}
        )

    def close(self) -> None:
        """Drain the save in flight and free the staging copy (the writer process, torch's, ends
        when this rank's pipe to it closes)."""
        self.finish_preparation()
        self.drain()
        if self.stager is not None:
            self.stager.close()
            self.stager = None
