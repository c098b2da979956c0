"""trainer/saves/background.py's saves in one process (a one-rank gloo group, the thread writer): pruning
to save.keep while saves are written in the background, and a write that outlasts the next save. The
trainee's state is a stand-in (one tensor holding the step); the writer is torch's own, slowed.

The process writer runs the same Saves.complete and prune after its write; it is left to
tests/integration/test_async_saves.py (torch starts its save process in 20-30 s on this host)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from tests.helpers import WORLD
from trainer.config import FaultConfig, SaveAsync, SaveConfig, Stage
from trainer.saves import background
from trainer.saves.background import Saves
from trainer.saves.dcp import Progress, SaveSpec, list_saves, save_step, saves_root
from trainer.saves.integrity import save_problem

pytestmark = pytest.mark.usefixtures("process_group")


def state(step: int) -> dict[str, Any]:
    """What a save of `step` holds here: a tensor of the step, and the progress entry."""
    return {"model": {"w": torch.full((256,), float(step))}, "progress": {"step": step}}


@pytest.fixture
def saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Saves:
    monkeypatch.setattr(
        background, "training_state", lambda trainee, spec, world, progress: state(progress.step)
    )
    spec = SaveSpec(
        SaveConfig(every=1, keep=2, async_mode=SaveAsync.thread), FaultConfig(), Stage.stage0, 1, 1
    )
    made = Saves(spec, WORLD, tmp_path, trainee=None)  # type: ignore[arg-type]  # the state is the stand-in's
    yield made
    made.close()


def slow_writes(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[int]:
    """Every write of a save's data sleeps `seconds` first (on the writer's thread); returns the steps
    whose write has ended, in order."""
    written: list[int] = []
    write_data = FileSystemWriter.write_data

    def slow(self, plan, planner):  # type: ignore[no-untyped-def]
        time.sleep(seconds)
        future = write_data(self, plan, planner)
        written.append(int(Path(str(self.path)).name.rsplit("_", 1)[1]))
        return future

    monkeypatch.setattr(FileSystemWriter, "write_data", slow)
    return written


def listed(run_dir: Path) -> list[int]:
    return [save_step(path) for path in list_saves(run_dir)]


def held_step(path: Path) -> int:
    """The step the save's tensor holds, read back with DCP (the whole save, checked first)."""
    assert save_problem(path) is None, save_problem(path)
    loaded = {"model": {"w": torch.zeros(256)}}
    dcp.load(loaded, checkpoint_id=path)
    values = set(loaded["model"]["w"].tolist())
    assert len(values) == 1, values
    return int(values.pop())


def test_keep_prunes_the_oldest_complete_saves_never_the_one_in_flight_nor_the_newest(
    saves: Saves, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save.keep=2, five background saves, each write slow enough to be in flight when save() returns:
    at every save, the saves listed are the newest two completed, and the one being written is left to
    finish (its .tmp_ directory stays, and it is whole once complete)."""
    slow_writes(monkeypatch, 0.05)
    root = saves_root(tmp_path)
    for step in range(1, 6):
        path = saves.save(None, Progress(step))  # type: ignore[arg-type]
        assert path == root / f"step_{step:08d}" and saves.in_flight is not None
        assert saves.in_flight.tmp == root / f".tmp_step_{step:08d}" and not path.exists()
        # the earlier save completed at this save's start, and was pruned to keep=2 with it the newest
        assert listed(tmp_path) == list(range(max(1, step - 2), step))
    saves.drain()
    assert saves.in_flight is None and listed(tmp_path) == [4, 5]
    assert [held_step(path) for path in list_saves(tmp_path)] == [4, 5]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000005"]  # no .tmp_ left
    assert [t.step for t in saves.done] == [1, 2, 3, 4, 5]


def test_a_write_that_outlasts_the_next_save_is_waited_for_and_both_are_whole(
    saves: Saves, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The save of step 1 is still being written when step 2's save starts: step 2's save waits for it
    (in its blocking time, said on the console past SAY_WAIT_S), lists it whole with step 1's values, and
    only then stages and writes its own."""
    written = slow_writes(monkeypatch, 0.3)
    monkeypatch.setattr(background, "SAY_WAIT_S", 0.15)
    saves.save(None, Progress(1))  # type: ignore[arg-type]
    first = saves.in_flight
    assert first is not None and not first.future.done()  # still being written
    assert written == [] and listed(tmp_path) == []
    saves.save(None, Progress(2))  # type: ignore[arg-type]
    assert first.future.done() and written == [1] and listed(tmp_path) == [1]
    assert held_step(saves_root(tmp_path) / "step_00000001") == 1
    assert saves.in_flight is not None and saves.in_flight.times.step == 2
    assert saves.in_flight.times.blocking_s >= 0.15  # the wait for step 1's write
    out = capsys.readouterr().out
    assert "save of step 2: waited " in out and " s for the save in flight" in out
    saves.drain()
    assert written == [1, 2] and listed(tmp_path) == [1, 2]
    assert [held_step(path) for path in list_saves(tmp_path)] == [1, 2]
    assert [(t.step, t.total_s is not None) for t in saves.done] == [(1, True), (2, True)]
