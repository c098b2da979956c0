"""Shared helpers: run `python -m trainer` as a user would and read back what it wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.jsonl import read_jsonl

REPO = Path(__file__).resolve().parent.parent

# Tests never reach W&B's servers: an offline run is written and read back locally.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out_dir: Path

    @property
    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.out_dir / "metrics.jsonl")

    @property
    def losses(self) -> list[float]:
        return [r["loss/train"] for r in self.records]

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out_dir / "summary.json").read_text())


def run_trainer(out_dir: Path, *overrides: str, check: bool = True, timeout: float = 300) -> Run:
    """`python -m trainer OVERRIDES hydra.run.dir=out_dir` in a fresh process."""
    args = [sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={out_dir}"]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    run = Run(proc.returncode, proc.stdout, proc.stderr, out_dir)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"trainer exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
    return run


def free_port() -> int:
    """A TCP port free on this host now: the rendezvous of a test's own process group."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives a rank on this host, for a process a test starts itself."""
    return {
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


# Small and fast: tiny model, short sequences, every step logged.
TINY = ("model=tiny", "device=cpu", "logger=none", "seq_len=64", "micro_batch=2", "log_every=1")


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
