"""Where a run starts: the save to resume from, the directory to continue in, the history to rewind.

The job process (trainer/job.py) resolves `resume=` before any rank starts: false, true (the
newest save of a run with this config, continuing in that run's directory), a run directory or
one save (trainer/saves/dcp.py writes them); it refuses a save whose global batch differs, and cuts
metrics.jsonl back to the save's step. After a launcher restart (max_restarts > 0) the ranks
make the same choice themselves: the newest save of their own run, recorded in restarts.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, TrainConfig, from_plain, to_plain
from trainer.jsonl import parse_line
from trainer.rank.trainee import Trainee
from trainer.saves.dcp import (
    METADATA,
    SAVES_DIR,
    Progress,
    SaveSpec,
    check_global_batch,
    first_attempt,
    is_valid_save,
    list_saves,
    load_training_state,
    read_progress,
    restart_count,
)
from trainer.saves.integrity import newest_whole_save, save_problem
from trainer.saves.restarts import RESTARTS_FILE
from trainer.world import World

# ----------------------------------------------------------------------------- in the job process


# Keys that say how a job runs rather than what it trains: a run that differs only in these is
# the same run for `resume=true` (the resumed invocation itself differs in `resume`, and a killed
# rehearsal in `fault`). `stability` too: a spike policy is how a run reacts, and skipping a bad
# window on resume (`stability.skip_steps`, Megatron's --iterations-to-skip) is done to the same run.
NOT_IDENTITY = (
    "resume", "fault", "max_restarts", "save", "logger", "nonfinite", "max_nonfinite_skips", "log_every",
    "telemetry", "dataloader", "plan", "fail_fast", "device_memory_gib", "node_rank", "rdzv_endpoint",
    "stability",
)  # fmt: skip


def run_identity(plain: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in plain.items() if key not in NOT_IDENTITY}


def saved_run_identity(run_dir: Path) -> dict[str, Any] | None:
    """The identity of the run in `run_dir`, from the config Hydra stored there; None if unreadable."""
    from omegaconf import OmegaConf

    try:
        stored = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=True)
        return run_identity(to_plain(from_plain(stored)))  # type: ignore[arg-type]
    except Exception:  # not a run directory, or one from an older schema: not this run
        return None


def candidate_runs(out_dir: Path) -> list[Path]:
    """This job's directory and its siblings in Hydra's `<root>/<date>/<time>` layout (outputs/runs/*/*)."""
    siblings = [p for p in out_dir.parent.parent.glob("*/*") if p.is_dir()]
    return sorted(set(siblings) | {out_dir})


def newest_matching_save(config: TrainConfig, out_dir: Path) -> Path | None:
    """The most recently written valid save of a run with this config (NOT_IDENTITY aside)."""
    identity = run_identity(to_plain(config))
    runs = [run for run in candidate_runs(out_dir) if list_saves(run) and saved_run_identity(run) == identity]
    saves = [save for run in runs if (save := newest_whole_save(list_saves(run))) is not None]
    return max(saves, key=lambda save: (save / METADATA).stat().st_mtime, default=None)


def resolve_resume(config: TrainConfig, out_dir: Path) -> tuple[str, Path]:
    """`resume` as the ranks take it (false, or a save's path) and the directory the job writes to.

    - false: start at step 0 in this job's directory.
    - true: the newest save of this config; continue in *that* run's directory, so metrics.jsonl
      and the W&B run go on. With no save yet, start at step 0 (a preemptible job can always
      pass resume=true).
    - a run directory: its newest save, continuing in that directory.
    - a save directory (`.../checkpoints/step_XXXXXXXX`): start from it in this job's directory,
      for example with another world size or stage.
    """
    if config.resume == "false":
        return "false", out_dir
    if config.resume == "true":
        save = newest_matching_save(config, out_dir)
        if save is None:
            print(
                f"resume=true: no whole save of this config under {out_dir.parent.parent}; starting at step 0",
                flush=True,
            )
            return "false", out_dir
        return str(save), save.parent.parent
    path = Path(config.resume).expanduser().resolve()
    if is_valid_save(path):
        if (problem := save_problem(path)) is not None:
            raise ConfigError(f"resume={config.resume}: that save is broken: {problem}")
        return str(path), out_dir
    if (save := newest_whole_save(list_saves(path))) is not None:
        return str(save), path
    raise ConfigError(
        f"resume={config.resume}: no save there; allowed: false, true, a run directory with "
        f"{SAVES_DIR}/step_XXXXXXXX saves, or one such save directory"
    )


def prepare_resume(config: TrainConfig, out_dir: Path, world_size: int) -> tuple[TrainConfig, Path]:
    """Resolve `resume` to a save and the directory to write to; refuse, before any rank starts,
    a save whose global batch differs from this run's."""
    resume, run_dir = resolve_resume(config, out_dir)
    if resume != "false":
        saved = read_progress(Path(resume))
        check_global_batch(saved["global_batch"], SaveSpec.of(config), world_size, Path(resume))
        rewind_metrics(run_dir, saved["step"])  # before the W&B feeder starts reading it
        where = f"; continuing in {run_dir}" if run_dir != out_dir else ""
        print(f"resume: from step {saved['step']} of {resume}{where}", flush=True)
    return dataclasses.replace(config, resume=resume), run_dir


def rewind_metrics(run_dir: Path, step: int) -> None:
    """Drop the metrics.jsonl records after `step` (written by ranks that died), so the file is one history.

    The shorter file replaces the old one with os.replace: atomic, and a new inode, by which the
    job process's reader (loggers.MetricsTail) knows to read the file anew. A torn last line (a
    rank killed mid-write) is not a record, and goes too.
    """
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if (record := parse_line(line)) is not None and record["step"] <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(".metrics.jsonl.rewind")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- in the ranks


def find_start(resume: str, run_dir: Path) -> Path | None:
    """The save this rank starts from, or None for step 0.

    After a launcher restart: the newest save of this run (the ranks died after it). Otherwise
    the save the job process resolved `resume` to (resolve_resume turns true / a run directory into one).
    """
    if not first_attempt() and (newest := newest_whole_save(list_saves(run_dir), say=False)) is not None:
        return newest
    return None if resume in ("false", "true") else Path(resume)


def log_restart(run_dir: Path, start: Path | None, world: World) -> None:
    """Rank 0 records each launcher restart on the console and in restarts.jsonl."""
    if first_attempt() or not world.is_main:
        return
    where = f"resuming from {start}" if start is not None else "no save yet: starting from step 0"
    print(f"restart {restart_count()}: the launcher restarted all ranks; {where}", flush=True)
    with (run_dir / RESTARTS_FILE).open("a") as f:
        f.write(json.dumps({"restart": restart_count(), "save": str(start) if start else None}) + "\n")


def resume_training(trainee: Trainee, spec: SaveSpec, resume: str, world: World, run_dir: Path) -> Progress:
    """Load the save this run starts from, if any; Progress() (step 0) for a fresh start."""
    start = find_start(resume, run_dir)
    log_restart(run_dir, start, world)
    progress = load_training_state(trainee, spec, world, start) if start is not None else Progress()
    if world.is_main and (start is not None or not first_attempt()):
        rewind_metrics(run_dir, progress.step)
        if start is not None:
            print(f"resumed from {start} at step {progress.step}", flush=True)
    return progress
