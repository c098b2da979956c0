"""Started under torchrun, the runner joins the ranks torchrun made instead of launching its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, TINY, Run, run_trainer


def test_torchrun_ranks_train_like_the_runners_own(tmp_path: Path) -> None:
    settings = [*TINY, "steps=4", "zero=stage3"]
    joined = torchrun(tmp_path / "torchrun", *settings)
    assert joined.returncode == 0, joined.stderr[-3000:]
    launched = run_trainer(tmp_path / "launched", *settings, "nproc=2")
    assert joined.summary["status"] == "ok"
    assert joined.losses == launched.losses  # same ranks, same data, same numbers
    assert joined.summary["memory/predicted_peak_gib"] == launched.summary["memory/predicted_peak_gib"]  # planned alike


def torchrun(out: Path, *overrides: str) -> Run:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", "-m", "trainer", *overrides, f"hydra.run.dir={out}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    return Run(proc.returncode, proc.stdout, proc.stderr, out)


def test_torchrun_job_is_planned_and_refused_by_rank0_before_training(tmp_path: Path) -> None:
    run = torchrun(tmp_path / "refused", *TINY, "steps=4", "device_memory_gib=0.01")
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: does not fit")]
    assert len(errors) == 1, run.stderr[-3000:]  # rank 0 says it once; rank 1 exits quietly
    assert run.summary["status"] == "refused" and run.summary["world_size"] == 2
    assert json.loads((run.out_dir / "plan.json").read_text())["world_size"] == 2
    assert not (run.out_dir / "metrics.jsonl").exists()
