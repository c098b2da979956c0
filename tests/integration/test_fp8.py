"""precision=fp8 as 2 CPU ranks run it (torchao's emulated Float8Linear): bf16 and fp8 at stage0 (DDP,
autocast) and stage3 (FSDP2, bf16 parameters), one sweep shared by the file. fp8's loss tracks bf16's;
the plan holds the measured peak within 0.5%, inside a block's backward too, where the eager float8 casts of
w2's backward peak (trainer/plan/fp8_backward.py; every stage, recipe and checkpointing mode:
tests/integration/test_fp8_plan.py)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import Run, fp8_sweep, point_dirs, settings

pytest.importorskip("torchao")
STEPS = 6
LOSS_BOUND = 0.005  # relative, every step: 0.24% at most seen over 6 steps here; 100 steps end within 0.1% (docs/memory_plan.md, "fp8")
PLAN_BOUND = 0.005


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Run]:
    tmp = tmp_path_factory.mktemp("fp8")
    proc = fp8_sweep(tmp / "sweep", STEPS, "zero=stage0,stage3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        (s["precision"], s["zero"]): Run(0, proc.stdout, "", point)
        for point in point_dirs(tmp / "sweep")
        for s in [settings(point)]
    }


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
def test_fp8_loss_tracks_bf16_at_every_step(runs: dict[tuple[str, str], Run], stage: str) -> None:
    bf16, fp8 = runs[("bf16", stage)], runs[("fp8", stage)]
    assert fp8.summary["status"] == "ok" and len(fp8.losses) == STEPS
    for step, (a, b) in enumerate(zip(fp8.losses, bf16.losses), start=1):
        assert abs(a - b) <= LOSS_BOUND * b, f"step {step}: fp8 {a} vs bf16 {b}"
    assert fp8.losses != bf16.losses  # the casts are real: fp8 is not bf16 under another name


def plan_errors(run: Run) -> list[tuple[float, str]]:
    """Per rank: (planned - measured) / measured and the plan's peak moment, measured as the lowest of the
    three identical tracked steps. At stage3 the peak is inside a block's backward, beside its
    reduce-scatter, where gloo's worker thread now and then frees its copy of the input late (docs/memory_plan.md,
    "Not exact"): one tracked step once measured a copy more (-5.27%, the bf16 job in CI). A late free only
    adds, so a miss of the plan, present in every step, still fails."""
    plan = json.loads((run.out_dir / "plan.json").read_text())
    out = []
    for rank in plan["ranks"]:
        key = f"memory/rank{rank['rank']}/peak_allocated_gib"
        tracked = [r[key] for r in run.records if r["step"] in (2, 4, 6)]
        assert len(tracked) == 3, [(r["step"], r.get(key)) for r in run.records]
        measured = min(tracked)
        out.append(((rank["peak_gib"] - measured) / measured, rank["peak_moment"]))
    return out


def test_the_plan_holds_stage0s_peak_within_half_a_percent(runs: dict[tuple[str, str], Run]) -> None:
    """DDP under autocast: fp8 keeps no cached bf16 weight casts of the converted linears and one fp32
    norm output per norm on CPU (trainer/plan/activations.py); the peak is the loss's backward."""
    for error, moment in plan_errors(runs[("fp8", "stage0")]):
        assert abs(error) < PLAN_BOUND and moment == "backward: loss", (error, moment)


def test_inside_a_blocks_backward_the_plan_holds_stage3s_peak_within_half_a_percent(
    runs: dict[tuple[str, str], Run],
) -> None:
    """FSDP2's bf16 parameters: the peak is in a block's backward, w2's float8 casts (trainer/plan/fp8_backward.py)."""
    for error, moment in plan_errors(runs[("fp8", "stage3")]):
        assert abs(error) < PLAN_BOUND and moment.startswith("backward: block"), (error, moment)
    for error, _ in plan_errors(runs[("bf16", "stage3")]):  # the same job in bf16: within the usual bound
        assert abs(error) < PLAN_BOUND, error


def test_plan_json_lists_the_fp8_linears_and_what_stays_bf16(runs: dict[tuple[str, str], Run]) -> None:
    fp8 = json.loads((runs[("fp8", "stage3")].out_dir / "plan.json").read_text())["fp8"]
    assert (fp8["recipe"], fp8["filter"], fp8["converted"], fp8["emulated"], list(fp8["left_in_bf16"])) == (
        "tensorwise",
        "all",
        28,
        True,
        ["output"],
    )
    block = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    block += ["feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]
    assert (
        fp8["converted_per_block"] == runs[("fp8", "stage3")].summary["fp8"]["converted_per_block"] == block
    )
    assert "precision" not in json.loads((runs[("bf16", "stage3")].out_dir / "plan.json").read_text()).get(
        "fp8", {}
    )


def test_the_console_says_the_emulated_path_runs(runs: dict[tuple[str, str], Run]) -> None:
    console = runs[("fp8", "stage0")].stdout
    assert (
        console.count(
            "fp8: tensorwise scaling in 28 block linears (fp8_filter=all; per block: attention.wq, attention.wk, "
            "attention.wv, attention.wo, feed_forward.w1, feed_forward.w3, feed_forward.w2), emulated on cpu "
            "(torchao's emulate=True"
        )
        == 2
    )
    assert "left in bf16: output (the output head" in console
