"""memory.snapshot (trainer/telemetry/snapshot.py) driven through a fake torch.cuda.memory: what is
recorded and dumped, where, and what a CPU rank writes instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import CPU_OOM
from trainer.config import MemoryConfig, SnapshotMode
from trainer.faults.failures import read_failures, recording_failures
from trainer.telemetry.snapshot import ACTIVE, CPU_LINE, VIEW, Snapshots
from trainer.units import GIB

CUDA = torch.device("cuda")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The private allocator calls, recorded instead of made (no CUDA here)."""
    made: list[tuple] = []

    def record(**kwargs) -> None:
        made.append(("record", kwargs))

    def dump(path: str) -> None:
        made.append(("dump", path))
        Path(path).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    yield made
    ACTIVE.clear()


def test_cuda_records_bounded_python_stacks_and_dumps_after_named_steps(
    calls: list[tuple], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = MemoryConfig(snapshot=SnapshotMode.steps, snapshot_steps=[2], snapshot_max_entries=5000)
    snaps = Snapshots(config, CUDA, tmp_path, rank=1)
    assert calls == [("record", {"max_entries": 5000, "stacks": "python"})]
    assert snaps.after_step(1, None) is None
    path = snaps.after_step(2, None)
    assert path == tmp_path / "memory_snapshots" / "rank1_step2.pickle" and path.read_bytes() == b"snapshot"
    assert calls[1:] == [("dump", str(path))]
    assert capsys.readouterr().out == f"memory snapshot of rank 1: {path}; {VIEW}\n"


def test_cuda_dumps_when_the_rank_runs_out(calls: list[tuple], tmp_path: Path) -> None:
    Snapshots(MemoryConfig(snapshot=SnapshotMode.oom), CUDA, tmp_path, rank=0)
    with pytest.raises(RuntimeError), recording_failures(tmp_path, rank=0):
        raise RuntimeError(CPU_OOM)
    record = read_failures(tmp_path)[0]
    assert record["snapshot"] == str(tmp_path / "memory_snapshots" / "rank0_oom.pickle")
    assert calls[-1] == ("dump", record["snapshot"])


def test_off_records_nothing(calls: list[tuple], tmp_path: Path) -> None:
    snaps = Snapshots(MemoryConfig(), CUDA, tmp_path, rank=0)
    assert (snaps.after_step(1, None), snaps.on_oom(None), calls, ACTIVE) == (None, None, [], [])


def test_cpu_says_so_in_one_line_and_writes_the_split_instead(
    calls: list[tuple], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snaps = Snapshots(MemoryConfig(snapshot=SnapshotMode.oom), torch.device("cpu"), tmp_path, rank=0)
    assert capsys.readouterr().out == f"{CPU_LINE}\n" and calls == []
    path = snaps.on_oom({"held": float(GIB), "activations": GIB / 2})
    assert json.loads(path.read_text()) == {"rank": 0, "at": "oom", "gib": {"held": 1.0, "activations": 0.5}}


def test_steps_without_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="memory.snapshot=steps needs memory.snapshot_steps"):
        MemoryConfig(snapshot=SnapshotMode.steps)
