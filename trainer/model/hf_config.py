"""`model=hf model.config=<config.json or its directory>`: the shapes of a Hugging Face checkpoint.

The file is read by `transformers`' own configuration class of its architecture (an optional
extra, `pip install zerolab[hf]`), so every field the file leaves out takes the library's
default, exactly as `from_pretrained` would build the model; nothing is downloaded. Supported are
the Llama-family decoders zerolab's decoder is (trainer/model/decoder.py): RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU, and per family

    LlamaForCausalLM     Llama 2/3.x: rope_scaling none or llama3, tied or untied head
    MistralForCausalLM   Mistral: a sliding window becomes max_seq_len (full causal attention
                         equals sliding-window attention for sequences no longer than the window)
    Qwen2ForCausalLM     Qwen2/2.5: biases on q, k, v
    Qwen3ForCausalLM     Qwen3: q/k RMSNorm, head_dim apart from hidden_size / heads

Anything else (mixture-of-experts, encoder-decoder, other activations, biases elsewhere, other
rope scalings) is refused in one line naming what is not supported, before any rank starts.
This module imports nothing of trainer/ (trainer/config/model.py calls it): its HfConfigError becomes the
schema's ConfigError there, its `rope_scaling` a RopeScaling name.
Weights are loaded only with `model.weights` (trainer/model/hf_weights.py, which permutes each
head between transformers' rotary layout and zerolab's); `export_config` writes the config.json
of an export (trainer/saves/hf_export.py).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class HfConfigError(ValueError):
    """A config.json zerolab cannot read or does not support (one line): `detail` about the file at
    `path`, named as model.config unless the caller names it otherwise (model.weights' own config.json)."""

    def __init__(self, detail: str, path: object = None) -> None:
        super().__init__(detail if path is None else f"model.config={path}: {detail}")
        self.detail = detail
        self.path = path


def config_path(value: str) -> Path:
    """The config.json named by `model.config`: the file itself, or the one in that directory."""
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HfConfigError("no such config.json (give the file or a directory holding one)", value)
    return path


def architecture(raw: dict[str, Any], path: Path) -> str:
    """The file's architecture, refused in one line unless zerolab's decoder is that model."""
    names = raw.get("architectures") or []
    if len(names) != 1 or names[0] not in SUPPORTED:
        found = ", ".join(names) if names else f"none (model_type {raw.get('model_type')})"
        raise HfConfigError(f"architecture {found} is not supported; supported: {', '.join(SUPPORTED)}", path)
    return names[0]


def hf_config_class(name: str) -> type:
    try:
        import transformers
    except ImportError:
        raise HfConfigError(
            "model=hf reads config.json with transformers' configuration classes: pip install 'zerolab[hf]' "
            "(transformers>=4.51)"
        ) from None
    return getattr(transformers, name.replace("ForCausalLM", "Config"))


def rope_fields(hf: Any, path: Path) -> dict[str, Any]:
    """rope_theta and the scaling: transformers 5 keeps both in `rope_parameters`, 4.x apart."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:  # transformers 4.x
        params = {"rope_theta": hf.rope_theta, **(getattr(hf, "rope_scaling", None) or {})}
    kind = params.get("rope_type", params.get("type")) or "default"
    fields: dict[str, Any] = {"rope_theta": float(params["rope_theta"])}
    if kind == "default":
        return {**fields, "rope_scaling": "none"}
    if kind != "llama3":
        raise HfConfigError(f"rope scaling {kind} is not supported; supported: llama3, none", path)
    return {
        **fields,
        "rope_scaling": "llama3",
        "rope_factor": float(params["factor"]),
        "rope_low_freq_factor": float(params["low_freq_factor"]),
        "rope_high_freq_factor": float(params["high_freq_factor"]),
        "rope_original_max_seq_len": int(params["original_max_position_embeddings"]),
    }


def refuse_unsupported(hf: Any, name: str, path: Path) -> None:
    """Options of these families zerolab's decoder does not have."""
    unsupported = {
        "hidden_act": getattr(hf, "hidden_act", "silu") != "silu",
        "attention_bias": bool(getattr(hf, "attention_bias", False)),
        "mlp_bias": bool(getattr(hf, "mlp_bias", False)),
    }
    for key, refused in unsupported.items():
        if refused:
            raise HfConfigError(
                f"{name} with {key}={getattr(hf, key)} is not supported "
                "(zerolab's decoder: SwiGLU with silu, no biases but Qwen2's on q, k, v)",
                path,
            )


def max_seq_len(hf: Any, name: str) -> int:
    """max_position_embeddings, capped at a sliding window (Mistral; Qwen2/3 with use_sliding_window)."""
    window = getattr(hf, "sliding_window", None)
    if name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not getattr(hf, "use_sliding_window", False):
        window = None
    limit = hf.max_position_embeddings
    return min(limit, window) if window else limit


SHAPE_FIELDS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "vocab_size": "vocab_size",
    "intermediate_size": "ffn_dim",
    "max_position_embeddings": "max_seq_len",
}
"""config.json's shape fields and the ModelConfig keys they set: each an integer >= 1 where present."""


def read_json(path: Path) -> dict[str, Any]:
    """The file as a JSON object; malformed JSON or a mistyped shape field in one line naming both."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HfConfigError(
            f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}", path
        ) from None
    except UnicodeDecodeError:
        raise HfConfigError("not a UTF-8 text file", path) from None
    if not isinstance(raw, dict):
        raise HfConfigError(f"a JSON object of fields expected, got {type(raw).__name__}", path)
    for key in SHAPE_FIELDS:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HfConfigError(f"{key} must be an integer >= 1, got {value!r}", path)
    return raw


def absent_shape_fields(path: Path) -> list[str]:
    """Shape fields config.json leaves out: transformers' defaults fill them (a different model, likely)."""
    raw = read_json(path)
    return [key for key in SHAPE_FIELDS if key != "max_position_embeddings" and raw.get(key) is None]


def model_fields(path: Path) -> dict[str, Any]:
    """The ModelConfig keys a config.json sets, read by transformers' class of its architecture."""
    raw = read_json(path)
    name = architecture(raw, path)
    try:
        hf = hf_config_class(name).from_json_file(str(path))
    except (TypeError, ValueError, KeyError) as err:  # transformers' own checks of the fields
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise HfConfigError(f"transformers refuses it: {line}", path) from None
    refuse_unsupported(hf, name, path)
    heads = hf.num_attention_heads
    return {
        "dim": hf.hidden_size,
        "n_layers": hf.num_hidden_layers,
        "n_heads": heads,
        "n_kv_heads": hf.num_key_value_heads or heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        "vocab_size": hf.vocab_size,
        "ffn_dim": hf.intermediate_size,
        "max_seq_len": max_seq_len(hf, name),
        "norm_eps": float(hf.rms_norm_eps),
        "tie_embeddings": bool(hf.tie_word_embeddings),
        "qk_norm": name == "Qwen3ForCausalLM",
        "qkv_bias": name == "Qwen2ForCausalLM",
        **rope_fields(hf, path),
    }


def export_config(model: Any, dtype: str) -> Any:
    """transformers' configuration of zerolab model `model` (a ModelConfig), the inverse of
    `model_fields`: Qwen3 where it has q/k norms, Qwen2 where it has q/k/v biases, else Llama
    (a Mistral is a Llama with a sliding window no shorter than max_seq_len, which it becomes)."""
    name = (
        "Qwen3ForCausalLM" if model.qk_norm else "Qwen2ForCausalLM" if model.qkv_bias else "LlamaForCausalLM"
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rope_theta}
    scaling = getattr(model.rope_scaling, "value", model.rope_scaling)
    if scaling == "llama3":
        rope |= {
            "rope_type": "llama3",
            "factor": model.rope_factor,
            "low_freq_factor": model.rope_low_freq_factor,
            "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_max_seq_len,
        }
    cls = hf_config_class(name)
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:  # transformers 5
        rope_kwargs: dict[str, Any] = {"rope_parameters": rope}
    else:  # transformers 4.x: the theta and the scaling apart, as rope_fields reads them
        theta = rope.pop("rope_theta")
        rope_kwargs = {"rope_theta": theta, "rope_scaling": None if rope["rope_type"] == "default" else rope}
    config = cls(
        architectures=[name],
        hidden_size=model.dim,
        intermediate_size=model.ffn_dim,
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads,
        head_dim=model.head_width,
        vocab_size=model.vocab_size,
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        **rope_kwargs,
    )
    config.dtype = dtype
    return config
