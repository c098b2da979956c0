"""precision=fp8 (trainer/model/fp8.py): which linears torchao converts, and what a converted block
saves for backward against bf16's, the two terms the plan adds (trainer/plan/activations.py,
ddp_walk.py), measured on a real block under CPU emulation."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest
import torch

from tests.helpers import compose_config, load_preset, tiny_config
from trainer.config import ConfigError, DType, Fp8Filter, Fp8Recipe
from trainer.model.decoder import build_model, materialize
from trainer.model.fp8 import (
    FP8_EXTRA,
    GEMM_MULTIPLE,
    SMALL_GEMM_RULES,
    apply_fp8,
    autocast_input_saving,
    converted_numel,
    float8_config,
    fp8_split,
    precision_split,
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


def test_under_fp8_filter_all_every_block_linear_converts_and_the_output_head_stays_bf16() -> None:
    split = fp8_split(load_preset("llama3-8b"), Fp8Filter.all, Fp8Recipe.tensorwise)
    assert split.converted == BLOCK
    assert [name for name, _ in split.kept] == ["output"]


TORCHAO_SPLIT = {
    # By hand from torchao's rules (torchao/float8/float8_linear_utils.py): tensorwise skips in <= 4096 and
    # out <= 1024; rowwise skips out <= 2048, or in <= 1024, or out <= 4096 and in <= 2048. (in, out) below:
    # 125m: q, k, v, o 768x768, w1 and w3 768x2048, w2 2048x768
    ("125m", "tensorwise"): ("feed_forward.w1", "feed_forward.w3"),
    ("125m", "rowwise"): (),
    # 1b: q and o 2048x2048, k and v 2048x512, w1 and w3 2048x8192, w2 8192x2048
    ("1b", "tensorwise"): (
        "attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2",
    ),
    ("1b", "rowwise"): ("feed_forward.w1", "feed_forward.w3"),
    # llama3-8b: q and o 4096x4096, k and v 4096x1024, w1 and w3 4096x14336, w2 14336x4096
    ("llama3-8b", "tensorwise"): (
        "attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2",
    ),
    ("llama3-8b", "rowwise"): (
        "attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("preset", "recipe"), list(TORCHAO_SPLIT))
def test_fp8_filter_auto_keeps_the_small_gemms_torchao_skips(preset: str, recipe: str) -> None:
    split = fp8_split(load_preset(preset), Fp8Filter.auto, Fp8Recipe(recipe))
    assert split.converted == TORCHAO_SPLIT[(preset, recipe)]
    kept = [name.removeprefix("layers.*.") for name, _ in split.kept]
    assert kept == ["output", *(name for name in BLOCK if name not in split.converted)]
    assert all("torchao's small-GEMM filter" in why for name, why in split.kept if name != "output")


def test_a_kept_linear_says_which_threshold_of_torchao_keeps_it() -> None:
    kept = dict(fp8_split(load_preset("llama3-8b"), Fp8Filter.auto, Fp8Recipe.tensorwise).kept)
    assert kept["layers.*.attention.wk"] == (
        "4096x1024: torchao's small-GEMM filter (tensorwise): in_features <= 4096 and out_features <= 1024, "
        "fp8 does not pay"
    )
    kept = dict(fp8_split(load_preset("1b"), Fp8Filter.auto, Fp8Recipe.rowwise).kept)
    assert kept["layers.*.attention.wq"].endswith("(rowwise): out_features <= 2048, fp8 does not pay")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_small_gemm_rule_is_torchaos_own_filter(recipe: str) -> None:
    """Against torchao's `_auto_filter_for_recipe` itself, on every pair of widths at and around its
    thresholds (and one not a multiple of 16)."""
    from torchao.float8 import _auto_filter_for_recipe

    torchao = _auto_filter_for_recipe(recipe, filter_fqns=["output"])
    widths = (8, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192)
    for n_in in widths:
        for n_out in widths:
            fits = n_in % GEMM_MULTIPLE == 0 and n_out % GEMM_MULTIPLE == 0
            ours = fits and SMALL_GEMM_RULES[Fp8Recipe(recipe)](n_in, n_out) is None
            linear = torch.nn.Linear(n_in, n_out, bias=False, device="meta")
            assert ours == torchao(linear, "layers.0.attention.wq"), (n_in, n_out)


def test_a_linear_whose_dims_fp8_gemms_cannot_take_stays_bf16() -> None:
    """k and v are 2 heads x 4 wide here: 8 is not a multiple of 16 (torch._scaled_mm's rule)."""
    m = dataclasses.replace(tiny_config().model, dim=64, n_heads=16, n_kv_heads=2, ffn_dim=128)
    split = fp8_split(m, Fp8Filter.all, Fp8Recipe.tensorwise)
    assert split.converted == (
        "attention.wq",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w3",
        "feed_forward.w2",
    )
    assert [name for name, _ in split.kept] == ["output", "layers.*.attention.wk", "layers.*.attention.wv"]
    assert "64x8: fp8 GEMMs need dims divisible by 16" in dict(split.kept)["layers.*.attention.wk"]
    precision = dataclasses.replace(fp8_precision(), fp8_filter=Fp8Filter.all)
    assert converted_numel(m, precision) == 64 * 64 * 2 + 64 * 128 * 3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_meta_model_converts_as_fp8_split_says_emulated_on_cpu(recipe: str) -> None:
    config = compose_config(
        "model=tiny", "precision=fp8", f"precision.fp8_recipe={recipe}", "precision.fp8_filter=all"
    )
    model = build_model(config.model, device="meta")
    assert apply_fp8(model, config.precision, "cpu") == 7 * config.model.n_layers
    converted = {name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}
    assert converted == {f"layers.{i}.{name}" for i in range(config.model.n_layers) for name in BLOCK}
    assert model.layers[0].attention.wq.config.emulate
    assert type(model.output) is torch.nn.Linear


def test_a_mixture_of_experts_converts_its_attention_and_keeps_router_and_experts_bf16() -> None:
    """tiny-moe: the four attention linears of each block are Float8Linear; the router's gate and the shared
    experts' linears stay nn.Linear, and the experts' 3-D weights are not linears at all."""
    config = compose_config(
        "model=tiny-moe", "model.n_shared_experts=1", "precision=fp8", "precision.fp8_filter=all"
    )
    model = build_model(config.model, device="meta")
    attention = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    assert precision_split(config.model, config.precision).converted == tuple(attention)
    assert apply_fp8(model, config.precision, "cpu") == 4 * config.model.n_layers
    converted = {name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}
    assert converted == {f"layers.{i}.{name}" for i in range(config.model.n_layers) for name in attention}
    kept = {name for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    assert {"layers.0.feed_forward.router.gate", "layers.0.feed_forward.shared.w1"} <= kept


def test_under_fp8_filter_auto_a_tiny_model_converts_none_and_the_plan_says_so() -> None:
    """tiny's widest GEMM is 128x384: under torchao's small-GEMM filter every block linear stays bf16."""
    from trainer.plan import build_plan, format_plan, summary_fields

    config = compose_config("model=tiny", "precision=fp8")
    assert config.precision.fp8_filter == Fp8Filter.auto
    model = build_model(config.model, device="meta")
    assert apply_fp8(model, config.precision, "cpu") == 0
    plan = build_plan(config, "cpu", 1)
    fields = summary_fields(plan)["fp8"]  # summary.json's, as plan.json's
    assert (fields["recipe"], fields["filter"], fields["converted_per_block"], fields["converted"]) == (
        "tensorwise",
        "auto",
        [],
        0,
    )
    assert list(fields["left_in_bf16"]) == ["output", *(f"layers.*.{name}" for name in BLOCK)]
    assert "fp8: tensorwise scaling in 0 block linears (fp8_filter=auto; per block: none)" in format_plan(
        plan
    )
    assert "layers.*.feed_forward.w2 (384x128: torchao's small-GEMM filter (tensorwise)" in format_plan(plan)


def test_fp8_filter_auto_has_no_rule_for_rowwise_with_gw_hp() -> None:
    with pytest.raises(ConfigError) as err:
        compose_config("precision=fp8", "precision.fp8_recipe=rowwise_with_gw_hp")
    assert "precision.fp8_filter=auto with precision.fp8_recipe=rowwise_with_gw_hp" in str(err.value)
    precision = compose_config(
        "precision=fp8", "precision.fp8_recipe=rowwise_with_gw_hp", "precision.fp8_filter=all"
    ).precision
    assert precision.fp8_filter == Fp8Filter.all


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


def fp8_all(precision, recipe: str, fp8_filter: Fp8Filter = Fp8Filter.all):  # type: ignore[no-untyped-def]
    """`precision` as precision=fp8 with `recipe` (default: converting every block linear, fp8_filter=all)."""
    return dataclasses.replace(
        precision,
        name="fp8",
        compute_dtype=DType.bfloat16,
        fp8_recipe=Fp8Recipe(recipe),
        fp8_filter=fp8_filter,
    )


TOKENS = 24  # one sequence: no activation has a weight's shape (the casts are told apart by shape)


def saved_bytes(
    recipe: str, autocast: bool, config: Any = None, fp8_filter: Fp8Filter = Fp8Filter.all
) -> tuple[int, int]:
    """(activation bytes, weight-cast bytes) one block (of the tiny model unless `config`) saves for backward,
    by distinct storage, under autocast (stages 0-1) or FSDP2's bf16 parameters (stages 2-3, no autocast)."""
    config = config or tiny_config()
    precision = fp8_all(config.precision, recipe, fp8_filter)
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
    precision = fp8_all(config.precision, recipe)
    assert (
        bf16_acts - acts
        == autocast_input_saving(config.model, precision, "cpu") * tokens
        == 2 * config.model.dim * tokens
    )
    assert (casts, bf16_casts) == (0, 2 * converted_numel(config.model, precision))


def test_a_block_torchaos_filter_converts_in_part_saves_what_the_plan_says() -> None:
    """fp8_filter=auto, tensorwise, on a block whose GEMMs straddle torchao's thresholds: dim 2048, 16 heads of
    128, 4 kv heads (k and v 2048x512: kept), ffn_dim 64 (w1 and w3 2048x64: kept; w2 64x2048: converted), so q,
    o and w2 run fp8. Autocast: q alone of attention_norm's readers saves its fp32 output (4·D) beside k's and
    v's bf16 casts, 2·D per token more than bf16 (`autocast_input_saving` < 0); the weight casts of the kept
    linears stay cached."""
    config = tiny_config()
    model = dataclasses.replace(config.model, dim=2048, n_heads=16, n_kv_heads=4, ffn_dim=64)
    config = dataclasses.replace(config, model=model)
    precision = fp8_all(config.precision, "tensorwise", Fp8Filter.auto)
    split = fp8_split(model, Fp8Filter.auto, Fp8Recipe.tensorwise)
    assert split.converted == ("attention.wq", "attention.wo", "feed_forward.w2")
    acts, casts = saved_bytes("tensorwise", autocast=True, config=config, fp8_filter=Fp8Filter.auto)
    bf16_acts, bf16_casts = saved_bytes("none", autocast=True, config=config)
    saving = autocast_input_saving(model, precision, "cpu")
    assert (saving, bf16_acts - acts) == (-2 * 2048, saving * TOKENS)
    assert converted_numel(model, precision) == 2048 * 2048 * 2 + 64 * 2048
    assert bf16_casts - casts == 2 * converted_numel(model, precision)
    assert saved_bytes("tensorwise", False, config, Fp8Filter.auto) == saved_bytes("none", False, config)
