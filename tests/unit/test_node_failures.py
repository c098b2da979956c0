"""Which failure ends a multi-node job (trainer/cluster.py job_failure): every node names the same one,
whichever node's launcher saw its ranks end first. The node records are written here as the other
node's launcher would write them, on a thread, a moment later."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest

from trainer.cluster import PEER_WAIT_S, job_failure, node_failure_path
from trainer.launch import RankFailure

KILLED = RankFailure(rank=1, exitcode=-9, cause="killed by SIGKILL (exit code -9)", node=1)
ABORTED = RankFailure(rank=0, exitcode=-6, cause="killed by SIGABRT (exit code -6)", node=0)
LOST = RankFailure(rank=0, exitcode=1, cause="RuntimeError: Connection reset by peer", node=0)
RAISED = RankFailure(rank=0, exitcode=1, cause="RuntimeError: injected fault at step 3", node=0)


def write_later(out_dir: Path, failure: RankFailure, delay_s: float) -> threading.Thread:
    """The other node's record, `delay_s` from now."""

    def write() -> None:
        time.sleep(delay_s)
        path = node_failure_path(out_dir, failure.node)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**dataclasses.asdict(failure), "time": time.time()}) + "\n")

    thread = threading.Thread(target=write)
    thread.start()
    return thread


@pytest.mark.parametrize("own", [ABORTED, LOST], ids=["aborted", "lost_peer"])
def test_a_node_whose_rank_aborted_or_lost_its_peer_names_the_killed_rank_of_the_other_node(
    tmp_path: Path, own: RankFailure
) -> None:
    other = write_later(tmp_path, KILLED, delay_s=0.5)  # written after this node's own
    failure = job_failure(tmp_path, own, nodes=2)
    other.join()
    assert failure == KILLED


def test_the_killed_ranks_node_names_its_own_rank_without_waiting(tmp_path: Path) -> None:
    node_failure_path(tmp_path, 0).parent.mkdir(parents=True)
    node_failure_path(tmp_path, 0).write_text(json.dumps({**dataclasses.asdict(ABORTED), "time": 0.0}) + "\n")
    assert job_failure(tmp_path, KILLED, nodes=2) == KILLED


def test_an_abort_is_named_before_a_lost_peer_once_every_node_has_written(tmp_path: Path) -> None:
    """No node's rank raised or was killed from outside: the abort, whose peer then lost it, began it."""
    lost_on_node_1 = dataclasses.replace(LOST, rank=1, node=1)
    other = write_later(tmp_path, ABORTED, delay_s=0.3)
    failure = job_failure(tmp_path, lost_on_node_1, nodes=2)
    other.join()
    assert failure == ABORTED


def test_a_rank_that_raised_is_named_by_its_node_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    assert job_failure(tmp_path, RAISED, nodes=2) == RAISED
    assert time.monotonic() - started < PEER_WAIT_S / 6  # it did not wait for node 1, which never writes here
