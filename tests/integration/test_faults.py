"""Faults found before a rank starts or survived while ranks run: a host too small for its CPU ranks,
a token file that is not one, a broken newest save, a save that cannot be written, W&B dying."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, Run, run_trainer

pytestmark = pytest.mark.timeout(300)


def refused(out_dir: Path, *overrides: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    cmd = [sys.executable, "-m", "trainer", "device=cpu", "logger=none", *overrides, f"hydra.run.dir={out_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


def started_no_rank(out_dir: Path) -> bool:
    """A rank writes metrics.jsonl (rank 0) or a failure record; a refused job has neither."""
    return not (out_dir / "metrics.jsonl").exists() and not (out_dir / "failures").exists()


def test_more_cpu_ranks_than_the_host_holds_are_refused_in_one_line(tmp_path: Path) -> None:
    proc, seconds = refused(tmp_path / "run", "nproc=64")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: does not fit this host: 64 CPU ranks each hold 0.40 GiB of process runtime")
    assert "GiB available" in lines[0] and "Try nproc=" in lines[0]
    assert "warning: 64 CPU ranks share" in proc.stdout and "0.40 GiB process runtime per rank" in proc.stdout
    assert started_no_rank(tmp_path / "run")
    assert seconds < 60  # about 5 s on an idle 2-core host; the bound leaves room for a loaded CI runner


def test_a_text_file_as_token_file_is_refused_in_one_line(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("not token ids\n" * 100)
    proc, _ = refused(tmp_path / "run", "nproc=2", "data=tokens", f"data.path={text}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: data.path: {text} is not a .npy file of token ids; make one with `python -m trainer.data make-tokens INPUT.txt OUTPUT.npy`"]
    assert not (tmp_path / "run" / "plan.json").exists() and started_no_rank(tmp_path / "run")
