"""What a CUDA rank needs beyond the tensors the plan walks: the headroom, fitted to published figures.

The plan's peak is tensor memory (what `torch.cuda.max_memory_allocated` reports). A GPU also
holds, per rank:

- outside the caching allocator (so outside `device_memory_gib`'s cap, which is a fraction of
  the allocator's reserved memory): the CUDA context with its loaded kernels, and NCCL's
  buffers, per communicator that carries traffic (trainer/plan/groups.py
  `ShardGroups.nccl_communicators`: one without HSDP or hpZ, three with HSDP, one more per
  hpZ block; with one rank the default group's, made at init and idle). "More communicators = more memory used" (NVIDIA/nccl#986,
  answering #864); NVIDIA/nccl#964 measured 544 MiB for a 2-GPU communicator and 688 MiB for
  3-4 GPUs on A100s with NVLink, after one all-reduce each;
- inside it: cuBLAS's workspace (torch allocates it through the caching allocator, once per
  stream) and fragmentation, the gap between reserved and allocated.

Inside the allocator, the figures are fitted to published measurements (docs/memory_plan.md,
"Held against published GPU measurements"; checks/plan_vs_published.py refits them and fails
when these constants drift from the fit). Reserved = (1 + f) x allocated + c, fitted on the two
1D FSDP2 runs that publish both peak active and peak reserved memory on 8 H100s (95.04 GiB):

- torchtitan PR #165 (commit 83c879f), Llama-2-7B shapes, local batch 8, seq 2048, per-op
  selective AC: peak active 52.13%, peak reserved 62.51% of 95.0396 GiB;
- torchtitan PR #699 (commit 6a6f755), Llama-3-8B, local batch 1, seq 8192, per-op selective AC,
  expandable segments: memory/max_active 41.17145 GiB, memory/max_reserved 49.58594 GiB;

which gives f = 0.1733 and c = 1.281 GiB (the 32 MiB cuBLAS workspace plus 1.25 GiB that the
allocator keeps cached on the streams FSDP2 all-gathers and reduce-scatters on). Validated on
the other published points (the table in docs/memory_plan.md). The CUDA context and NCCL
figures come from the GPU check's first run (checks/gpu_check.py's `headroom` row, 2026-12-04,
one H200, torch 2.11.0+cu130, NCCL 2.28.9, docs/gpu.md "Results"): the context measured 0.723 GiB
once kernels had run, taken as 0.75; NCCL measured 0.545 GiB at one rank, in line with the 544 MiB
NVIDIA/nccl#964 measured for 2 GPUs, and is taken as that issue's 688 MiB for 3-4 GPUs, since one
GPU cannot measure a communicator of 8 (its buffers grow with peers and channels).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.units import GIB


@dataclass(frozen=True)
class Headroom:
    """A CUDA rank's memory beyond its tensors (fitted, measured and published figures; see the
    module docstring)."""

    context_gib: float = 0.75
    """CUDA context and kernel images, per process: outside the allocator (0.723 GiB measured on an
    H200, rounded up)."""
    nccl_gib: float = 688 / 1024
    """NCCL's buffers per communicator that carries traffic: outside the allocator (688 MiB; the
    module docstring gives the measurements it stands for)."""
    nccl_one_rank_gib: float = 0.545
    """A one-rank job's default-group communicator, which init_process_group(device_id=...) creates at once
    (trainer/world.py) though nothing crosses it: 0.545 GiB measured on one H200 (the module docstring)."""
    cublas_workspace_gib: float = 1 / 32
    """cuBLAS workspace (32 MiB): inside the allocator."""
    stream_cache_gib: float = 1.25
    """Fitted: reserved memory beyond (1 + fragmentation) x allocated, less the cuBLAS workspace."""
    fragmentation: float = 0.1733
    """Fitted: reserved grows by this fraction of allocated memory, beyond the fixed part."""

    def outside_allocator(self, communicators: int, world_size: int = 2) -> int:
        """Bytes a rank's device holds that the caching allocator does not manage, with
        `communicators` NCCL communicators carrying its traffic (of one rank alone at world_size 1)."""
        nccl = self.nccl_one_rank_gib if world_size == 1 else self.nccl_gib
        return int((self.context_gib + nccl * communicators) * GIB)

    def reserved(self, allocated: int) -> int:
        """The allocator's reserved memory predicted for a tensor peak of `allocated` bytes."""
        fixed = self.cublas_workspace_gib + self.stream_cache_gib
        return int(allocated * (1 + self.fragmentation) + fixed * GIB)


HEADROOM = Headroom()
