"""mode=advise's fp8 rows (trainer/advise/fp8.py): the fit holds the published points within its stated
error, its reference shape is the llama3-8b preset's, the gain depends on the GEMM shapes, and an
accelerator without fp8 tensor cores is offered none, with the reason in the summary line."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import compose_config, load_preset
from trainer.advise.advisor import fp8_json, fp8_summary
from trainer.advise.calibrate import ACCELERATORS
from trainer.advise.fp8 import (
    FIT_ERROR_PP,
    LLAMA31_8B,
    PUBLISHED,
    PUBLISHED_SHAPE,
    compute_factor,
    fit_cast_cost,
    linear_share,
)

H100_HBM = ACCELERATORS["h100"].hbm_tbps


def speedup(recipe: str, seq_len: int = 8192, micro_batch: int = 1, accelerator: str = "h100") -> float:
    cost = fit_cast_cost(LLAMA31_8B, H100_HBM, recipe)
    hbm = ACCELERATORS[accelerator].hbm_tbps
    return 1.0 / compute_factor(LLAMA31_8B, seq_len, micro_batch, accelerator, hbm, cost)


def test_the_reference_shape_is_the_llama3_8b_preset() -> None:
    preset = load_preset("llama3-8b")
    gemm = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim")
    assert {k: getattr(LLAMA31_8B, k) for k in gemm} == {k: getattr(preset, k) for k in gemm}
    assert round(linear_share(LLAMA31_8B, 8192), 4) == 0.7231  # block linears: 72% of the FLOPs


@pytest.mark.parametrize("point", PUBLISHED, ids=[f"{p.recipe}-{p.speedup}" for p in PUBLISHED])
def test_the_fit_holds_each_published_point_within_its_stated_error(point) -> None:  # type: ignore[no-untyped-def]
    assert PUBLISHED_SHAPE == {"accelerator": "h100", "seq_len": 8192, "micro_batch": 1}
    assert round(abs(speedup(point.recipe) - point.speedup), 9) <= FIT_ERROR_PP / 100
    assert round(speedup(point.recipe), 3) == {"tensorwise": 1.265, "rowwise": 1.1}[point.recipe]


def test_the_gain_falls_with_smaller_gemms_and_rowwise_stops_paying_first() -> None:
    """Fewer tokens per GEMM (M) leave the casts' bytes while the FLOPs shrink: at M = 2048 rowwise loses."""
    assert round(speedup("tensorwise", seq_len=2048), 3) == 1.133
    assert round(speedup("rowwise", seq_len=2048), 3) == 0.885
    assert round(speedup("tensorwise", seq_len=8192, micro_batch=2), 3) > 1.265  # larger M: more
    assert round(speedup("tensorwise", accelerator="h200"), 3) == 1.343  # faster HBM: cheaper casts


def test_a100_is_offered_no_fp8_and_the_summary_says_why() -> None:
    a100 = compose_config("mode=advise", "global_batch=32", "precision=bf16", "plan.accelerator=a100-80gb")
    assert fp8_summary(a100) == (
        "; fp8: none offered, a100-80gb has no fp8 tensor cores (fp8 GEMMs need compute capability 8.9 "
        "or later: Ada, Hopper, Blackwell)"
    )
    assert fp8_json(a100, [])["offered"] is False
    h100 = dataclasses.replace(a100, plan=dataclasses.replace(a100.plan, accelerator="h100"))
    assert fp8_summary(h100) == "; fp8: predicted for the 3 best below (compiled, torchao Float8Linear)"
    fp32 = compose_config("mode=advise", "global_batch=32", "precision=fp32", "plan.accelerator=h100")
    assert fp8_summary(fp32) == ""  # fp8 rows are for bf16 jobs
