"""precision=fp8 (trainer/model/fp8.py): which linears torchao converts, and what a converted block
saves for backward against bf16's, the two terms the plan adds (trainer/plan/activations.py,
ddp_walk.py), measured on a real block under CPU emulation."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from tests.helpers import compose_config, load_preset, tiny_config
from trainer.config import ConfigError, DType, Fp8Recipe
from trainer.model.decoder import build_model, materialize
from trainer.model.fp8 import (
    FP8_EXTRA,
    apply_fp8,
    autocast_input_saving,
    converted_numel,
    float8_config,
    fp8_split,
)

pytest.importorskip("torchao")
BLOCK = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w3",
    "feed_forward.w2",
)


def fp8_precision(recipe: str = "tensorwise"):  # type: ignore[no-untyped-def]
    return compose_config("precision=fp8", f"precision.fp8_recipe={recipe}").precision


def test_every_block_linear_converts_and_the_output_head_stays_bf16() -> None:
    split = fp8_split(load_preset("llama3-8b"))
    assert split.converted == BLOCK
    assert [name for name, _ in split.kept] == ["output"]


def test_a_linear_whose_dims_fp8_gemms_cannot_take_stays_bf16() -> None:
    """k and v are 2 heads x 4 wide here: 8 is not a multiple of 16 (torch._scaled_mm's rule)."""
    m = dataclasses.replace(tiny_config().model, dim=64, n_heads=16, n_kv_heads=2, ffn_dim=128)
    split = fp8_split(m)
    assert split.converted == (
        "attention.wq",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w3",
        "feed_forward.w2",
    )
    assert [name for name, _ in split.kept] == ["output", "layers.*.attention.wk", "layers.*.attention.wv"]
    assert "64x8: fp8 GEMMs need dims divisible by 16" in dict(split.kept)["layers.*.attention.wk"]
    assert converted_numel(m) == 64 * 64 * 2 + 64 * 128 * 3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_meta_model_converts_as_fp8_split_says_emulated_on_cpu(recipe: str) -> None:
    config = compose_config("model=tiny", "precision=fp8", f"precision.fp8_recipe={recipe}")
    model = build_model(config.model, device="meta")
    assert apply_fp8(model, config.precision, "cpu") == 7 * config.model.n_layers
    converted = {name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}
    assert converted == {f"layers.{i}.{name}" for i in range(config.model.n_layers) for name in BLOCK}
    assert model.layers[0].attention.wq.config.emulate
    assert type(model.output) is torch.nn.Linear


def test_without_torchao_precision_fp8_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def missing(name: str, *args: object) -> object:
        if name.startswith("torchao"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ConfigError) as err:
        float8_config(fp8_precision(), "cpu")
    assert (
        str(err.value)
        == FP8_EXTRA
        == "precision=fp8 needs torchao: pip install 'zerolab[fp8]' (torchao>=0.18)"
    )


TOKENS = 24  # one sequence: no activation has a weight's shape (the casts are told apart by shape)


def saved_bytes(recipe: str, autocast: bool) -> tuple[int, int]:
    """(activation bytes, weight-cast bytes) one tiny block saves for backward, by distinct storage,
    under autocast (stages 0-1) or FSDP2's bf16 parameters (stages 2-3, no autocast)."""
    config = tiny_config()
    precision = dataclasses.replace(
        config.precision, name="fp8", compute_dtype=DType.bfloat16, fp8_recipe=Fp8Recipe(recipe)
    )
    model = build_model(config.model, device="meta")
    apply_fp8(model, precision, "cpu")
    materialize(model, "cpu", seed=0)
    block = model.layers[0] if autocast else model.layers[0].to(torch.bfloat16)
    cis = model.rope_table(torch.device("cpu"))[:TOKENS]
    x = torch.randn(1, TOKENS, config.model.dim, requires_grad=True)
    x = x if autocast else x.detach().bfloat16().requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    # autocast's weight casts, as saved or transposed (x @ w.t())
    shapes = {
        s
        for m in block.modules()
        if isinstance(m, torch.nn.Linear)
        for s in (m.weight.shape, m.weight.t().shape)
    }
    seen: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t

    region = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with region, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cis)
    casts = {ptr for ptr, (_, shape) in seen.items() if ptr not in params and shape in shapes}
    acts = sum(n for ptr, (n, _) in seen.items() if ptr not in params and ptr not in casts)
    return acts, sum(seen[ptr][0] for ptr in casts)


@pytest.mark.torch_versions
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_converted_block_saves_what_the_plan_says(recipe: str) -> None:
    """FSDP2's bf16 parameters: exactly nn.Linear's saves (torchao keeps the high-precision input and
    weight, no fp8 cast). Autocast: `autocast_input_saving` less per token, and no cached bf16 weight
    casts for the converted linears (`converted_numel`, 2 bytes each)."""
    config, tokens = tiny_config(), TOKENS
    assert saved_bytes(recipe, autocast=False) == saved_bytes("none", autocast=False)
    acts, casts = saved_bytes(recipe, autocast=True)
    bf16_acts, bf16_casts = saved_bytes("none", autocast=True)
    assert (
        bf16_acts - acts
        == autocast_input_saving(config.model, "cpu") * tokens
        == 2 * config.model.dim * tokens
    )
    assert (casts, bf16_casts) == (0, 2 * converted_numel(config.model))
