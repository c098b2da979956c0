"""The tests' job server (tests/job_zygote.py): a job forked from it, and the fork server it forks for its
ranks, train as a fresh `python -m trainer` process does, and leave nothing behind."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from tests.helpers import (
    REPO,
    TINY,
    Run,
    assert_nothing_left,
    job_env,
    job_zygote,
    left_in,
    short_tmpdir,
    trainer_args,
)
from trainer.faults.leftovers import JOB_MARKER, marked

JOB = (*TINY, "nproc=2", "steps=3", "save=off", "zero=stage1")  # stage1: the fork server preloads more


def run(way: str, out_dir: Path, tmp: Path | None = None) -> Run:
    """The job forked from the server, or as a fresh process (with TMPDIR=`tmp`)."""
    args, env = trainer_args(*JOB, f"hydra.run.dir={out_dir}"), job_env()
    server = job_zygote()
    assert server is not None and server.takes(env)
    if way == "server":
        proc = server.run(args, cwd=REPO, env=env, timeout=300)
    else:
        fresh_env = {**env, "TMPDIR": str(tmp)} if tmp is not None else env
        proc = subprocess.run(args, cwd=REPO, env=fresh_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Run(proc.returncode, proc.stdout, proc.stderr, out_dir, env[JOB_MARKER])


def test_a_job_from_the_server_trains_bitwise_as_a_fresh_process_and_leaves_nothing(tmp_path: Path) -> None:
    with short_tmpdir() as scratch:  # the fork server's socket lives there
        fresh = run("process", tmp_path / "process", scratch)
        left = left_in(scratch)
    forked = run("server", tmp_path / "server")
    assert len(forked.losses) == 3 and forked.losses == fresh.losses  # bitwise
    assert forked.summary["status"] == fresh.summary["status"] == "ok"
    # The forked fork server ends with its job, as a spawned one does: it holds no end of its
    # alive pipe but the read end it was passed.
    assert_nothing_left(forked.marker)
    assert_nothing_left(fresh.marker)
    # Nor anything in its temporary directory but torch's compile cache (torchinductor_USER, kept
    # across runs by design): the launcher's directory of error files goes with the job (torch's
    # default, /tmp/torchelastic_*, stays forever), as does multiprocessing's fork-server socket's.
    assert left == []


def test_every_process_of_a_job_from_the_server_carries_its_mark(tmp_path: Path) -> None:
    """The mark a job's processes are found by (/proc/PID/environ, trainer/faults/leftovers.py) is in
    the forked job, its forked fork server and the ranks forked from that, not only in os.environ."""
    out_dir, env = tmp_path / "run", job_env()
    args = trainer_args(*TINY, "nproc=2", "steps=100", "save=off", f"hydra.run.dir={out_dir}")
    server = job_zygote()
    assert server is not None
    ended: list[int] = []
    job = threading.Thread(target=lambda: ended.append(server.run(args, REPO, env, 300).returncode))
    job.start()
    metrics, deadline = out_dir / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = {proc.pid: proc.ppid() for proc in marked(env[JOB_MARKER])}
    job.join()
    assert ended == [0]
    ranks = [pid for pid, parent in seen.items() if parent in seen and seen[parent] in seen]
    assert len(ranks) == 2, seen  # children of the fork server, itself a child of the job process
    assert_nothing_left(env[JOB_MARKER])
