"""The layout of a job's ranks: its parallel axes, their degrees and their order, and the one formula
that places a rank on them.

Free of torch.distributed, so that the plan, the advisor, telemetry and the data stream read the same
arithmetic the ranks do; trainer/rank/mesh.py builds the job's one DeviceMesh from it. The axes,
outermost first, as torchtitan orders them (pytorch/torchtitan torchtitan/distributed/parallel_dims.py:
pp, dp_replicate, dp_shard, cp, tp):

    pp            pipeline stages (parallel.pp): a PP group strides over everything inside it, so a
                  pipeline spans nodes while the axes below stay inside one
    dp_replicate  data-parallel replicas holding the same states: DDP's ranks (zero=stage0/1), or
                  HSDP's replicate dim (zero.shard_ranks)
    dp_shard      FSDP2's shard dim (zero=stage2/3): every data-parallel rank, or zero.shard_ranks
    cp            context-parallel ranks (parallel.cp): each holds 1/cp of every sequence
    tp            tensor-parallel ranks (parallel.tp): innermost, so a TP group is consecutive ranks
                  inside one node

    rank = (((pp * dp_replicate_degree + dp_replicate) * dp_shard_degree + dp_shard) * cp_degree + cp)
           * tp_degree + tp

The data-parallel axes together ("dp") split the batch: the ranks of one TP group, of one CP group and of
one pipeline read the same samples. ZeRO works over dp and cp alike (torchtitan folds cp into FSDP's shard
dim): each cp rank's gradients are its own sequence chunks', so they are reduced over cp as over dp;
`zero_axes` names the axes. hpZ (zero.hpz_ranks) is not an axis of its own: FSDP2 keeps its secondary shards
over consecutive groups of FSDP2's shard group, dp_shard x cp (`group("hpz", rank)`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.config import TP_SPLIT_KEYS, ConfigError, ZeroConfig, check_composition, unchecked_replace

if TYPE_CHECKING:
    from trainer.config import ModelConfig, TrainConfig

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Every axis, outermost first."""
DP_AXES = ("dp_replicate", "dp_shard")
"""The data-parallel axes: the batch is split over both; ZeRO shards over dp_shard (FSDP2) or
dp_replicate (ZeroRedundancyOptimizer over DDP's ranks)."""


@dataclass(frozen=True)
class Group:
    """The ranks that share every coordinate but those of `axes` with one rank, in coordinate order."""

    axes: tuple[str, ...]
    members: tuple[int, ...]
    intra_node: bool
    """Whether every member sits on one node (ranks are numbered node by node)."""

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class Layout:
    """The degree of every axis, and how many ranks each node holds."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ranks_per_node: int | None = None
    """None: every rank on one node."""
    hpz: int | None = None
    """zero.hpz_ranks: FSDP2's secondary shard groups inside dp_shard, or None."""

    @classmethod
    def from_config(cls, config: TrainConfig, world_size: int) -> Layout:
        """The layout of `config` on `world_size` ranks, `config.nodes` nodes (whole shard and hpZ groups:
        ConfigError naming the key otherwise; `check_world` checks the rest before a job starts)."""
        tp, pp, cp = config.parallel.tp, config.parallel.pp, config.parallel.cp
        if world_size % (tp * pp * cp):
            context = f" * parallel.cp={cp}" if cp > 1 else ""
            raise ConfigError(
                f"parallel.pp={pp}{context} * parallel.tp={tp} must divide the world of {world_size} ranks (nodes * nproc)"
            )
        dp = world_size // (tp * pp * cp)
        replicate, shard, hpz = data_parallel_degrees(config.zero, dp, cp)
        per_node = world_size // config.nodes if config.nodes > 1 else None
        return cls(pp, replicate, shard, cp, tp, per_node, hpz)

    def degree(self, axis: str) -> int:
        return getattr(self, axis)

    def size(self, *axes: str) -> int:
        """The product of the degrees of `axes` ("dp": both data-parallel axes); of every axis when none."""
        return math.prod(self.degree(axis) for axis in expand(axes or AXES))

    @property
    def world_size(self) -> int:
        return self.size()

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def replicas(self) -> int:
        """The data-parallel replicas of a zero=stage0/1 model: dp x cp (a cp rank computes its own chunks, so
        its gradients are reduced like a replica's). DDP wraps a model only where there are several
        (trainer/rank/parallelize.py `replicas_to_wrap`), and the plan walks a step without it where there is one."""
        return self.size("dp", "cp")

    def enabled(self, axis: str) -> bool:
        return self.size(axis) > 1

    def coords(self, rank: int) -> dict[str, int]:
        """Where `rank` stands on every axis: the one formula (the module's docstring)."""
        out = {}
        for axis in reversed(AXES):
            rank, out[axis] = divmod(rank, self.degree(axis))
        return {axis: out[axis] for axis in AXES}

    def rank_at(self, **coords: int) -> int:
        """The global rank at `coords` (an axis left out: 0)."""
        rank = 0
        for axis in AXES:
            rank = rank * self.degree(axis) + coords.get(axis, 0)
        return rank

    def zero_axes(self, uses_fsdp: bool) -> tuple[str, ...]:
        """The axes ZeRO works over: FSDP2's shard dim folded with cp (HSDP's replicate dim before them),
        or DDP's replicas folded with cp; the axes of one rank left out, but never all of them."""
        axes = ("dp_replicate", "dp_shard", "cp") if uses_fsdp else ("dp_replicate", "cp")
        kept = tuple(axis for axis in axes if self.degree(axis) > 1)
        return kept or (axes[1] if uses_fsdp else axes[0],)

    def shard_size(self, uses_fsdp: bool = True) -> int:
        """The ranks one FSDP2 shard group holds: dp_shard x cp (DDP: 1, nothing sharded)."""
        return self.dp_shard * self.cp if uses_fsdp else 1

    def shard_index(self, rank: int) -> int:
        """The rank's place in its FSDP2 shard group (dp_shard, then cp): which shard it holds."""
        c = self.coords(rank)
        return c["dp_shard"] * self.cp + c["cp"]

    def dp_index(self, rank: int) -> int:
        """The rank's data-parallel index: which share of the batch it reads."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def group(self, axes: str | tuple[str, ...], rank: int) -> Group:
        """The group of `rank` along `axes` ("dp": both data-parallel axes; "hpz": its secondary shard
        group, consecutive members of its dp_shard group)."""
        names = expand((axes,) if isinstance(axes, str) else axes)
        if names == ("hpz",):
            return self.hpz_group(rank)
        at = self.coords(rank)
        sizes = [range(self.degree(axis)) for axis in names]
        members = tuple(self.rank_at(**{**at, **dict(zip(names, point))}) for point in product(sizes))
        return Group(names, members, self.on_one_node(members))

    def hpz_group(self, rank: int) -> Group:
        """`hpz` consecutive members of the rank's FSDP2 shard group, dp_shard x cp in the flattened mesh dim's
        order (trainer/rank/mesh.py): FSDP2 views that dim's ranks as (-1, hpz) (_fsdp_init.py)."""
        shard = self.group(("dp_shard", "cp"), rank).members
        width = self.hpz or len(shard)
        start = shard.index(rank) // width * width
        members = shard[start : start + width]
        return Group(("hpz",), members, self.on_one_node(members))

    def per_node(self, axes: str | tuple[str, ...]) -> int:
        """How many members of a group along `axes` share one node (rank 0's group, on rank 0's node):
        what a group's link depends on."""
        members = self.group(axes, 0).members
        return sum(self.node(rank) == self.node(0) for rank in members)

    def node(self, rank: int) -> int:
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def on_one_node(self, members: tuple[int, ...]) -> bool:
        return len({self.node(rank) for rank in members}) <= 1


def expand(axes: tuple[str, ...]) -> tuple[str, ...]:
    """Axis names with "dp" read as both data-parallel axes; an unknown name is our own error."""
    out: list[str] = []
    for axis in axes:
        out += DP_AXES if axis == "dp" else [axis]
    assert all(axis in (*AXES, "hpz") for axis in out), f"unknown axis in {axes}"
    return tuple(out)


def product(ranges: list[range]) -> list[tuple[int, ...]]:
    """Every point of `ranges`, the last varying fastest (the order of the ranks)."""
    points: list[tuple[int, ...]] = [()]
    for r in ranges:
        points = [(*point, i) for point in points for i in r]
    return points


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def data_parallel_degrees(zero: ZeroConfig, dp: int, cp: int = 1) -> tuple[int, int, int | None]:
    """(dp_replicate, dp_shard, hpz) of `zero` over `dp` data-parallel ranks; ConfigError (naming the
    key) for a size torch refuses. DDP's ranks (stage0/1) are replicas; FSDP2 shards over every dp rank,
    or over zero.shard_ranks of them with the groups replicated (HSDP). FSDP2's shard group folds in the
    `cp` ranks of each (Layout.zero_axes), HSDP's too: zero.shard_ranks counts dp ranks, a shard group is
    zero.shard_ranks x cp ranks (torchtitan's dp_shard x cp); hpZ's groups divide dp_shard x cp."""
    if not zero.uses_fsdp:
        return dp, 1, None
    shard = dp if zero.shard_ranks is None else zero.shard_ranks
    # beside cp, zero.shard_ranks counts data-parallel ranks and each shard group spans shard_ranks x cp ranks
    # (torchtitan's dp_shard degree; FSDP2's shard dim dp_shard_cp, trainer/rank/mesh.py)
    ranks, beside_cp = (f"the world ({dp} ranks)", f"the world size {dp}"), ""
    if cp > 1:
        ranks = (f"the {dp} data-parallel ranks",) * 2
        beside_cp = f"; beside parallel.cp={cp} a shard group is zero.shard_ranks x {cp} ranks"
    if shard > dp:
        raise ConfigError(
            f"zero.shard_ranks={shard} is larger than {ranks[0]}{beside_cp}; "
            f"allowed: a divisor of {dp}: {', '.join(map(str, divisors(dp)))}"
        )
    if dp % shard:
        raise ConfigError(
            f"zero.shard_ranks={shard} must divide {ranks[1]} (HSDP: whole shard groups{beside_cp}); "
            f"allowed: {', '.join(map(str, divisors(dp)))}"
        )
    hpz, group = zero.hpz_ranks, shard * cp
    if hpz is not None and (group % hpz or not 1 < hpz < group):
        allowed = [d for d in divisors(group) if 1 < d < group]
        raise ConfigError(
            f"zero.hpz_ranks={hpz} must divide the shard group of {group} ranks, other than 1 and {group} "
            f"(FSDP2 reshard_after_forward=<int>); allowed: {', '.join(map(str, allowed)) or 'none (hpZ needs a shard group of 4 or more ranks)'}"
        )
    return dp // shard, shard, hpz


def check_world(config: TrainConfig, nproc: int, nodes: int) -> None:
    """Before a job starts: a TP group is consecutive ranks inside one node (tp divides nproc), whole
    pipelines and TP groups fill the world, and DDP replicates no tensor-parallel parameters (torch's DDP
    holds them as local tensors), so zero=stage0 only with one data-parallel replica."""
    tp, pp, cp, zero = config.parallel.tp, config.parallel.pp, config.parallel.cp, config.zero
    allowed = ", ".join(str(d) for d in divisors(nproc))
    world = nodes * nproc
    if nproc % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide nproc={nproc} (a tensor-parallel group stays inside one node "
            f"of {nproc} ranks); allowed: {allowed}"
        )
    if world % (tp * pp):
        raise ConfigError(
            f"parallel.pp={pp} * parallel.tp={tp} must divide the world of {world} ranks (nodes * nproc); "
            f"allowed parallel.pp: {', '.join(str(d) for d in divisors(world // tp))}"
        )
    if world % (tp * pp * cp):
        raise ConfigError(
            f"parallel.cp={cp} must divide the {world // (tp * pp)} ranks of each parallel.pp={pp} x "
            f"parallel.tp={tp} layer of the world; allowed parallel.cp: {', '.join(map(str, divisors(world // (tp * pp))))}"
        )
    dp = world // (tp * pp * cp)
    check_expert_ranks(config, dp)
    # the table's rows that need the world (`ep_holds_the_experts`), asked again where nproc was auto
    if config.nproc != str(nproc) or config.nodes != nodes:
        check_composition(unchecked_replace(config, nproc=str(nproc), nodes=nodes))
    check_one_replica(zero, dp * cp)
    if not (tp == 1 or zero.uses_fsdp or dp * cp == 1):
        # The one tp leaving one replica, where it is a valid size (inside a node, dividing the model's heads).
        whole = [t for t in tp_sizes(config.model, nproc) if t * pp == world]
        raise ConfigError(
            f"parallel.tp={tp} with zero={zero.stage.value} on {dp * cp} data-parallel replicas is not supported (torch's "
            f"DDP holds tensor-parallel parameters as local tensors); use zero=stage2 or stage3"
            + "".join(f", or parallel.tp={t}" for t in whole)
        )


def check_one_replica(zero: ZeroConfig, replicas: int) -> None:
    """zero.compression and zero.sync_every change how replicas reduce their gradients: with one replica
    no DDP wraps the model (trainer/rank/parallelize.py `replicas_to_wrap`), so they would do nothing."""
    methods = [f"zero.compression={zero.compression.value}"] if zero.compression.value != "none" else []
    methods += [f"zero.sync_every={zero.sync_every}"] if zero.sync_every > 1 else []
    if replicas == 1 and methods:
        raise ConfigError(
            f"{' and '.join(methods)} {'changes' if len(methods) == 1 else 'change'} how data-parallel replicas "
            "reduce gradients, and this job has one "
            "replica (no DDP wraps it); use zero.compression=none and zero.sync_every=1, or more ranks"
        )


def check_expert_ranks(config: TrainConfig, dp: int) -> None:
    """parallel.ep > 1: the ep group is the group ZeRO works over (the `dp` data-parallel ranks times parallel.cp:
    `zero_axes`), or under FSDP2 (zero=stage2/3) a group of ep consecutive ranks inside it (torchtitan's
    dp_shard_in_ep, carved from dp_shard x cp as here), FSDP2 sharding each rank's experts over the ranks holding
    the same ones (trainer/rank/experts.py). DDP (zero=stage0) would all-reduce those over the same ranks, which is
    not yet built."""
    ep, cp = config.parallel.ep, config.parallel.cp
    ranks = dp * cp
    if ep == 1 or ep == ranks:
        return
    if config.zero.uses_fsdp and ranks % ep == 0:
        return
    what = f"{ranks} data-parallel x context-parallel ranks" if cp > 1 else f"{ranks} data-parallel ranks"
    if config.zero.uses_fsdp:
        raise ConfigError(f"parallel.ep={ep} must divide the {what}; allowed: a divisor of {ranks}")
    allowed = f"parallel.ep={ranks} (if it divides model.n_experts={config.model.n_experts}) or 1"
    raise ConfigError(
        f"parallel.ep={ep} must equal the {what} at zero={config.zero.stage.value} (an ep group "
        f"inside DDP's replicas is not yet built; zero=stage2 or stage3 take one); allowed: {allowed}"
    )


def tp_sizes(model: ModelConfig, nproc: int) -> list[int]:
    """The parallel.tp sizes allowed on nodes of `nproc` ranks: a group inside one node, dividing the
    model's heads, kv heads, ffn_dim and vocabulary (ParallelConfig.check_model)."""
    return [t for t in divisors(nproc) if all(getattr(model, key) % t == 0 for key in TP_SPLIT_KEYS)]
