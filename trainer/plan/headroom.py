"""What a CUDA rank needs beyond the tensors the plan walks: the headroom, by stated assumption.

The plan's peak is tensor memory (what `torch.cuda.max_memory_allocated` reports). A GPU also
holds, per rank:

- outside the caching allocator (so outside `device_memory_gib`'s cap, which is a fraction of
  the allocator's reserved memory): the CUDA context with its loaded kernels, and NCCL's
  communicator buffers (one communicator per process group; none with one rank);
- inside it: cuBLAS's workspace (torch allocates it through the caching allocator, once per
  stream) and fragmentation, the gap between reserved and allocated.

The figures below are assumptions, not measurements: the CUDA context of torch 2.x with lazy
module loading on Hopper is about 0.5 GiB; NCCL with its default buffer size (4 MiB per
channel and peer) about 0.5 GiB on one 8-GPU node; torch's cuBLAS workspace on Hopper 32 MiB;
with expandable segments (trainer/rank/cuda.py sets them) reserved stays within about 5% of
allocated. benchmarks/gpu_check.py measures the first three on the GPU (its `headroom` row) and
the last in its throughput rows (peak reserved against peak allocated): replace the assumptions
with those figures once it has run.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.units import GIB


@dataclass(frozen=True)
class Headroom:
    """A CUDA rank's memory beyond its tensors (assumptions; see the module docstring)."""

    context_gib: float = 0.5
    """CUDA context and kernel images, per process: outside the allocator."""
    nccl_gib: float = 0.5
    """NCCL communicator buffers when the job has more than one rank: outside the allocator."""
    cublas_workspace_gib: float = 1 / 32
    """cuBLAS workspace (32 MiB): inside the allocator."""
    fragmentation: float = 0.05
    """Reserved over allocated, minus 1, with expandable segments: inside the allocator."""

    def outside_allocator(self, world_size: int) -> int:
        """Bytes a rank's device holds that the caching allocator does not manage."""
        return int((self.context_gib + (self.nccl_gib if world_size > 1 else 0.0)) * GIB)

    def reserved(self, allocated: int) -> int:
        """The allocator's reserved memory predicted for a tensor peak of `allocated` bytes."""
        return int(allocated * (1 + self.fragmentation) + self.cublas_workspace_gib * GIB)


HEADROOM = Headroom()
