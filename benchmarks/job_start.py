"""What a short job costs around its training: this working tree against another commit, side by side.

    python benchmarks/job_start.py [--base REV] [--rounds 5]

Runs the same jobs from this working tree and from a temporary git worktree of REV (default
HEAD), alternating round by round so that a shared machine's load hits both alike:

- `train`: a 1-step, 2-rank tiny job (`save=off`): start-up, one step, shut-down;
- `plan`: `mode=plan` for the same job: the job process alone, no rank.

It prints the median wall time and CPU seconds of each, their ratio (this tree / REV), and each
figure's noise (slowest round over fastest, less 1). CPU seconds are the whole machine's busy
time during the job, from /proc/stat (Linux): run it on an otherwise quiet machine. The test
suite is about a hundred such jobs, so it costs in proportion.

Pass rule: every job's CPU ratio <= --max-cpu-ratio and wall ratio <= --max-wall-ratio (default
1.05 each: this tree no costlier than REV beyond noise; docs/design.md's figures against a1ae575
are checked with `--base a1ae575 --max-cpu-ratio 0.65 --max-wall-ratio 0.75`). Exits 1 when one is over.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare with (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-cpu-ratio", type=float, default=1.05)
    parser.add_argument("--max-wall-ratio", type=float, default=1.05)
    args = parser.parse_args()
    failed: list[str] = []
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
            failed = over_budget(report(figures, list(trees)), args.max_cpu_ratio, args.max_wall_ratio)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=True, capture_output=True
            )
    for line in failed:
        print(f"MISS {line}")
    return 1 if failed else 0


def report(
    figures: dict[tuple[str, str], list[tuple[float, float]]], trees: list[str]
) -> dict[str, tuple[float, float]]:
    """Print the table; return each job's (wall ratio, CPU ratio), this tree over the other."""
    print(
        f"| job | {trees[0]} wall s | {trees[1]} wall s | wall ratio | {trees[0]} CPU s | {trees[1]} CPU s "
        "| CPU ratio | noise (wall, CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ratios = {}
    for job in JOBS:
        mine, theirs = figures[job, trees[0]], figures[job, trees[1]]
        wall = [statistics.median(w for w, _ in runs) for runs in (mine, theirs)]
        cpu = [statistics.median(c for _, c in runs) for runs in (mine, theirs)]
        noise = [max(spread([r[i] for r in runs]) for runs in (mine, theirs)) for i in (0, 1)]
        ratios[job] = (wall[0] / wall[1], cpu[0] / cpu[1])
        print(
            f"| {job} | {wall[0]:.2f} | {wall[1]:.2f} | {ratios[job][0]:.3f} | {cpu[0]:.1f} | {cpu[1]:.1f} "
            f"| {ratios[job][1]:.3f} | {noise[0]:.0%}, {noise[1]:.0%} |"
        )
    return ratios


def spread(values: list[float]) -> float:
    """An arm's noise: its slowest round over its fastest, less 1."""
    return max(values) / min(values) - 1


def over_budget(ratios: dict[str, tuple[float, float]], max_cpu: float, max_wall: float) -> list[str]:
    """The pass rule: one line per job whose wall or CPU ratio is above its ceiling."""
    out = []
    for job, (wall, cpu) in ratios.items():
        if wall > max_wall:
            out.append(f"{job}: wall ratio {wall:.3f} > {max_wall:g}")
        if cpu > max_cpu:
            out.append(f"{job}: CPU ratio {cpu:.3f} > {max_cpu:g}")
    return out


if __name__ == "__main__":
    sys.exit(main())
