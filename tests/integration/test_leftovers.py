"""Nothing left behind (trainer/faults/leftovers.py): a job whose ranks' fork server is SIGKILLed ends
in one line naming it, and no process of the job outlives it. (A rank SIGKILLed, with and without
an elastic restart: tests/integration/test_resume.py; Ctrl-C and SIGTERM: test_stop.py.)"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, TINY, assert_nothing_left, error_lines, job_env, left_in, trainer_args
from trainer.faults.leftovers import JOB_MARKER

pytestmark = pytest.mark.timeout(240)


def test_a_killed_fork_server_takes_its_ranks_with_it_and_is_named(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"  # the job's TMPDIR
    scratch.mkdir()
    out_dir, env = tmp_path / "run", {**job_env(), "TMPDIR": str(scratch)}
    args = trainer_args(*TINY, "nproc=2", "steps=400", "save=off", f"hydra.run.dir={out_dir}")
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics, deadline = out_dir / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    (server,) = (
        child
        for child in psutil.Process(proc.pid).children()
        if "multiprocessing.forkserver" in " ".join(child.cmdline())
    )
    ranks = server.children()
    assert len(ranks) == 2
    server.kill()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert error_lines(stderr)[-1] == (
        f"error: the ranks' fork server (pid {server.pid}) failed: killed from outside (the OOM killer, "
        "or kill); every rank died with it"
    )
    assert "Traceback" not in stderr
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["status"] == "crashed" and "failed_rank" not in summary
    assert summary["failed_process"] == f"the ranks' fork server (pid {server.pid})"
    assert_nothing_left(env[JOB_MARKER])
    assert left_in(scratch) == []  # the launcher's directory of error files went with the job
