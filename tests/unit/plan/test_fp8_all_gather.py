"""precision.fp8_all_gather in the plan: FSDP2 all-gathers each converted linear's weight in float8 and holds the
unsharded weight as a Float8TrainingTensor over the gathered bytes (torchao/float8/fsdp_utils.py), so every
all-gather and every unsharded copy of those weights is 1 byte an element, not the compute dtype's 2. Planned for
CUDA only: gloo cannot all-gather float8 (trainer/rank/refusals.py), so no CPU rank measures it."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.model.fp8 import converted_weight_numel
from trainer.plan import build_plan
from trainer.plan.tensor_parallel import tp_local_model


def planned(*overrides: str, gather: bool, world: int):
    config = compose_config(
        "mode=plan", "plan.accelerator=h100", "precision=fp8", "precision.fp8_recipe=tensorwise",
        f"precision.fp8_all_gather={str(gather).lower()}", *overrides,
    )  # fmt: skip
    return config, build_plan(config, "cuda", world)


def test_stage3_gathers_the_converted_weights_in_one_byte() -> None:
    """70b at stage3 on 64 ranks (no dim 0 pads at 64): each block is gathered twice a micro-batch (forward, and
    again in backward), grad_accum=2 of them; the float8 weights save 1 byte an element each time, nothing else
    moves (the root, the norms and the reduce-scatters are as in bf16)."""
    overrides = ("model=70b", "zero=stage3", "nodes=8", "nproc=8", "micro_batch=1", "grad_accum=2")
    config, bf16 = planned(*overrides, gather=False, world=64)
    _, fp8 = planned(*overrides, gather=True, world=64)
    weights = converted_weight_numel(config.model, config.precision)
    assert weights == 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672  # wq, wo; wk, wv (GQA); w1, w3, w2
    saved = 2 * config.grad_accum * config.model.n_layers * weights
    by, gathered = bf16.comm.bytes_by_collective, fp8.comm.bytes_by_collective
    assert by["all_gather"] - gathered["all_gather"] == saved
    assert by["reduce_scatter"] == gathered["reduce_scatter"]


def test_a_pipeline_stage_holds_its_float8_weights_unsharded_in_one_byte() -> None:
    """The pipeline's law under fp8 all-gather: stage 0 of Llama 3.1 405B at tp=8 x pp=8 holds its 16 blocks'
    converted weights (of its TP shard) at 1 byte, the rest at 2; its fp32 gradient is unchanged."""
    overrides = (
        "model=llama3-405b", "nodes=64", "nproc=8", "seq_len=8192", "checkpointing=full", "zero=stage3",
        "parallel.tp=8", "parallel.pp=8", "micro_batch=4", "grad_accum=8",
    )  # fmt: skip
    config, bf16 = planned(*overrides, gather=False, world=512)
    _, fp8 = planned(*overrides, gather=True, world=512)
    before, after = (p.pipeline_json()["stages"][0] for p in (bf16, fp8))
    assert before["blocks"] == after["blocks"] == [[0, 16]]
    local = converted_weight_numel(tp_local_model(config.model, 8), config.precision)
    assert local == converted_weight_numel(config.model, config.precision) // 8
    held = "within_step_unsharded_params_bytes"
    assert before[held] - after[held] == 16 * local
    assert before["within_step_unsharded_grads_bytes"] == after["within_step_unsharded_grads_bytes"]
    assert after["peak_bytes"] < before["peak_bytes"]


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_without_the_flag_the_plan_is_bf16s(stage: str) -> None:
    """fp8 all-gather off: the converted weights are gathered and held in bf16, as the eager bf16 parameters."""
    overrides = ("model=tiny", f"zero={stage}", "nproc=2")
    _, off = planned(*overrides, gather=False, world=2)
    bf16 = build_plan(
        compose_config("mode=plan", "plan.accelerator=h100", "precision=bf16", *overrides), "cuda", 2
    )
    assert off.comm.bytes_by_collective["all_gather"] == bf16.comm.bytes_by_collective["all_gather"]
