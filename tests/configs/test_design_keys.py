"""docs/design.md section 1 names every top-level key of the schema (TrainConfig): a key added to
trainer/config/train.py without a word in the contract fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from trainer.config import TrainConfig

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def test_the_design_names_every_top_level_key() -> None:
    section = DESIGN.read_text().split("## 1.", 1)[1].split("## 2.", 1)[0]
    named = set(re.findall(r"`([a-z_]+)(?:\.\*)?`", section))
    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    assert len(keys) > 30 and {"micro_batch", "attention", "fault"} <= keys
    groups = set(re.findall(r"^\| `([a-z_]+)` \|", DESIGN.read_text(), re.MULTILINE))  # section 2's table
    assert sorted(keys - named - groups) == []
