"""Started under torchrun, the runner joins the ranks torchrun made instead of launching its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, TINY, Run, run_trainer


def test_torchrun_ranks_train_like_the_runners_own(tmp_path: Path) -> None:
    out = tmp_path / "torchrun"
    settings = [*TINY, "steps=4", "zero=stage3"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", "-m", "trainer", *settings, f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    joined = Run(proc.returncode, proc.stdout, proc.stderr, out)
    launched = run_trainer(tmp_path / "launched", *settings, "nproc=2")
    assert joined.summary["status"] == "ok"
    assert joined.losses == launched.losses  # same ranks, same data, same numbers
