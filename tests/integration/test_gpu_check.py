"""checks/gpu_check.py --dry-run: the whole GPU check on CPU with the tiny model, the same table shape."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from checks.gpucheck import catalog
from tests.helpers import REPO, left_in

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h

ROWS = [
    "environment", "kernel rates", "throughput 1b bf16 stage0", "step breakdown (1b eager)", "cupti torn down vs attached (1b)",
    "1b eager micro_batch 32", "compile 1b", "compile 1b micro_batch 16", "fp8 vs bf16 compiled (1b)",
    "throughput 125m bf16 stage0", "compile", "text data, document packing", "advisor tokens/s (h200)",
    "gpu tests", "throughput 125m bf16 stage3", "throughput 1b bf16 stage3",
    "headroom", "expandable segments", "cpu save resumed on the device", "device save resumed on the device",
    "fp16 injected overflow", "fp16 sharded scaler (stage3)", "offload=cpu skips a NaN step", "offload host memory", "plan at the device limit",
    "oom under device_memory_gib", "micro_batch=auto", "fp32 vs bf16 losses", "bf16 runs reproducible", "checkpointing full",
    "checkpointing selective", "checkpointing op", "loss chunked", "attention efficient (bf16)", "attention math (bf16)",
    "grad_accum 2", "stage2 on one GPU", "sync-free step", "fp8 vs bf16 compiled (125m)",
]  # fmt: skip
NO_XDIST = {**os.environ, "PYTEST_ADDOPTS": "-p no:xdist"}
"""The GPU host has no pytest-xdist: every pytest the check starts runs with the plugin blocked, so
pyproject's `-n 2` would be a usage error unless the check overrides addopts (issue 27, item 1)."""


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every finished descendant that was waited for
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def adopting_orphans() -> Iterator[None]:
    """Count the CPU of descendants whose parent ends first: a job's ranks are children of its
    fork server, which outlives the job process by a moment and would otherwise be reaped, with
    its ranks' CPU time, by init. This process becomes their subreaper and waits for them."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())
    ours = {child.pid for child in psutil.Process().children()}
    try:
        yield
        for orphan in [child for child in psutil.Process().children() if child.pid not in ours]:
            orphan.wait(timeout=30)  # psutil reaps its own child with waitpid: its CPU is counted
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@pytest.mark.slow  # about 150 s of 2 CPU cores, a third of them alone at the suite's end: .ci/run runs it
@pytest.mark.timeout(1800)
def test_dry_run_produces_every_row_and_passes(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    bundle = tmp_path_factory.mktemp("bundle")
    start, cpu_before = time.perf_counter(), children_cpu_s()
    with adopting_orphans():
        # A deadline far off: on a shared machine the wall time says more about the neighbours than
        # about the check, so CPU time is what is asserted below.
        args = [sys.executable, "checks/gpu_check.py", "--dry-run", "--out", str(tmp_path),
                "--bundle", str(bundle), "--deadline", "1500"]  # fmt: skip
        proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1700, env=NO_XDIST)
    elapsed, cpu_s = time.perf_counter() - start, children_cpu_s() - cpu_before
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {row["check"]: row for row in results["rows"]}
    assert results["dry_run"] and [row["check"] for row in results["rows"]] == ROWS
    assert proc.returncode == 0, [
        (r["check"], r["status"], r["note"])
        for r in results["rows"]
        if r["status"] not in ("pass", "info", "skip")
    ]
    assert {name for name, row in rows.items() if row["status"] == "skip"} == {
        "headroom",
        "expandable segments",
        "attention efficient (bf16)",  # a CUDA kernel only
        "sync-free step",  # a timing
    }
    assert "skipped" in rows["gpu tests"]["figures"]["pytest"]  # pytest ran, without xdist
    fp16 = rows["fp16 injected overflow"]["figures"]["scales"]
    assert fp16[2] == fp16[1] / 2 and rows["fp16 sharded scaler (stage3)"]["figures"]["skipped_steps"] == 1
    assert rows["oom under device_memory_gib"]["figures"]["status"] == "oom"
    assert rows["cpu save resumed on the device"]["figures"]["first_step"] == 5
    assert rows["offload=cpu skips a NaN step"]["figures"]["nonfinite_skipped"] == 1
    host = rows["offload host memory"]["figures"]
    assert host["planned_parts_gib"]["runtime"] == 0.4  # a CPU rank's runtime, plan.cpu_rank_runtime_gib
    # what the rank's RSS says its runtime was: about the 0.3-0.45 GiB trainer/plan/host.py states
    assert 0.2 <= host["measured_runtime_gib"] <= 0.8, host
    assert rows["bf16 runs reproducible"]["figures"]["bitwise"] is True  # CPU: bitwise equal
    for name in (
        "checkpointing op",
        "loss chunked",
        "attention math (bf16)",
    ):  # losses and peak against the plan
        assert rows[name]["status"] == "pass" and rows[name]["figures"]["max_rel_diff"] <= 0.02, rows[name]
    # The advisor row's figures are the advice file's prediction and the job's own measurement.
    advised = rows["advisor tokens/s (h200)"]["figures"]["125m_stage0"]
    advice = json.loads((tmp_path / "jobs" / catalog.ADVICE_FILE).read_text())["125m_stage0"]
    # (a dry run's 125m_stage0 is 1b_stage0's job, the first of the two: both are the tiny model)
    stage0 = json.loads((tmp_path / "jobs" / "1b_stage0" / "summary.json").read_text())
    assert advised["advised"] == round(advice["tokens_per_s"], 1)
    assert advised["measured"] == round(stage0["throughput/tokens_per_s"], 1)
    # The limit row runs the largest micro-batch the plan fits under the dry run's cap; the
    # throughput row judges the job's own plan.
    setup = catalog.Setup(dry_run=True, out=tmp_path, deadline=0.0)
    largest = catalog.largest_fitting_micro_batch(setup, catalog.limit_base(setup))
    assert rows["plan at the device limit"]["figures"]["micro_batch"] == largest
    stage3_plan = json.loads((tmp_path / "jobs" / "125m_stage3" / "plan.json").read_text())
    predicted = rows["throughput 125m bf16 stage3"]["figures"]["predicted_allocated_gib"]
    assert predicted == round(stage3_plan["peak_gib"], 3)
    # What explains each job stays under the output folder: its files, its console, its failure records.
    jobs = tmp_path / "jobs"
    assert (jobs / "125m_stage3" / "summary.json").exists() and (
        jobs / "125m_stage3" / "metrics.jsonl"
    ).exists()
    assert (jobs / "oom" / "failures" / "rank0.json").exists()
    assert re.search(r"step +4/4", (tmp_path / "logs" / "125m_stage3.log").read_text())
    # The bundle: the results and one archive of jobs/ and logs/, checkpoints left out, nothing else.
    assert sorted(p.name for p in bundle.iterdir()) == ["gpu_check.tar.gz", "results.json", "results.md"]
    assert json.loads((bundle / "results.json").read_text()) == results
    with tarfile.open(bundle / "gpu_check.tar.gz") as archive:
        names = archive.getnames()
    assert "jobs/125m_stage3/summary.json" in names and "logs/125m_stage3.log" in names
    assert not any("checkpoints" in name for name in names) and (jobs / "cpu_save" / "checkpoints").exists()
    table = (tmp_path / "results.md").read_text().splitlines()
    assert table[2] == "| check | status | figures | note | s |" and len(table) == 4 + len(ROWS)
    # At most 190 CPU-seconds: 240 held the dry run before issue 40 added the op, chunked-loss,
    # math-attention and advisor rows (250 CPU-s measured with them on 2 idle cores); issues 37 and 34
    # added micro_batch=auto's probes and the compiled fp8 pair (335 CPU-s measured with them). With
    # OpenMP's threads waiting passively (tests/conftest.py; a 1-rank job's rank spun 5 of its 6 CPU-s)
    # and the launcher's cheaper rendezvous events it measured 208 and 215 CPU-s (2 cores under a load
    # average of 6-15); on 2026-12-03, 223 (load average 2.5-4) and 171 (2), each job paying 6-7
    # CPU-s to start (its process and fork server) and under one to train. With the 14 fault and
    # comparison jobs the points of one sweep, which starts once (catalog.all_jobs), it measured 149
    # (load average 2.5), 108 and 114 (2). Issue 59's performance rows add two helper processes (the
    # kernel rates, the text corpus), three sweep points (1b at micro-batch 32, compiled at 16, the text
    # job) and a traced step in each throughput job: 238 and 245 CPU-s measured with them (2026-12-05,
    # 2 cores under a load average of 6-8; at 6-15, before the sweep, the check had measured 208-215):
    # the bound leaves the higher 14%.
    # The wall time on a shared machine says more about the neighbours than about the check, so it
    # is printed, not asserted.
    print(f"dry run: {elapsed:.0f} s wall, {cpu_s:.0f} CPU-s")
    assert cpu_s <= 280


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow  # ~35 s, most of it the deadline it waits out: .ci/run runs the slow tier
@pytest.mark.timeout(400)
def test_a_hung_row_is_killed_with_its_ranks_at_the_deadline_and_the_rest_skipped(tmp_path: Path) -> None:
    """The first throughput job never ends by itself: at the deadline its process group (the job,
    its fork server, its rank) is killed, its row fails naming what was killed, and the rows whose
    jobs had not started are skipped; the check ends soon after the deadline, exit status 1. The rows
    are named (--rows), so that the environment job alone runs before it, as when the drill was timed."""
    # The drill waits out the whole deadline, so it is as short as the hung job's first step allows:
    # after the environment job and two interpreters importing torch (the job, its fork server; the
    # rank is forked), step 1 was logged at 34 s on 2 unpinned cores under a load average of 12-16
    # (before the suite pinned each xdist worker to a core of its own, which this drill's processes
    # inherit), and at 6.8 s on one pinned core (2026-12-04, polling the log while the drill ran); 30 s leaves
    # over 4 times that.
    deadline = 30
    args = [sys.executable, "checks/gpu_check.py", "--dry-run", "--out", str(tmp_path), "--jobs", "1",
            "--deadline", str(deadline), "--inject-hang", "1b_stage0", "--rows", "environment",
            "--rows", "throughput 1b bf16 stage0", "--rows", "throughput 125m bf16 stage0", "--rows", "compile"]  # fmt: skip
    # The check's TMPDIR, where a killed job's temporary files must not stay (a short path: a fork server's
    # socket lies below it, and AF_UNIX paths end at 107 bytes)
    scratch = Path(tempfile.mkdtemp(prefix="drill_"))
    start = time.perf_counter()
    env = {**NO_XDIST, "TMPDIR": str(scratch)}
    try:
        proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=360, env=env)
        assert left_in(scratch) == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.perf_counter() - start
    rows = {row["check"]: row for row in json.loads((tmp_path / "results.json").read_text())["rows"]}
    hung = rows["throughput 1b bf16 stage0"]
    assert proc.returncode == 1 and hung["status"] == "fail", (hung, proc.stdout[-2000:])
    killed = hung["figures"]["killed_pids"]
    assert len(killed) >= 3, killed  # the job, its fork server, its rank
    assert hung["figures"]["survivors"] == [] and not any(alive(pid) for pid in killed)
    log = (tmp_path / "logs" / "1b_stage0.log").read_text()
    assert re.search(r"step +1/1000000", log) and not re.search(
        r"step +2/", log
    )  # trained, then hung in step 2
    assert rows["throughput 125m bf16 stage0"]["status"] == "fail"  # the dry run's 125m is the same job
    assert rows["compile"]["status"] == "skip" and rows["compile"]["note"].startswith(
        "not reached by the deadline"
    )
    assert elapsed < deadline + 120
