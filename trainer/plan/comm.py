"""The communication plan: the bytes each rank's collectives move per optimizer step, before launch.

ZeRO buys memory with communication. This module predicts the payload of every collective one
rank takes part in during one optimizer step, as torch's own implementations issue them and as
c10d's flight recorder records them (trainer/telemetry/comm.py measures the same quantity):

- payload = the bytes of the full (unsharded) tensor a collective reads or writes: an all-reduce's
  buffer, an all-gather's output, a reduce-scatter's input, a broadcast's tensor. What crosses the
  wire is a multiple of it that depends on the algorithm (a ring all-reduce sends 2(N-1)/N of it
  per rank, a ring all-gather or reduce-scatter (N-1)/N); the plan states payloads.
- stage0 (DDP): one all-reduce of every gradient per reduction, in fp32, or in bf16 under torch's
  bf16_compress_hook (zero.reduce_dtype=bf16). Buckets (zero.bucket_cap_mb) change how many
  all-reduces, not their bytes.
- Reductions per optimizer step (`reductions`): zero.reduce_every=step reduces once, in the last
  micro-batch (DDP no_sync, FSDP2 set_requires_gradient_sync(False) before it); micro_batch reduces
  in every backward, grad_accum times.
- stage1 (DDP + ZeroRedundancyOptimizer): the same all-reduce, then each parameter broadcast from
  the rank that stepped it: 4 bytes per parameter (fp32 master weights).
- stage2/3 (FSDP2): per micro-batch, one all-gather of the root (embeddings, final norm, output
  head) and of each block in forward, in the compute dtype (param_dtype), each parameter's dim 0
  padded to a multiple of N; stage3 gathers every block again in backward (the root is not
  re-sharded after forward, trainer/rank/sharding.py). FSDP2 re-shards after every backward, so each
  micro-batch gathers afresh, unless zero.reshard_after_backward=false keeps every group unsharded
  from one micro-batch's backward to the next forward (`forward_gathers`): then only the first
  micro-batch's forward gathers (the root and every block); stage3's backward gathers stay, as its
  blocks still re-shard after each forward. Per reduction (every micro-batch's under zero.reduce_every=micro_batch,
  else the last one's), one reduce-scatter of the root and of each block in zero.reduce_dtype, on
  the same padded sizes.
- FSDP2 on one rank issues no collective: unshard copies the sharded parameter into the unsharded
  one and foreach_reduce copies the reduce-scatter input to its output (torch/distributed/fsdp/
  _fully_shard/_fsdp_param_group.py and _fsdp_collectives.py, `world_size == 1`), so it plans 0 bytes.
- HSDP (zero.shard_ranks) pads to the shard group and adds, per reduction, an all-reduce of each
  gradient shard across the groups; hpZ (zero.hpz_ranks) moves stage3 backward's all-gathers into
  the secondary groups. `CommPlan.groups` gives the bytes per process group and the link each
  crosses (trainer/plan/groups.py).
- gloo has no reduce-scatter of its own: ProcessGroupGloo runs `reduce_scatter_tensor` as an
  all-reduce of the whole input (and records it as one), so on gloo the reduce-scatter payload
  is planned, and measured, under `all_reduce`.

- parallel.cp > 1 (trainer/model/context_parallel.py): ZeRO works over dp x cp (trainer/layout.py `zero_axes`:
  FSDP2 shards over dp_shard x cp, padding every dim 0 to that many ranks; DDP replicates over dp_replicate
  x cp), and the cp group exchanges activations per block and micro-batch (`cp_moves`), in `groups["cp"]`.

- parallel.ep > 1 (trainer/rank/experts.py): FSDP2 or DDP leaves the experts' stacked weights alone (no
  all-gather, reduce-scatter or all-reduce of them), and every MoE layer's dispatch runs all-to-alls over the ep
  group, which is ZeRO's data-parallel group, FSDP2's shard group or DDP's (`ep_moves`), in `groups["ep"]`, per
  ep rank (its experts' rows differ; under cp a rank routes its own T / cp positions). An ep group inside FSDP2's
  shard group (ep < dp x cp) is a group of its own, and FSDP2 gathers and reduce-scatters each rank's experts over
  the ranks holding the same ones (`expert_shard_moves`, in `groups["expert_shard"]`).

- parallel.pp > 1: the pipeline's own all-reduces over its pp group, every step: the step's fp32 loss
  (the last stage's, on every stage: trainer/rank/pipeline.py) and the fp32 squared gradient norm
  (trainer/rank/optim.py `clip_gradients`), 4 bytes each (`PIPELINE_MOVES`), in `groups["pp"]`.

Left out, by design: the other scalar collectives the training loop issues itself (trainer/telemetry/comm.py
LOOP_COLLECTIVES names them) and one-time ones (DDP's parameter broadcast at construction, its
bucket rebuild after the first step).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from trainer.config import (
    BalanceLoss,
    Compression,
    DType,
    ReduceDType,
    ReduceEvery,
    Stage,
    TrainConfig,
    ZeroConfig,
    unchecked_replace,
)
from trainer.layout import Layout
from trainer.model.fp8 import converted_weight_numel
from trainer.plan.activations import precisions
from trainer.plan.context_parallel import cp_local
from trainer.plan.groups import INTRA_NODE, NETWORK, ShardGroups, shard_groups
from trainer.plan.moe import expert_local_shapes, expert_rows, expert_shapes
from trainer.plan.pipeline import (
    P2PPlan,
    plan_p2p,
    rank_stages,
    stage_blocks,
    stage_config,
    stage_model_shape,
)
from trainer.plan.states import ModelShape, model_shape, padded_numel, with_experts
from trainer.plan.target import planned_device_kind
from trainer.plan.tensor_parallel import recomputed_blocks, tp_local, tp_moves
from trainer.private_apis.of_torch import ddp_default_bucket_cap_mb
from trainer.units import MIB

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
"""The kinds of collective the plan and the measurement name (metric keys use these names)."""

PARAM_BYTES = {DType.float32: 4, DType.bfloat16: 2, DType.float16: 2}
REDUCE_BYTES = {ReduceDType.fp32: 4, ReduceDType.bf16: 2}
MASTER_BYTES = 4  # fp32 master weights, what ZeroRedundancyOptimizer broadcasts
MIN_COMPRESSION_RATE = 2.0
"""PowerSGDState's default min_compression_rate, which trainer/rank/compression.py passes: a matrix is
compressed only where (n + m) * rank * rate < n * m (powerSGD_hook.py `_should_compress`)."""


def fp8_gathered_numel(config: TrainConfig) -> int:
    """precision.fp8_all_gather: the elements of one block FSDP2 all-gathers in float8, 1 byte each instead of the
    compute dtype's: its converted linears' weights (torchao's WeightWithDynamicFloat8CastTensor casts its shard
    before the all-gather, and the unsharded weight is a Float8TrainingTensor over the gathered bytes:
    torchao/float8/fsdp_utils.py `fsdp_pre_all_gather`, `fsdp_post_all_gather`); 0 otherwise. `config` may be
    one TP rank's job: its local linears, as autocast_casts counts them (trainer/plan/tp_walk.py)."""
    precision = config.precision
    if not (precision.is_fp8 and precision.fp8_all_gather):
        return 0
    return converted_weight_numel(config.model, precision)


def gathered_block_bytes(config: TrainConfig, numel: int) -> int:
    """The bytes FSDP2 all-gathers, and holds unsharded, for `numel` elements of one block: the compute dtype's,
    but 1 byte for each weight precision.fp8_all_gather gathers in float8 (`fp8_gathered_numel`)."""
    param = PARAM_BYTES[config.precision.compute_dtype]
    return param * numel - (param - 1) * fp8_gathered_numel(config)


@dataclass(frozen=True)
class CommPlan:
    """Payload bytes one rank's collectives move per optimizer step, by kind of collective."""

    bytes_by_collective: dict[str, int]
    """all_reduce, all_gather, reduce_scatter, broadcast, all_to_all -> payload bytes per rank per optimizer step."""
    calls_by_collective: dict[str, int]
    """How many collectives of each kind per optimizer step (sizes the flight recorder's buffer)."""
    backend: str
    """gloo or nccl: gloo records a reduce-scatter as an all-reduce."""
    groups: dict[str, GroupComm] = field(default_factory=dict)
    """The same bytes split by process group (trainer/plan/groups.py: shard, replicate, hpz, world, tp, cp, pp)."""
    p2p: P2PPlan | None = None
    """parallel.pp > 1: the sends between stages (trainer/plan/pipeline.py), not in `total` (no collective)."""

    @property
    def total(self) -> int:
        return sum(self.bytes_by_collective.values())

    @property
    def calls(self) -> int:
        return sum(self.calls_by_collective.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "bytes_per_step": self.total,
            "bytes_by_collective": dict(self.bytes_by_collective),
            "calls_by_collective": dict(self.calls_by_collective),
            "groups": {name: group.to_json() for name, group in self.groups.items()},
            **({"p2p": self.p2p.to_json()} if self.p2p is not None else {}),
        }


@dataclass(frozen=True)
class GroupComm:
    """One process group's share of a rank's collectives per optimizer step, and the link it crosses."""

    ranks: int
    link: str  # intra-node or network (trainer/plan/groups.py)
    bytes_by_collective: dict[str, int]
    calls_by_collective: dict[str, int]
    per_stage: tuple[dict[str, int], ...] = ()
    """parallel.pp > 1: bytes by collective of each pipeline rank, whose stages differ (the figures above are
    pipeline rank 0's)."""
    exchange: dict[str, Any] | None = None
    """The cp group: one block's exchange per micro-batch and direction (`cp_exchange_json`)."""
    per_rank: tuple[dict[str, int], ...] = ()
    """The ep group: bytes by collective of each ep rank, whose experts' rows differ (the figures above are ep
    rank 0's, the busiest under moe.imbalance)."""

    @property
    def total(self) -> int:
        return sum(self.bytes_by_collective.values())

    def to_json(self) -> dict[str, Any]:
        stages = {"bytes_by_collective_per_stage": list(self.per_stage)} if self.per_stage else {}
        exchange = {"exchange": self.exchange} if self.exchange is not None else {}
        ranks = {"bytes_by_collective_per_rank": list(self.per_rank)} if self.per_rank else {}
        return {
            "ranks": self.ranks,
            "link": self.link,
            "bytes_per_step": self.total,
            "bytes_by_collective": dict(self.bytes_by_collective),
            "calls_by_collective": dict(self.calls_by_collective),
            **stages,
            **exchange,
            **ranks,
        }


def plan_comm(config: TrainConfig, world_size: int, backend: str | None = None) -> CommPlan:
    """Bytes per rank per optimizer step; backend None: nccl when the job plans for a GPU, else gloo."""
    if backend is None:
        backend = "nccl" if planned_device_kind(config.plan, config.device) == "cuda" else "gloo"
    tp, pp = config.parallel.tp, config.parallel.pp
    pipeline = pipeline_group(config, world_size, backend) if pp > 1 else None
    config = tp_local(config)  # one TP rank's layers; zero works over the dp ranks
    shape = model_shape(config.model)
    p2p = plan_p2p(config, world_size, precisions(config.precision, config.zero).residual) if pp > 1 else None
    per_stage = tp_per_stage(config, backend) if pp > 1 and tp > 1 else ()
    dp_stages = (
        [dp_moves(*pipelined(config, shape, rank), world_size) for rank in range(pp)] if pp > 1 else []
    )
    # parallel.cp under a pipeline: each pipeline rank's cp group exchanges for its own stages' blocks
    cp_stages = (
        tuple(
            context_group(pipelined(config, shape, rank)[0], world_size, backend).bytes_by_collective
            for rank in range(pp)
        )
        if pp > 1 and config.parallel.cp > 1
        else ()
    )
    if pp > 1:
        config, shape = pipelined(config, shape, 0)
    by_group = dp_moves(config, shape, world_size)
    if tp > 1:
        by_group["tp"] = tp_moves(
            config, PARAM_BYTES[config.precision.compute_dtype], backend, head=config.parallel.stages == 1
        )
    bytes_by, calls_by = dict.fromkeys(COLLECTIVES, 0), dict.fromkeys(COLLECTIVES, 0)
    plans = {}
    groups = data_parallel_groups(config, world_size)
    for name, moves in by_group.items():
        group_bytes, group_calls = tally(moves, backend)
        stages = per_stage if name == "tp" else tuple(tally(by[name], backend)[0] for by in dp_stages)
        plans[name] = GroupComm(groups.size(name), groups.link(name), group_bytes, group_calls, stages)
    if config.parallel.cp > 1:
        plans["cp"] = dataclasses.replace(context_group(config, world_size, backend), per_stage=cp_stages)
    if config.parallel.ep > 1:
        plans["ep"] = expert_group(config, backend, groups)
    if pipeline is not None:
        plans["pp"] = pipeline
    for group in plans.values():
        for kind in COLLECTIVES:
            bytes_by[kind] += group.bytes_by_collective[kind]
            calls_by[kind] += group.calls_by_collective[kind]
    return CommPlan(bytes_by, calls_by, backend, plans, p2p)


PIPELINE_MOVES: list[Move] = [("all_reduce", 4, 1), ("all_reduce", 4, 1)]
"""parallel.pp > 1, per step over the pp group: the fp32 loss, the fp32 squared gradient norm."""


def pipeline_group(config: TrainConfig, world_size: int, backend: str) -> GroupComm:
    """The pp group (trainer/plan/groups.py): `parallel.pp` ranks, on one node or across the network."""
    members = Layout.from_config(config, world_size).group("pp", 0)
    group_bytes, group_calls = tally(PIPELINE_MOVES, backend)
    return GroupComm(
        config.parallel.pp, INTRA_NODE if members.intra_node else NETWORK, group_bytes, group_calls
    )


def data_parallel_groups(config: TrainConfig, world_size: int) -> ShardGroups:
    """ZeRO's groups: over the dp ranks times cp (trainer/layout.py `zero_axes`), `ranks_per_node` of them
    on a node."""
    cp = config.parallel.cp
    zero_world = config.parallel.dp(world_size) * cp
    layout = Layout.from_config(config, world_size)
    per_node = layout.per_node(("dp", "cp"))
    return shard_groups(config.zero, zero_world, per_node, config.parallel.tp, cp, config.parallel.ep)


def dp_moves(config: TrainConfig, shape: ModelShape, world_size: int) -> dict[str, list[Move]]:
    """The data-parallel groups' collectives of `config` (one TP rank's job, or one pipeline rank's)."""
    if config.zero.uses_fsdp:
        return fsdp_group_moves(config, shape, data_parallel_groups(config, world_size))
    if config.parallel.tp > 1 or config.parallel.dp(world_size) * config.parallel.cp == 1:
        return {}  # one data-parallel replica (trainer/layout.py check_world): DDP is not applied
    if config.parallel.ep > 1:  # DDP leaves the experts out of its buckets (trainer/rank/experts.py)
        shape = with_experts(shape, None)
    return {"world": ddp_moves(config, shape, world_size)}


def pipelined(config: TrainConfig, shape: ModelShape, rank: int) -> tuple[TrainConfig, ModelShape]:
    """The dp collectives of pipeline rank `rank`: its stages' blocks, the embedding on the first stage's rank,
    the final norm and the head on the last's, as PipelineStage runs them: every backward but the last without
    gradient sync and, under FSDP2, without resharding (zero.reduce_every=step, zero.reshard_after_backward=
    false). The group's headline figures are pipeline rank 0's (the most parameters: the extra block and the
    embedding); `per_stage` holds every rank's."""
    p = config.parallel
    split, mine = stage_blocks(config.model.n_layers, p.stages), rank_stages(p, rank)
    blocks = sum(len(split[s]) for s in mine)
    local = stage_config(config, blocks)
    local.zero = copy.copy(config.zero)  # as stage_config: not the checks of a job the user wrote
    local.zero.reduce_every = ReduceEvery.step
    local.zero.reshard_after_backward = not config.zero.uses_fsdp
    return local, stage_model_shape(shape, blocks, 0 in mine, p.stages - 1 in mine)


def pipeline_gathers(config: TrainConfig, world_size: int, rank: int) -> dict[str, int]:
    """parallel.pp under FSDP2: pipeline rank `rank`'s all-gather bytes per step at zero=stage3 and at zero=stage2,
    side by side. stage2 is FSDP2's reshard_after_forward=False, torchtitan's default under PP ("to avoid
    per-microbatch all-gathers", torchtitan/distributed/fsdp.py): the stage gathers each block once a step and holds
    it unsharded from its first forward; stage3 reshards each block after every forward and gathers it again in
    that micro-batch's backward (`pipelined`: PipelineStage keeps it unsharded from a backward to the next forward).
    `config` is the job's; hpZ's backward gathers count with stage3's, none at stage2."""
    local = tp_local(config)
    shape = model_shape(local.model)
    out = {}
    for stage in (Stage.stage3, Stage.stage2):
        hpz = local.zero.hpz_ranks if stage == Stage.stage3 else None
        zero = unchecked_replace(
            local.zero, stage=stage, hpz_ranks=hpz
        )  # not a job the user wrote: unchecked
        moves = dp_moves(*pipelined(unchecked_replace(local, zero=zero), shape, rank), world_size)
        out[stage.value] = sum(b for group in moves.values() for kind, b, _ in group if kind == "all_gather")
    return out


def tp_per_stage(config: TrainConfig, backend: str) -> tuple[dict[str, int], ...]:
    """The tp group's bytes by collective on each pipeline rank (`config`: one TP rank's job): its stages'
    blocks, and the embedding's collectives on the first stage, the head's and the loss's on the last."""
    p, split = config.parallel, stage_blocks(config.model.n_layers, config.parallel.stages)
    compute = PARAM_BYTES[config.precision.compute_dtype]
    out = []
    for rank in range(p.pp):
        mine = rank_stages(p, rank)
        local = stage_config(config, sum(len(split[s]) for s in mine))
        moves = tp_moves(local, compute, backend, embedding=0 in mine, head=p.stages - 1 in mine)
        out.append(tally(moves, backend)[0])
    return tuple(out)


Move = tuple[str, int, int]  # kind of collective, payload bytes per step, calls per step


def context_group(config: TrainConfig, world_size: int, backend: str) -> GroupComm:
    """The cp group (`config`: one TP rank's job): `parallel.cp` ranks `parallel.tp` apart, on one node or
    across the network (trainer/layout.py: cp lies just outside tp)."""
    members = Layout.from_config(config, world_size).group("cp", 0)
    compute = PARAM_BYTES[config.precision.compute_dtype]
    group_bytes, group_calls = tally(cp_moves(config, compute, backend), backend)
    link = INTRA_NODE if members.intra_node else NETWORK
    return GroupComm(
        config.parallel.cp, link, group_bytes, group_calls, exchange=cp_exchange_json(config, compute)
    )


def expert_group(config: TrainConfig, backend: str, groups: ShardGroups) -> GroupComm:
    """The ep group (parallel.ep, trainer/rank/experts.py): ZeRO's group itself (FSDP2's shard group, or DDP's), so
    its link; its headline figures are ep rank 0's (the busiest under moe.imbalance), `per_rank` every ep rank's."""
    ep = config.parallel.ep
    local = cp_local(config)  # under cp a rank routes its T / cp positions of each row
    per_rank = tuple(tally(ep_moves(local, rank), backend) for rank in range(ep))
    bytes_by, calls_by = per_rank[0]
    # the ep group is ZeRO's (trainer/rank/experts.py), or a group of its own inside FSDP2's (trainer/rank/mesh.py)
    zero = "ep" if groups.ep > 1 else "shard" if config.zero.uses_fsdp else "world"
    return GroupComm(
        ep, groups.link(zero), bytes_by, calls_by, per_rank=tuple(figures for figures, _ in per_rank)
    )


def ep_moves(config: TrainConfig, ep_rank: int) -> list[Move]:
    """ep rank `ep_rank`'s all-to-alls per optimizer step (trainer/model/moe.py `dispatch_to_experts`): per MoE
    layer and forward, one of the counts (E int64 each way) and two of rows (D wide, in the dtype the MoE layer
    reads: the ffn_norm's output), the rows to their experts' ranks and the experts' output back; backward the
    two rows' gradients, each the other way. A checkpointed block's recompute dispatches again. The flight
    recorder books an all-to-all at the larger of what it sends and what it receives (trainer/telemetry/comm.py
    `payload_bytes`): max(A, R) rows, A the rank's tokens' kept assignments, R the rows its experts compute
    (trainer/plan/moe.py `expert_rows`)."""
    rows = expert_rows(config, ep_rank)
    width = precisions(config.precision, config.zero).residual * config.model.dim
    accum, layers = config.grad_accum, config.model.n_layers
    forwards = accum * (layers + recomputed_blocks(config))
    backwards = accum * layers
    counts = 8 * config.model.n_experts
    rows_bytes = max(rows.sent, rows.total) * width
    return [
        ("all_to_all", forwards * (counts + 2 * rows_bytes), 3 * forwards),
        ("all_to_all", backwards * 2 * rows_bytes, 2 * backwards),
    ]


def cp_exchange_json(config: TrainConfig, compute_bytes: int) -> dict[str, Any]:
    """plan.json's `comm.groups.cp.exchange`: one block's payloads per micro-batch in each direction (the
    backward exchanges the same tensors' gradients), the collective that carries them, and the share of each
    payload a rank sends (Ulysses) or receives (the all-gather) over the wire."""
    cp, exchange = config.parallel.cp, cp_exchange(config, compute_bytes)
    ulysses = config.parallel.cp_impl == "ulysses"
    return {
        "impl": config.parallel.cp_impl,
        "forward": {"collective": "all_to_all" if ulysses else "all_gather", "bytes_per_block": exchange},
        "backward": {
            "collective": "all_to_all" if ulysses else "reduce_scatter",
            "bytes_per_block": exchange,
        },
        "wire_share": (cp - 1) / cp,
        "recomputed_blocks": recomputed_blocks(config),
    }


def cp_exchange(config: TrainConfig, compute_bytes: int) -> dict[str, int]:
    """One block's cp exchange in one micro-batch, per direction, in payload bytes (trainer/model/
    context_parallel.py; `config`: one TP rank's heads H and K, of width Q; b rows of s positions, 1/cp
    of them on each rank, c the compute dtype's bytes: q, k, v and the output leave the projections and
    SDPA in it).

    ulysses: one all-to-all each of q and the output, b·(s/cp)·H·Q·c, and of k and v, b·(s/cp)·K·Q·c
    (input and output equal; each rank keeps 1/cp of it and sends (cp − 1)/cp); backward the same four
    gradients. allgather: one all-gather of k and v together, b·s·2·K·Q·c out (each rank receives
    (cp − 1)/cp of it); backward its adjoint, a reduce-scatter of that input."""
    m, cp = config.model, config.parallel.cp
    rows = config.micro_batch * config.seq_len // cp
    q = rows * m.n_heads * m.head_width * compute_bytes
    kv = rows * m.n_kv_heads * m.head_width * compute_bytes
    if config.parallel.cp_impl == "ulysses":
        return {"q": q, "k": kv, "v": kv, "output": q}
    return {"kv": cp * 2 * kv}


def cp_moves(config: TrainConfig, compute_bytes: int, backend: str) -> list[Move]:
    """The cp group's collectives per optimizer step (`cp_exchange`): every block's forward exchange, again
    for each block whose forward a checkpoint reruns in backward, and its backward exchange, per micro-batch.
    ProcessGroupGloo's flight recorder lists a functional all-gather's output as one rank's chunk (as for
    tp: trainer/plan/tensor_parallel.py), so on gloo the K/V all-gather is booked at payload / cp."""
    if config.parallel.cp == 1:
        return []
    exchange = cp_exchange(config, compute_bytes)
    accum, layers = config.grad_accum, config.model.n_layers
    forwards = accum * (layers + recomputed_blocks(config))
    backwards = accum * layers
    balance = moe_balance_moves(config, forwards, backwards)
    if config.parallel.cp_impl == "ulysses":
        each = sum(exchange.values())
        return [
            ("all_to_all", (forwards + backwards) * each, (forwards + backwards) * len(exchange)),
            *balance,
        ]
    gathered = exchange["kv"]
    recorded = gathered // config.parallel.cp if backend == "gloo" else gathered
    return [
        ("all_gather", forwards * recorded, forwards),
        ("reduce_scatter", backwards * gathered, backwards),
        *balance,
    ]


def moe_balance_moves(config: TrainConfig, forwards: int, backwards: int) -> list[Move]:
    """A mixture of experts' balance loss under cp (trainer/model/moe.py `balance_loss`): each MoE forward (a
    checkpointed block's recompute too) all-reduces its choices and its scores, R x E fp32 each (R: one row for
    moe.balance=aux, a row per sequence for seq_aux); where the loss is weighted (moe.aux_coeff > 0), backward
    all-reduces the scores' gradient."""
    routing = config.moe
    if not config.model.is_moe or routing.balance == BalanceLoss.none:
        return []
    rows = config.micro_batch if routing.balance == BalanceLoss.seq_aux else 1
    stats = 4 * rows * config.model.n_experts
    backward = [("all_reduce", backwards * stats, backwards)] if routing.aux_coeff > 0 else []
    return [("all_reduce", forwards * 2 * stats, forwards * 2), *backward]


def tally(moves: list[Move], backend: str) -> tuple[dict[str, int], dict[str, int]]:
    """Payload bytes and calls by kind of collective, as the backend records them."""
    bytes_by, calls_by = dict.fromkeys(COLLECTIVES, 0), dict.fromkeys(COLLECTIVES, 0)
    for kind, payload, calls in moves:
        if kind == "reduce_scatter" and backend == "gloo":
            kind = "all_reduce"  # ProcessGroupGloo's reduce_scatter_tensor is an all-reduce
        bytes_by[kind] += payload
        calls_by[kind] += calls
    return bytes_by, calls_by


def reductions(config: TrainConfig) -> int:
    """Gradient reductions per optimizer step: every micro-batch's, or the last one's (zero.reduce_every)."""
    return config.grad_accum if config.zero.reduce_every == ReduceEvery.micro_batch else 1


def forward_gathers(config: TrainConfig) -> int:
    """Forwards per optimizer step that all-gather: every micro-batch's, or with
    zero.reshard_after_backward=false the first one's (the later ones start unsharded)."""
    return 1 if not config.zero.reshard_after_backward else config.grad_accum


def ddp_moves(config: TrainConfig, shape: ModelShape, world_size: int) -> list[Move]:
    """DDP's bucketed all-reduce per reduction; ZeRO-1 adds one broadcast per parameter."""
    numel = shape.num_params
    # How many all-reduces (to size the flight recorder): DDP fills its small first bucket, then
    # buckets of at least bucket_cap_mb (fp32 gradients); torch's default cap where none is set
    # (a private constant, trainer/private_apis/).
    cap_mb = config.zero.bucket_cap_mb or ddp_default_bucket_cap_mb()
    buckets = min(len(shape.order), 2 + math.ceil(4 * numel / (cap_mb * MIB)))
    times = reductions(config)
    replicas = (
        config.parallel.dp(world_size) * config.parallel.cp
    )  # DDP's group: one stage's under parallel.pp
    moves = [
        (kind, times * payload, times * calls * buckets)
        for kind, payload, calls in gradient_moves(config, shape, replicas)
    ]
    if config.zero.stage == Stage.stage1:
        moves.append(("broadcast", numel * MASTER_BYTES, len(shape.order)))
    return moves


def fsdp_group_moves(config: TrainConfig, shape: ModelShape, groups: ShardGroups) -> dict[str, list[Move]]:
    """FSDP2's collectives by the group they run in (trainer/plan/groups.py).

    shard: forward's all-gathers, stage3 backward's (without hpZ) and the reduce-scatters, every
    tensor's dim 0 padded to the shard group. hpz: backward's all-gathers from the secondary shards;
    the output is the same padded tensor, so the payload is too (FSDP2's to_sharded_post_forward keeps
    1/hpz of the all-gather output, _fsdp_param.py). replicate (HSDP): one all-reduce of each reduce-
    scatter output, the gradient shard, across shard groups (_fsdp_collectives.py foreach_reduce).
    """
    if (
        groups.world == 1
    ):  # FSDP2 on one rank copies instead of communicating (_fsdp_param_group.py, foreach_reduce)
        return {"shard": []}
    root = sum(padded_numel(s, groups.shard) for s in shape.root)
    # parallel.ep: FSDP2 leaves the experts' stacked weights alone (trainer/rank/experts.py): they are never
    # gathered or reduce-scattered, their gradients averaged in the graph (MeanOverRanks)
    experts = expert_shapes(config.model) if config.parallel.ep > 1 else ()
    block = sum(padded_numel(s, groups.shard) for s in shape.block)
    block -= sum(padded_numel(s, groups.shard) for s in experts)
    layers, accum = config.model.n_layers, config.grad_accum
    param_bytes = PARAM_BYTES[config.precision.compute_dtype]
    reduce_bytes = REDUCE_BYTES[config.zero.reduce_dtype]
    stage3 = config.zero.stage == Stage.stage3
    reduced = reductions(config)
    gathered = gathered_block_bytes(config, block)  # one block's all-gather: fp8 weights under fp8_all_gather
    backward_gather = [("all_gather", accum * layers * gathered, accum * layers)] if stage3 else []
    gathers = forward_gathers(config)
    shard = [
        ("all_gather", gathers * (param_bytes * root + layers * gathered), gathers * (1 + layers)),
        ("reduce_scatter", reduced * reduce_bytes * (root + layers * block), reduced * (1 + layers)),
    ]
    moves = {"shard": shard}
    if groups.hpz is not None:
        moves["hpz"] = backward_gather
    else:
        shard[:0] = backward_gather
    if groups.ep > 1:
        moves["expert_shard"] = expert_shard_moves(config, groups)
    if groups.hsdp:
        moves["replicate"] = [
            (
                "all_reduce",
                reduced * reduce_bytes * (root + layers * block) // groups.shard,
                reduced * (1 + layers),
            )
        ]
    return moves


def expert_shard_moves(config: TrainConfig, groups: ShardGroups) -> list[Move]:
    """ep < dp under FSDP2: each MoE layer's experts unit (a rank's E / ep experts, trainer/rank/sharding.py
    `shard_experts`) gathered and reduce-scattered over the ranks holding the same experts, as the blocks are over
    the shard group: forward's all-gathers, stage3 backward's, and one reduce-scatter per reduction, the shard dim
    padded to that group (trainer/plan/moe.py `expert_local_shapes`)."""
    ranks = groups.size("expert_shard")
    unit = sum(math.prod(s) for s in expert_local_shapes(config.model, config.parallel.ep, ranks))
    layers, accum = config.model.n_layers, config.grad_accum
    param_bytes = PARAM_BYTES[config.precision.compute_dtype]
    gathers = forward_gathers(config) + (accum if config.zero.stage == Stage.stage3 else 0)
    reduced = reductions(config)
    return [
        ("all_gather", gathers * param_bytes * layers * unit, gathers * layers),
        (
            "reduce_scatter",
            reduced * REDUCE_BYTES[config.zero.reduce_dtype] * layers * unit,
            reduced * layers,
        ),
    ]


def gradient_moves(config: TrainConfig, shape: ModelShape, replicas: int) -> list[Move]:
    """DDP's gradient communication of one reduction over its `replicas` ranks, per bucket calls, after any warm-up
    (trainer/rank/compression.py).

    none: every gradient all-reduced in zero.reduce_dtype. powersgd: per bucket three all-reduces (the
    uncompressed tensors, concatenated; every compressed matrix's P, n x r; then its Q, m x r). topk: per
    bucket one all-gather of each rank's values and int32 indices, ceil(ratio * numel) of each gradient.
    sync_every=N: no gradient traffic; the parameters' fp32 all-reduce every N steps, here per step
    (rounded; one call, not per bucket, counted per bucket here only to size the recorder).
    """
    zero, numel = config.zero, shape.num_params
    if zero.compression == Compression.powersgd:
        kept = sum(powersgd_elements(s, zero) for s in shape.order)
        return [("all_reduce", 4 * kept, 3)]
    if zero.compression == Compression.topk:
        sent = sum(topk_count(math.prod(s), zero.topk_ratio) for s in shape.order)
        return [("all_gather", replicas * 2 * 4 * sent, 1)]
    if zero.sync_every > 1:
        return [("all_reduce", round(4 * numel / zero.sync_every), 1)]
    return [("all_reduce", numel * REDUCE_BYTES[zero.reduce_dtype], 1)]


def powersgd_elements(tensor: tuple[int, ...], zero: ZeroConfig) -> int:
    """Elements powerSGD_hook all-reduces for one gradient: viewed as n x m (dim 0 by the rest), P and Q
    (n * r + m * r, r = min(n, m, rank)) where that pays by MIN_COMPRESSION_RATE, else the tensor itself."""
    n = tensor[0]
    m = math.prod(tensor) // n
    r = min(n, m, zero.powersgd_rank)
    return (n + m) * r if (n + m) * r * MIN_COMPRESSION_RATE < n * m else n * m


def topk_count(numel: int, ratio: float) -> int:
    """Elements TopK sends of a gradient of `numel` (the hook calls this too): at least one."""
    return max(1, math.ceil(ratio * numel))
