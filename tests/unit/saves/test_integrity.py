"""trainer.saves.integrity.py: a save's files against its DCP metadata; the newest whole save of a run."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.saves.integrity import newest_whole_save, save_problem


def make_save(path: Path) -> Path:
    with warnings.catch_warnings():  # DCP warns that there is no process group: intended here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.arange(1000.0), "b": torch.ones(10)}, checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture
def save(tmp_path: Path) -> Path:
    return make_save(tmp_path / "step_00000008")


def data_file(save: Path) -> Path:
    (path,) = save.glob("*.distcp")
    return path


def test_a_whole_save_has_no_problem(save: Path) -> None:
    assert save_problem(save) is None


def test_a_truncated_shard_is_named_with_its_size(save: Path) -> None:
    shard = data_file(save)
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size - 100)
    assert save_problem(save) == f"{shard.name} is {size - 100} bytes; .metadata says {size}"


def test_a_missing_shard_an_unlisted_shard_and_unreadable_metadata(save: Path) -> None:
    shard = data_file(save)
    shard.rename(save / "__9_0.distcp")
    assert save_problem(save) == f"{shard.name} is missing"
    (save / "__9_0.distcp").rename(shard)
    (save / "__9_0.distcp").write_bytes(b"x")
    assert save_problem(save) == ".metadata does not list __9_0.distcp (files of another save?)"
    (save / "__9_0.distcp").unlink()
    (save / ".metadata").write_bytes(b"not a pickle")
    assert save_problem(save).startswith(".metadata cannot be read")


def test_the_newest_whole_save_skips_broken_ones_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    older, newer = make_save(tmp_path / "step_00000004"), make_save(tmp_path / "step_00000008")
    data_file(newer).unlink()
    assert newest_whole_save([older, newer]) == older
    assert capsys.readouterr().out == f"resume: skipping {newer}: {data_file(older).name} is missing\n"
    data_file(older).unlink()
    assert newest_whole_save([older, newer], say=False) is None
