"""The job process's W&B side: the service yields the CPU to the ranks; the tail hands over whole lines."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest
import wandb

from trainer.loggers import MetricsTail, yield_cpu_to_ranks


@pytest.fixture
def isolated_wandb() -> Iterator[None]:
    """wandb.setup's settings are process-wide: later tests must read the environment afresh."""
    yield
    wandb.teardown()


def test_wandb_service_processes_run_at_the_lowest_priority_and_the_job_process_does_not(tmp_path: Path, isolated_wandb) -> None:
    own_priority = os.nice(0)
    with wandb.init(project="zerolab-test", dir=str(tmp_path), mode="offline"):
        yield_cpu_to_ranks()
        service = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("wandb")]
        assert service, "wandb.init started no service process"
        assert {p.name(): p.nice() for p in service} == {p.name(): 19 for p in service}
    assert os.nice(0) == own_priority  # this process, and so the ranks it would start, keep their priority


def test_tail_hands_over_complete_lines_and_keeps_a_torn_one_for_the_next_poll(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n")  # an earlier job's record: not this job's
    seen: list[dict[str, Any]] = []
    tail = MetricsTail(path, seen.append)
    with path.open("a") as f:
        f.write(json.dumps({"step": 2}) + "\n" + '{"step": 3')
    tail.poll()
    assert seen == [{"step": 2}]
    with path.open("a") as f:
        f.write(', "loss/train": 1.5}\n')
    tail.poll()
    assert seen == [{"step": 2}, {"step": 3, "loss/train": 1.5}]
