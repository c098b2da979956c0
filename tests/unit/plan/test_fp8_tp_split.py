"""Which linears precision=fp8 converts is torchao's decision on the whole model (apply_fp8 converts before
tensor parallelism shards it), so the plan, which counts one TP rank's linears, decides on the whole dims too:
under fp8_filter=auto a shard can look small where the whole linear is not (llama3-8b's wq at tp=8 is
4096 x 512 on a rank, within torchao's tensorwise small-GEMM rule, and 4096 x 4096 whole, outside it)."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.model.fp8 import converted_weight_numel, precision_split
from trainer.plan.tensor_parallel import tp_local_model


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_one_tp_ranks_converted_linears_are_the_whole_models_and_hold_a_tp_th_of_them(tp: int) -> None:
    config = compose_config(
        "mode=plan", "model=llama3-8b", "precision=fp8", "precision.fp8_recipe=tensorwise"
    )
    whole, local = config.model, tp_local_model(config.model, tp)
    converted = precision_split(whole, config.precision).converted
    assert converted == (
        "attention.wq",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w3",
        "feed_forward.w2",
    )
    assert precision_split(local, config.precision).converted == converted
    # 4096 x 4096 twice (wq, wo), 4096 x 14336 three times (w1, w3, w2): each sharded tp ways.
    assert converted_weight_numel(whole, config.precision) == 2 * 4096 * 4096 + 3 * 4096 * 14336
    assert converted_weight_numel(local, config.precision) * tp == converted_weight_numel(
        whole, config.precision
    )


def test_the_kept_linears_are_named_with_the_whole_models_dims() -> None:
    config = compose_config(
        "mode=plan", "model=llama3-8b", "precision=fp8", "precision.fp8_recipe=tensorwise"
    )
    kept = dict(precision_split(tp_local_model(config.model, 8), config.precision).kept)
    assert kept["layers.*.attention.wk"].startswith("4096x1024: torchao's small-GEMM filter (tensorwise)")


def test_a_linear_whose_shard_breaks_the_gemm_rule_stays_bf16_in_the_plan_and_the_run() -> None:
    """torch._scaled_mm needs both dims of each rank's GEMM divisible by 16 (on CUDA; the plan and the run keep the
    rule everywhere): at dim 64, 8 heads of width 8 (4 kv) and ffn_dim 96 every linear converts at tp=2 (wk is
    64 x 16 on a rank, w1 64 x 48), and at tp=4 only wq and wo do (64 x 16, 16 x 64): wk and wv are 64 x 8 on a
    rank, w1 and w3 64 x 24, w2 24 x 64. apply_fp8, told parallel.tp, converts what one TP rank's plan lists."""
    import torch

    from trainer.model.decoder import Transformer
    from trainer.model.fp8 import apply_fp8

    config = compose_config(
        "model=tiny",
        "model.dim=64",
        "model.n_heads=8",
        "model.n_kv_heads=4",
        "model.ffn_dim=96",
        "precision=fp8",
        "precision.fp8_filter=all",
    )
    m = config.model
    assert m.head_width == 8
    assert len(precision_split(tp_local_model(m, 2), config.precision).converted) == 7
    at_four = precision_split(tp_local_model(m, 4), config.precision)
    assert at_four.converted == ("attention.wq", "attention.wo")
    assert dict(at_four.kept)["layers.*.attention.wk"] == (
        "64x32 is 64x8 on each of 4 TP ranks: fp8 GEMMs need dims divisible by 16"
    )
    assert dict(at_four.kept)["layers.*.feed_forward.w2"] == (
        "96x64 is 24x64 on each of 4 TP ranks: fp8 GEMMs need dims divisible by 16"
    )
    with torch.device("meta"):
        model = Transformer(m)
    assert apply_fp8(model, config.precision, "cpu", tp=4) == 2 * m.n_layers
