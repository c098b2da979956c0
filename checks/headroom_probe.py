"""What a CUDA rank holds besides its tensors, measured in this process (checks/gpu_check.py's headroom row).

    python checks/headroom_probe.py        # on a GPU host; prints one JSON line

The figures trainer/plan/headroom.py assumes, each measured for this process only:

- context_gib: the CUDA context and kernel images (after a matmul's forward and backward: kernels
  load at their first launch), outside the caching allocator: this process's
  device memory (nvidia-smi's per-process figure; where the process is not listed, as in a
  container with its own PID namespace, the device's used memory after this process created its
  context less before) minus what the allocator reserved. Other processes on the device are
  left out (`other_processes_gib` says how much they held).
- cublas_workspace_gib: one cuBLAS workspace, inside the allocator and inside *allocated*; there is
  one per thread that runs matmuls (the forward's and autograd's backward thread) and stream.
  Measured as what stays allocated after a matmul's forward and backward, beyond the tensors still
  alive, per thread (cublas_workspaces_gib: both).
- nccl_world1_gib: NCCL's communicator at world size 1, outside the allocator. One GPU cannot
  show NCCL at 8 ranks (buffers per peer and channel): `nccl_8_ranks` says so, and the plan's
  figure for several ranks stays an assumption.
- expandable_segments: every segment of the allocator's snapshot is expandable once the rank's
  environment (trainer/cuda.py set_rank_environment) is applied.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GIB = 2**30
NOT_MEASURABLE_HERE = "not measurable on one GPU: NCCL's buffers grow with peers and channels"
MATMUL_THREADS = 2
"""Threads that run the probe's matmuls, each with a cuBLAS workspace: the forward's and autograd's."""


def nvidia_smi(*query: str) -> list[str] | None:
    """nvidia-smi's CSV lines for a query, or None where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    args = ["nvidia-smi", *query, "--format=csv,noheader,nounits"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    return proc.stdout.strip().splitlines() if proc.returncode == 0 else None


def device_used_bytes(index: int) -> int | None:
    """The device's used memory (every process), without creating a CUDA context."""
    lines = nvidia_smi("--query-gpu=memory.used", f"--id={index}")
    return int(float(lines[0])) * 2**20 if lines else None


def process_used_bytes(pid: int) -> int | None:
    """This process's device memory as the driver reports it; None where it is not listed."""
    for line in nvidia_smi("--query-compute-apps=pid,used_memory") or []:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) * 2**20
    return None


def own_context_bytes(
    process: int | None, before: int | None, after: int | None, reserved: int
) -> int | None:
    """The context of this process: its own figure less the allocator's, else the device's growth."""
    if process is not None:
        return process - reserved
    if before is None or after is None:
        return None
    return after - before - reserved


def measure() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    from trainer.cuda import set_rank_environment

    set_rank_environment(None)  # what a rank sets before its allocator starts: expandable segments
    before = device_used_bytes(0)
    torch.cuda.init()
    x, w = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "xw")
    (x @ w).float().sum().backward()  # forward on this thread, backward on autograd's
    torch.cuda.synchronize()
    # The context after kernels ran: CUDA loads a kernel's module at its first launch (lazy loading,
    # torch's default), so a context measured before any kernel leaves those images out.
    context = own_context_bytes(
        process_used_bytes(os.getpid()), before, device_used_bytes(0), torch.cuda.memory_reserved()
    )
    alive = sum(t.numel() * t.element_size() for t in (x, w, x.grad, w.grad))
    cublas = torch.cuda.memory_allocated() - alive
    segments = torch.cuda.memory_snapshot()
    expandable = bool(segments) and all(s.get("is_expandable", False) for s in segments)
    free0, _ = torch.cuda.mem_get_info()
    reserved0 = torch.cuda.memory_reserved()
    store = dist.TCPStore("localhost", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(2**20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    nccl = free0 - free1 - (torch.cuda.memory_reserved() - reserved0)
    dist.destroy_process_group()
    return {
        "context_gib": None if context is None else context / GIB,
        "cublas_workspace_gib": cublas / MATMUL_THREADS / GIB,  # per thread, as the plan assumes one
        "cublas_workspaces_gib": cublas / GIB,
        "nccl_world1_gib": nccl / GIB,
        "nccl_8_ranks": NOT_MEASURABLE_HERE,
        "expandable_segments": expandable,
        "other_processes_gib": None if before is None else before / GIB,
    }


if __name__ == "__main__":
    print(json.dumps(measure()), flush=True)
