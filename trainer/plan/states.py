"""Model states per rank: the parameters, gradients and Adam state each rank holds at rest.

The shapes come from the model built on the meta device (one block of it: every block is
alike); the shards are FSDP2's (dim 0, padded to the world size) and ZeroRedundancyOptimizer's
(whole tensors, greedily), repeated here because the plan is made before any rank exists.
The walk of a step (trainer/plan/ddp_walk.py, fsdp_walk.py) adds what each moment holds on top of these.

Model states (the ZeRO paper, Rajbhandari et al. 2020, section 3.1) for mixed-precision Adam
are 2P (fp16 weights) + 2P (fp16 gradients) + 12P (fp32 weights, momentum, variance) = 16P
bytes, divided by the world size N from ZeRO-1 (the 12P), ZeRO-2 (+ gradients), ZeRO-3 (all).
zerolab keeps what PyTorch keeps, which splits the same 16P differently:

    stage  params         grads           optimizer (Adam moments)
    0      4P             4P              8P          DDP: the gradients are its buckets
    1      4P             4P              8P / N      ZeroRedundancyOptimizer: a greedy split
    2      4P / N         4P / N          8P / N      FSDP2 shards dim 0, padded to N rows
    3      4P / N         4P / N          8P / N

- No persistent 2-byte copy of the weights: autocast (stages 0/1) casts per op, FSDP2
  (stages 2/3) casts in its all-gather; master weights are always the fp32 parameters.
- Gradients are fp32 in every precision: DDP's buckets take the fp32 parameters' dtype and
  FSDP2 reduce-scatters in fp32 (`reduce_dtype`), so stages 0-1 hold 4P, not ZeRO's 2P.
- ZeRO-1's optimizer split is by whole tensors (largest first, to the emptiest rank), so
  ranks differ slightly; FSDP2 pads every tensor's dim 0 to a multiple of N for its params and
  gradients, while Adam's moments follow the unpadded shard.
- Adam's `step` counters (4 B per tensor) are left out of `optimizer` (metrics.py does the
  same) and counted with buffers under `other`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import ModelConfig, Stage
from trainer.model.decoder import build_model

# ----------------------------------------------------------------------------- the model's shapes


@dataclass(frozen=True)
class ModelShape:
    """Parameter shapes of the decoder, split as FSDP2 groups them: the root and one block."""

    config: ModelConfig
    root: tuple[tuple[int, ...], ...]  # tok_embeddings, norm, output (registration order)
    block: tuple[tuple[int, ...], ...]  # one transformer block (all blocks are alike)
    order: tuple[tuple[int, ...], ...]  # every parameter, in model.parameters() order
    block_linear_numel: int  # matmul weights and biases of one block (what autocast casts)

    @property
    def num_params(self) -> int:
        return sum(map(math.prod, self.order))

    @property
    def block_numel(self) -> int:
        """One block's parameters."""
        return sum(map(math.prod, self.block))


@functools.lru_cache(maxsize=32)
def _model_shape(key: tuple[Any, ...]) -> ModelShape:
    config = ModelConfig(**dict(key))
    # Every block is the same TransformerBlock(config), so one block on meta gives every shape;
    # 70b's 80 blocks would take seconds to build even on meta (tests compare with a full build).
    model = build_model(dataclasses.replace(config, n_layers=1), device="meta")  # no storage: shapes only
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    block = tuple(shape for name, shape in named if name.startswith("layers.0."))
    first = next(i for i, (name, _) in enumerate(named) if name.startswith("layers.0."))
    root = tuple(shape for name, shape in named if not name.startswith("layers."))
    order = (
        tuple(shape for _, shape in named[:first])
        + block * config.n_layers
        + tuple(shape for _, shape in named[first + len(block) :])
    )
    linear = sum(  # weights and biases (Qwen2's q, k, v): autocast caches the cast of each
        p.numel() for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()
    )
    return ModelShape(config, root, block, order, linear)


def model_shape(config: ModelConfig) -> ModelShape:
    """Shapes from the model definition itself, built on the meta device (cached per shape)."""
    return _model_shape(config.shape_key())


# ----------------------------------------------------------------------------- per-rank model states


def shard_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows of dim 0 that `rank` holds: torch.chunk's split, which FSDP2's Shard(0) uses."""
    per_rank = -(-dim0 // world_size)
    return max(0, min(per_rank, dim0 - rank * per_rank))


def padded_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of a tensor with dim 0 padded to a multiple of the world size (FSDP2's layout)."""
    return -(-shape[0] // world_size) * world_size * math.prod(shape[1:])


def zero1_partition(numels: list[int], world_size: int) -> list[list[int]]:
    """Indices of the tensors whose optimizer state each rank keeps under ZeroRedundancyOptimizer.

    Its own `_partition_parameters` needs a process group, which the plan (made before any
    rank exists, for world sizes this host cannot start) does not have, so its rule is
    repeated here: largest tensor first, each to the rank with the fewest elements so far.
    """
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    sizes = [0] * world_size
    for index in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):  # stable, like sorted()
        rank = sizes.index(min(sizes))
        ranks[rank].append(index)
        sizes[rank] += numels[index]
    return ranks


@dataclass(frozen=True)
class RankStates:
    """Model states of one rank at rest, and what its optimizer step works over."""

    params: int
    grads: int
    optimizer: int  # Adam's exp_avg and exp_avg_sq
    step_counters: int  # Adam's 0-dim fp32 `step` per tensor
    local_numel: int  # elements this rank's optimizer updates
    loop_temporary: int  # elements of Adam's per-tensor temporaries at their worst (see below)
    largest_numel: int = 0  # elements of its largest tensor (offload=nvme's chunk temporaries)


def loop_temporary(numels: list[int]) -> int:
    """Adam's per-tensor loop (torch.optim.adamw on CPU) makes `exp_avg_sq.sqrt()` and its
    quotient for each tensor while the previous tensor's `denom` is still bound to the loop
    variable: at worst 2 x this tensor + 1 x the one updated before it."""
    return max((2 * n + (numels[i - 1] if i else 0) for i, n in enumerate(numels)), default=0)


def rank_states(shape: ModelShape, stage: Stage, world_size: int) -> list[RankStates]:
    """Model states of every rank (FSDP2 and ZeRO-1 shards are not all the same size)."""
    numels = [math.prod(s) for s in shape.order]
    count = len(numels)
    if stage in (Stage.stage2, Stage.stage3):
        # Distinct shapes are few (a dozen even for 70b), so per rank this is cheap at any world size.
        counts = Counter(shape.order)
        pairs = {(shape.order[i - 1] if i else None, s) for i, s in enumerate(shape.order)}
        padded = sum(n * padded_numel(s, world_size) for s, n in counts.items()) // world_size
        states = []
        for rank in range(world_size):
            local = {s: shard_rows(s[0], world_size, rank) * math.prod(s[1:]) for s in counts}
            local_numel = sum(counts[s] * local[s] for s in counts)
            temporary = max(2 * local[s] + (local[before] if before else 0) for before, s in pairs)
            largest = max(local.values())
            states.append(
                RankStates(
                    4 * padded, 4 * padded, 8 * local_numel, 4 * count, local_numel, temporary, largest
                )
            )
        return states
    total = sum(numels)
    if stage == Stage.stage0:
        return [
            RankStates(4 * total, 4 * total, 8 * total, 4 * count, total, loop_temporary(numels), max(numels))
        ] * world_size
    states = []
    for mine in zero1_partition(
        numels, world_size
    ):  # each rank's local AdamW steps its tensors in this order
        local = [numels[i] for i in mine]
        states.append(
            RankStates(
                4 * total,
                4 * total,
                8 * sum(local),
                4 * len(local),
                sum(local),
                loop_temporary(local),
                max(local, default=0),
            )
        )
    return states


# ----------------------------------------------------------------------------- expert parallelism


def with_expert_shards(shape: ModelShape, ep: int, ranks: int) -> ModelShape:
    """The shapes with every MoE layer's stacked expert weights as FSDP2 shards them under an ep group inside
    its shard group (trainer/plan/moe.py `as_fsdp_shard`: each rank's E / ep experts over `ranks`)."""
    from trainer.plan.moe import as_fsdp_shard, expert_shapes

    experts = set(expert_shapes(shape.config))
    block = tuple(as_fsdp_shard(s, ep, ranks) if s in experts else s for s in shape.block)
    first = next(i for i in range(len(shape.order)) if shape.order[i : i + len(shape.block)] == shape.block)
    after = first + len(shape.block) * shape.config.n_layers
    order = shape.order[:first] + block * shape.config.n_layers + shape.order[after:]
    return dataclasses.replace(shape, block=block, order=order)


def with_experts(shape: ModelShape, ep: int | None) -> ModelShape:
    """The shapes with every MoE layer's stacked expert weights (trainer/plan/moe.py `expert_shapes`) held as
    parallel.ep holds them under DDP (trainer/rank/experts.py): E / `ep` experts of each on a rank, or, with
    `ep` None, left out, as DDP leaves them out of its buckets and all-reduce."""
    from trainer.plan.moe import expert_shapes

    pending = Counter(expert_shapes(shape.config))
    block = []
    for s in shape.block:
        if pending[s] > 0:
            pending[s] -= 1
            if ep is not None:
                block.append((s[0] // ep, *s[1:]))
            continue
        block.append(s)
    first = next(i for i in range(len(shape.order)) if shape.order[i : i + len(shape.block)] == shape.block)
    after = first + len(shape.block) * shape.config.n_layers
    order = shape.order[:first] + tuple(block) * shape.config.n_layers + shape.order[after:]
    return dataclasses.replace(shape, block=tuple(block), order=order)
