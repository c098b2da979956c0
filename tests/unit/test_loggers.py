"""The job process's W&B side: the service yields the CPU to the ranks (the tail is tested in test_metrics.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import wandb

from trainer.loggers import yield_cpu_to_ranks


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

