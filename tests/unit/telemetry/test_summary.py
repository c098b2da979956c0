"""summary.json's figures (trainer/telemetry/summary.py): steady-state throughput, the worst window, secrets redacted."""

from __future__ import annotations

import json

import pytest

from trainer.telemetry.summary import (
    build_summary,
    comm_error,
    plan_error_rows,
    redact_secrets,
    steady_tokens_per_s,
)


def window(step: int, tokens_per_s: float, step_s: float, **extra: float) -> dict[str, float]:
    return {
        "step": step,
        "loss/train": 1.0,
        "throughput/tokens_per_s": tokens_per_s,
        "time/step_s": step_s,
        **extra,
    }


def test_steady_throughput_is_total_tokens_over_total_time_after_warmup() -> None:
    # Windows of 10 steps; the first (warm-up) is slow and must not count.
    records = [window(10, 100.0, 1.0), window(20, 1000.0, 0.1), window(30, 500.0, 0.2)]
    tokens = 1000.0 * 0.1 * 10 + 500.0 * 0.2 * 10
    seconds = 0.1 * 10 + 0.2 * 10
    assert steady_tokens_per_s(records, total_steps=30) == pytest.approx(tokens / seconds)
    assert steady_tokens_per_s(records, total_steps=30, warmup_steps=0) == pytest.approx(
        (tokens + 100.0 * 10) / (seconds + 10)
    )


def test_summary_keeps_the_worst_window_of_the_worst_rank() -> None:
    records = [
        window(
            10,
            100.0,
            1.0,
            **{"memory/max_rank_peak_gib": 2.0, "memory/argmax_rank": 1, "memory/predicted_peak_gib": 2.5},
        ),
        window(20, 100.0, 1.0, **{"memory/predicted_peak_gib": 2.5}),
        window(
            30,
            100.0,
            1.0,
            **{"memory/max_rank_peak_gib": 3.0, "memory/argmax_rank": 0, "memory/predicted_peak_gib": 2.5},
        ),
    ]
    summary = build_summary("ok", records, total_steps=30)
    assert (
        summary["memory/max_rank_peak_gib"],
        summary["memory/argmax_rank"],
        summary["memory/peak_step"],
    ) == (3.0, 0, 30)
    assert summary["memory/predicted_peak_gib"] == 2.5


def test_summary_carries_every_ranks_host_memory_while_loading_and_the_largest() -> None:
    loaded = {"memory/rank0/load_host_peak_gib": 0.5, "memory/rank1/load_host_peak_gib": 0.75}
    loaded |= {"memory/rank0/load_rss_peak_gib": 1.0, "memory/rank1/load_rss_peak_gib": 1.25}
    summary = build_summary("ok", [window(10, 100.0, 1.0, **loaded), window(20, 100.0, 1.0)], total_steps=20)
    assert {k: v for k, v in summary.items() if "load" in k} == loaded | {
        "memory/max_rank_load_host_peak_gib": 0.75
    }


def test_secrets_from_the_environment_are_redacted_everywhere(monkeypatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    nested = {
        "overrides": ["+x=0123456789abcdef0123456789abcdef01234567"],
        "a": {"b": "key 0123456789abcdef0123456789abcdef01234567"},
    }
    assert "0123456789abcdef" not in json.dumps(redact_secrets(nested))
    assert redact_secrets({"lr": 0.1, "name": "zero=stage3"}) == {"lr": 0.1, "name": "zero=stage3"}


def comm_window(
    step: int, predicted: float, measured: float, window_plan: float | None = None
) -> dict[str, float]:
    """A 2-rank window as trainer/telemetry/metrics.py writes it (both ranks measured alike)."""
    record = window(step, 100.0, 1.0, **{"comm/predicted_bytes_per_step": predicted})
    record |= {f"comm/rank{rank}/bytes_per_step": measured for rank in (0, 1)}
    if window_plan is not None:
        record["comm/window_predicted_bytes_per_step"] = window_plan
    record["comm/prediction_error_bytes"] = (predicted if window_plan is None else window_plan) - measured
    return record


def test_an_error_against_a_near_zero_prediction_is_in_bytes_not_percent() -> None:
    """One rank, or pp at dp=1: the plan's 0 against the loop's own few hundred bytes is -424 B, not -100%."""
    assert comm_error(0, 424.0) == {"comm/prediction_error_bytes": -424.0}
    assert comm_error(4095, 4500.0) == {"comm/prediction_error_bytes": -405.0}
    assert comm_error(48_640, 49_504.0) == {
        "comm/prediction_error_bytes": -864.0,
        "comm/prediction_error_pct": pytest.approx(-1.7453, abs=1e-4),
    }
    summary = build_summary("ok", [comm_window(step, 0, 424.0) for step in (1, 2, 3)], total_steps=3)
    assert "comm/prediction_error_pct" not in summary
    assert (summary["comm/prediction_error_bytes"], summary["comm/compared_steps"]) == (-424.0, 2)
    assert (
        dict(plan_error_rows(summary))["comm plan error"]
        == "-424 B per step (predicted near zero) over 2 steps"
    )


def test_each_window_is_compared_with_the_plan_of_its_own_steps() -> None:
    """PowerSGD from step 3: steps 1-2 all-reduce exactly, and the steady windows (2-8) are compared with
    the plan of their own steps, not the compressed figure: -0.2% over 7 steps, where the compressed
    plan against their mean was -91.4%."""
    exact, compressed, loop = 3_674_624, 48_640, 864.0
    records = [comm_window(s, compressed, exact + loop, window_plan=exact) for s in (1, 2)]
    records += [comm_window(s, compressed, compressed + loop) for s in range(3, 9)]
    summary = build_summary("ok", records, total_steps=8)
    plan = (exact + 6 * compressed) / 7
    assert summary["comm/compared_steps"] == 7
    assert summary["comm/window_predicted_bytes_per_step"] == pytest.approx(plan)
    assert summary["comm/prediction_error_bytes"] == pytest.approx(-loop)
    assert summary["comm/prediction_error_pct"] == pytest.approx(-100 * loop / (plan + loop))
    assert summary["comm/predicted_bytes_per_step"] == compressed  # plan.json's figure, as before
    assert dict(plan_error_rows(summary))["comm plan error"] == "-0.15% (-864 B per step) over 7 steps"


def test_the_memory_error_is_the_worst_compared_windows_and_the_excluded_are_counted() -> None:
    """A window none of whose measured steps the plan's peak describes carries no error (metrics.py): the
    summary's error is the worst window that has one, with both counts."""
    peak = {"memory/predicted_peak_gib": 2.0}
    records = [
        window(2, 100.0, 1.0, **peak, **{"memory/max_rank_peak_gib": 2.1}),  # excluded, yet the run's worst
        window(
            3, 100.0, 1.0, **peak, **{"memory/max_rank_peak_gib": 1.9, "memory/prediction_error_pct": 5.26}
        ),
        window(
            4, 100.0, 1.0, **peak, **{"memory/max_rank_peak_gib": 1.99, "memory/prediction_error_pct": 0.5}
        ),
    ]
    summary = build_summary("ok", records, total_steps=4)
    assert (summary["memory/max_rank_peak_gib"], summary["memory/peak_step"]) == (2.1, 2)
    assert (summary["memory/prediction_error_pct"], summary["memory/prediction_error_step"]) == (0.5, 4)
    assert (summary["memory/compared_windows"], summary["memory/excluded_windows"]) == (2, 1)
    assert dict(plan_error_rows(summary))["peak plan error"] == (
        "+0.50% at step 4 (2 measured windows compared, 1 left out (planned otherwise))"
    )


@pytest.mark.parametrize(("precision", "labelled"), [("fp8", True), ("bf16", False)])
def test_an_fp8_runs_mfu_is_labelled_bf16_equivalent(tmp_path, precision: str, labelled: bool) -> None:
    """fp8's GEMMs run faster than the bf16 peak MFU divides by: summary.json (W&B's summary is the same
    dict) names the basis, and the console's row says it; a bf16 run's MFU needs no label."""
    from tests.helpers import compose_config
    from trainer.job import end_summary
    from trainer.telemetry import keys
    from trainer.telemetry.summary import summary_table

    figures = {
        keys.LOSS: 5.0,
        keys.TOKENS_PER_S: 1000.0,
        keys.MFU_PCT: 40.0,
        keys.STEP_S: 0.1,
        keys.DATA_S: 0.0,
    }
    records = [{"step": s, **figures} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = compose_config(f"precision={precision}", "steps=3", "telemetry.warmup_steps=1")
    summary = end_summary(config, tmp_path, keys.Status.ok, {}, {})
    assert summary[keys.MFU_PCT] == 40.0
    assert (summary.get(keys.MFU_BASIS) == keys.FP8_MFU_BASIS) is labelled
    assert json.loads((tmp_path / "summary.json").read_text()).get(keys.MFU_BASIS) == summary.get(
        keys.MFU_BASIS
    )
    row = next(line for line in summary_table(summary).splitlines() if "MFU (steady)" in line)
    assert row.split("MFU (steady)")[1].strip() == ("40.0% (bf16-equivalent)" if labelled else "40.0%")
