"""What a rank does to save and load the full training state with torch.distributed.checkpoint (DCP).

A save is a DCP directory `<run>/checkpoints/step_XXXXXXXX` holding, under canonical,
wrapper-free names (no `module.`, no activation-checkpoint or FSDP prefixes):

- model:     every parameter (FSDP2 DTensor shards or DDP's replicated tensors; DCP writes each
             element once and reads back whatever slice the loading rank holds),
- optim:     AdamW's state and hyperparameters, flattened per parameter name,
- scheduler: the LR scheduler's counters, scaler: the fp16 loss scale and its growth tracker,
- rng:       every rank's torch / CUDA / Python / NumPy generator states,
- progress:  the step (= the data position: data.build_batches resumes the global sample stream
             at any step) and the global batch it was taken with, plus skip counters.

Because the names and the layout do not depend on the ZeRO stage or the world size, a save from
N ranks at one stage loads into M ranks at another.

Atomicity: every rank writes into `checkpoints/.tmp_step_XXXXXXXX`; after DCP has written the
metadata (its last act, once every rank's data is on disk) and a barrier, rank 0 renames the
directory to `step_XXXXXXXX` (one rename: atomic on POSIX) and prunes to the last `save.keep`.
A kill at any moment leaves either the previous saves alone or a `.tmp_*` directory, which is
never read. Only a directory named `step_XXXXXXXX` that contains `.metadata` is a save. (DCP
writes straight into the directory it is given and has no commit step of its own, hence the
rename, written here.)

Finding the save a run starts from (resume=..., a launcher restart) is trainer/saves/resume.py's.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.config import ConfigError, FaultConfig, FaultKind, SaveConfig, Stage, TrainConfig, global_batch
from trainer.faults.failures import mark_phase
from trainer.files import SAVES_DIR
from trainer.rank.trainee import Trainee, local_optimizer
from trainer.saves.integrity import save_error
from trainer.world import World

SAVE_NAME = re.compile(r"^step_(\d{8})$")
METADATA = ".metadata"  # written by DCP last, on rank 0, once every rank's data is written

# Flattened optimizer state is keyed by parameter name (`state.<fqn>.exp_avg`,
# `param_groups.<fqn>.lr`) rather than by position in a param group: names are the same whatever
# the stage, and under ZeRO-1 each rank's partial state then has keys disjoint from the others'.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class Progress:
    """Where training stands: what a save records besides the trainee, and where a resume starts."""

    step: int = 0
    """Optimizer steps taken; also the data position (build_batches(start_step=step))."""
    nonfinite_skipped: int = 0
    """Steps skipped by nonfinite=skip so far."""
    overflow_skipped: int = 0
    """fp16 steps the GradScaler skipped so far."""


def save_name(step: int) -> str:
    return f"step_{step:08d}"


def saves_root(run_dir: Path) -> Path:
    return run_dir / SAVES_DIR


def is_valid_save(path: Path) -> bool:
    """A complete save: the final name (renamed only after writing) and DCP's metadata file."""
    return SAVE_NAME.match(path.name) is not None and (path / METADATA).is_file()


def list_saves(run_dir: Path) -> list[Path]:
    """The run's complete saves, oldest first; half-written `.tmp_*` directories are not saves."""
    root = saves_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_valid_save(p)), key=lambda p: p.name)


def latest_save(run_dir: Path) -> Path | None:
    saves = list_saves(run_dir)
    return saves[-1] if saves else None


def save_step(path: Path) -> int:
    match = SAVE_NAME.match(path.name)
    assert match is not None, path
    return int(match.group(1))


def should_save(save: SaveConfig, steps: int, step: int) -> bool:
    """Every save.every steps and at the last of `steps`; never when save.every is 0."""
    return save.every > 0 and (step % save.every == 0 or step == steps)


@dataclass(frozen=True)
class SaveSpec:
    """What a save records and how, besides the trainee: built once per rank from the config."""

    save: SaveConfig
    fault: FaultConfig
    stage: Stage
    """The ZeRO stage, recorded in `progress` (a save loads into any stage)."""
    micro_batch: int
    grad_accum: int
    replica_ranks: int = 1
    """parallel.tp * parallel.pp * parallel.cp: the ranks of one model replica (and its cp group) read one
    batch, so the global batch counts world / replica_ranks ranks."""

    def global_batch(self, world_size: int) -> int:
        return global_batch(self.micro_batch, self.grad_accum, world_size // self.replica_ranks)

    @classmethod
    def of(cls, config: TrainConfig) -> SaveSpec:
        return cls(
            config.save,
            config.fault,
            config.zero.stage,
            config.micro_batch,
            config.grad_accum,
            config.parallel.tp * config.parallel.pp * config.parallel.cp,
        )


# ----------------------------------------------------------------------------- state


def copy_hyperparameters(src_groups: list[dict[str, Any]], dst_groups: list[dict[str, Any]]) -> None:
    """Copy lr, betas, ... between matching param groups (what ZeroRedundancyOptimizer's private
    _sync_param_groups does): the scheduler writes the wrapper's groups, and the wrapper copies
    them into `.optim` only inside step(), so at save time `.optim` still has the last step's lr."""
    for src, dst in zip(src_groups, dst_groups, strict=True):
        dst.update({key: value for key, value in src.items() if key != "params"})


def rng_state(device: torch.device) -> dict[str, Any]:
    """The generators this rank draws from; the CUDA one only when the rank computes on a GPU
    (not whenever the host has one: a CPU run on a GPU host must save what a CPU host saves)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what the save has; a CPU save on a GPU rank leaves the CUDA generator as seeded."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def drop_unsaved_rng(state: dict[str, Any], keys: set[str], rank: int) -> None:
    """Leave out of the load template what the save does not have: the whole rng entry of a rank
    the save did not have (more ranks now), the CUDA state of a save made on CPU. (A GPU save's
    CUDA state is simply not asked for by a CPU rank.)"""
    entry = f"rng.rank{rank}"
    if not has_entry(keys, entry):
        del state["rng"]
    elif not has_entry(keys, f"{entry}.cuda"):
        state["rng"][f"rank{rank}"].pop("cuda", None)


def training_state(trainee: Trainee, spec: SaveSpec, world: World, progress: Progress) -> dict[str, Any]:
    """The state dict DCP writes (and, as a template, fills in place when loading).

    ZeroRedundancyOptimizer's own state_dict() would gather every partition onto one rank (the
    memory ZeRO-1 exists to avoid) and DCP's helpers do not know the wrapper, so they get its
    local AdamW: each rank contributes its partition's state, the union is a stage0 AdamW's.
    """
    optimizer = local_optimizer(trainee.optimizer)
    if optimizer is not trainee.optimizer:
        copy_hyperparameters(trainee.optimizer.param_groups, optimizer.param_groups)
    return {
        "model": get_model_state_dict(trainee.model, options=OPTIONS),
        "optim": get_optimizer_state_dict(trainee.model, optimizer, options=OPTIONS),
        "scheduler": trainee.scheduler.state_dict(),
        "scaler": trainee.scaler.state_dict(),  # {} unless fp16
        # One entry per rank: DCP keeps a single copy of a key that every rank writes.
        "rng": {f"rank{world.rank}": rng_state(world.device)},
        "progress": {
            "step": progress.step,
            "global_batch": spec.global_batch(world.world_size),
            "world_size": world.world_size,
            "stage": spec.stage.value,
            "nonfinite_skipped": progress.nonfinite_skipped,
            "overflow_skipped": progress.overflow_skipped,
        },
    }


# ----------------------------------------------------------------------------- save


def save_training_state(
    trainee: Trainee, spec: SaveSpec, world: World, run_dir: Path, progress: Progress
) -> Path:
    """Write the state after `progress.step` steps atomically (a collective: every rank calls it)."""
    root = saves_root(run_dir)
    final, tmp = root / save_name(progress.step), root / f".tmp_{save_name(progress.step)}"
    mark_phase(progress.step, "save")  # where a failure is reported to have happened
    try:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save killed at this very step
            root.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dcp.save(training_state(trainee, spec, world, progress), checkpoint_id=tmp)
    except OSError as err:  # no space, a path that cannot be created: one line naming the path
        raise unwritable(err, root, tmp, world, progress.step) from err
    except CheckpointException as err:  # DCP's wrapper of each rank's error
        raise unwritable(err, root, tmp, world, progress.step) from err
    kill_if_rehearsing(spec.fault, world, progress.step)
    dist.barrier()  # every rank has returned from DCP: its data and the metadata are on disk
    if world.is_main:
        publish(tmp, final)
        prune(root, spec.save.keep, progress.step)
    return final


def unwritable(err: BaseException, root: Path, tmp: Path, world: World, step: int) -> Exception:
    """The save's one-line error; rank 0 removes what was half written (space a full disk needs back)."""
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    return save_error(err, root, step)


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished save into place; the rename is the moment it becomes a save."""
    if final.exists():
        # A save of this step from a run this one replaces (a reused directory). The previous
        # saves stay valid meanwhile; only this step's is briefly missing.
        shutil.rmtree(final)
    os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable, not only the files (DCP fsyncs those)
    finally:
        os.close(fd)


def prune(root: Path, keep: int, step: int) -> None:
    """Keep the newest `keep` saves up to `step`; remove leftovers of killed saves.

    Saves after `step` belong to a timeline this run has replaced (a directory reused for a
    new run): they go, so they can never be resumed by mistake nor crowd out this run's saves.
    """
    saves = list_saves(root.parent)
    current = [path for path in saves if save_step(path) <= step]
    for path in current[:-keep] + [path for path in saves if save_step(path) > step]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".tmp_step_*"):
        shutil.rmtree(path, ignore_errors=True)


def kill_if_rehearsing(fault: FaultConfig, world: World, step: int) -> None:
    """fault.kind=kill_during_save: SIGKILL this rank after its data is written, before the rename."""
    if (
        fault.kind == FaultKind.kill_during_save
        and fault.step == step
        and fault.rank == world.rank
        and first_attempt()
    ):
        os.kill(os.getpid(), signal.SIGKILL)


def term_if_rehearsing(fault: FaultConfig, world: World, step: int) -> None:
    """fault.kind=term_during_save: this rank sends itself SIGTERM while the save of `step` is
    written in the background (a scheduler's preemption arriving then: trainer/faults/stop.py)."""
    if (
        fault.kind == FaultKind.term_during_save
        and fault.step == step
        and fault.rank == world.rank
        and first_attempt()
    ):
        os.kill(os.getpid(), signal.SIGTERM)


def restart_count() -> int:
    """How many times the elastic launcher has restarted the ranks of this job (0: first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def first_attempt() -> bool:
    """Whether this is the launcher's first start of the ranks (a fault rehearses one failure)."""
    return restart_count() == 0


# ----------------------------------------------------------------------------- load


def saved_keys(path: Path) -> set[str]:
    """The flattened keys in a save (e.g. `rng.rank1.torch`), from DCP's metadata."""
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def has_entry(keys: set[str], prefix: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for key in keys)


def load_training_state(trainee: Trainee, spec: SaveSpec, world: World, path: Path) -> Progress:
    """Fill the trainee from a save made with any world size and stage; returns where to go on."""
    keys = saved_keys(path)
    state = training_state(trainee, spec, world, Progress())
    # Optional entries: a rank the save did not have (more ranks now), a scaler only fp16 has.
    drop_unsaved_rng(state, keys, world.rank)
    if not state["scaler"] or not has_entry(keys, "scaler"):
        del state["scaler"]
    dcp.load(state, checkpoint_id=path)
    progress = state["progress"]
    check_global_batch(progress["global_batch"], spec, world.world_size, path)
    apply_training_state(trainee, state, world.device)
    return Progress(progress["step"], progress["nonfinite_skipped"], progress["overflow_skipped"])


IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")
"""AdamW's param-group keys that choose how it computes, not what: the running job's, never the
save's. A save from a per-tensor AdamW (fused=False) loaded over a fused one would otherwise
switch it back, and the scaler's found_inf would reach the per-tensor path, which asserts."""


def keep_implementation(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each param group's implementation flags, to put back after a load."""
    return [{key: group[key] for key in IMPLEMENTATION_FLAGS if key in group} for group in groups]


PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas")
"""LambdaLR's state_dict entries that hold one value per param group."""


def per_group(scheduler: dict[str, Any], groups: int) -> dict[str, Any]:
    """A saved scheduler's state for an optimizer of `groups` param groups. The optimizer's groups are one, or
    under DDP with parallel.ep two with the same hyperparameters (trainer/rank/optim.py `parameter_groups`), so a
    save from either resumes in the other (DCP maps the optimizer's state by parameter name); a scheduler's
    per-group values, all equal, are repeated to the running count. Values that differ are left as saved."""
    fitted = dict(scheduler)
    for key in PER_GROUP:
        values = scheduler.get(key)
        if (
            isinstance(values, list)
            and values
            and len(values) != groups
            and values.count(values[0]) == len(values)
        ):
            fitted[key] = values[:1] * groups
    return fitted


def apply_training_state(trainee: Trainee, state: dict[str, Any], device: torch.device) -> None:
    """Hand the loaded entries to their owners (tensors DCP already filled in place)."""
    optimizer = local_optimizer(trainee.optimizer)
    set_model_state_dict(trainee.model, state["model"], options=OPTIONS)
    running = keep_implementation(optimizer.param_groups)
    set_optimizer_state_dict(trainee.model, optimizer, state["optim"], options=OPTIONS)
    for group, flags in zip(optimizer.param_groups, running, strict=True):
        group.update(flags)
    if optimizer is not trainee.optimizer:
        copy_hyperparameters(optimizer.param_groups, trainee.optimizer.param_groups)
    trainee.scheduler.load_state_dict(per_group(state["scheduler"], len(optimizer.param_groups)))
    if "scaler" in state:
        # The scale and its growth tracker are state; factors and interval stay as configured now.
        current = trainee.scaler.state_dict()
        trainee.scaler.load_state_dict(
            {
                **current,
                "scale": state["scaler"]["scale"],
                "_growth_tracker": state["scaler"]["_growth_tracker"],
            }
        )
    if "rng" in state:
        set_rng_state(next(iter(state["rng"].values())), device)


def check_global_batch(saved: int, spec: SaveSpec, world_size: int, path: Path) -> None:
    """The data position is a step of `saved` sequences each; another global batch would skip or repeat samples."""
    now = spec.global_batch(world_size)
    if saved != now:
        raise ConfigError(
            f"resume: {path} was saved with a global batch of {saved} sequences; this run has {now} "
            f"(micro_batch={spec.micro_batch} x grad_accum={spec.grad_accum} x {world_size} ranks): "
            f"set micro_batch and grad_accum so that micro_batch x grad_accum x ranks is {saved}"
        )


def read_progress(path: Path) -> dict[str, Any]:
    """The `progress` entry of a save, read in this process without a process group."""
    state: dict[str, Any] = {"progress": {"step": 0, "global_batch": 0, "world_size": 0, "stage": ""}}
    with warnings.catch_warnings():  # DCP warns that there is no process group: that is the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["progress"]


# ----------------------------------------------------------------------------- the loop's last save


def save_last_good(trainee: Trainee, spec: SaveSpec, world: World, run_dir: Path, progress: Progress) -> None:
    """Before stopping on a non-finite step: save the state after the last good step, when saving is on.

    The failed step changed neither weights, optimizer, scheduler nor scaler, so the trainee is
    exactly the state after `progress.step` steps. Skipped when that save exists already.
    """
    if (
        spec.save.every == 0
        or progress.step == 0
        or (saves_root(run_dir) / save_name(progress.step)).exists()
    ):
        return
    path = save_training_state(trainee, spec, world, run_dir, progress)
    if world.is_main:
        print(f"saved the last good state (step {progress.step}) to {path}", flush=True)
