"""The job's one device mesh, built from its layout (trainer/layout.py), and each technique's part of it.

Every technique takes its sub-mesh by name: tensor parallelism `mesh["tp"]`, the pipeline `mesh["pp"]`,
DDP `mesh["dp_replicate"]`, FSDP2 `mesh["dp_shard"]` or, under HSDP, `mesh["dp_replicate", "dp_shard"]`
(FSDP2 replicates over the first dim and shards over the second), context parallelism `mesh["cp"]`.
Under parallel.cp ZeRO works over cp too: its dim is folded with dp_shard (FSDP2) or dp_replicate (DDP)
into one flattened dim, `dp_shard_cp` or `dp_replicate_cp` (torchtitan's `dp_shard_cp`). The mesh's dims are the layout's axes
that have more than one rank, and always the data-parallel axis ZeRO works over: an axis of one rank
still gives DDP or FSDP2 its (trivial) group, and an axis that is not needed is not built, so that no
process group exists that carries nothing. A dim spanning the whole world reuses the default group
(DeviceMesh does), so a plain data-parallel job runs its collectives on the default group as before.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ZeroConfig
from trainer.layout import AXES, Layout
from trainer.private_apis.of_torch import flatten_mesh


def build_mesh(layout: Layout, device_type: str, zero: ZeroConfig) -> DeviceMesh:
    """The one mesh of this job: the layout's axes in its order, those of one rank left out unless ZeRO
    works over them."""
    needed = set(layout.zero_axes(zero.uses_fsdp))
    dims = [axis for axis in AXES if layout.degree(axis) > 1 or axis in needed]
    return init_device_mesh(
        device_type, tuple(layout.degree(axis) for axis in dims), mesh_dim_names=tuple(dims)
    )


def data_parallel_mesh(mesh: DeviceMesh, layout: Layout, zero: ZeroConfig) -> DeviceMesh:
    """The sub-mesh ZeRO replicates or shards over (Layout.zero_axes): one dim, HSDP's two (replicate,
    shard), or cp folded with the data-parallel dim into one (HSDP with cp is refused: the table)."""
    axes = layout.zero_axes(zero.uses_fsdp)
    if len(axes) == 1:
        return mesh[axes[0]]
    if "cp" in axes:
        return flatten_mesh(mesh[axes], "_".join(axes))
    return mesh[axes]


def secondary_mesh(layout: Layout, device_type: str) -> DeviceMesh | None:
    """hpZ under a pipeline: the mesh FSDP2 keeps each block's secondary shard over, `dp_mesh.mesh.view(-1, H)` of
    this rank's stage (H = zero.hpz_ranks; trainer/private_apis/of_torch.py `prebuilt_secondary_mesh` says why
    FSDP2 cannot build it itself), made by every rank at once over the world (pp, dp / H, H); None elsewhere.
    hpZ does not compose with tp, nor with cp under a pipeline (the composition table), so a stage's dp ranks are
    consecutive."""
    if layout.hpz is None or not layout.enabled("pp"):
        return None
    assert layout.tp == layout.cp == 1, layout
    shape = (layout.pp, layout.dp // layout.hpz, layout.hpz)
    world = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "hpz_rows", "hpz"))
    return world["hpz_rows", "hpz"]
