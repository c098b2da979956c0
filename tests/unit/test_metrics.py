"""The Meter's arithmetic (worst rank, MFU, steady throughput) and the job process's W&B feed, without ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from trainer.config import DType, PrecisionConfig
from trainer.config import TrainConfig
from trainer.loggers import MetricsTail, NullLogger, WandbLogger, open_logger
from trainer.memory import CPU_FIELDS, CUDA_FIELDS
from trainer.metrics import PEAK_TFLOPS, device_peak_flops, memory_fields, mfu_pct
from trainer.summary import build_summary, redact_secrets, steady_tokens_per_s
from trainer.units import GIB

NAN = float("nan")


def cpu_rows(peaks: list[float], rss: list[float]) -> torch.Tensor:
    """Per-rank CPU memory rows (bytes) in CPU_FIELDS order; the category columns are NaN."""
    rows = [[peak, r, *[NAN] * (len(CPU_FIELDS) - 2)] for peak, r in zip(peaks, rss)]
    return torch.tensor(rows, dtype=torch.float64)


def test_worst_rank_is_the_largest_peak_with_its_rank_and_max_over_mean() -> None:
    peaks = [3 * GIB, 5 * GIB, 4 * GIB]
    record = memory_fields(CPU_FIELDS, cpu_rows(peaks, [6 * GIB] * 3), predicted_gib=None)
    assert record["memory/max_rank_peak_gib"] == 5.0
    assert record["memory/argmax_rank"] == 1
    assert record["memory/imbalance"] == pytest.approx(5 / 4)
    assert [record[f"memory/rank{r}/peak_allocated_gib"] for r in range(3)] == [3.0, 5.0, 4.0]


def test_unmeasured_figures_are_left_out_not_logged_as_nan() -> None:
    record = memory_fields(CPU_FIELDS, cpu_rows([NAN, NAN], [GIB, 2 * GIB]), predicted_gib=1.5)
    assert "memory/rank0/peak_allocated_gib" not in record
    assert "memory/max_rank_peak_gib" not in record and "memory/prediction_error_pct" not in record
    assert record["memory/rank1/peak_rss_gib"] == 2.0
    assert record["memory/predicted_peak_gib"] == 1.5
    assert not any(isinstance(v, float) and math.isnan(v) for v in record.values())


def test_prediction_error_is_relative_to_the_measured_worst_rank() -> None:
    record = memory_fields(CPU_FIELDS, cpu_rows([2 * GIB, 4 * GIB], [GIB, GIB]), predicted_gib=5.0)
    assert record["memory/prediction_error_pct"] == pytest.approx(100 * (5.0 - 4.0) / 4.0)


def test_gpu_counts_are_counts_and_bytes_are_gib() -> None:
    row = {"peak_allocated": 2 * GIB, "peak_reserved": 3 * GIB, "peak_active": 2 * GIB, "alloc_retries": 2, "num_ooms": 1, "peak_rss": GIB}
    record = memory_fields(CUDA_FIELDS, torch.tensor([[row[f] for f in CUDA_FIELDS]], dtype=torch.float64), None)
    assert record["memory/rank0/peak_reserved_gib"] == 3.0
    assert record["memory/rank0/alloc_retries"] == 2 and record["memory/rank0/num_ooms"] == 1


def test_mfu_is_model_flops_over_the_summed_peak_of_all_ranks() -> None:
    # 1e6 FLOPs/token at 1e6 tokens/s on 2 devices of 1 TFLOPS each: 1e12 / 2e12 = 50%.
    assert mfu_pct(1e6, 1e6, 1e12, world_size=2) == pytest.approx(50.0)


def test_peak_tflops_override_wins_and_cpu_has_no_peak_without_it() -> None:
    fp32 = PrecisionConfig()
    assert device_peak_flops(torch.device("cpu"), fp32, None) is None
    assert device_peak_flops(torch.device("cpu"), fp32, 2.5) == 2.5e12


@pytest.mark.parametrize(
    ("device_name", "dtype", "expected_row"),
    [
        ("NVIDIA H100 80GB HBM3", DType.bfloat16, "H100"),
        ("NVIDIA H100 PCIe", DType.bfloat16, "H100 PCIe"),
        ("NVIDIA H200", DType.float16, "H200"),
        ("NVIDIA A100-SXM4-80GB", DType.bfloat16, "A100"),
        ("NVIDIA A10", DType.bfloat16, "A10"),
        ("NVIDIA L40S", DType.float32, "L40S"),
    ],
)
def test_gpu_peak_comes_from_the_most_specific_table_row(monkeypatch, device_name: str, dtype: DType, expected_row: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    peaks = dict(PEAK_TFLOPS)[expected_row]
    column = {DType.bfloat16: 0, DType.float16: 1, DType.float32: 3}[dtype]  # fp32 at torch's default "highest"
    assert device_peak_flops(torch.device("cuda", 0), PrecisionConfig(compute_dtype=dtype), None) == peaks[column] * 1e12


def test_fp32_uses_the_tf32_peak_once_torch_allows_tf32(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert device_peak_flops(torch.device("cuda", 0), PrecisionConfig(), None) == dict(PEAK_TFLOPS)["A100"][2] * 1e12


def window(step: int, tokens_per_s: float, step_s: float, **extra: float) -> dict[str, float]:
    return {"step": step, "loss/train": 1.0, "throughput/tokens_per_s": tokens_per_s, "time/step_s": step_s, **extra}


def test_steady_throughput_is_total_tokens_over_total_time_after_warmup() -> None:
    # Windows of 10 steps; the first (warm-up) is slow and must not count.
    records = [window(10, 100.0, 1.0), window(20, 1000.0, 0.1), window(30, 500.0, 0.2)]
    tokens = 1000.0 * 0.1 * 10 + 500.0 * 0.2 * 10
    seconds = 0.1 * 10 + 0.2 * 10
    assert steady_tokens_per_s(records, total_steps=30) == pytest.approx(tokens / seconds)
    assert steady_tokens_per_s(records, total_steps=30, warmup_steps=0) == pytest.approx((tokens + 100.0 * 10) / (seconds + 10))


def test_summary_keeps_the_worst_window_of_the_worst_rank() -> None:
    records = [
        window(10, 100.0, 1.0, **{"memory/max_rank_peak_gib": 2.0, "memory/argmax_rank": 1, "memory/predicted_peak_gib": 2.5}),
        window(20, 100.0, 1.0, **{"memory/predicted_peak_gib": 2.5}),
        window(30, 100.0, 1.0, **{"memory/max_rank_peak_gib": 3.0, "memory/argmax_rank": 0, "memory/predicted_peak_gib": 2.5}),
    ]
    summary = build_summary("ok", records, total_steps=30)
    assert (summary["memory/max_rank_peak_gib"], summary["memory/argmax_rank"], summary["memory/peak_step"]) == (3.0, 0, 30)
    assert summary["memory/predicted_peak_gib"] == 2.5


def test_secrets_from_the_environment_are_redacted_everywhere(monkeypatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    nested = {"overrides": ["+x=0123456789abcdef0123456789abcdef01234567"], "a": {"b": "key 0123456789abcdef0123456789abcdef01234567"}}
    assert "0123456789abcdef" not in json.dumps(redact_secrets(nested))
    assert redact_secrets({"lr": 0.1, "name": "zero=stage3"}) == {"lr": 0.1, "name": "zero=stage3"}


def test_tail_hands_over_complete_lines_only_and_starts_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n")  # an earlier job's record: not this run's
    seen: list[dict] = []
    tail = MetricsTail(path, seen.append)
    with path.open("a") as f:
        f.write(json.dumps({"step": 2}) + "\n" + '{"step": ')
    tail.poll()
    assert seen == [{"step": 2}]
    with path.open("a") as f:
        f.write("3}\n")
    tail.poll()
    assert seen == [{"step": 2}, {"step": 3}]


def test_wandb_that_cannot_start_warns_once_and_leaves_the_job_a_null_logger(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("WANDB_MODE", "not-a-mode")  # wandb.init rejects its settings
    meta = {"config": {}, "overrides": [], "world_size": 1}
    config = TrainConfig()
    with open_logger(config.logger, tmp_path, meta, "defaults", "today", config.zero.stage.value, config.resume) as logger:
        assert isinstance(logger, NullLogger)
    assert capsys.readouterr().err.count("warning: W&B could not start") == 1


class BrokenRun:
    """A W&B run whose every call fails, as when the server goes away midway."""

    calls = 0

    def log(self, *args, **kwargs) -> None:
        BrokenRun.calls += 1
        raise ConnectionError("gone")

    def finish(self, *args, **kwargs) -> None:
        BrokenRun.calls += 1
        raise ConnectionError("gone")


def test_wandb_failing_midway_warns_once_and_stops_calling_it(capsys) -> None:
    logger = WandbLogger(BrokenRun())
    for step in (1, 2, 3):
        logger.log_record({"step": step, "loss/train": 1.0})
    logger.finish({"status": "ok"})
    assert BrokenRun.calls == 1
    assert capsys.readouterr().err.count("warning: W&B stopped working") == 1
