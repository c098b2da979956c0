"""The job's one device mesh, built from its layout (trainer/layout.py), and each technique's part of it.

Every technique takes its sub-mesh by name: tensor parallelism `mesh["tp"]`, the pipeline `mesh["pp"]`,
DDP `mesh["dp_replicate"]`, FSDP2 `mesh["dp_shard"]` or, under HSDP, `mesh["dp_replicate", "dp_shard"]`
(FSDP2 replicates over the first dim and shards over the second), context parallelism `mesh["cp"]`.
Under parallel.cp ZeRO works over cp too: its dim is folded with dp_shard (FSDP2) or dp_replicate (DDP)
into one flattened dim, `dp_shard_cp` or `dp_replicate_cp` (torchtitan's `dp_shard_cp`); under HSDP
with cp, FSDP2's mesh is `("dp_replicate", "dp_shard_cp")`, cp folded into the shard dim only. The mesh's dims are the layout's axes
that have more than one rank, and always the data-parallel axis ZeRO works over: an axis of one rank
still gives DDP or FSDP2 its (trivial) group, and an axis that is not needed is not built, so that no
process group exists that carries nothing. A dim spanning the whole world reuses the default group
(DeviceMesh does), so a plain data-parallel job runs its collectives on the default group as before.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ZeroConfig
from trainer.layout import AXES, Layout
from trainer.private_apis.of_torch import concatenate_meshes, flatten_mesh


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
    shard), or cp folded with the data-parallel dim into one; under HSDP cp folds into the shard dim
    (`dp_shard_cp`, or cp itself at zero.shard_ranks=1), the replicate dim stays its own."""
    axes = layout.zero_axes(zero.uses_fsdp)
    if len(axes) == 1:
        return mesh[axes[0]]
    hsdp = zero.uses_fsdp and axes[0] == "dp_replicate"
    if hsdp and len(axes) == 3:
        # HSDP with cp: FSDP2 replicates over dim 0 and shards over dim 1, so cp folds into the shard dim alone
        # (torchtitan's ("dp_replicate", "dp_shard_cp"))
        flat = flatten_mesh(mesh[axes[1:]], "_".join(axes[1:]))
        return concatenate_meshes(mesh, [mesh["dp_replicate"], flat])
    if "cp" in axes and not hsdp:  # HSDP at zero.shard_ranks=1 shards over cp itself: (dp_replicate, cp)
        return flatten_mesh(mesh[axes], "_".join(axes))
    return mesh[axes]


def secondary_mesh(layout: Layout, device_type: str) -> DeviceMesh | None:
    """hpZ under a pipeline: the mesh FSDP2 keeps each block's secondary shard over, `dp_mesh.mesh.view(-1, H)` of
    this rank's stage (H = zero.hpz_ranks; trainer/private_apis/of_torch.py `prebuilt_secondary_mesh` says why
    FSDP2 cannot build it itself), made by every rank at once over the world (pp, dp·cp / H, H); None elsewhere.
    hpZ does not compose with tp (the composition table), so a stage's shard group, its dp ranks with cp folded in
    (`data_parallel_mesh`), is consecutive ranks, and so is each secondary group."""
    if layout.hpz is None or not layout.enabled("pp"):
        return None
    assert layout.tp == 1, layout
    shape = (layout.pp, layout.dp * layout.cp // layout.hpz, layout.hpz)
    world = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "hpz_rows", "hpz"))
    return world["hpz_rows", "hpz"]


def expert_mesh(layout: Layout, device_type: str, ep: int) -> DeviceMesh | None:
    """parallel.ep inside ZeRO's ranks (ep < dp x cp, zero=stage2/3): a mesh of its own over the world,
    (dp x cp / ep, ep), named ("expert_shard", "ep"): each ep group is ep consecutive ranks of FSDP2's shard dim
    (dp_shard then cp: under cp a group may be a sample's cp ranks, whose tokens route alike), and FSDP2 shards
    their experts over "expert_shard", the ranks holding the same ones (torchtitan's dp_shard_mod_ep x
    dp_shard_in_ep). One root for both dims, as FSDP2 requires of a parameter sharded already (the experts'
    DTensors on "ep"). A mixture of experts takes no tp or pp (the composition table), so the world is ZeRO's
    ranks. None where ep is 1 or all of ZeRO's ranks (the job mesh's own dim serves)."""
    ranks = layout.dp * layout.cp
    if ep == 1 or ep == ranks:
        return None
    assert layout.world_size == ranks, layout
    return init_device_mesh(device_type, (ranks // ep, ep), mesh_dim_names=("expert_shard", "ep"))
