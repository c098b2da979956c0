"""Fixtures for every tier; the helpers they use live in tests/helpers.py (test modules import them from there)."""

from __future__ import annotations

import os

# OpenMP's threads sleep while they wait for work, in this process and in every job the tests start:
# set before torch loads OpenMP, which reads it once. Spinning, a 1-rank CPU job's two threads (world.py
# gives a lone rank both cores) burned 5-6 of its rank's 6-6.5 CPU-seconds on this 2-core machine with
# the suite's two workers beside it (0.7-0.9 passive; a 4-step tiny job, measured). The threads, the
# work they split and so the numbers are the same either way; only the waiting changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor's vector ISA is taken from the CPU's flags as they are (its `cpp.vec_isa_ok`), in this process and
# every job: without it each process that first compiles with inductor on CPU builds and dlopens a probe
# library per ISA the CPU lists, about 10 s the first time on this machine. The inductor tests and the GPU
# check's compiled rows still build, load and compare real kernels; what is skipped is torch checking that
# this machine's compiler can target the ISA its CPU reports: both inductor tests from a cold cache, in one
# process, 57.7 s with the probes and 24.3 s without (tests/unit/model, side by side).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import TINY, Run, run_trainer  # noqa: E402

# Tests never reach W&B's servers: an offline run is written and read back locally.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pin_xdist_worker() -> None:
    """Give each xdist worker its own share of the cores, which the jobs it starts inherit.

    A CPU rank splits the cores it may run on among its node's ranks (trainer/world.py); two workers
    whose jobs each take every core run twice the threads the host has, and OpenMP's barriers then
    wait on descheduled threads: a 1-rank tiny job of 8 steps took 72 s beside other jobs and 17 s
    pinned to one core (16:14 UTC, 2 cores, load 12). The rank code already honours an affinity
    mask (taskset, a cgroup cpuset); the suite sets one per worker."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or workers is None or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    share = cores[int(worker.removeprefix("gw")) % len(cores) :: int(workers)] or cores
    os.sched_setaffinity(0, share)


pin_xdist_worker()


@pytest.fixture
def trainer(tmp_path: Path):
    """Call as trainer("zero=stage3", "steps=8") -> Run; each call gets its own output directory."""
    counter = iter(range(1000))

    def _run(*overrides: str, check: bool = True) -> Run:
        return run_trainer(tmp_path / f"run{next(counter)}", *TINY, *overrides, check=check)

    return _run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
