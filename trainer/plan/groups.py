"""The process groups a job's collectives run in, and which link each one crosses.

FSDP2 shards over the shard dim of its device mesh and replicates over the other
(torch/distributed/fsdp/_fully_shard/_fully_shard.py, `mesh` in fully_shard's docstring: a 2-D mesh
gives HSDP with `(Replicate(), Shard(0))`). zerolab's layout names the two dims `(dp_replicate, dp_shard)` =
`(world / zero.shard_ranks, zero.shard_ranks)` (trainer/layout.py; the mesh: trainer/rank/mesh.py), so a shard group is
`shard_ranks` consecutive global ranks (one node when shard_ranks = nproc) and a replicate group
takes one rank of each shard group. Under parallel.cp, zero.shard_ranks still counts dp ranks and cp folds into
each shard group (the mesh's `(dp_replicate, dp_shard_cp)`, torchtitan's): `shard_ranks x cp` ranks. torchtitan calls the two degrees `data_parallel_replicate_degree`
and `data_parallel_shard_degree` (pytorch/torchtitan docs/fsdp.md maps the 2-D mesh to MiCS).

hpZ (ZeRO++): `fully_shard(reshard_after_forward=H)` keeps, after each block's forward, a secondary
shard over groups of H consecutive ranks; torch builds that post-forward mesh as
`mesh.mesh.view(-1, H)` (_fsdp_init.py, `_get_post_forward_mesh_info`) and requires H to be a
"non-trivial divisor of the mesh shard dim size (i.e. excluding 1 and the dim size itself)"
(fully_shard's docstring), which `shard_groups` checks before any rank starts.

Groups, by the names plan.json, metrics.jsonl and the advisor use:
    shard      FSDP2's all-gathers and reduce-scatters (the whole world without HSDP)
    replicate  HSDP's all-reduce of each gradient shard across shard groups
    hpz        stage3 backward's all-gathers from the secondary shards
    world      every rank: DDP's collectives (stages 0-1) and, under HSDP, the loop's own flags
    cp         parallel.cp: the context-parallel exchanges of activations (trainer/plan/comm.py `cp_moves`:
               Ulysses' all-to-alls, or the K/V all-gather and its reduce-scatter); `cp` ranks `tp` apart.
               ZeRO's groups span dp x cp ranks (FSDP2 shards over dp_shard x cp, DDP replicates over
               dp_replicate x cp: trainer/layout.py `zero_axes`); at dp = 1 the cp group and ZeRO's are one
               process group, which telemetry splits by what each collective moves (trainer/telemetry/comm.py)
    tp         parallel.tp: the tensor-parallel layers' all-gathers, reduce-scatters and all-reduces of
               activations (trainer/plan/tensor_parallel.py); `tp` consecutive ranks, inside one node
    ep         parallel.ep: the MoE layers' all-to-alls of the counts and rows (trainer/plan/comm.py `ep_moves`);
               the ep group is ZeRO's, FSDP2's shard group or DDP's `world` (trainer/rank/experts.py), so one process group that
               telemetry splits by kind: its all-to-alls are ep's (trainer/telemetry/comm.py); or, ep < dp x cp under
               FSDP2, `ep` consecutive ranks of the shard group (trainer/rank/mesh.py `expert_mesh`), a group of its own
    expert_shard  ep < dp x cp under FSDP2: the ranks holding the same experts, every ep-th of the shard group, over
               which FSDP2 all-gathers and reduce-scatters them (torchtitan's dp_shard_mod_ep)
    pp         parallel.pp: a pipeline's ranks (the mesh's pp dim, striding over everything inside it): the
               all-reduces of the step's loss and squared gradient norm (trainer/plan/comm.py
               `PIPELINE_MOVES`); the sends between its stages are `comm.p2p`, not collectives
Under a pipeline (parallel.pp > 1) DDP runs over the mesh's dp_replicate dim, not every rank: `world` then
names the data-parallel world (`ShardGroups.world` counts data-parallel ranks), and telemetry names that
dim's group alike (trainer/telemetry/comm.py `group_names`).
A group lies inside one node when its ranks all sit on one (ranks are numbered node by node,
`nproc` per node); else it crosses the network, the slowest link it uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ZeroConfig
from trainer.layout import data_parallel_degrees

GROUPS = ("world", "shard", "replicate", "hpz", "tp", "cp", "pp", "ep", "expert_shard")
"""Every group name, in the order metrics list them."""
INTRA_NODE, NETWORK = "intra-node", "network"
LINKS = (INTRA_NODE, NETWORK)


@dataclass(frozen=True)
class ShardGroups:
    """Sizes of a job's groups: `world` ranks, `ranks_per_node` on each node."""

    world: int
    ranks_per_node: int
    shard: int
    hpz: int | None = None
    tp: int = 1
    """parallel.tp: `world` counts data-parallel replicas then, each `tp` consecutive ranks."""
    cp: int = 1
    """parallel.cp: `world` (and `shard`, FSDP2's) count dp x cp ranks, ZeRO's (trainer/layout.py `zero_axes`)."""
    ep: int = 1
    """parallel.ep inside FSDP2's shard group (ep < shard): the ep group's size; 1 elsewhere (the ep group, where
    there is one, is ZeRO's own)."""

    @property
    def replicate(self) -> int:
        return self.world // self.shard

    @property
    def hsdp(self) -> bool:
        return self.replicate > 1

    def size(self, group: str) -> int:
        sizes = {"world": self.world, "shard": self.shard, "replicate": self.replicate, "hpz": self.hpz or 1}
        sizes |= {"ep": self.ep, "expert_shard": self.shard // self.ep}
        return self.tp if group == "tp" else sizes[group]

    def link(self, group: str) -> str:
        """intra-node when every rank of the group is on one node, else network.

        shard and hpz groups are consecutive ranks (inside a node when they fit in one and the node's
        ranks split evenly into them); a replicate group strides by the shard size from one end of the
        world to the other, so it crosses the network whenever the world does.
        """
        size, per_node = self.size(group), self.ranks_per_node
        if group == "tp":  # parallel.tp divides nproc: consecutive ranks of one node
            return INTRA_NODE
        if size <= 1 or self.world <= per_node:
            return INTRA_NODE
        if group in (
            "replicate",
            "expert_shard",
        ):  # strided: rank k and k + world - shard (or k + shard - ep)
            return NETWORK
        return INTRA_NODE if size <= per_node and per_node % size == 0 else NETWORK

    def nccl_communicators(self, hpz_modules: int) -> int:
        """NCCL communicators that carry traffic on one rank, each holding its own buffers.

        NCCL creates a communicator at a group's first collective, so a group that moves nothing
        costs nothing, except the default group's, which init_process_group(device_id=...) creates at
        once, one rank alone too (trainer/world.py). With more than one rank: the default group (DDP, the loop's agreements, and
        FSDP2's 1-D mesh over every rank, which DeviceMesh takes as the default group); HSDP's 2-D
        mesh adds its shard and replicate groups; hpZ adds one per module sharded with
        reshard_after_forward=<int> (`hpz_modules`): FSDP2 builds each such module a DeviceMesh of
        its own (torch/distributed/fsdp/_fully_shard/_fsdp_init.py `_get_post_forward_mesh_info`),
        whose hpz dimension carries backward's all-gathers. Under a pipeline every block shares one such mesh,
        made by every rank at once (trainer/rank/mesh.py `secondary_mesh`): one there.
        """
        tp = 1 if self.tp > 1 else 0  # the TP mesh dim's group
        # the cp dim's group, where it is not ZeRO's: dp > 1, and under HSDP zero.shard_ranks > 1 (the shard
        # group, shard_ranks x cp ranks, is cp's own at shard_ranks=1)
        cp = 1 if 1 < self.cp < min(self.world, self.shard) else 0
        experts = 2 if self.ep > 1 else 0  # ep inside the shard group: the expert mesh's two dims
        if self.world <= 1:
            return 1  # the default group's: init_process_group(device_id=...) makes it at once (trainer/world.py)
        return 1 + (2 if self.hsdp else 0) + (hpz_modules if self.hpz is not None else 0) + tp + cp + experts


def shard_groups(
    zero: ZeroConfig,
    world_size: int,
    ranks_per_node: int | None = None,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
) -> ShardGroups:
    """The groups of `zero` on `world_size` ranks; ConfigError (naming the key) for a size torch refuses.
    Under parallel.tp, `world_size` and `ranks_per_node` count data-parallel replicas (a TP group is one
    node's `tp` consecutive ranks, so the dp groups' links are those of replicas numbered node by node);
    under parallel.cp they count dp x cp ranks, the ranks ZeRO works over, and FSDP2's shard group is
    zero.shard_ranks x cp of them (HSDP's shard dim `dp_shard_cp`: trainer/rank/mesh.py). `ep`: parallel.ep, kept
    where its group lies inside FSDP2's shard group."""
    per_node = ranks_per_node or world_size
    # the checks torch would make, before any rank: zero.shard_ranks counts dp ranks, cp folds into each group
    _, shard, hpz = data_parallel_degrees(zero, world_size // cp, cp)
    shard *= cp
    if not zero.uses_fsdp:
        shard = world_size  # DDP's group is the plan's shard group too: every rank of `world_size`
    inside = ep if zero.uses_fsdp and 1 < ep < shard else 1
    return ShardGroups(world_size, per_node, shard, hpz, tp, cp, inside)
