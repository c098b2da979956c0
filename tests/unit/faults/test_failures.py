"""Out of memory as a result (trainer/faults/failures.py): telling it from other errors, the failure records that
make a point `oom` or `crashed`, and the CPU memory cap."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from tests.helpers import CPU_OOM
from trainer.faults.failures import explain, is_out_of_memory, mark_phase, read_failures, recording_failures


@pytest.mark.parametrize(
    "error,oom",
    [
        (RuntimeError(CPU_OOM), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (MemoryError(), True),
        (RuntimeError("std::bad_alloc"), True),
        (RuntimeError("injected fault at step 2"), False),
        (ValueError("micro_batch must be >= 1"), False),
    ],
)
def test_out_of_memory_is_told_from_other_errors(error: BaseException, oom: bool) -> None:
    assert is_out_of_memory(error) is oom


def test_a_failing_rank_records_its_step_and_phase(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), recording_failures(tmp_path, rank=1):
        mark_phase(4, "backward")
        raise RuntimeError(CPU_OOM)
    record = read_failures(tmp_path)[1]
    assert (record["rank"], record["step"], record["phase"], record["oom"]) == (1, 4, "backward", True)
    assert record["message"] == f"RuntimeError: {CPU_OOM}"


def test_an_oom_record_explains_the_job_before_the_first_failed_rank(tmp_path: Path) -> None:
    """Rank 0 failed first (its peer's socket closed), but rank 1 ran out of memory: the job is oom on rank 1."""
    with pytest.raises(RuntimeError), recording_failures(tmp_path, rank=0):
        mark_phase(2, "backward")
        raise RuntimeError("Connection closed by peer [127.0.0.1]:53149")
    with pytest.raises(RuntimeError), recording_failures(tmp_path, rank=1):
        mark_phase(2, "forward")
        raise RuntimeError(CPU_OOM)
    record = explain(first_rank=0, exitcodes={0: 1, 1: 1}, out_dir=tmp_path, capped=True)
    assert record is not None and (record["rank"], record["step"], record["phase"], record["oom"]) == (
        1,
        2,
        "forward",
        True,
    )


def test_a_sigkill_is_oom_only_under_a_memory_cap(tmp_path: Path) -> None:
    exitcodes = {1: -signal.SIGKILL}
    record = explain(first_rank=1, exitcodes=exitcodes, out_dir=tmp_path, capped=True)
    assert record is not None and (record["rank"], record["oom"]) == (1, True)
    record = explain(first_rank=1, exitcodes=exitcodes, out_dir=tmp_path, capped=False)
    assert record is not None and (record["rank"], record["oom"], record["message"]) == (
        1,
        False,
        "killed by SIGKILL (exit code -9)",
    )


def test_a_killed_rank_explains_the_job_when_the_launcher_names_its_peer_first(tmp_path: Path) -> None:
    """Rank 1 was killed (no record); rank 0 then failed on the closed connection and the launcher
    saw rank 0 end first: rank 1 explains the job, out of memory only under a cap."""
    with pytest.raises(RuntimeError), recording_failures(tmp_path, rank=0):
        mark_phase(4, "forward")
        raise RuntimeError("Connection closed by peer [127.0.0.1]:53149")
    exitcodes = {0: 1, 1: -signal.SIGKILL}
    record = explain(first_rank=0, exitcodes=exitcodes, out_dir=tmp_path, capped=False)
    assert record is not None and (record["rank"], record["oom"], record["message"]) == (
        1,
        False,
        "killed by SIGKILL (exit code -9)",
    )
    record = explain(first_rank=0, exitcodes=exitcodes, out_dir=tmp_path, capped=True)
    assert record is not None and (record["rank"], record["oom"]) == (1, True)


def test_the_rank_that_raised_first_explains_the_job_when_torch_names_its_peer(tmp_path: Path) -> None:
    """Rank 1 raised; rank 0 then failed on the closed connection in the same second, and torch's
    whole-second timestamps name rank 0 first: the records' own clock names rank 1."""
    with pytest.raises(RuntimeError), recording_failures(tmp_path, rank=1):
        mark_phase(2, "forward")
        raise RuntimeError("injected fault at step 2")
    with pytest.raises(RuntimeError), recording_failures(tmp_path, rank=0):
        mark_phase(2, "backward")
        raise RuntimeError("Connection closed by peer [127.0.0.1]:53149")
    record = explain(first_rank=0, exitcodes={0: 1, 1: 1}, out_dir=tmp_path, capped=False)
    assert record is not None and (record["rank"], record["step"], record["phase"]) == (1, 2, "forward")
    assert record["message"] == "RuntimeError: injected fault at step 2"


def test_a_killed_rank_explains_the_job_before_a_peer_that_aborted(tmp_path: Path) -> None:
    """Rank 1 was killed; rank 0 met the broken connection on gloo's own thread and aborted, and the
    launcher saw rank 0 end first: neither left a record, and rank 1's signal explains the job."""
    exitcodes = {0: -signal.SIGABRT, 1: -signal.SIGKILL}
    record = explain(first_rank=0, exitcodes=exitcodes, out_dir=tmp_path, capped=False)
    assert record is not None and (record["rank"], record["message"]) == (
        1,
        "killed by SIGKILL (exit code -9)",
    )
    record = explain(first_rank=0, exitcodes={0: -signal.SIGABRT}, out_dir=tmp_path, capped=False)
    assert record is not None and (record["rank"], record["message"]) == (
        0,
        "killed by SIGABRT (exit code -6)",
    )
