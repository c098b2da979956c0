"""Llama-3.x, Qwen3 and Mistral: the presets' published counts, model=hf's config.json, tied
embeddings, q/k norms, a separate head width, and the chunked loss's equality with the full one."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import load_preset, materialized
from trainer.config import ConfigError, ModelConfig, RopeScaling
from trainer.model.decoder import build_model, build_rope_table, flops_per_token, num_params
from trainer.model.loss import chunked_cross_entropy
from trainer.plan.states import model_shape

# The published parameter counts (issue 23); qwen3-32b's from its config.json's shapes.
COUNTS = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
    "mistral-7b": 7_241_732_096,
}

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# The fields of each model's Hugging Face config.json that set its shapes (the rest take the library's defaults).
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA31_ROPE,
        "tie_word_embeddings": False,
    },
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA31_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
    },
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
    },
}
SHAPE_KEYS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "ffn_dim",
    "max_seq_len",
    "norm_eps",
    "rope_theta",
    "head_width",
    "tie_embeddings",
    "qk_norm",
    "qkv_bias",
    *(f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("rope_")),  # every rope field
)
# What the files set of those rope fields (ModelConfig's names): Llama-3.x's rope_scaling block, Qwen3's theta.
FILE_ROPE = {
    "llama3-8b": dict(rope_theta=500000.0, rope_scaling=RopeScaling.llama3, rope_factor=8.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=8192),
    "llama3.2-1b": dict(rope_theta=500000.0, rope_scaling=RopeScaling.llama3, rope_factor=32.0,
                        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=8192),
    "qwen3-0.6b": dict(rope_theta=1000000.0, rope_scaling=RopeScaling.none),
    "qwen3-8b": dict(rope_theta=1000000.0, rope_scaling=RopeScaling.none),
}  # fmt: skip


def write_config(directory: Path, fields: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return directory


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize(("preset", "expected"), COUNTS.items())
def test_presets_have_the_published_parameter_counts(preset: str, expected: int) -> None:
    config = load_preset(preset)
    assert model_shape(config).num_params == expected  # the plan's count: one block on meta, repeated
    if config.n_layers <= 40:  # a whole build on meta (the 70b/405b builds take seconds)
        assert num_params(config) == expected


def test_tied_embeddings_are_one_parameter_counted_once() -> None:
    tied = load_preset("llama3.2-1b")
    untied = dataclasses.replace(tied, tie_embeddings=False)
    assert num_params(untied) - num_params(tied) == tied.vocab_size * tied.dim
    model = build_model(tied)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())
    # MFU's FLOPs: the one matrix counts as the head's matmul, the embedding lookup as nothing.
    L, H, Q, T = tied.n_layers, tied.n_heads, tied.head_width, 2048
    assert flops_per_token(tied, T) == 6 * num_params(tied) + 12 * L * H * Q * T
    assert (
        flops_per_token(untied, T)
        == 6 * (num_params(untied) - tied.vocab_size * tied.dim) + 12 * L * H * Q * T
    )


def test_new_features_off_leave_the_state_dict_keys_unchanged() -> None:
    tiny = load_preset("tiny")
    keys = set(build_model(tiny).state_dict())
    assert not any("q_norm" in k or "k_norm" in k or k.endswith(".bias") for k in keys)
    qwen = build_model(dataclasses.replace(tiny, qk_norm=True, head_dim=48, qkv_bias=True))
    extra = set(qwen.state_dict()) - keys
    assert extra == {
        f"layers.{i}.attention.{name}"
        for i in range(tiny.n_layers)
        for name in ("q_norm.weight", "k_norm.weight", "wq.bias", "wk.bias", "wv.bias")
    }
    assert qwen.layers[0].attention.wq.weight.shape == (4 * 48, 128)


def test_tied_model_trains_the_one_weight_from_both_ends() -> None:
    config = dataclasses.replace(load_preset("tiny"), tie_embeddings=True)
    model = materialized(config, seed=0)
    assert model.output.weight is model.tok_embeddings.weight  # tied again after to_empty
    tokens_BT = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(tokens_BT).flatten(0, 1), tokens_BT.flatten()).backward()
    assert (
        model.tok_embeddings.weight.grad is not None
        and model.output.weight.grad is model.tok_embeddings.weight.grad
    )


def test_llama3_rope_scaling_divides_only_low_frequencies() -> None:
    config = load_preset("llama3-8b")
    assert config.rope_scaling == RopeScaling.llama3
    cis_TF = build_rope_table(config.head_width, 64, config.rope_theta, torch.device("cpu"), config)
    plain_TF = build_rope_table(config.head_width, 64, config.rope_theta, torch.device("cpu"))
    angle_F = cis_TF[1].angle()
    inv_freq_F = 1.0 / config.rope_theta ** (torch.arange(0, 128, 2) / 128)
    wavelen_F = 2 * math.pi / inv_freq_F
    high = wavelen_F < 8192 / 4.0
    low = wavelen_F > 8192 / 1.0
    assert torch.allclose(angle_F[high], inv_freq_F[high].float(), rtol=1e-5)
    assert torch.allclose(angle_F[low], (inv_freq_F[low] / 8.0).float(), rtol=1e-4)
    assert high.sum() > 0 and low.sum() > 0 and not torch.equal(cis_TF, plain_TF)


# ----------------------------------------------------------------------------- model=hf


@pytest.mark.parametrize("preset", HF_CONFIGS)
def test_a_config_json_gives_the_presets_shapes(tmp_path: Path, preset: str) -> None:
    pytest.importorskip("transformers")
    from_json = ModelConfig(config=str(write_config(tmp_path, HF_CONFIGS[preset])))
    config = load_preset(preset)
    assert {k: getattr(from_json, k) for k in SHAPE_KEYS} == {k: getattr(config, k) for k in SHAPE_KEYS}
    assert from_json.name == f"hf:{(tmp_path / 'config.json').resolve()}" and from_json.config is None
    assert model_shape(from_json).num_params == COUNTS[preset]
    for key, value in FILE_ROPE.get(preset, {}).items():
        assert (key, getattr(from_json, key)) == (key, value)
        assert (key, getattr(config, key)) == (key, value)


def test_every_llama3_rope_field_comes_from_its_own_key(tmp_path: Path) -> None:
    """Values no default shares, so a field read from another key (the original context from
    max_position_embeddings, a factor from another factor) or left at its default shows."""
    rope = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
            "original_max_position_embeddings": 4096}  # fmt: skip
    fields = {**HF_CONFIGS["llama3.2-1b"], "rope_theta": 250000.0, "rope_scaling": rope}
    from_json = ModelConfig(config=str(write_config(tmp_path, fields)))
    rope_keys = [k for k in SHAPE_KEYS if k.startswith("rope_")]
    assert {k: getattr(from_json, k) for k in rope_keys} == dict(
        rope_theta=250000.0, rope_scaling=RopeScaling.llama3, rope_factor=16.0, rope_low_freq_factor=2.0,
        rope_high_freq_factor=8.0, rope_original_max_seq_len=4096
    )  # fmt: skip


@pytest.mark.parametrize("preset", ["llama3.2-1b", "qwen3-0.6b", "mistral-7b"])
def test_transformers_own_model_has_the_same_count(preset: str) -> None:
    """transformers builds its model of the family on meta from the same config.json fields."""
    transformers = pytest.importorskip("transformers")
    fields = HF_CONFIGS[preset]
    config_class = getattr(transformers, fields["architectures"][0].replace("ForCausalLM", "Config"))
    model_class = getattr(transformers, fields["architectures"][0])
    with torch.device("meta"):
        hf_model = model_class(config_class(**{k: v for k, v in fields.items() if k != "architectures"}))
    assert sum(p.numel() for p in hf_model.parameters()) == COUNTS[preset] == num_params(load_preset(preset))


def test_qwen2_config_has_qkv_biases_and_transformers_agrees(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    fields = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "tie_word_embeddings": True,
    }
    config = ModelConfig(config=str(write_config(tmp_path, fields)))
    assert config.qkv_bias and config.tie_embeddings and not config.qk_norm
    with torch.device("meta"):
        hf_model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields))
    assert num_params(config) == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
            "architecture DeepseekV3ForCausalLM is not supported; supported: LlamaForCausalLM, MistralForCausalLM, "
            "Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM",
        ),
        (
            {"architectures": ["T5ForConditionalGeneration"]},
            "architecture T5ForConditionalGeneration is not supported",
        ),
        ({"model_type": "llama"}, "architecture none (model_type llama) is not supported"),
    ],
)
def test_other_architectures_are_refused_naming_them(
    tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        ModelConfig(config=str(write_config(tmp_path, fields)))
    assert "\n" not in str(err.value)


def test_unsupported_options_of_a_supported_family_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    fields = {**HF_CONFIGS["llama3-8b"], "attention_bias": True}
    with pytest.raises(ConfigError, match="attention_bias=True is not supported"):
        ModelConfig(config=str(write_config(tmp_path, fields)))
    with pytest.raises(ConfigError, match="no such config.json"):
        ModelConfig(config=str(tmp_path / "missing"))


# ----------------------------------------------------------------------------- chunked loss


@pytest.mark.parametrize("chunk_tokens", [7, 16, 48, 1000])
def test_chunked_loss_and_gradients_equal_the_full_loss(chunk_tokens: int) -> None:
    config = dataclasses.replace(load_preset("tiny"), qk_norm=True, head_dim=48, tie_embeddings=True)
    model = materialized(config, seed=1)
    tokens_BT, targets_BT = torch.randint(
        0, config.vocab_size, (2, 2, 24), generator=torch.Generator().manual_seed(2)
    )
    full = F.cross_entropy(model(tokens_BT).float().flatten(0, 1), targets_BT.flatten())
    full.backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.loss_chunk_tokens = chunk_tokens
    chunked = model(tokens_BT, targets_BT)
    chunked.backward()
    assert abs(chunked.item() - full.item()) < 1e-6
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, full_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_loss_never_holds_the_whole_logits() -> None:
    """The largest tensor alive in the chunked loss is a chunk's: no fp32 N x V exists at once."""
    hidden_ND = torch.randn(64, 32, requires_grad=True)
    weight_VD = torch.randn(1000, 32, requires_grad=True)
    targets_N = torch.randint(0, 1000, (64,))
    largest = 0

    class Largest(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            nonlocal largest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() != weight_VD.numel():  # its gradient aside
                    largest = max(largest, t.numel())
            return out

    with Largest():
        chunked_cross_entropy(hidden_ND[None], weight_VD, targets_N[None], chunk_tokens=16).backward()
    assert largest == 16 * 1000  # one chunk's logits (or their gradient), never 64 x 1000
    assert weight_VD.grad is not None and hidden_ND.grad is not None
