"""precision=fp8 on the GPU: torch._scaled_mm, not the emulated path the CPU tests run (marked gpu:
skipped without CUDA). Real fp8 GEMMs need compute capability 8.9 (Ada, Hopper, Blackwell)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.helpers import compose_config, run_trainer
from trainer.model.decoder import build_model
from trainer.model.fp8 import apply_fp8, import_float8

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao")
JOB = ("model=tiny", "device=cuda", "nproc=1", "logger=none", "save=off", "seq_len=256", "micro_batch=8",
       "steps=8", "log_every=1", "optim.warmup_steps=2")  # fmt: skip
LOSS_BOUND = (
    0.02  # relative, every step: the bound bf16 is held to against fp32 (tests/integration/test_precision.py)
)


def needs_fp8_gemms() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability 8.9 or later")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    needs_fp8_gemms()
    return run_trainer(tmp_path_factory.mktemp("bf16"), *JOB, "precision=bf16")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_loss_tracks_bf16_over_a_few_steps(bf16, tmp_path: Path, recipe: str) -> None:  # type: ignore[no-untyped-def]
    # tiny's GEMMs are all below torchao's small-GEMM filter (precision.fp8_filter=auto): every one converts
    fp8 = run_trainer(
        tmp_path, *JOB, "precision=fp8", f"precision.fp8_recipe={recipe}", "precision.fp8_filter=all"
    )
    assert fp8.summary["status"] == "ok" and len(fp8.losses) == 8
    for step, (a, b) in enumerate(zip(fp8.losses, bf16.losses), start=1):
        assert abs(a - b) <= LOSS_BOUND * b, f"step {step}: fp8 {a} vs bf16 {b}"
    assert fp8.losses[-1] < 0.95 * fp8.losses[0]
    plan = json.loads((tmp_path / "plan.json").read_text())["fp8"]
    assert (plan["recipe"], plan["emulated"], plan["converted"]) == (recipe, False, 28)


@pytest.mark.parametrize(("recipe", "granularity"), [("tensorwise", "tensorwise"), ("rowwise", "axiswise")])
def test_the_converted_linears_are_not_emulated_and_run_scaled_mm(recipe: str, granularity: str) -> None:
    """The converted modules themselves, not the plan's `emulated` flag: converted as a CUDA rank converts
    them (trainer/rank/parallelize.py passes its device's type), every Float8Linear's config has
    emulate=False, as have the three gemms' ScaledMMConfig torchao 0.18 copies from it
    (Float8Linear.linear_mm_config), and one of them materialised on the GPU runs its forward and
    backward as torch._scaled_mm: output, grad_input, grad_weight. (Emulated, torchao would run aten::mm
    on dequantised copies and no _scaled_mm: checked on CPU, where torch 2.13 has _scaled_mm too.)"""
    needs_fp8_gemms()
    import_float8()  # quietly, as the ranks import it
    from torchao.float8.float8_linear import Float8Linear

    config = compose_config(
        "model=tiny",
        "device=cuda",
        "precision=fp8",
        f"precision.fp8_recipe={recipe}",
        "precision.fp8_filter=all",
    )
    model = build_model(config.model, device="meta")
    device = torch.device("cuda", torch.cuda.current_device())
    assert apply_fp8(model, config.precision, device.type) == 28
    converted = [module for module in model.modules() if isinstance(module, Float8Linear)]
    assert len(converted) == 28
    assert [module.config.emulate for module in converted] == [False] * 28
    assert all(not gemm.emulate for module in converted for gemm in module.linear_mm_config)
    assert {module.config.cast_config_input.scaling_granularity.value for module in converted} == {
        granularity
    }
    linear = model.layers[0].feed_forward.w1
    linear.to_empty(device=device)
    torch.nn.init.normal_(linear.weight, std=0.02)
    x = torch.randn(256, linear.in_features, device=device, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.autocast("cuda", torch.bfloat16):
        linear(x).sum().backward()
    torch.cuda.synchronize()
    assert [event.name for event in prof.events()].count("aten::_scaled_mm") == 3
    assert x.grad is not None and linear.weight.grad is not None
