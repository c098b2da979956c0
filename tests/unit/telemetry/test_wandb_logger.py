"""The job process's W&B side (trainer/telemetry/wandb_logger.py): the metrics.jsonl tail, W&B failing to start or midway,
and the service yielding the CPU to the ranks."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import wandb

from trainer.config import TrainConfig
from trainer.telemetry.wandb_logger import (
    MetricsTail,
    NullLogger,
    WandbLogger,
    open_logger,
    yield_cpu_to_ranks,
)


@pytest.fixture
def isolated_wandb() -> Iterator[None]:
    """wandb.setup's settings are process-wide: later tests must read the environment afresh."""
    yield
    wandb.teardown()


def test_wandb_service_processes_run_at_the_lowest_priority_and_the_job_process_does_not(
    tmp_path: Path, isolated_wandb
) -> None:
    own_priority = os.nice(0)
    with wandb.init(project="zerolab-test", dir=str(tmp_path), mode="offline"):
        yield_cpu_to_ranks()
        service = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("wandb")]
        assert service, "wandb.init started no service process"
        assert {p.name(): p.nice() for p in service} == {p.name(): 19 for p in service}
    assert os.nice(0) == own_priority  # this process, and so the ranks it would start, keep their priority


def test_tail_hands_over_complete_lines_only_and_starts_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n")  # an earlier job's record: not this run's
    seen: list[dict] = []
    tail = MetricsTail(path, seen.append)
    with path.open("a") as f:
        f.write(json.dumps({"step": 2}) + "\n" + '{"step": ')
    tail.poll()
    assert seen == [{"step": 2}]
    with path.open("a") as f:
        f.write("3}\n")
    tail.poll()
    assert seen == [{"step": 2}, {"step": 3}]


def test_wandb_that_cannot_start_warns_once_and_leaves_the_job_a_null_logger(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("WANDB_MODE", "not-a-mode")  # wandb.init rejects its settings
    meta = {"config": {}, "overrides": [], "world_size": 1}
    config = TrainConfig()
    with open_logger(
        config.logger, tmp_path, meta, "defaults", "today", config.zero.stage.value, config.resume
    ) as logger:
        assert isinstance(logger, NullLogger)
    assert capsys.readouterr().err.count("warning: W&B could not start") == 1


class BrokenRun:
    """A W&B run whose every call fails, as when the server goes away midway."""

    calls = 0

    def log(self, *args, **kwargs) -> None:
        BrokenRun.calls += 1
        raise ConnectionError("gone")

    def finish(self, *args, **kwargs) -> None:
        BrokenRun.calls += 1
        raise ConnectionError("gone")


def test_wandb_failing_midway_warns_once_and_stops_calling_it(capsys) -> None:
    logger = WandbLogger(BrokenRun())
    for step in (1, 2, 3):
        logger.log_record({"step": step, "loss/train": 1.0})
    logger.finish({"status": "ok"}, exit_code=0)
    assert BrokenRun.calls == 1
    assert capsys.readouterr().err.count("warning: W&B stopped working") == 1


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError("Connection lost"),
        BrokenPipeError(32, "Broken pipe"),
        "MailboxClosedError",
        "HandleAbandonedError",
    ],
)
def test_a_dead_service_is_one_warning_whichever_call_meets_it(capsys, error) -> None:
    """The flake this fixes: the same killed service was reported as ConnectionResetError on one run and
    as wandb's MailboxClosedError on another, depending on which call met it first."""
    if isinstance(error, str):
        import wandb.sdk.mailbox as mailbox

        error = getattr(mailbox, error)()

    class DeadService:
        def log(self, *args, **kwargs) -> None:
            raise error

    WandbLogger(DeadService()).log_record({"step": 1, "loss/train": 1.0})
    assert capsys.readouterr().err.strip() == (
        "warning: W&B stopped working (ConnectionError: lost the connection to the W&B service process); "
        "metrics.jsonl and summary.json are complete"
    )


def test_another_wandb_failure_is_named_as_raised(capsys) -> None:
    class Refusing:
        def log(self, *args, **kwargs) -> None:
            raise ValueError("step must increase")

    WandbLogger(Refusing()).log_record({"step": 1, "loss/train": 1.0})
    assert "(ValueError: step must increase)" in capsys.readouterr().err
