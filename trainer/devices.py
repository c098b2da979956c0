"""The accelerators zerolab knows: exact device names, memory and dense peak TFLOPS.

A device is known only by the exact name `torch.cuda.get_device_name()` reports (NVIDIA's
product names: the H100 SXM reports "NVIDIA H100 80GB HBM3", the PCIe card "NVIDIA H100
PCIe"). Substring matching confused `L4` with `L40`/`L40S` and every H100 variant with the
SXM one; a MIG slice ("... MIG 1g.10gb") has a fraction of the device's compute and memory,
so it, like any name not listed here, is unknown: MFU then needs `telemetry.peak_tflops` and
the plan `device_memory_gib`, rather than a wrong figure.

Peaks are the vendors' datasheet figures without sparsity (the datasheets print the sparse
ones, twice as large), per matmul input dtype. Memory is what nvidia-smi reports as the total.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: its short name (`plan.accelerator=`), memory and dense peak TFLOPS."""

    short: str
    memory_mib: int
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float


DEVICES: dict[str, DeviceSpec] = {
    "NVIDIA H100 80GB HBM3": DeviceSpec("h100-sxm", 81_559, 989.4, 989.4, 494.7, 66.9),
    "NVIDIA H100 PCIe": DeviceSpec("h100-pcie", 81_559, 756.5, 756.5, 378.0, 51.2),
    # The 96 GB HBM2e H100 at 500 W of Meta's Grand Teton hosts, where torchtitan's H100 figures were
    # measured (torchtitan benchmarks/llama3_h100_202412_torchtitan.md lines 11-15). Its name and
    # memory as torch reports them: "CUDA capacity: NVIDIA H100 with 94.99GiB memory" (torchtitan
    # commit 32beb604e's log; metrics.py prints torch.cuda.get_device_name) and 95.0396 GiB (torchtitan
    # PR #165). NVIDIA publishes no peaks for it ("between SXM and NVL", ibid. footnote 2): the SXM's
    # are used, as torchtitan's MFU does, so its MFU reads low.
    "NVIDIA H100": DeviceSpec("h100-hbm2e", 97_320, 989.4, 989.4, 494.7, 66.9),
    "NVIDIA H100 NVL": DeviceSpec("h100-nvl", 95_830, 835.5, 835.5, 417.5, 60.0),
    "NVIDIA H200": DeviceSpec("h200", 143_771, 989.4, 989.4, 494.7, 66.9),  # SXM5
    "NVIDIA H200 NVL": DeviceSpec("h200-nvl", 143_771, 835.5, 835.5, 417.5, 60.0),
    "NVIDIA B200": DeviceSpec("b200", 183_359, 2250.0, 2250.0, 1100.0, 75.0),  # HGX B200, per GPU
    "NVIDIA A100-SXM4-40GB": DeviceSpec("a100-40gb", 40_960, 312.0, 312.0, 156.0, 19.5),
    "NVIDIA A100-SXM4-80GB": DeviceSpec("a100-80gb", 81_920, 312.0, 312.0, 156.0, 19.5),
    "NVIDIA A100-PCIE-40GB": DeviceSpec("a100-40gb-pcie", 40_960, 312.0, 312.0, 156.0, 19.5),
    "NVIDIA A100 80GB PCIe": DeviceSpec("a100-80gb-pcie", 81_920, 312.0, 312.0, 156.0, 19.5),
    "NVIDIA L4": DeviceSpec("l4", 23_034, 121.0, 121.0, 60.0, 30.3),
    "NVIDIA L40": DeviceSpec("l40", 46_068, 181.0, 181.0, 90.5, 90.5),
    "NVIDIA L40S": DeviceSpec("l40s", 46_068, 362.1, 362.1, 183.0, 91.6),
    "NVIDIA A10": DeviceSpec("a10", 23_028, 125.0, 125.0, 62.5, 31.2),
    "Tesla V100-SXM2-16GB": DeviceSpec(
        "v100-16gb", 16_160, None, 125.0, None, 15.7
    ),  # fp16 tensor cores only
    "Tesla V100-SXM2-32GB": DeviceSpec("v100-32gb", 32_510, None, 125.0, None, 15.7),
}

# `plan.accelerator=h100` has always meant the SXM part (the one in DGX/HGX systems).
ALIASES = {"h100": "h100-sxm"}
BY_SHORT = {spec.short: spec for spec in DEVICES.values()}


def accelerator_names() -> list[str]:
    """What `plan.accelerator` accepts (in any case)."""
    return sorted([*BY_SHORT, *ALIASES])


def find_accelerator(name: str) -> DeviceSpec | None:
    """The device a `plan.accelerator` name means, whatever its case; None when unknown."""
    short = name.strip().lower()
    return BY_SHORT.get(ALIASES.get(short, short))


def find_device(device_name: str) -> DeviceSpec | None:
    """The device `torch.cuda.get_device_name()` reported, by exact name; None when unknown (MIG slices too)."""
    return DEVICES.get(device_name.strip())


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32 tensor cores (trainer/cuda.py sets it from precision.tf32)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        setting = matmul.fp32_precision
        if setting == "none":  # inherits the global setting
            setting = torch.backends.fp32_precision
        return setting == "tf32"
    return bool(matmul.allow_tf32)


def peak_tflops(spec: DeviceSpec, dtype: str, tf32: bool) -> float | None:
    """Dense peak of the matmuls a run in `dtype` (`precision.compute_dtype`: `float32`, `bfloat16`,
    `float16`) does; fp32 runs on TF32 tensor cores only when allowed."""
    if dtype == "bfloat16":
        return spec.bf16
    if dtype == "float16":
        return spec.fp16
    return spec.tf32 if tf32 else spec.fp32
