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
    MixtralForCausalLM   Mixtral: every block's MLP a mixture of experts (trainer/model/moe.py),
                         num_local_experts of width intermediate_size, num_experts_per_tok per
                         token, softmax scores, the chosen weights always normalised
    Qwen3MoeForCausalLM  Qwen3-MoE: Qwen3's attention, num_experts of width moe_intermediate_size,
                         normalised when norm_topk_prob; every block sparse (mlp_only_layers
                         empty, decoder_sparse_step 1)

Anything else (shared experts, dense blocks among sparse ones, router noise, encoder-decoder,
other activations, biases elsewhere, other rope scalings) is refused in one line naming what is
not supported, before any rank starts. A mixture's training keys (router_aux_loss_coef,
output_router_logits) are not read: the run's moe: keys decide them (conf/moe).
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

SUPPORTED = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
MIXTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
"""The families whose every block's MLP is a mixture of experts (model.n_experts > 0)."""
SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")
"""Other families' names for shared experts: refused if a Mixtral or Qwen3-MoE file carries one."""


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
    """max_position_embeddings, capped at a sliding window (Mistral, Mixtral; Qwen2/3/3-MoE with
    use_sliding_window)."""
    window = getattr(hf, "sliding_window", None)
    qwen = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if name in qwen and not getattr(hf, "use_sliding_window", False):
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
        "qk_norm": name in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        "qkv_bias": name == "Qwen2ForCausalLM",
        **rope_fields(hf, path),
        **moe_fields(hf, name, path),
    }


def moe_fields(hf: Any, name: str, path: Path) -> dict[str, Any]:
    """The mixture's keys (n_experts 0 for a dense family, so that a dense file also sets it): softmax
    scores over all experts, top num_experts_per_tok, normalised always (Mixtral's router) or when
    norm_topk_prob (Qwen3-MoE's); Mixtral's experts are intermediate_size wide, Qwen3-MoE's apart."""
    if name not in MIXTURES:
        return {"n_experts": 0}
    refuse_unsupported_moe(hf, name, path)
    qwen = name == "Qwen3MoeForCausalLM"
    return {
        # transformers 5 calls both num_local_experts (num_experts an alias), 4.x's Qwen3-MoE num_experts.
        "n_experts": getattr(hf, "num_local_experts", None) or hf.num_experts,
        "top_k": hf.num_experts_per_tok,
        "moe_ffn_dim": hf.moe_intermediate_size if qwen else None,
        "n_shared_experts": 0,
        "router_score": "softmax",
        "route_norm": bool(hf.norm_topk_prob) if qwen else True,
    }


def refuse_unsupported_moe(hf: Any, name: str, path: Path) -> None:
    """What zerolab's mixture (trainer/model/moe.py) is not: it replaces every block's MLP, has at least 2
    routed experts, no shared experts and no router noise."""
    count = "num_local_experts" if name == "MixtralForCausalLM" else "num_experts"
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", 0)
    dense_layers = getattr(hf, "mlp_only_layers", None) or []
    sparse_step = getattr(hf, "decoder_sparse_step", 1)
    noise = getattr(hf, "router_jitter_noise", 0.0)
    checks = [
        (count, experts, experts < 2),
        ("mlp_only_layers", dense_layers, bool(dense_layers)),
        ("decoder_sparse_step", sparse_step, sparse_step != 1),
        ("router_jitter_noise", noise, bool(noise)),
        *((key, getattr(hf, key, None), bool(getattr(hf, key, None))) for key in SHARED_EXPERT_FIELDS),
    ]
    for key, value, refused in checks:
        if refused:
            raise HfConfigError(
                f"{name} with {key}={value} is not supported (zerolab's mixture of experts: every block's "
                "MLP, at least 2 routed experts, no shared experts, no router noise)",
                path,
            )


def export_architecture(model: Any) -> str:
    """transformers' class of zerolab model `model` (a ModelConfig), by what sets the families apart:
    Qwen3 where it has q/k norms, Qwen2 where it has q/k/v biases, else Llama (a Mistral is a Llama with
    a sliding window no shorter than max_seq_len, which it becomes); with experts, Qwen3-MoE where it has
    q/k norms, else Mixtral. Both the export and model.weights' key map (hf_weights.py) go by it."""
    if model.n_experts == 0:
        dense = "Qwen2ForCausalLM" if model.qkv_bias else "LlamaForCausalLM"
        return "Qwen3ForCausalLM" if model.qk_norm else dense
    refusal = moe_refusal(model)
    if refusal is not None:
        raise HfConfigError(refusal)
    return "Qwen3MoeForCausalLM" if model.qk_norm else "MixtralForCausalLM"


def moe_refusal(model: Any) -> str | None:
    """Why a mixture of experts is neither transformers' Mixtral nor its Qwen3-MoE (one line), or None."""
    score = getattr(model.router_score, "value", model.router_score)
    if model.n_shared_experts > 0:
        shared = model.n_shared_experts
        return f"model.n_shared_experts={shared}: neither Mixtral nor Qwen3-MoE has shared experts"
    if score != "softmax":
        return f"model.router_score={score}: Mixtral and Qwen3-MoE score their experts by softmax"
    if model.qkv_bias:
        return "model.qkv_bias=true with experts: neither Mixtral nor Qwen3-MoE has q/k/v biases"
    if not model.qk_norm and not model.route_norm:
        return (
            "model.route_norm=false without model.qk_norm: Mixtral always normalises its top_k weights "
            "(Qwen3-MoE, which has q/k norms, may not)"
        )
    return None


def moe_kwargs(model: Any, name: str) -> dict[str, Any]:
    """The mixture's fields of transformers' configuration `name`: the inverse of `moe_fields`."""
    if name == "MixtralForCausalLM":  # its experts are intermediate_size wide (ffn_dim is not written)
        return {
            "intermediate_size": model.expert_width,
            "num_local_experts": model.n_experts,
            "num_experts_per_tok": model.top_k,
        }
    if name == "Qwen3MoeForCausalLM":
        return {
            "moe_intermediate_size": model.expert_width,
            "num_experts": model.n_experts,
            "num_experts_per_tok": model.top_k,
            "norm_topk_prob": model.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return {}


def export_config(model: Any, dtype: str) -> Any:
    """transformers' configuration of zerolab model `model` (a ModelConfig), the inverse of
    `model_fields`, of the class `export_architecture` names."""
    name = export_architecture(model)
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
    shapes = {
        "hidden_size": model.dim,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.head_width,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings,
    }
    config = cls(architectures=[name], **(shapes | moe_kwargs(model, name)), **rope_kwargs)
    config.dtype = dtype
    return config
