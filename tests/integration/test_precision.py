"""Mixed precision: the fp16 loss scaler's skip-and-back-off, and bf16/fp16 tracking fp32."""

from __future__ import annotations

import math

import pytest

from tests.helpers import TINY, Run, sweep_runs

INIT_SCALE = 1024.0
FP16 = (
    "precision=fp16",
    f"precision.loss_scale_init={INIT_SCALE}",
    "precision.growth_interval=1000",
    "nproc=2",
)


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
def test_an_inf_gradient_on_one_rank_skips_the_step_on_both(trainer, stage: str) -> None:
    """The inf is injected on rank 1; the record's scaler figures are rank 0's own (its gradients were
    finite), and on every log step the Meter gathers both ranks' scale and skip count and ends the
    job unless they are equal (check_ranks_agree, a real check: tests/unit/telemetry/test_metrics.py)."""
    run = trainer(*FP16, f"zero={stage}", "steps=5", "fault.kind=inf_grad", "fault.step=3", "fault.rank=1")
    by_step = {r["step"]: r for r in run.records}
    assert [by_step[s]["precision/overflow"] for s in range(1, 6)] == [0, 0, 1, 0, 0]
    assert [by_step[s]["precision/loss_scale"] for s in range(1, 6)] == [INIT_SCALE] * 2 + [
        INIT_SCALE / 2
    ] * 3
    assert [by_step[s]["precision/skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    # Rank 1 agreed with rank 0 at every step (else check_ranks_agree had ended the job), and
    # neither rank applied the inf: the mean loss over both ranks stays finite after step 3.
    assert run.summary["status"] == "ok" and run.summary["steps_done"] == 5
    assert all(math.isfinite(by_step[s]["loss/train"]) for s in range(1, 6))


TOLERANCE = {"bf16": 0.02, "fp16": 0.005}  # relative, at every step


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Run]:
    """10 steps on 2 ranks in fp32, bf16 and fp16 at stages 0 and 3: the points of one sweep."""
    return sweep_runs(
        tmp_path_factory.mktemp("precision"),
        *TINY,
        "nproc=2",
        "steps=10",
        "optim.warmup_steps=2",
        "zero=stage0,stage3",
        "precision=fp32,bf16,fp16",
        by=("zero", "precision"),
    )


@pytest.mark.parametrize(
    "stage", ["stage0", "stage3"]
)  # autocast under DDP; MixedPrecisionPolicy under FSDP2
def test_low_precision_tracks_fp32(precision_runs: dict[tuple[str, str], Run], stage: str) -> None:
    """Each step's loss within TOLERANCE of the fp32 run; the curves fall together."""
    fp32 = precision_runs[(stage, "fp32")]
    for precision, tolerance in TOLERANCE.items():
        low = precision_runs[(stage, precision)]
        for step, (a, b) in enumerate(zip(low.losses, fp32.losses), start=1):
            assert abs(a - b) <= tolerance * b, f"step {step}: {precision} {a} vs fp32 {b}"
        assert low.losses[-1] < 0.95 * low.losses[0]  # 10 steps of warmup and decay: a clear fall
