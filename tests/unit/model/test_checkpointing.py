"""checkpointing=op (trainer/model/checkpointing.py): torchtitan's per-op policy on torch's selective
checkpoint contexts trains exactly like no checkpointing, eager and compiled, and keeps what the plan says."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from tests.helpers import WORLD, run_steps, tiny_config
from trainer.config import ConfigError
from trainer.model.attention import run_choice
from trainer.model.checkpointing import apply_activation_checkpointing, op_saved_matmuls
from trainer.model.decoder import apply_sdpa_choice, build_model, init_weights
from trainer.plan.activations import activations, precisions
from trainer.plan.states import model_shape
from trainer.rank.loop import build_trainee

pytestmark = pytest.mark.torch_versions  # torch 2.11 calls the op policy in recompute too

CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


def losses(config, steps: int = 8) -> list[float]:
    torch.manual_seed(config.seed)
    return run_steps(build_trainee(config, WORLD), config, 1, steps)


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
def test_op_trains_like_no_checkpointing_over_8_steps(process_group: None, stage: str) -> None:
    none = losses(tiny_config(steps=8, zero__stage=stage))
    op = losses(tiny_config(steps=8, zero__stage=stage, checkpointing__mode="op"))
    assert len(op) == 8 and max(abs(a - b) for a, b in zip(none, op)) <= 1e-6


@pytest.mark.parametrize(
    "overrides",
    [
        dict(zero__stage="stage1", precision__compute_dtype="float16"),
        dict(zero__stage="stage2", precision__compute_dtype="bfloat16", offload__target="cpu"),
    ],
)
def test_op_composes_with_half_precision_and_offload(process_group: None, overrides: dict) -> None:
    """The recompute reruns the same ops in the same dtypes: the losses are the same, bit for bit."""
    none = losses(tiny_config(steps=4, **overrides), 4)
    assert losses(tiny_config(steps=4, checkpointing__mode="op", **overrides), 4) == none


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
def test_op_compiled_trains_like_no_checkpointing_eager(process_group: None, stage: str) -> None:
    """compile=true around the policy (checkpointing, then compile, then shard), within
    tests/unit/model/test_compile.py's tolerance for compiled against eager."""
    none = losses(tiny_config(steps=8, zero__stage=stage))
    compiled = losses(
        tiny_config(
            steps=8, zero__stage=stage, checkpointing__mode="op", compile=True, compile_backend="aot_eager"
        )
    )
    assert max(abs(a - b) for a, b in zip(none, compiled)) <= 1e-5


def test_op_block_compiled_with_inductor_matches_eager() -> None:
    """One real inductor build (g++) of a block under the policy: forward and backward match eager."""
    config = tiny_config(checkpointing__mode="op")
    grads = []
    for compiled in (False, True):
        model = build_model(config.model, device="cpu")
        init_weights(model, seed=0)
        apply_activation_checkpointing(model, config.checkpointing)
        if compiled:
            model.layers[0].compile(backend="inductor")
        out = model(torch.arange(32).reshape(2, 16) % config.model.vocab_size)
        out.float().square().mean().backward()
        grads.append((out.detach(), model.layers[0].attention.wq.weight.grad))
    (eager, eager_grad), (compiled_out, compiled_grad) = grads
    assert torch.allclose(compiled_out, eager, atol=1e-5)
    assert torch.allclose(compiled_grad, eager_grad, atol=1e-6)


# ----------------------------------------------------------------------------- what the policy keeps


def held_after_forward(config) -> int:
    """Bytes one block of the tiny model holds after its forward on CPU, its input and output
    excluded, measured with torch's MemTracker."""
    model = build_model(config.model, device="cpu")
    init_weights(model, seed=0)
    apply_sdpa_choice(
        model, run_choice(config.attention, config.model, config.precision.compute_dtype, "cpu")
    )
    apply_activation_checkpointing(model, config.checkpointing)
    block = model.layers[0]
    regime = precisions(config.precision, config.zero).regime
    if regime == "fsdp_mp":  # what FSDP2's MixedPrecisionPolicy(param_dtype=bf16) computes with
        block.to(torch.bfloat16)
    dtype = torch.bfloat16 if regime == "fsdp_mp" else torch.float32
    x = torch.randn(config.micro_batch, config.seq_len, config.model.dim, dtype=dtype, requires_grad=True)
    cis = model.rope_table(x.device)[: config.seq_len]
    tracker = MemTracker()
    tracker.track_external(block, x, cis)
    with tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast"):
        before = tracker.get_tracker_snapshot()[x.device]["Total"]
        out = block(x, cis)
        return tracker.get_tracker_snapshot()[x.device]["Total"] - before - out.untyped_storage().nbytes()


@pytest.mark.parametrize(
    ("precision", "stage", "save_ops"),
    [
        ("fp32", "stage0", None),
        ("bf16", "stage3", None),
        ("bf16", "stage1", None),
        ("fp32", "stage0", ["aten.mm"]),
        ("fp32", "stage0", [CPU_FLASH]),
        ("fp32", "stage0", ["aten.max"]),
    ],
)
def test_the_plan_keeps_what_the_policy_saves(precision: str, stage: str, save_ops: list[str] | None) -> None:
    """A block's kept bytes after forward (its input excluded: the caller holds it) are the plan's."""
    dtype = "bfloat16" if precision == "bf16" else "float32"
    overrides = {"checkpointing__mode": "op", "precision__compute_dtype": dtype, "zero__stage": stage}
    if save_ops is not None:
        overrides["checkpointing__save_ops"] = save_ops
    config = tiny_config(**overrides)
    acts = activations(config, "cpu")
    tokens = config.micro_batch * config.seq_len
    block_input = (
        (4 if stage in ("stage0", "stage1") else 2 if precision == "bf16" else 4) * config.model.dim * tokens
    )
    # Autocast's cached bf16 weights, which the plan counts as a temporary of the whole step.
    casts = (
        2 * model_shape(config.model).block_linear_numel if precision == "bf16" and stage == "stage1" else 0
    )
    assert held_after_forward(config) == acts.blocks[0] - block_input + casts
    mm = save_ops is None or "aten.mm" in save_ops
    assert op_saved_matmuls(config.checkpointing.save_ops) == (("wq", "wv", "w1", "w2") if mm else ())


def test_op_keeps_between_none_and_full() -> None:
    plans = {mode: activations(tiny_config(checkpointing__mode=mode)) for mode in ("none", "op", "full")}
    assert plans["full"].blocks[0] < plans["op"].blocks[0] < plans["none"].blocks[0]
    assert plans["op"].full_block == plans["none"].full_block


def test_a_save_op_that_is_not_a_torch_op_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"checkpointing\.save_ops: 'aten\.not_an_op' is not a torch op"):
        tiny_config(checkpointing__mode="op", checkpointing__save_ops=["aten.mm", "aten.not_an_op"])
