"""trainer/saves/resume.py: resolving resume= to a save and a directory, and rewinding metrics.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import fake_save, tiny_config
from trainer.config import ConfigError, TrainConfig, to_plain
from trainer.saves.resume import resolve_resume, rewind_metrics


def test_rewinding_metrics_keeps_records_up_to_the_save_in_a_new_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss/train": 1.0 / s}) + "\n" for s in range(1, 7)))
    inode = path.stat().st_ino
    rewind_metrics(tmp_path, 6)  # nothing to drop: the file is left alone
    assert path.stat().st_ino == inode
    rewind_metrics(tmp_path, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert path.stat().st_ino != inode  # the W&B feeder notices a replaced file and rereads it


def fake_run(run_dir: Path, config: TrainConfig, steps: tuple[int, ...]) -> None:
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(to_plain(config)))
    for step in steps:
        fake_save(run_dir, step)


def test_resume_true_continues_the_newest_save_of_the_same_config(tmp_path: Path) -> None:
    day = tmp_path / "runs" / "2026-01-01"
    config = tiny_config()
    fake_run(day / "10-00-00", config, (4,))
    fake_run(day / "11-00-00", tiny_config(seed=1), (8,))  # another config: never resumed
    fake_run(
        day / "12-00-00", tiny_config(fault__kind="kill", fault__step=7), (4, 8)
    )  # fault.* aside, the same run
    os.utime(day / "10-00-00" / "checkpoints" / "step_00000004" / ".metadata", (1, 1))  # older
    new_dir = day / "13-00-00"
    new_dir.mkdir()
    resume, run_dir = resolve_resume(tiny_config(resume="true"), new_dir)
    assert (resume, run_dir) == (str(day / "12-00-00" / "checkpoints" / "step_00000008"), day / "12-00-00")


def test_resume_true_without_a_save_starts_at_step_0(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs" / "day" / "t0"
    out_dir.mkdir(parents=True)
    assert resolve_resume(tiny_config(resume="true"), out_dir) == ("false", out_dir)


def test_resume_a_path_to_a_run_or_to_a_save(tmp_path: Path) -> None:
    run = tmp_path / "old"
    fake_run(run, tiny_config(), (4, 8))
    here = tmp_path / "new"
    assert resolve_resume(tiny_config(resume=str(run)), here) == (
        str(run / "checkpoints" / "step_00000008"),
        run,
    )
    save = run / "checkpoints" / "step_00000004"
    assert resolve_resume(tiny_config(resume=str(save)), here) == (
        str(save),
        here,
    )  # e.g. other ranks or stage
    with pytest.raises(ConfigError, match=r"^resume=.*allowed: false, true, a run directory"):
        resolve_resume(tiny_config(resume=str(tmp_path / "nothing")), here)


def test_resume_true_finds_the_run_whatever_its_stability_settings(tmp_path: Path) -> None:
    """A spike policy, or a data window to skip on resume (Megatron's --iterations-to-skip), does not make
    another run: resume=true with them continues the run saved without them."""
    day = tmp_path / "runs" / "day"
    fake_run(day / "t0", tiny_config(), (4,))
    new_dir = day / "t1"
    new_dir.mkdir()
    resumed = tiny_config(resume="true", stability__skip_steps=[5], stability__spike__action="log")
    assert resolve_resume(resumed, new_dir) == (str(day / "t0" / "checkpoints" / "step_00000004"), day / "t0")
