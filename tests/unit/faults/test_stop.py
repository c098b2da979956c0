"""trainer/faults/stop.py: the signal -> status table, a rank's note of a signal and its agreement, the job's handler."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.api import SignalException

from tests.helpers import WORLD, keeping_stop_handlers
from trainer.config import NonFinitePolicy
from trainer.faults.stop import (
    STOP_REQUEST,
    STOPS,
    RankStop,
    exit_code_for,
    handling_stops,
    stopped,
    sweep_stop,
)
from trainer.rank.nonfinite import NonFiniteGuard, agree, stop_request


@pytest.fixture(autouse=True)
def own_handlers() -> Iterator[None]:
    """RankStop installs handlers for good (a rank's whole life): put pytest's back after each test."""
    with keeping_stop_handlers():
        yield


def test_the_table_maps_each_signal_to_a_status_and_the_shells_exit_code() -> None:
    assert {s.name: (stop.status, stop.exit_code) for s, stop in STOPS.items()} == {
        "SIGINT": ("interrupted", 130),
        "SIGTERM": ("preempted", 143),
        "SIGUSR1": ("preempted", 138),
        "SIGUSR2": ("preempted", 140),
    }
    assert [exit_code_for(status) for status in ("ok", "interrupted", "preempted", "crashed", "oom")] == [
        0,
        130,
        143,
        1,
        1,
    ]


def test_a_rank_notes_a_signal_and_the_step_agreement_carries_it(tmp_path: Path) -> None:
    stop = RankStop(tmp_path, watches_request=False)
    one = torch.ones(())
    guard = NonFiniteGuard(NonFinitePolicy("raise"), 1, WORLD, fp16=False)

    def step_may_go(step: int) -> bool:  # the loop's read of one step's agreement
        return guard.check_now(step, agree(one, one, WORLD, stop=stop_request(stop)), stop)

    assert step_may_go(1) and stop.agreed == 0
    os.kill(os.getpid(), signal.SIGUSR1)  # noted, not fatal
    os.kill(os.getpid(), signal.SIGINT)  # preemption outranks an interrupt: the larger number stays
    assert stop.requested == signal.SIGUSR1
    assert step_may_go(2) and stop.agreed == signal.SIGUSR1
    assert stop.ending(2, tmp_path / "s") == {
        "status": "preempted",
        "signal": "SIGUSR1",
        "stopped_step": 2,
        "save": str(tmp_path / "s"),
    }


def test_the_first_local_rank_reads_the_job_processs_request(tmp_path: Path) -> None:
    watcher, other = RankStop(tmp_path, watches_request=True), RankStop(tmp_path, watches_request=False)
    assert watcher.local_request() == 0
    (tmp_path / STOP_REQUEST).write_text("SIGTERM\n")
    assert (watcher.local_request(), other.local_request()) == (signal.SIGTERM, 0)


def test_the_job_handler_asks_once_then_stops_at_once_and_puts_the_handlers_back(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with handling_stops(tmp_path) as job_stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert (tmp_path / STOP_REQUEST).read_text() == "SIGTERM\n"
        assert job_stop.stop == STOPS[signal.SIGTERM]
        with pytest.raises(SignalException) as raised, job_stop.ranks_running():
            os.kill(os.getpid(), signal.SIGINT)
        assert raised.value.sigval == signal.SIGKILL  # what the elastic agent kills the ranks with
    assert signal.getsignal(signal.SIGTERM) is before and not (tmp_path / STOP_REQUEST).exists()
    assert sweep_stop("ok") == STOPS[signal.SIGTERM]  # a signal while a point ended ok still ends the sweep


def test_the_stopped_account_names_the_signal_the_step_and_the_save() -> None:
    result = {
        "status": "preempted",
        "signal": "SIGTERM",
        "stopped_step": 7,
        "save": "/r/checkpoints/step_00000007",
    }
    assert stopped(result, saving=True) == {
        "error": "SIGTERM stopped the job after step 7; saved /r/checkpoints/step_00000007: resume=true continues from it",
        "stop_signal": "SIGTERM",
        "stopped_step": 7,
        "save": "/r/checkpoints/step_00000007",
    }
    assert stopped({**result, "save": None}, saving=False)["error"] == (
        "SIGTERM stopped the job after step 7; saving is off (save.every=0), so nothing to resume from"
    )
