"""The job's one device mesh, built from its layout (trainer/layout.py), and each technique's part of it.

Every technique takes its sub-mesh by name: tensor parallelism `mesh["tp"]`, the pipeline `mesh["pp"]`,
DDP `mesh["dp_replicate"]`, FSDP2 `mesh["dp_shard"]` or, under HSDP, `mesh["dp_replicate", "dp_shard"]`
(FSDP2 replicates over the first dim and shards over the second). The mesh's dims are the layout's axes
that have more than one rank, and always the data-parallel axis ZeRO works over: an axis of one rank
still gives DDP or FSDP2 its (trivial) group, and an axis that is not needed is not built, so that no
process group exists that carries nothing. A dim spanning the whole world reuses the default group
(DeviceMesh does), so a plain data-parallel job runs its collectives on the default group as before.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ZeroConfig
from trainer.layout import AXES, Layout


def zero_axes(layout: Layout, zero: ZeroConfig) -> tuple[str, ...]:
    """The mesh dims ZeRO works over: FSDP2's shard dim (with HSDP's replicate dim before it), or DDP's
    replicas."""
    if not zero.uses_fsdp:
        return ("dp_replicate",)
    return ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)


def build_mesh(layout: Layout, device_type: str, zero: ZeroConfig) -> DeviceMesh:
    """The one mesh of this job: the layout's axes in its order, those of one rank left out unless ZeRO
    works over them."""
    needed = set(zero_axes(layout, zero))
    dims = [axis for axis in AXES if layout.degree(axis) > 1 or axis in needed]
    return init_device_mesh(
        device_type, tuple(layout.degree(axis) for axis in dims), mesh_dim_names=tuple(dims)
    )


def data_parallel_mesh(mesh: DeviceMesh, layout: Layout, zero: ZeroConfig) -> DeviceMesh:
    """The sub-mesh ZeRO replicates or shards over (zero_axes)."""
    axes = zero_axes(layout, zero)
    return mesh[axes[0]] if len(axes) == 1 else mesh[axes]
