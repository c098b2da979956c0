"""The Meter's arithmetic (trainer/telemetry/metrics.py: worst rank, prediction error, MFU, device peaks), without ranks."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.config import DType, PrecisionConfig
from trainer.layout import Layout
from trainer.telemetry import keys
from trainer.telemetry.memory import CPU_FIELDS, CUDA_FIELDS
from trainer.telemetry.metrics import (
    check_ranks_agree,
    device_peak_flops,
    memory_fields,
    mfu_pct,
    pipeline_fields,
)
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
    row = {
        "peak_allocated": 2 * GIB,
        "peak_reserved": 3 * GIB,
        "peak_active": 2 * GIB,
        "alloc_retries": 2,
        "num_ooms": 1,
        "peak_rss": GIB,
        "outside_allocator": GIB / 2,
        "load_host_peak": GIB / 4,  # model.weights, in the first row only
        "load_rss_peak": NAN,
    }
    record = memory_fields(
        CUDA_FIELDS, torch.tensor([[row[f] for f in CUDA_FIELDS]], dtype=torch.float64), None
    )
    assert (
        record["memory/rank0/load_host_peak_gib"] == 0.25 and "memory/rank0/load_rss_peak_gib" not in record
    )
    assert record["memory/rank0/peak_reserved_gib"] == 3.0
    assert record["memory/rank0/outside_allocator_gib"] == 0.5
    assert record["memory/rank0/alloc_retries"] == 2 and record["memory/rank0/num_ooms"] == 1


def test_mfu_is_model_flops_over_the_summed_peak_of_all_ranks() -> None:
    # 1e6 FLOPs/token at 1e6 tokens/s on 2 devices of 1 TFLOPS each: 1e12 / 2e12 = 50%.
    assert mfu_pct(1e6, 1e6, 1e12, world_size=2) == pytest.approx(50.0)


def test_peak_tflops_override_wins_and_cpu_has_no_peak_without_it() -> None:
    fp32 = PrecisionConfig()
    assert device_peak_flops(torch.device("cpu"), fp32, None) is None
    assert device_peak_flops(torch.device("cpu"), fp32, 2.5) == 2.5e12


@pytest.mark.parametrize(
    ("device_name", "dtype", "expected_tflops"),
    [
        ("NVIDIA H100 80GB HBM3", DType.bfloat16, 989.4),  # SXM
        ("NVIDIA H100 PCIe", DType.bfloat16, 756.5),
        ("NVIDIA H100 NVL", DType.bfloat16, 835.5),
        ("NVIDIA H200", DType.float16, 989.4),
        ("NVIDIA B200", DType.bfloat16, 2250.0),
        ("NVIDIA A100-SXM4-80GB", DType.bfloat16, 312.0),
        ("NVIDIA A100-PCIE-40GB", DType.float32, 19.5),
        ("NVIDIA L4", DType.bfloat16, 121.0),  # not L40's 181
        ("NVIDIA L40", DType.bfloat16, 181.0),
        ("NVIDIA L40S", DType.float32, 91.6),
    ],
)
def test_gpu_peak_comes_from_the_exact_device_name(
    monkeypatch, device_name: str, dtype: DType, expected_tflops: float
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    monkeypatch.setattr("trainer.telemetry.metrics.tf32_enabled", lambda: False)
    assert (
        device_peak_flops(torch.device("cuda", 0), PrecisionConfig(compute_dtype=dtype), None)
        == expected_tflops * 1e12
    )


@pytest.mark.parametrize(
    "device_name",
    [
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
        "NVIDIA L4X",
        "NVIDIA GeForce RTX 4090",
    ],
)
def test_mig_slices_and_unlisted_devices_have_no_peak(monkeypatch, device_name: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    assert (
        device_peak_flops(torch.device("cuda", 0), PrecisionConfig(compute_dtype=DType.bfloat16), None)
        is None
    )


def test_fp32_uses_the_tf32_peak_once_tf32_is_on(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr("trainer.telemetry.metrics.tf32_enabled", lambda: True)
    assert device_peak_flops(torch.device("cuda", 0), PrecisionConfig(), None) == 156.0e12


def test_ranks_that_disagree_on_the_loss_scale_or_skips_raise_an_error_not_an_assert() -> None:
    check_ranks_agree(torch.tensor([[512.0, 1.0], [512.0, 1.0]], dtype=torch.float64))  # agreed: no error
    for rank1 in ([1024.0, 1.0], [512.0, 0.0]):  # rank 1 kept its scale, or took the step rank 0 skipped
        with pytest.raises(RuntimeError, match=r"^ranks disagree on loss scale and skipped steps"):
            check_ranks_agree(torch.tensor([[512.0, 1.0], rank1], dtype=torch.float64))


def test_pipeline_fields_per_rank_per_stage_and_per_replica() -> None:
    """4 ranks, pp=2 outermost (trainer/layout.py): ranks 0 and 1 are stage 0 of two replicas; each sent the
    bytes of its stage."""
    per_rank = torch.tensor([[0.2, 100.0], [0.4, 100.0], [0.3, 100.0], [0.6, 100.0]], dtype=torch.float64)
    record = pipeline_fields(per_rank, Layout(pp=2, dp_replicate=2))
    assert record[keys.pp_rank_idle_key(3)] == 0.6
    assert record[keys.pp_idle_key(0)] == pytest.approx(0.3) and record[keys.pp_idle_key(1)] == pytest.approx(
        0.45
    )
    assert record[keys.pp_sent_key(0)] == record[keys.pp_sent_key(1)] == 100.0
    assert record[keys.PP_MEASURED_BYTES] == 200.0
