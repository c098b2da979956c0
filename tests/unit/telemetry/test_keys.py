"""trainer/telemetry/keys.py: the contract's names, checked against docs/design.md."""

from __future__ import annotations

import re

from tests.helpers import REPO
from trainer.telemetry import keys
from trainer.telemetry.keys import Status

DESIGN = (REPO / "docs" / "design.md").read_text()


def test_the_statuses_are_the_designs() -> None:
    listed = re.search(r"with a status \(([a-z |]+)\)", DESIGN)
    assert listed is not None
    assert [s.strip() for s in listed.group(1).split("|")] == [s.value for s in Status]
    assert f"{Status.interrupted}" == str(Status.interrupted) == "interrupted" == Status.interrupted


def test_every_per_step_key_is_in_the_designs_metric_table() -> None:
    table = DESIGN.split("## 4.")[1].split("## 5.")[0]
    per_step = [
        keys.LOSS, keys.LR, keys.GRAD_NORM, keys.TOKENS_PER_S, keys.TOKENS_PER_S_PER_RANK, keys.MFU_PCT,
        keys.STEP_S, keys.DATA_S, keys.MAX_RANK_PEAK, keys.ARGMAX_RANK, keys.IMBALANCE, keys.PREDICTED_PEAK,
        keys.PREDICTION_ERROR_PCT, keys.LOSS_SCALE, keys.OVERFLOW, keys.SKIPPED_STEPS,
        keys.COMM_PREDICTED_BYTES, keys.COMM_PREDICTION_ERROR_PCT, keys.COMM_EXPOSED_PCT,
        keys.COMM_PREDICTION_ERROR_BYTES, keys.COMM_WINDOW_PREDICTED_BYTES,
    ]  # fmt: skip
    assert [key for key in per_step if f"`{key}`" not in table] == []


def test_per_rank_keys_and_their_patterns_agree() -> None:
    assert keys.memory_key(3, "peak_allocated_gib") == "memory/rank3/peak_allocated_gib"
    assert keys.PEAK_ALLOCATED_KEY.fullmatch(keys.memory_key(3, "peak_allocated_gib")).group(1) == "3"
    assert keys.COMM_KEY.fullmatch(keys.comm_key(12, "bytes_per_step")).group(1) == "12"
    assert keys.COMM_KEY.fullmatch(keys.comm_key(1, "all_reduce_bytes_per_step")) is None
    assert keys.comm_key(0, "bytes_per_step").startswith(keys.COMM_RANK_PREFIX)
    assert keys.comm_key(0, "bytes_per_step").endswith(keys.BYTES_PER_STEP_SUFFIX)


def test_every_summary_only_key_of_the_plans_errors_is_in_the_design() -> None:
    """summary.json's counts of what the plan's errors compared (issue 60 item 3), named in docs/design.md."""
    summary_only = [
        keys.COMM_COMPARED_STEPS, keys.MEMORY_COMPARED_WINDOWS, keys.MEMORY_EXCLUDED_WINDOWS, keys.MEMORY_ERROR_STEP,
    ]  # fmt: skip
    assert [key for key in summary_only if f"`{key}`" not in DESIGN] == []
