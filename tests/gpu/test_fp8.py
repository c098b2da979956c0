"""precision=fp8 on the GPU: torch._scaled_mm, not the emulated path the CPU tests run (marked gpu:
skipped without CUDA). Real fp8 GEMMs need compute capability 8.9 (Ada, Hopper, Blackwell)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_trainer

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao")
JOB = ("model=tiny", "device=cuda", "nproc=1", "logger=none", "save=off", "seq_len=256", "micro_batch=8",
       "steps=8", "log_every=1", "optim.warmup_steps=2")  # fmt: skip
LOSS_BOUND = (
    0.02  # relative, every step: the bound bf16 is held to against fp32 (tests/integration/test_precision.py)
)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability 8.9 or later")
    return run_trainer(tmp_path_factory.mktemp("bf16"), *JOB, "precision=bf16")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_loss_tracks_bf16_over_a_few_steps(bf16, tmp_path: Path, recipe: str) -> None:  # type: ignore[no-untyped-def]
    fp8 = run_trainer(tmp_path, *JOB, "precision=fp8", f"precision.fp8_recipe={recipe}")
    assert fp8.summary["status"] == "ok" and len(fp8.losses) == 8
    for step, (a, b) in enumerate(zip(fp8.losses, bf16.losses), start=1):
        assert abs(a - b) <= LOSS_BOUND * b, f"step {step}: fp8 {a} vs bf16 {b}"
    assert fp8.losses[-1] < 0.95 * fp8.losses[0]
    plan = json.loads((tmp_path / "plan.json").read_text())["fp8"]
    assert (plan["recipe"], plan["emulated"], plan["converted"]) == (recipe, False, 28)
