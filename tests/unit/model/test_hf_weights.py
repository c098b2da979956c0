"""Issue 35: a Hugging Face checkpoint in zerolab's decoder (world size 1; two ranks in
tests/integration/test_hf_weights.py): logits equal transformers' for each family at stages 0 and 3,
the control without the rotary permutation, the checks' one-line refusals, the export's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import HF_FAMILIES, HF_SEQUENCES, WORLD, hf_checkpoint, hf_logits, zero_over_world
from trainer.config import ConfigError, ModelConfig, Stage, ZeroConfig
from trainer.model import hf_weights
from trainer.model.decoder import build_model
from trainer.model.hf_weights import check_weights, expected_tensors, to_hf_layout, to_meta_layout

pytestmark = (
    pytest.mark.torch_versions
)  # DCP's HuggingFaceStorageReader into DTensor shards: torch 2.11 and 2.13
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each family's tiny random checkpoint and transformers' logits on the 4 sequences."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (path := hf_checkpoint(root / name, name), hf_logits(path)) for name in HF_FAMILIES}


def zerolab_logits(weights: Path, stage: str) -> torch.Tensor:
    config = ModelConfig(name="hf", weights=str(weights))
    model = zero_over_world(build_model(config), ZeroConfig(stage=Stage(stage)), WORLD, config.weights)
    with torch.no_grad():
        return model(HF_SEQUENCES)


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_logits_equal_transformers(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], family: str, stage: str, process_group: None
) -> None:
    weights, expected = checkpoints[family]
    assert (zerolab_logits(weights, stage) - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_without_the_rotary_permutation_the_check_fails(
    checkpoints: dict[str, tuple[Path, torch.Tensor]],
    family: str,
    process_group: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hf_weights, "to_meta_layout", lambda tensor, heads: tensor)
    weights, expected = checkpoints[family]
    assert (zerolab_logits(weights, "stage3") - expected).abs().max().item() > 1e-3


def test_the_two_layouts_are_each_others_inverse_and_transformers_permute() -> None:
    heads, head_dim, dim = 3, 8, 5
    meta = torch.arange(heads * head_dim * dim, dtype=torch.float32).reshape(heads * head_dim, dim)
    # transformers' convert_llama_weights_to_hf.py permute(w, n_heads, dim1, dim2), written out.
    permuted = meta.view(heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(heads * head_dim, dim)
    assert torch.equal(to_hf_layout(meta, heads), permuted)
    assert torch.equal(to_meta_layout(permuted, heads), meta)
    bias = torch.arange(heads * head_dim, dtype=torch.float32)
    assert torch.equal(to_meta_layout(to_hf_layout(bias, heads), heads), bias)


def test_a_tied_head_asks_for_no_lm_head(checkpoints: dict[str, tuple[Path, torch.Tensor]]) -> None:
    config = ModelConfig(name="hf", weights=str(checkpoints["Qwen3ForCausalLM"][0]))
    keys = {tensor.key for tensor, _ in expected_tensors(config).values()}
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert "model.layers.1.self_attn.q_norm.weight" in keys


def test_a_pipeline_stage_reads_its_own_tensors_only(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of 2 stages asks DCP's reader and the permuted reader for its own parameters' tensors only (stage 0
    the embedding and block 0, stage 1 block 1, the norm and the head), and holds them as the whole model does."""
    import torch.distributed.checkpoint as dcp

    from trainer.model.decoder import materialize
    from trainer.model.pipeline_split import build_stage

    weights = checkpoints["LlamaForCausalLM"][0]
    config = ModelConfig(name="hf", weights=str(weights))
    whole = build_model(config, device="meta")
    materialize(whole, "cpu", seed=0, load=lambda m: hf_weights.load_weights(m, weights))
    asked: list[str] = []
    load, load_permuted = dcp.load, hf_weights.load_permuted
    monkeypatch.setattr(dcp, "load", lambda state, **kw: (asked.extend(state), load(state, **kw))[1])
    monkeypatch.setattr(hf_weights, "load_permuted", lambda p, w: (asked.extend(p), load_permuted(p, w))[1])
    expected = {name: tensor.key for name, (tensor, _) in expected_tensors(config).items()}
    held = []
    for stage in range(2):
        asked.clear()
        part = build_stage(config, stage, 2)
        materialize(part, "cpu", seed=0, load=lambda m: hf_weights.load_weights(m, weights))
        names = [name for name, _ in part.named_parameters()]
        assert sorted(asked) == sorted(expected[name] for name in names)
        for name, param in part.named_parameters():
            assert torch.equal(param, whole.get_parameter(name)), (stage, name)
        held += names
    assert sorted(held) == sorted(expected)  # the two stages together: every tensor, each once


# ----------------------------------------------------------------------------- the checks' lines


def copy_checkpoint(source: Path, target: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    """`source` copied to `target` with tensors replaced (a tensor) or left out (None)."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = safetensors_torch.load_file(source / "model.safetensors")
    for key, value in edit.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    safetensors_torch.save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def refusal(weights: Path, **config: str) -> str:
    with pytest.raises(ConfigError) as err:
        check_weights(ModelConfig(name="hf", weights=str(weights), **config))
    return str(err.value)


def test_a_mis_shaped_tensor_is_named_with_both_shapes(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    key = "model.layers.1.mlp.up_proj.weight"
    bad = copy_checkpoint(checkpoints["LlamaForCausalLM"][0], tmp_path / "bad", {key: torch.zeros(95, 64)})
    assert refusal(bad) == (
        f"model.weights={bad}: tensor {key} has shape [95, 64] in model.safetensors, the model needs [96, 64]"
    )


def test_a_missing_tensor_is_named_with_its_shape(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    key = "model.layers.0.self_attn.q_proj.bias"
    bad = copy_checkpoint(checkpoints["Qwen2ForCausalLM"][0], tmp_path / "bad", {key: None})
    assert refusal(bad) == (
        f"model.weights={bad}: tensor {key} missing (the model needs [64], the checkpoint has none; 1 missing in all)"
    )


def test_an_unexpected_tensor_is_named_with_its_shape(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    key = "model.layers.0.self_attn.o_proj.bias"  # a bias zerolab's decoder does not have
    bad = copy_checkpoint(checkpoints["Qwen3ForCausalLM"][0], tmp_path / "bad", {key: torch.zeros(64)})
    assert refusal(bad) == (
        f"model.weights={bad}: tensor {key} of shape [64] in model.safetensors is not in the model (no such "
        "tensor there; 1 unexpected in all): another architecture or options"
    )


def test_a_config_json_of_another_model_names_the_fields(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    weights = checkpoints["LlamaForCausalLM"][0]
    other = json.loads((weights / "config.json").read_text()) | {"num_hidden_layers": 3, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(other))
    assert refusal(weights, config=str(tmp_path)) == (
        f"model.weights={weights}: its config.json is another model than model=hf:{tmp_path / 'config.json'}: "
        f"n_layers (2 there, 3 here), norm_eps (1e-06 there, 1e-05 here); model=hf model.weights={weights} alone "
        "builds the model its config.json describes"
    )


def test_a_directory_without_safetensors_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        check_weights(ModelConfig(weights=str(tmp_path)))
    assert str(err.value) == (
        f"model.weights={tmp_path}: no safetensors files there (model.safetensors, or shards with "
        "model.safetensors.index.json); give a directory written by transformers' save_pretrained"
    )


def test_a_truncated_safetensors_file_is_named_with_its_sizes(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """Issue 60: a copy cut short was safetensors' traceback; its header says how long the file must be."""
    source = checkpoints["LlamaForCausalLM"][0]
    cut = copy_checkpoint(source, tmp_path / "cut", {})
    whole = (source / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(whole[:8], "little")
    (cut / "model.safetensors").write_bytes(whole[: len(whole) - 1000])
    assert refusal(cut) == (
        f"model.weights={cut}: model.safetensors is truncated: {len(whole) - 1000} bytes, its header describes "
        f"{len(whole)}; copy the file again"
    )
    (cut / "model.safetensors").write_bytes(whole[: header - 1])
    assert refusal(cut) == (
        f"model.weights={cut}: model.safetensors is truncated: {header - 1} bytes, less than its header "
        f"({header} bytes); copy the file again"
    )


def test_model_weights_own_config_json_is_named_as_model_weights(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """Issue 60: model=hf with model.weights alone reads its config.json; a bad one names model.weights."""
    weights = copy_checkpoint(checkpoints["LlamaForCausalLM"][0], tmp_path / "w", {})
    (weights / "config.json").write_text('{"architectures": ')
    with pytest.raises(ConfigError) as err:
        ModelConfig(name="hf", weights=str(weights))
    assert str(err.value) == (
        f"model.weights={weights}: its config.json: not valid JSON: Expecting value at line 1 column 19"
    )
    (weights / "config.json").unlink()
    with pytest.raises(ConfigError) as err:
        ModelConfig(name="hf", weights=str(weights))
    assert str(err.value) == (
        f"model.weights={weights}: no config.json there, and model=hf builds the model its config.json describes; "
        "give a directory written by transformers' save_pretrained, or model.config=<a config.json>"
    )


# ----------------------------------------------------------------------------- export's config.json


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_the_exported_config_json_is_the_same_model(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], family: str, tmp_path: Path
) -> None:
    from trainer.model.hf_config import export_config, model_fields

    config = ModelConfig(name="hf", weights=str(checkpoints[family][0]))
    export_config(config, "float32").save_pretrained(tmp_path)
    fields = model_fields(tmp_path / "config.json")
    assert fields == {key: getattr(getattr(config, key), "value", getattr(config, key)) for key in fields}
