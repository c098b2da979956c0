"""precision=fp8 with a mixture of experts, as 2 CPU ranks run it (torchao's emulated Float8Linear): each block's
attention linears convert, the router and the experts stay bf16 (trainer/model/fp8.py). Against the same job in
bf16: the loss tracks it at every step, and the plan holds every rank's measured peak within 0.5%, at zero=stage3
(FSDP2's bf16 parameters) and stage0 (DDP under autocast); slow tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import Run, fp8_sweep, point_dirs, settings

pytest.importorskip("torchao")
pytestmark = (
    pytest.mark.slow
)  # the default run's 20 minutes (README); the conversion itself: tests/unit/model/test_fp8.py
STEPS = 6
LOSS_BOUND = 0.005  # relative, every step, as tests/integration/test_fp8.py's dense model
PLAN_BOUND = 0.005
ATTENTION = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]


def sweep(tmp: Path, stage: str) -> dict[str, Run]:
    """The bf16 and fp8 jobs at `stage`, by precision."""
    proc = fp8_sweep(tmp / "sweep", STEPS, "model=tiny-moe", f"zero={stage}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        settings(point)["precision"]: Run(0, proc.stdout, "", point) for point in point_dirs(tmp / "sweep")
    }


@pytest.fixture(scope="module", params=["stage3", "stage0"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return sweep(tmp_path_factory.mktemp(f"moe_fp8_{request.param}"), request.param)


def test_fp8_loss_tracks_bf16_at_every_step(runs: dict[str, Run]) -> None:
    bf16, fp8 = runs["bf16"], runs["fp8"]
    assert fp8.summary["status"] == "ok" and len(fp8.losses) == STEPS
    for step, (a, b) in enumerate(zip(fp8.losses, bf16.losses), start=1):
        assert abs(a - b) <= LOSS_BOUND * b, f"step {step}: fp8 {a} vs bf16 {b}"
    assert fp8.losses != bf16.losses  # the casts are real


def test_every_ranks_peak_is_the_plans_within_half_a_percent(runs: dict[str, Run]) -> None:
    for precision in ("fp8", "bf16"):
        run = runs[precision]
        plan = json.loads((run.out_dir / "plan.json").read_text())
        for rank in plan["ranks"]:
            key = f"memory/rank{rank['rank']}/peak_allocated_gib"
            tracked = [r[key] for r in run.records if r["step"] in (2, 4, 6)]
            assert len(tracked) == 3
            error = (rank["peak_gib"] - min(tracked)) / min(tracked)
            assert abs(error) < PLAN_BOUND, (precision, rank["rank"], error)


def test_only_the_attention_linears_convert(runs: dict[str, Run]) -> None:
    fp8 = json.loads((runs["fp8"].out_dir / "plan.json").read_text())["fp8"]
    assert (fp8["converted"], fp8["converted_per_block"], list(fp8["left_in_bf16"])) == (
        16,
        ATTENTION,
        ["output", "layers.*.feed_forward"],
    )
    assert "the mixture of experts: router, routed and shared experts" in runs["fp8"].stdout
