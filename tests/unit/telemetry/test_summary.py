"""summary.json's figures (trainer/telemetry/summary.py): steady-state throughput, the worst window, secrets redacted."""

from __future__ import annotations

import json

import pytest

from trainer.telemetry.summary import build_summary, redact_secrets, steady_tokens_per_s


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
