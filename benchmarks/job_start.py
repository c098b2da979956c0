"""What a short job costs around its training: this working tree against another commit, side by side.

    python benchmarks/job_start.py [--base REV] [--rounds 5]

Runs the same jobs from this working tree and from a temporary git worktree of REV (default
HEAD), alternating round by round so that a shared machine's load hits both alike:

- `train`: a 1-step, 2-rank tiny job (`save=off`): start-up, one step, shut-down;
- `plan`: `mode=plan` for the same job: the job process alone, no rank.

It prints the median wall time and CPU seconds of each, and their ratio (this tree / REV). CPU
seconds are the whole machine's busy time during the job, from /proc/stat (Linux): run it on an
otherwise quiet machine. The test suite is about a hundred such jobs, so it costs in proportion.
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
JOB = [
    "model=tiny",
    "device=cpu",
    "nproc=2",
    "logger=none",
    "seq_len=64",
    "micro_batch=2",
    "steps=1",
    "save=off",
]
JOBS = {"train": JOB, "plan": [*JOB, "mode=plan"]}


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (every field of /proc/stat's cpu line but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run(tree: Path, overrides: list[str], out: Path) -> tuple[float, float]:
    """Wall and busy CPU seconds of one `python -m trainer` from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "disabled"}  # `trainer` from that tree
    cpu, start = busy_cpu_s(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={out}"], cwd=tree, env=env,
                   check=True, capture_output=True, text=True, timeout=600)  # fmt: skip
    return time.perf_counter() - start, busy_cpu_s() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare with (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.base],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        try:
            trees = {"this tree": REPO, args.base: base}
            figures: dict[tuple[str, str], list[tuple[float, float]]] = {
                (j, t): [] for j in JOBS for t in trees
            }
            for n in range(args.rounds):
                order = list(trees.items()) if n % 2 == 0 else list(trees.items())[::-1]
                for job, overrides in JOBS.items():
                    for name, tree in order:
                        out = (
                            Path(tmp) / "runs" / f"{job}-{n}-{list(trees).index(name)}"
                        )  # one directory per run
                        figures[job, name].append(run(tree, overrides, out))
            report(figures, list(trees))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=True, capture_output=True
            )


def report(figures: dict[tuple[str, str], list[tuple[float, float]]], trees: list[str]) -> None:
    print(
        f"| job | {trees[0]} wall s | {trees[1]} wall s | wall ratio | {trees[0]} CPU s | {trees[1]} CPU s | CPU ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for job in JOBS:
        mine, theirs = figures[job, trees[0]], figures[job, trees[1]]
        wall = [statistics.median(w for w, _ in runs) for runs in (mine, theirs)]
        cpu = [statistics.median(c for _, c in runs) for runs in (mine, theirs)]
        print(
            f"| {job} | {wall[0]:.2f} | {wall[1]:.2f} | {wall[0] / wall[1]:.3f} | {cpu[0]:.1f} | {cpu[1]:.1f} | {cpu[0] / cpu[1]:.3f} |"
        )


if __name__ == "__main__":
    main()
