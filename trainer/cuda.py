"""What a process sets up on a CUDA device, beside what every rank does (trainer/world.py, which
imports it: a rank's CUDA setup sits at world.py's layer, below the rank's package; the job process
uses it too, to check a host's GPUs and to hand its ranks NCCL's environment).

- The process group: NCCL for device tensors, plus gloo for host tensors when FSDP2 offloads
  states to host memory: offloaded gradients are CPU tensors, and clipping's all-reduce of
  their norm would find no CPU backend in an NCCL-only group (torchtitan builds the same
  `cuda:nccl,cpu:gloo` group for CPU offload).
- NCCL's failure handling: a collective that errors or times out aborts the communicator
  (async error handling) instead of hanging, and the flight recorder (also what trainer/telemetry/comm.py
  measures communication with) keeps the last collectives of each rank and dumps them on a
  timeout, so a hang can be read afterwards.
- The caching allocator: expandable segments, which PyTorch recommends against fragmentation
  when shapes vary (each block's all-gathered parameters, activations); set before the
  allocator first runs.
- TF32 for fp32 matmuls and convolutions (`precision.tf32`), through both of torch's APIs.
- CUPTI torn down when a profile ends (`TEARDOWN_CUPTI=1`): kineto detaches it only then, and a rank that
  profiles a step (the exposed-communication step, telemetry.trace_steps) would otherwise run every later
  step with CUPTI attached, 10-20% slower (pytorch/pytorch#146604).
- What the device cannot run, refused before any rank starts (`capability_error`): fp8 matmuls need
  compute capability 8.9 (Ada, Hopper, Blackwell: `torch._scaled_mm`), bf16 8.0 (Ampere).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainer.config import ConfigError, DType, PrecisionConfig

ALLOC_CONF = "expandable_segments:True"
# NCCL environment a rank gets unless set already (by the user, or by trainer/telemetry/comm.py, which
# sizes the flight recorder for its measurements): on a collective's error or timeout, tear the
# process down (3: SkipCleanUp, torch's own default, which does not wait on an ncclCommAbort that
# can itself hang; ProcessGroupNCCL.hpp ErrorHandlingMode), keep the last 2000 collectives per rank
# in the flight recorder and dump them when a collective times out.
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
PROFILER_ENV = {"TEARDOWN_CUPTI": "1"}
"""kineto's: detach CUPTI when a profile stops (the module docstring says why)."""
FP8_CAPABILITY, BF16_CAPABILITY = (8, 9), (8, 0)
FLIGHT_RECORDER_DIR = "nccl_traces"


def process_group_backend(device_kind: str, offload_to_cpu: bool) -> str:
    """The backend string for init_process_group: gloo on CPU; NCCL on CUDA, with gloo beside it
    for the host tensors of CPU offload."""
    if device_kind != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if offload_to_cpu else "nccl"


def local_ranks_error(local_world_size: int, visible_devices: int) -> str | None:
    """One line when this host starts more ranks than it has GPUs (CUDA's own error is an opaque
    `invalid device ordinal` from the first rank past the end); None when they fit."""
    if local_world_size <= visible_devices:
        return None
    return (
        f"{local_world_size} ranks on this host but only {visible_devices} CUDA devices are visible "
        f"(one rank per GPU); start at most {visible_devices} per node (nproc=, torchrun --nproc_per_node) or use device=cpu"
    )


def check_local_ranks(local_world_size: int) -> None:
    """Raise ConfigError (exit 2, before training) when the ranks of this host outnumber its GPUs."""
    error = local_ranks_error(local_world_size, torch.cuda.device_count())
    if error is not None:
        raise ConfigError(error)


def capability_error(precision: PrecisionConfig, capability: tuple[int, int], name: str) -> str | None:
    """One line when the GPU (`name`, compute capability `capability`) cannot run `precision`; else None."""
    have = f"GPU 0 ({name}) has compute capability {capability[0]}.{capability[1]}"
    if precision.is_fp8 and capability < FP8_CAPABILITY:
        instead = "precision=bf16" if capability >= BF16_CAPABILITY else "precision=fp16"
        return f"precision=fp8 needs float8 tensor cores (compute capability 8.9 or later: Ada, Hopper); {have}; use {instead}"
    if precision.compute_dtype == DType.bfloat16 and capability < BF16_CAPABILITY:
        return (
            f"precision=bf16 needs compute capability 8.0 or later (Ampere); {have}; use precision=fp16 "
            "(dynamic loss scaling) or precision=fp32"
        )
    return None


def check_capability(precision: PrecisionConfig) -> None:
    """In the job process of a CUDA job, before any rank starts: ConfigError (exit 2) for what GPU 0 cannot run."""
    error = capability_error(precision, torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0))
    if error is not None:
        raise ConfigError(error)


def set_launcher_environment() -> None:
    """In the job process, before the elastic agent starts the ranks: the agent gives every rank
    TORCH_NCCL_ASYNC_ERROR_HANDLING from its own environment, else "1"
    (torch/distributed/elastic/agent/server/local_elastic_agent.py, `_start_workers`), so a rank's
    setdefault would never see it unset. Set here, the job's value reaches the ranks; a user's
    own setting wins. (Under torchrun the agent is torchrun's: export it there.)"""
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    os.environ.setdefault(key, NCCL_ENV[key])


def set_rank_environment(out_dir: Path | None) -> None:
    """Before the process group and the allocator start: NCCL failure handling, the flight
    recorder's dump files (under the run's directory), expandable segments, CUPTI's teardown. A
    user's own setting of any of these wins."""
    for key, value in {**NCCL_ENV, **PROFILER_ENV}.items():
        os.environ.setdefault(key, value)
    if out_dir is not None:
        dump_dir = out_dir / FLIGHT_RECORDER_DIR
        dump_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(dump_dir / "rank_"))  # rank_<r> per rank
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)


def apply_tf32(enabled: bool) -> None:
    """fp32 matmuls (cuBLAS) and convolutions (cuDNN) on TF32 tensor cores, or in full IEEE fp32.

    Set through both APIs, the legacy flags first: torch >= 2.9 raises "mix of the legacy and new
    APIs" when a legacy getter (`matmul.allow_tf32`, `get_float32_matmul_precision()`, which
    inductor's max-autotune reads) follows a setting made through `fp32_precision` alone
    (pytorch/pytorch#166387); a legacy setter keeps both views in step, and the new setter
    states the same value where it exists.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        setting = "tf32" if enabled else "ieee"
        torch.backends.cuda.matmul.fp32_precision = setting
        torch.backends.cudnn.conv.fp32_precision = setting
