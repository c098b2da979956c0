"""Issue 39, A7: model=hf's bad inputs, each one line and exit 2 before any rank starts; shape fields the
config.json leaves out are warned about."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_trainer

PLAN = ("mode=plan", "nproc=2", "device=cpu", "logger=none")
FIELDS = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def refused(tmp_path: Path, *overrides: str) -> str:
    run = run_trainer(tmp_path / "run", *PLAN, "model=hf", *overrides, check=False)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    assert not (tmp_path / "run" / "plan.json").exists()
    return lines[0]


def test_model_hf_without_a_config_is_refused(tmp_path: Path) -> None:
    assert refused(tmp_path) == (
        "error: model=hf needs model.config=<a Hugging Face config.json, or a directory holding one>"
    )


def test_malformed_json_names_the_file_and_where(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,, }')
    assert refused(tmp_path, f"model.config={path}") == (
        f"error: model.config={path}: not valid JSON: Expecting property name enclosed in double quotes "
        "at line 1 column 59"
    )


def test_a_mistyped_shape_field_is_named(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**FIELDS, "num_hidden_layers": "2"}))
    assert refused(tmp_path, f"model.config={path}") == (
        f"error: model.config={path}: num_hidden_layers must be an integer >= 1, got '2'"
    )


def test_a_shape_override_beside_model_hf_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FIELDS))
    assert refused(tmp_path, f"model.config={path}", "model.dim=1024") == (
        f"error: model.dim=1024 beside model=hf: the shapes come from model.config={path}; "
        "edit that config.json, or drop the override"
    )


def test_absent_shape_fields_are_warned_and_take_transformers_defaults(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({k: v for k, v in FIELDS.items() if k not in ("vocab_size", "num_key_value_heads")})
    )
    run = run_trainer(tmp_path / "run", *PLAN, "model=hf", f"model.config={path}")
    assert (
        f"warning: model.config={path}: num_key_value_heads, vocab_size absent: transformers' defaults taken "
        "(num_key_value_heads=4, vocab_size=32000), likely not the checkpoint's model"
    ) in run.stderr
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["num_params"] > 32000 * 64
