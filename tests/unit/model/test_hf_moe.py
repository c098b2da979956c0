"""Mixtral and Qwen3-MoE (the MoE issue's item 4): model=hf reads their config.json (the published counts in
`mode=plan`, the presets' shapes, the one-line refusals), model.weights loads tiny checkpoints transformers
saved with logits equal to transformers' (world size 1, stages 0 and 3), and the export loads back in
transformers with the same logits."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import (
    HF_SEQUENCES,
    HF_SHAPES,
    WORLD,
    hf_logits,
    load_preset,
    run_in_one_process,
    zero_over_world,
)
from trainer.config import ConfigError, ModelConfig, RouterScore, Stage, ZeroConfig
from trainer.model import hf_weights
from trainer.model.decoder import build_model, materialize
from trainer.model.hf_weights import check_weights, header_shapes, hf_shapes, largest_tensor_bytes
from trainer.plan.states import model_shape

pytestmark = pytest.mark.torch_versions  # DCP's HuggingFaceStorageReader into DTensor shards
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# The published counts: transformers' Mixtral and Qwen3-MoE built from these files count the same.
COUNTS = {"mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624}
# The shape fields of the Hugging Face config.json of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
    },
}
SHAPE_KEYS = (
    *("dim", "n_layers", "n_heads", "n_kv_heads", "head_width", "vocab_size", "ffn_dim", "max_seq_len"),
    *("norm_eps", "rope_theta", "rope_scaling", "tie_embeddings", "qk_norm", "qkv_bias"),
    *("n_experts", "top_k", "moe_ffn_dim", "expert_width", "n_shared_experts", "router_score", "route_norm"),
)
# Tiny checkpoints (name -> architecture, fields): hidden 64, 2 layers, 4 heads of 16, 2 kv heads, 4 experts
# of width 32, 2 per token, vocabulary 128; Qwen3-MoE with its top-2 weights normalised and not.
TINY = {  # the dense families' tiny shapes (tests/helpers.py), the MLP's width set per architecture below
    **{key: value for key, value in HF_SHAPES.items() if key != "intermediate_size"},
    "head_dim": 16,
    "num_experts_per_tok": 2,
}
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralForCausalLM", {"intermediate_size": 32, "num_local_experts": 4}),
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4, "norm_topk_prob": True},
    ),
    "qwen3-moe-unnormalised": (
        "Qwen3MoeForCausalLM",
        {"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4, "norm_topk_prob": False},
    ),
}
TOLERANCE = 1e-5
"""fp32 max abs logit difference, docs/pretrained.md's for the dense families."""


def write_config(directory: Path, fields: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return directory / "config.json"


def moe_checkpoint(directory: Path, architecture: str, fields: dict[str, Any]) -> Path:
    """A tiny random checkpoint saved by transformers' save_pretrained, every parameter drawn (norms
    about 1), so that no weight could be loaded wrongly and go unseen."""
    config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**TINY, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2 if param.ndim == 1 else 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each tiny checkpoint and transformers' logits on the 4 sequences."""
    root = tmp_path_factory.mktemp("moe")
    return {
        name: (path := moe_checkpoint(root / name, *CHECKPOINTS[name]), hf_logits(path))
        for name in CHECKPOINTS
    }


def zerolab_logits(config: ModelConfig, stage: str) -> torch.Tensor:
    model = zero_over_world(build_model(config), ZeroConfig(stage=Stage(stage)), WORLD, config.weights)
    with torch.no_grad():
        return model(HF_SEQUENCES)


# ----------------------------------------------------------------------------- model=hf's config.json


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """`python -m trainer mode=plan model=hf model.config=<file>` of each published config.json (one
    process for both: the imports paid once)."""
    tmp = tmp_path_factory.mktemp("plans")
    files = {name: write_config(tmp / name, fields) for name, fields in HF_CONFIGS.items()}
    argvs = [
        ["mode=plan", "model=hf", f"model.config={path}", "nproc=1", "device=cpu", "logger=none",
         f"hydra.run.dir={tmp / 'out' / name}"]
        for name, path in files.items()
    ]  # fmt: skip
    results = run_in_one_process(
        argvs, tmp / "results.json", timeout=120, env={**os.environ, "WANDB_MODE": "offline"}
    )
    return {name: {**result, "out": tmp / "out" / name} for name, result in zip(files, results)}


@pytest.mark.parametrize("preset", HF_CONFIGS)
def test_the_plan_of_a_published_config_json_reports_its_count(
    plans: dict[str, dict[str, Any]], preset: str
) -> None:
    run = plans[preset]
    first = run["stdout"].splitlines()[0]
    assert first.startswith("memory plan: model=hf:") and first.endswith(f", {COUNTS[preset]:,} parameters")
    assert json.loads((run["out"] / "plan.json").read_text())["num_params"] == COUNTS[preset]


@pytest.mark.parametrize("preset", HF_CONFIGS)
def test_a_config_json_gives_the_presets_shapes(tmp_path: Path, preset: str) -> None:
    from_json = ModelConfig(config=str(write_config(tmp_path, HF_CONFIGS[preset])))
    config = load_preset(preset)
    assert {k: getattr(from_json, k) for k in SHAPE_KEYS} == {k: getattr(config, k) for k in SHAPE_KEYS}
    assert from_json.router_score == RouterScore.softmax and from_json.route_norm
    assert model_shape(from_json).num_params == model_shape(config).num_params == COUNTS[preset]


@pytest.mark.parametrize("preset", HF_CONFIGS)
def test_transformers_own_model_has_the_same_count(preset: str) -> None:
    fields = {k: v for k, v in HF_CONFIGS[preset].items() if k != "architectures"}
    architecture = HF_CONFIGS[preset]["architectures"][0]
    with torch.device("meta"):
        model = getattr(transformers, architecture)(
            getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**fields)
        )
    assert sum(p.numel() for p in model.parameters()) == COUNTS[preset]


def test_the_moe_fields_map_to_the_model_keys(checkpoints: dict[str, tuple[Path, torch.Tensor]]) -> None:
    """num_local_experts / num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob."""
    got = {
        name: ModelConfig(name="hf", weights=str(checkpoints[name][0]))
        for name in ("mixtral", "qwen3-moe", "qwen3-moe-unnormalised")
    }
    keys = ("n_experts", "top_k", "ffn_dim", "moe_ffn_dim", "expert_width", "route_norm", "qk_norm")
    assert {name: tuple(getattr(config, k) for k in keys) for name, config in got.items()} == {
        "mixtral": (4, 2, 32, None, 32, True, False),
        "qwen3-moe": (4, 2, 96, 32, 32, True, True),
        "qwen3-moe-unnormalised": (4, 2, 96, 32, 32, False, True),
    }


@pytest.mark.parametrize(
    ("preset", "extra", "key", "value"),
    [
        ("qwen3-30b-a3b", {"mlp_only_layers": [0, 47]}, "mlp_only_layers", "[0, 47]"),
        ("qwen3-30b-a3b", {"decoder_sparse_step": 2}, "decoder_sparse_step", "2"),
        (
            "qwen3-30b-a3b",
            {"shared_expert_intermediate_size": 5632},
            "shared_expert_intermediate_size",
            "5632",
        ),
        ("qwen3-30b-a3b", {"num_experts": 1}, "num_experts", "1"),
        ("mixtral-8x7b", {"router_jitter_noise": 0.1}, "router_jitter_noise", "0.1"),
        ("mixtral-8x7b", {"n_shared_experts": 2}, "n_shared_experts", "2"),
    ],
)
def test_what_the_mixture_is_not_is_refused_in_one_line(
    tmp_path: Path, preset: str, extra: dict[str, Any], key: str, value: str
) -> None:
    path = write_config(tmp_path, HF_CONFIGS[preset] | extra)
    with pytest.raises(ConfigError) as err:
        ModelConfig(config=str(path))
    assert str(err.value) == (
        f"model.config={path}: {HF_CONFIGS[preset]['architectures'][0]} with {key}={value} is not supported "
        "(zerolab's mixture of experts: every block's MLP, at least 2 routed experts, no shared experts, "
        "no router noise)"
    )


# ----------------------------------------------------------------------------- model.weights


def test_save_pretrained_writes_one_tensor_per_expert(
    checkpoints: dict[str, tuple[Path, torch.Tensor]],
) -> None:
    """transformers 5 holds the experts fused once loaded, but writes the Hub's per-expert names, which
    are the names and shapes zerolab asks for: exactly the file's tensors, no more, no fewer."""
    for name in CHECKPOINTS:
        weights = checkpoints[name][0]
        found = {key: shape for key, (shape, _) in header_shapes([weights / "model.safetensors"]).items()}
        assert hf_shapes(ModelConfig(name="hf", weights=str(weights))) == found
    mixtral = header_shapes([checkpoints["mixtral"][0] / "model.safetensors"])
    assert mixtral["model.layers.1.block_sparse_moe.experts.3.w2.weight"][0] == [64, 32]
    assert mixtral["model.layers.1.block_sparse_moe.gate.weight"][0] == [4, 64]
    qwen = header_shapes([checkpoints["qwen3-moe"][0] / "model.safetensors"])
    assert qwen["model.layers.1.mlp.experts.3.gate_proj.weight"][0] == [32, 64]
    assert qwen["model.layers.1.mlp.gate.weight"][0] == [4, 64]


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_equal_transformers(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], name: str, stage: str, process_group: None
) -> None:
    weights, expected = checkpoints[name]
    config = ModelConfig(name="hf", weights=str(weights))
    check_weights(config)
    assert (zerolab_logits(config, stage) - expected).abs().max().item() < TOLERANCE


def test_the_controls_differ(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """norm_topk_prob false read as true, and the experts loaded in the reverse order, both fail the check."""
    weights, expected = checkpoints["qwen3-moe-unnormalised"]
    config = ModelConfig(name="hf", weights=str(weights))
    normalised = dataclasses.replace(config, route_norm=True)
    assert (zerolab_logits(normalised, "stage3") - expected).abs().max().item() > 1e-3
    load_experts = hf_weights.load_experts

    def reversed_experts(experts: dict[str, Any], path: Path) -> None:
        load_experts(experts, path)
        for param, _ in experts.values():
            param.copy_(param.flip(0))

    monkeypatch.setattr(hf_weights, "load_experts", reversed_experts)
    assert (zerolab_logits(config, "stage0") - expected).abs().max().item() > 1e-3


def test_a_rank_reads_the_experts_it_holds_and_another_dims_shard_all(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], process_group: None
) -> None:
    """held_experts: every expert of a plain tensor or of a dim-0 shard on one rank; None for a shard of dim 1
    (all E read, stacked and sliced by copy_full_into), which loads the same values as the plain tensor.
    Two ranks' shares: tests/integration/test_hf_moe.py."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weights = checkpoints["qwen3-moe"][0]
    config = ModelConfig(name="hf", weights=str(weights))
    (name, (tensor, shape)) = next(
        (n, e) for n, e in hf_weights.expected_tensors(config).items() if e[0].experts
    )
    plain = torch.zeros(shape)
    by_dim = {dim: distribute_tensor(torch.zeros(shape), mesh, [Shard(dim)]) for dim in (0, 1)}
    assert [hf_weights.held_experts(t, 4) for t in (plain, by_dim[0], by_dim[1])] == [[0, 1, 2, 3]] * 2 + [
        None
    ]
    for param in (plain, *by_dim.values()):
        hf_weights.load_experts({tensor.key: (param, tensor)}, weights)
    assert name == "layers.0.feed_forward.experts.w1" and plain.abs().sum() > 0
    assert torch.equal(by_dim[0].full_tensor(), plain) and torch.equal(by_dim[1].full_tensor(), plain)
    gate = safetensors_torch.load_file(weights / "model.safetensors")[
        "model.layers.0.mlp.experts.3.gate_proj.weight"
    ]
    assert torch.equal(plain[3], gate)


def test_an_expert_weight_is_planned_whole(tmp_path: Path) -> None:
    """The plan's loading figure counts a stacked expert weight (what load_experts holds at once), not one
    expert: 3 experts of 8 x 4 fp32 are 384 bytes, more than the 10 x 4 embedding's 160."""
    tensors = {f"model.layers.0.mlp.experts.{e}.gate_proj.weight": torch.zeros(8, 4) for e in range(3)}
    tensors |= {"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(8, 4)}
    tensors |= {"model.embed_tokens.weight": torch.zeros(10, 4)}
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
    assert largest_tensor_bytes([tmp_path / "model.safetensors"]) == 3 * 8 * 4 * 4


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_export_loads_in_transformers_with_equal_logits(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], name: str, tmp_path: Path
) -> None:
    """A save of the loaded model, exported: the files' names and shapes are save_pretrained's, and
    transformers' logits of the export equal zerolab's (and the original checkpoint's)."""
    import torch.distributed.checkpoint as dcp

    from trainer.model.hf_config import model_fields
    from trainer.saves.hf_export import export_save

    weights, expected = checkpoints[name]
    config = ModelConfig(name="hf", weights=str(weights))
    model = build_model(config, device="meta")
    materialize(model, "cpu", seed=0, load=lambda m: hf_weights.load_weights(m, weights))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: intended
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "save", no_dist=True)
    out = export_save(tmp_path / "save", tmp_path / "hf", config)
    exported = {key: shape for key, (shape, _) in header_shapes(hf_weights.safetensors_files(out)).items()}
    assert exported == {
        key: shape for key, (shape, _) in header_shapes([weights / "model.safetensors"]).items()
    }
    assert model_fields(out / "config.json") == model_fields(weights / "config.json")
    with torch.no_grad():
        ours = model(HF_SEQUENCES)
    assert (hf_logits(out) - ours).abs().max().item() < TOLERANCE
    assert (ours - expected).abs().max().item() < TOLERANCE


REFUSED_MIXTURES = {
    "shared": (
        {"n_shared_experts": 1},
        "model.n_shared_experts=1: neither Mixtral nor Qwen3-MoE has shared experts",
    ),
    "sigmoid": (
        {"router_score": RouterScore.sigmoid},
        "model.router_score=sigmoid: Mixtral and Qwen3-MoE score their experts by softmax",
    ),
    "unnormalised-mixtral": (
        {"qk_norm": False, "route_norm": False},
        "model.route_norm=false without model.qk_norm: Mixtral always normalises its top_k weights "
        "(Qwen3-MoE, which has q/k norms, may not)",
    ),
}


@pytest.mark.parametrize("case", REFUSED_MIXTURES)
def test_a_mixture_neither_family_holds_is_refused(
    checkpoints: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path, case: str
) -> None:
    """By the export before it reads the save, and by model.weights before any rank starts."""
    from trainer.saves.hf_export import export_save

    change, detail = REFUSED_MIXTURES[case]
    weights = checkpoints["qwen3-moe"][0]
    config = dataclasses.replace(ModelConfig(name="hf", weights=str(weights)), **change)
    with pytest.raises(ConfigError) as err:
        export_save(tmp_path / "no-save", tmp_path / "hf", config)
    assert str(err.value) == f"export: {detail}"
    with pytest.raises(ConfigError) as err:
        check_weights(config)
    assert str(err.value) == f"model.weights={weights}: {detail}"
