"""Fixtures for every tier; the helpers they use live in tests/helpers.py (test modules import them from there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY, Run, run_trainer

# Tests never reach W&B's servers: an offline run is written and read back locally.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


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
