"""What the tests' job server (tests/job_zygote.py) saves per job, side by side.

    python benchmarks/job_server.py [--rounds 5]

Runs the same jobs as a fresh `python -m trainer` process and forked from a warm job server (as
tests/helpers.py `run_trainer` does; such a job forks its ranks' fork server too), alternating round
by round so that a shared machine's load hits both alike:

- `train`: a 1-step, 2-rank tiny job (`save=off`): start-up, one step, shut-down;
- `plan`: `mode=plan` for the same job: the job process alone, no rank.

It prints the median wall time and CPU seconds of each way, their ratio (server / fresh process)
and each figure's noise (slowest round over fastest, less 1). CPU seconds are the whole machine's
busy time during the job, from /proc/stat (Linux): run it on an otherwise quiet machine.
Every job must exit 0 either way; the script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import TINY, trainer_args  # noqa: E402
from tests.job_zygote import JobZygote  # noqa: E402

JOBS = {"train": ("nproc=2", "steps=1", "save=off"), "plan": ("nproc=2", "mode=plan")}


def busy_seconds() -> float:
    """The machine's busy CPU time so far (every core; /proc/stat, less idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def run_once(server: JobZygote | None, overrides: tuple[str, ...], out: Path) -> tuple[float, float]:
    args = trainer_args(*TINY, *overrides, f"hydra.run.dir={out}")
    env = dict(os.environ)
    wall, cpu = time.perf_counter(), busy_seconds()
    if server is None:
        proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    else:
        proc = server.run(args, cwd=REPO, env=env, timeout=600)
    wall, cpu = time.perf_counter() - wall, busy_seconds() - cpu
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args[3:])} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wall, cpu


def noise(values: list[float]) -> float:
    return max(values) / min(values) - 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    server = JobZygote.start()
    if server is None:
        sys.exit("the job server did not start")
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="job_server_") as tmp:
        for r in range(rounds):
            for job, overrides in JOBS.items():
                for way, by in (("process", None), ("server", server)):
                    out = Path(tmp, f"{job}_{way}_{r}")
                    figures.setdefault((job, way), []).append(run_once(by, overrides, out))
    print(f"{'job':6} {'way':8} {'wall s':>7} {'noise':>6} {'CPU s':>6} {'noise':>6}")
    for job in JOBS:
        medians = {}
        for way in ("process", "server"):
            walls, cpus = zip(*figures[job, way], strict=True)
            medians[way] = statistics.median(walls), statistics.median(cpus)
            print(f"{job:6} {way:8} {medians[way][0]:7.2f} {noise(list(walls)):6.0%} "
                  f"{medians[way][1]:6.2f} {noise(list(cpus)):6.0%}")  # fmt: skip
        wall_ratio = medians["server"][0] / medians["process"][0]
        cpu_ratio = medians["server"][1] / medians["process"][1]
        print(f"{job:6} ratio    {wall_ratio:7.2f}x wall {cpu_ratio:6.2f}x CPU (server / fresh process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
