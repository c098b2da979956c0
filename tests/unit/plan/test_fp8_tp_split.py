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
