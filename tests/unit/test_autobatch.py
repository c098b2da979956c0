"""micro_batch=auto's console (trainer/autobatch.py): what it changes is said (issue 60)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import compose_config
from trainer.autobatch import choose_micro_batch

CAP = (
    "model=tiny",
    "device=cpu",
    "seq_len=256",
    "device_memory_gib=0.15",
    "advise.headroom=0.45",
    "mode=plan",
)


def test_auto_without_global_batch_says_the_global_batch_it_chose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without global_batch the global batch follows memory: one warning names it and how to hold it."""
    config, record = choose_micro_batch(
        compose_config(*CAP, "micro_batch=auto", "grad_accum=3"), tmp_path, "cpu", 2, 2
    )
    m = record["chosen"]
    assert (config.micro_batch, config.grad_accum) == (m, 3)
    assert capsys.readouterr().err.splitlines() == [
        f"warning: micro_batch=auto without global_batch: the global batch follows memory: micro_batch={m} x "
        f"grad_accum=3 x 2 data-parallel ranks = {6 * m} sequences per step; global_batch={6 * m} keeps it on "
        "other devices"
    ]


def test_auto_with_global_batch_says_nothing_more(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = choose_micro_batch(
        compose_config(*CAP, "micro_batch=auto", "global_batch=48"), tmp_path, "cpu", 2, 2
    )
    assert config.sequences_per_step(2) == 48 and capsys.readouterr().err == ""
