"""The memory plan: what each rank will hold, and when, known before any rank starts.

The plan walks one optimizer step as a list of moments (the last block's forward, the loss,
the output head's backward, the start, end and reduce-scatter of each block's backward, the
optimizer step), adds up the tensors alive at each, and calls the largest the peak. Every
figure is exact arithmetic on the parameter shapes of the model built on the meta device;
nothing is allocated. benchmarks/plan_accuracy.py checks it against real runs.

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

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1) are 34·s·b·h + 5·a·s²·b bytes per layer for GPT-3 in fp16 with dropout,
s = sequence, b = micro-batch, h = width, a = heads. zerolab's block is different, so the
formula is re-derived from what its autograd graph saves (checked by listing saved tensors,
see docs/memory_plan.md), per token, in bytes:

    attention: norm input x, x·rstd, norm output, q, k, v, SDPA output, SDPA logsumexp (4·H)
    MLP:       norm input h, h·rstd, norm output, w1 out, w3 out, silu out, their product
    fp32                        4·(8D + 2·KQ + 4M) + 4H + 8
    bf16/fp16, stages 0-1       30D + 4·KQ + 8M + 4H + 8   (autocast: residual and norms fp32,
                                the norm output cast once per projection: 3 copies, then 2)
    bf16/fp16, stages 2-3       24D + 4·KQ + 8M + 4H + 8   (FSDP2: everything in bf16 except
                                RMSNorm, which upcasts its input to fp32 and saves that)

No dropout (Korthikanti's 2 masks), no attention matrix: SDPA on CPU runs the flash kernel
(saves q, k, v, output and a logsumexp; grouped K/V are not repeated), hence no 5·a·s²·b
term; SwiGLU saves 4 M-wide tensors where GELU saves 2. After the blocks: the final norm and
the fp32 log-softmax of the logits (4·V per token; `logits.float()` adds a transient fp32
copy in bf16). Activation checkpointing (non-reentrant) keeps only a block's input (D values
in the residual dtype) and recomputes the block in backward, so the last block's full set
comes back at the start of backward.

Temporaries, the part estimators leave out and where stages differ most:
- stage2 keeps every block's parameters unsharded (param dtype) from forward to backward;
  stage3 one block at a time (plus the prefetched next one in backward); the root
  (embeddings, final norm, output head) stays unsharded in both, as sharding.py asks.
- FSDP2's flat all-gather output lives next to the unsharded copy until the next copy-out;
  the reduce-scatter input (fp32, padded), its output (the new gradient shard) and on gloo a
  second input-sized buffer; the root's unsharded output-head gradient lives from the head's
  backward until the root's reduce-scatter at the very end of backward.
- DDP under autocast caches a 2-byte copy of every matmul weight for forward and backward.
- The loss: log_softmax and its backward hold 2-3 fp32 B·T·V tensors at once.
- Adam: on CPU the per-tensor loop makes 2 temporaries of a tensor while the previous
  tensor's is still alive; on CUDA the foreach path makes one of every tensor it updates.
- Gradient accumulation: micro-batches before the last keep a full unsharded fp32 gradient
  (DDP no_sync outside its buckets; FSDP2 without reduce-scatter).

CPU offload: FSDP2 keeps parameters, gradients and optimizer state in host memory; on a GPU
they leave the device figure (reported as `offloaded_gib`); on a CPU device nothing moves.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from trainer.activation_checkpointing import should_checkpoint
from trainer.config import CheckpointMode, DType, ModelConfig, OffloadTarget, Stage, TrainConfig
from trainer.model import build_model

GIB = 2**30
BYTES_PER_PARAM = {"params": 4, "grads": 4, "optimizer": 8}  # fp32 master weights, grads, Adam moments
SHARDED_FROM = {"params": Stage.stage2, "grads": Stage.stage2, "optimizer": Stage.stage1}
STAGE_ORDER = [Stage.stage0, Stage.stage1, Stage.stage2, Stage.stage3]
BATCH_BYTES_PER_TOKEN = 16  # int64 inputs and targets

# Usable memory of known accelerators (MiB, as nvidia-smi reports the total).
ACCELERATOR_MIB = {
    "a100-40gb": 40_960,
    "a100-80gb": 81_920,
    "h100": 81_559,
    "h200": 143_771,
}


# ----------------------------------------------------------------------------- ZeRO arithmetic


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states one rank holds at rest."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_states_per_rank(num_parameters: int, stage: Stage, world_size: int) -> ModelStates:
    """Per-rank model-state bytes for a stage, the ZeRO arithmetic (exact when every shard is even)."""

    def part(kind: str) -> int:
        full = BYTES_PER_PARAM[kind] * num_parameters
        sharded = STAGE_ORDER.index(stage) >= STAGE_ORDER.index(SHARDED_FROM[kind])
        return -(-full // world_size) if sharded else full  # ceil: the largest shard

    return ModelStates(params=part("params"), grads=part("grads"), optimizer=part("optimizer"))


# ----------------------------------------------------------------------------- the model's shapes


@dataclass(frozen=True)
class ModelShape:
    """Parameter shapes of the decoder, split as FSDP2 groups them: the root and one block."""

    config: ModelConfig
    root: tuple[tuple[int, ...], ...]  # tok_embeddings, norm, output (registration order)
    block: tuple[tuple[int, ...], ...]  # one transformer block (all blocks are alike)
    order: tuple[tuple[int, ...], ...]  # every parameter, in model.parameters() order
    block_linear_numel: int  # matmul weights of one block (what autocast casts)

    @property
    def num_params(self) -> int:
        return sum(map(math.prod, self.order))


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
    order = tuple(shape for _, shape in named[:first]) + block * config.n_layers + tuple(shape for _, shape in named[first + len(block) :])
    linear = sum(m.weight.numel() for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    return ModelShape(config, root, block, order, linear)


def model_shape(config: ModelConfig) -> ModelShape:
    """Shapes from the model definition itself, built on the meta device (cached per shape)."""
    return _model_shape(tuple(sorted(vars(config).items())))


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
            states.append(RankStates(4 * padded, 4 * padded, 8 * local_numel, 4 * count, local_numel, temporary))
        return states
    total = sum(numels)
    if stage == Stage.stage0:
        return [RankStates(4 * total, 4 * total, 8 * total, 4 * count, total, loop_temporary(numels))] * world_size
    states = []
    for mine in zero1_partition(numels, world_size):  # each rank's local AdamW steps its tensors in this order
        local = [numels[i] for i in mine]
        states.append(RankStates(4 * total, 4 * total, 8 * sum(local), 4 * len(local), sum(local), loop_temporary(local)))
    return states


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class Precisions:
    """Bytes per element where the compute dtype shows, for one stage and precision."""

    regime: str  # fp32 | autocast (stages 0-1, bf16/fp16) | fsdp_mp (stages 2-3, bf16/fp16)
    compute: int  # matmul outputs, attention
    residual: int  # the residual stream between blocks
    param: int  # the weights matmuls read (FSDP2's unsharded copy; autocast's cached cast)


def precisions(config: TrainConfig) -> Precisions:
    if config.precision.compute_dtype == DType.float32:
        return Precisions("fp32", 4, 4, 4)
    if config.zero.uses_fsdp:
        return Precisions("fsdp_mp", 2, 2, 2)
    return Precisions("autocast", 2, 4, 2)  # embedding output and residual adds stay fp32


def block_bytes_per_token(m: ModelConfig, regime: str) -> int:
    """Saved activations of one transformer block, per token (see the module docstring)."""
    D, M, H = m.dim, m.ffn_dim, m.n_heads
    KQ = m.n_kv_heads * (m.dim // m.n_heads)
    stats = 4 * H + 8  # SDPA logsumexp (fp32 per head) and the two RMSNorm rstd (fp32)
    if regime == "fp32":
        return 4 * (8 * D + 2 * KQ + 4 * M) + stats
    if regime == "autocast":
        return 30 * D + 4 * KQ + 8 * M + stats
    return 24 * D + 4 * KQ + 8 * M + stats


def head_bytes_per_token(m: ModelConfig, regime: str) -> int:
    """Saved after the blocks, per token: final RMSNorm (input, x·rstd, output) and log_softmax (fp32)."""
    norm_output = 4 * m.dim if regime == "fp32" else 2 * m.dim
    return 4 * m.dim + 4 * m.dim + norm_output + 4 + 4 * m.vocab_size


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch on one rank."""

    blocks: tuple[int, ...]  # saved by each block in forward (its input only when checkpointed)
    full_block: int  # one block's full set (a checkpointed block recomputes it in backward)
    head: int  # final norm + fp32 log-softmax
    log_softmax: int
    batch: int

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.head + self.batch

    @property
    def before_last_block(self) -> int:
        """Saved by every block but the last, plus the batch: what the last block adds to."""
        return sum(self.blocks[:-1]) + self.batch


def activations(config: TrainConfig) -> Activations:
    m, prec = config.model, precisions(config)
    tokens = config.micro_batch * config.seq_len
    full = block_bytes_per_token(m, prec.regime) * tokens
    checkpointed = prec.residual * m.dim * tokens  # non-reentrant checkpoint keeps the block's input
    blocks = tuple(checkpointed if should_checkpoint(i, config.checkpointing) else full for i in range(m.n_layers))
    head = head_bytes_per_token(m, prec.regime) * tokens + 4  # + nll_loss's fp32 total weight
    return Activations(blocks, full, head, 4 * m.vocab_size * tokens, BATCH_BYTES_PER_TOKEN * tokens)


# ----------------------------------------------------------------------------- moments of a step


@dataclass(frozen=True)
class Moment:
    """The tensors alive at one point of a training step, by kind (bytes)."""

    name: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class StepContext:
    """Everything the moments of one rank's step are computed from."""

    config: TrainConfig
    shape: ModelShape
    states: RankStates
    acts: Activations
    prec: Precisions
    world_size: int
    device_kind: str
    other: int  # rotary tables, data tables, Adam's step counters

    @property
    def tokens(self) -> int:
        return self.config.micro_batch * self.config.seq_len

    @property
    def offloaded(self) -> bool:
        """States in host memory while compute runs on the GPU (FSDP2 CPUOffloadPolicy)."""
        return self.config.offload.target == OffloadTarget.cpu and self.device_kind == "cuda"

    def moment(self, name: str, grads: int | None = None, activations: int = 0, temporary: int = 0) -> Moment:
        """Model states at rest plus what the moment adds; `grads` replaces the at-rest gradients."""
        if self.offloaded:  # on the host: not in the device's figure
            params = grads = optimizer = 0
        else:
            params, optimizer = self.states.params, self.states.optimizer
            grads = self.states.grads if grads is None else grads
        parts = dict(params=params, grads=grads, optimizer=optimizer, activations=activations, temporary=temporary)
        return Moment(name, {**parts, "other": self.other})


def loss_forward_temporary(ctx: StepContext) -> int:
    """Logits, their fp32 copy (`logits.float()`, none in fp32) and the log-softmax being written."""
    nv = ctx.tokens * ctx.config.model.vocab_size
    return 4 * nv if ctx.prec.regime == "fp32" else 2 * nv + 4 * nv


def loss_backward_temporary(ctx: StepContext) -> int:
    """log_softmax's backward: the incoming gradient and the outgoing one, both fp32 B·T·V."""
    return 8 * ctx.tokens * ctx.config.model.vocab_size


def block_backward_temporary(ctx: StepContext, weight_grad_bytes: int, weight_grad_held: bool) -> int:
    """Early in a block's backward: the gradient arriving from above and the MLP's gradients.

    w2's backward holds the gradient of the SwiGLU product (B·T·M) and of w2's weight; then
    the product's backward holds two B·T·M gradients while w2's saved input is already gone.
    DDP copies each weight gradient into its bucket at once (a transient); FSDP2 keeps the
    block's unsharded weight gradients until the block's reduce-scatter.
    """
    m, n = ctx.config.model, ctx.tokens
    incoming = ctx.prec.residual * n * m.dim
    nm, w2_grad = ctx.prec.compute * n * m.ffn_dim, weight_grad_bytes * m.dim * m.ffn_dim
    if weight_grad_held:
        return incoming + 2 * nm + w2_grad
    return incoming + max(nm + w2_grad, 2 * nm)


def optimizer_temporary(ctx: StepContext) -> int:
    """Adam's temporaries: CPU runs a per-tensor loop (`loop_temporary`), CUDA the foreach path
    (one sqrt of every tensor the rank updates). Offloaded states are updated on the host."""
    if ctx.offloaded:
        return 0
    if ctx.device_kind == "cuda":
        return 4 * ctx.states.local_numel
    return 4 * ctx.states.loop_temporary


def accumulation_grads(ctx: StepContext) -> int:
    """Micro-batches before the last keep an unsharded fp32 gradient outside buckets and shards."""
    return 4 * ctx.shape.num_params if ctx.config.grad_accum > 1 else 0


def ddp_moments(ctx: StepContext) -> list[Moment]:
    """Stages 0-1: DDP holds replicated fp32 params and its gradient buckets all step long."""
    m, n, acts, prec = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec
    vd = m.vocab_size * m.dim
    linear = ctx.shape.block_linear_numel * m.n_layers + vd  # blocks' matmuls + output head
    # Autocast caches its cast of every weight from first use until the autocast region (which
    # wraps forward and backward in loop.py) exits.
    fixed = (2 * linear if prec.regime == "autocast" else 0) + accumulation_grads(ctx)
    if prec.regime == "autocast":  # bf16 weight gradient, then its fp32 cast; or with the logits' gradient
        head = max(2 * n * m.vocab_size + 2 * n * m.dim + 2 * vd, 2 * n * m.dim + 6 * vd)
    else:
        head = 4 * n * m.vocab_size + 4 * n * m.dim + 4 * vd
    weight_grad = 6 if prec.regime == "autocast" else 4
    return [
        ctx.moment("forward: last block", activations=acts.before_last_block + acts.full_block, temporary=fixed),
        ctx.moment("forward: loss", activations=acts.total, temporary=fixed + loss_forward_temporary(ctx)),
        ctx.moment("backward: loss", activations=acts.total, temporary=fixed + loss_backward_temporary(ctx)),
        ctx.moment("backward: output head", activations=acts.total - acts.log_softmax, temporary=fixed + head),
        ctx.moment(
            "backward: last block",
            activations=acts.before_last_block + acts.full_block,
            temporary=fixed + block_backward_temporary(ctx, weight_grad, weight_grad_held=False),
        ),
        ctx.moment("backward: embedding", activations=acts.batch, temporary=fixed + 4 * vd + prec.residual * n * m.dim),
        ctx.moment("optimizer step", temporary=optimizer_temporary(ctx)),
    ]


@dataclass(frozen=True)
class FsdpSizes:
    """FSDP2 buffers of one rank (bytes)."""

    root: int  # the root's unsharded parameters (= its flat all-gather output), param dtype
    block: int  # one block's
    root_rs: int  # the root's reduce-scatter input (fp32, padded)
    block_rs: int
    block_grad_shard: int  # one block's gradient shard (its reduce-scatter output)
    root_grad_shard: int
    output_grad: int  # the output head's unsharded weight gradient (+ final norm's)
    gloo_copy: bool  # gloo's reduce-scatter works on a copy of its input


def fsdp_sizes(ctx: StepContext) -> FsdpSizes:
    s, w, p = ctx.shape, ctx.world_size, ctx.prec.param
    root_padded = sum(padded_numel(t, w) for t in s.root)
    block_padded = sum(padded_numel(t, w) for t in s.block)
    m = ctx.config.model
    return FsdpSizes(
        root=p * root_padded,
        block=p * block_padded,
        root_rs=4 * root_padded,
        block_rs=4 * block_padded,
        block_grad_shard=4 * block_padded // w,
        root_grad_shard=4 * root_padded // w,
        output_grad=p * (m.vocab_size * m.dim + m.dim),
        gloo_copy=ctx.device_kind == "cpu",
    )


def fsdp_moments(ctx: StepContext) -> list[Moment]:
    """Stages 2-3: FSDP2 gathers parameters per block and reduce-scatters gradients per block.

    zero_grad frees the gradient shards at the start of the step, so forward-time moments hold none.
    """
    m, n, acts, prec, L = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec, ctx.config.model.n_layers
    f = fsdp_sizes(ctx)
    stage3 = ctx.config.zero.stage == Stage.stage3
    accum = accumulation_grads(ctx)
    after_forward = f.root + (0 if stage3 else L * f.block) + accum  # unsharded at the loss
    # The last block's forward: its unsharded copy and its flat all-gather output (kept until the
    # next copy-out; during its own copy-out the block before's is still there too); stage2
    # still holds every earlier block unsharded. Offloaded shards are staged on the device first.
    forward = f.root + (2 * f.block if stage3 else (L + 1) * f.block) + accum
    staging = (4 + prec.param) * f.block // ctx.world_size // prec.param if ctx.offloaded else 0
    head = prec.compute * n * (m.vocab_size + m.dim) + f.output_grad
    # The embedding's backward, before the root reduce-scatters: every block's gradient shard,
    # block 0's retained reduce-scatter input, the root unsharded with its gradients.
    embedding = f.root + f.output_grad + prec.param * m.vocab_size * m.dim + prec.residual * n * m.dim + f.block_rs
    # The root's reduce-scatter (its output is the root's gradient shard); FSDP2 still holds the
    # last gradient it reduced (a loop variable in foreach_reduce): the output head's.
    root_reduce = f.root_rs * (2 if f.gloo_copy else 1) + f.output_grad
    all_grads = L * f.block_grad_shard + f.root_grad_shard
    return [
        ctx.moment("forward: last block all-gather", 0, acts.before_last_block, forward + f.block + staging),
        ctx.moment("forward: last block", 0, acts.before_last_block + acts.full_block, forward),
        ctx.moment("forward: loss", 0, acts.total, after_forward + loss_forward_temporary(ctx)),
        ctx.moment("backward: loss", 0, acts.total, after_forward + loss_backward_temporary(ctx)),
        ctx.moment("backward: output head", 0, acts.total - acts.log_softmax, after_forward + head),
        *fsdp_block_moments(ctx, f),
        ctx.moment("backward: embedding", L * f.block_grad_shard, acts.batch, embedding + accum),
        ctx.moment("backward: root reduce-scatter", all_grads, acts.batch, root_reduce + accum),
        ctx.moment("optimizer step", temporary=optimizer_temporary(ctx)),
    ]


def fsdp_block_moments(ctx: StepContext, f: FsdpSizes) -> list[Moment]:
    """The worst block backward and the worst block reduce-scatter, over every block.

    Going down the blocks, activations shrink while gradient shards grow, and from the
    second-to-last block on, the block above's reduce-scatter input is retained (FSDP2 frees it
    at the next post-backward), so the worst block is not always the last one.
    """
    m, n, acts, prec, L = ctx.config.model, ctx.tokens, ctx.acts, ctx.prec, ctx.config.model.n_layers
    stage3 = ctx.config.zero.stage == Stage.stage3
    accum = accumulation_grads(ctx)
    # Reduce-scatter: the fp32 input, then either the unsharded gradients being copied in, or
    # the output (the new shard) and gloo's copy of the input.
    rs_block = f.block_rs + max(f.block, f.block_grad_shard + (f.block_rs if f.gloo_copy else 0))
    compute = block_backward_temporary(ctx, prec.param, weight_grad_held=True)
    incoming = prec.residual * n * m.dim
    worst: dict[str, Moment] = {}
    for i in reversed(range(L)):
        below = sum(acts.blocks[:i]) + acts.batch
        grads = (L - 1 - i) * f.block_grad_shard
        retained = f.block_rs if i < L - 1 else 0
        prefetched = f.block if i > 0 else 0  # stage3 gathers the block below while this one runs
        # stage3: this block re-gathered; stage2: blocks 0..i never resharded after forward.
        params = f.root + (f.block + prefetched if stage3 else (i + 1) * f.block) + f.output_grad + retained + accum
        moments = [
            # its start: all its activations back (recomputed if checkpointed), the MLP's gradients
            ctx.moment(f"backward: block {i}", grads, below + acts.full_block, params + compute),
            # its end: its activations gone, every unsharded weight gradient of the block held
            ctx.moment(f"backward: block {i} end", grads, below, params + f.block + 2 * incoming),
            # its reduce-scatter: the block resharded, the retained input of the block above freed
            ctx.moment(
                f"backward: block {i} reduce-scatter",
                grads,
                below,
                f.root + (prefetched if stage3 else i * f.block) + f.output_grad + incoming + rs_block + accum,
            ),
        ]
        for kind, moment in zip(("start", "end", "reduce"), moments):
            if kind not in worst or moment.total > worst[kind].total:
                worst[kind] = moment
    return list(worst.values())


# ----------------------------------------------------------------------------- the plan of a job


def other_bytes(config: TrainConfig, states: RankStates) -> int:
    """Rotary tables (fp32 cos and sin of every position), synthetic data's transition tables
    (int64 successors, float64 probabilities, float64 stationary distribution) and Adam's steps."""
    m = config.model
    rope = 2 * m.max_seq_len * (m.dim // m.n_heads // 2) * 4
    data = 16 * m.vocab_size * config.data.branching + 8 * m.vocab_size if config.data.kind.value == "synthetic" else 0
    return rope + data + states.step_counters


@dataclass(frozen=True)
class RankPlan:
    rank: int
    states: RankStates
    activations: int
    moments: tuple[Moment, ...]
    offloaded: int  # model states kept in host memory instead (offload=cpu on a GPU)

    @property
    def peak(self) -> Moment:
        return max(self.moments, key=lambda moment: moment.total)

    def figures(self) -> dict[str, float]:
        """GiB figures of the plan.json row: model states at rest, activations at the end of
        forward, and the temporaries and other tensors at the peak."""
        peak = self.peak
        return {
            "params_gib": self.states.params / GIB,
            "grads_gib": self.states.grads / GIB,
            "optimizer_gib": self.states.optimizer / GIB,
            "activations_gib": self.activations / GIB,
            "temporary_gib": peak.parts["temporary"] / GIB,
            "other_gib": peak.parts["other"] / GIB,
            "peak_gib": peak.total / GIB,
            "offloaded_gib": self.offloaded / GIB,
        }


@dataclass(frozen=True)
class DeviceMemory:
    """What each rank may use, and where the figure comes from (None: unknown)."""

    per_rank_bytes: int | None
    source: str


def device_memory(config: TrainConfig, device_kind: str, world_size: int) -> DeviceMemory:
    """The cap (device_memory_gib), else a named accelerator, else this host's GPU or memory."""
    if config.device_memory_gib is not None:
        return DeviceMemory(int(config.device_memory_gib * GIB), f"device_memory_gib={config.device_memory_gib:g}")
    accelerator = config.plan.accelerator
    if accelerator is not None:
        mib = ACCELERATOR_MIB[accelerator.value]
        return DeviceMemory(mib * 2**20, f"{accelerator.value}, {mib * 2**20 / GIB:.1f} GiB")
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            return DeviceMemory(None, "no GPU visible here")
        total = torch.cuda.get_device_properties(0).total_memory
        return DeviceMemory(total, f"{torch.cuda.get_device_name(0)}, {total / GIB:.1f} GiB")
    # CPU ranks share this host's memory, so each gets an equal part of what is free now.
    available = psutil.virtual_memory().available
    ranks_here = max(1, world_size)
    return DeviceMemory(available // ranks_here, f"this host, {available / GIB:.1f} GiB available / {ranks_here} ranks")


@dataclass(frozen=True)
class Plan:
    """The memory plan of one job: every rank's moments and whether the worst one fits."""

    config: TrainConfig
    device_kind: str
    world_size: int
    num_params: int
    ranks: tuple[RankPlan, ...]
    memory: DeviceMemory

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda rank: rank.peak.total)

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak.total

    def rank_fits(self, rank: RankPlan) -> bool | None:
        if self.memory.per_rank_bytes is None:
            return None
        return rank.peak.total <= self.memory.per_rank_bytes

    @property
    def fits(self) -> bool | None:
        return self.rank_fits(self.worst)

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "model": c.model.name,
            "num_params": self.num_params,
            "world_size": self.world_size,
            "device": self.device_kind,
            "zero": c.zero.stage.value,
            "precision": c.precision.name,
            "checkpointing": c.checkpointing.mode.value,
            "offload": c.offload.target.value,
            "micro_batch": c.micro_batch,
            "seq_len": c.seq_len,
            "grad_accum": c.grad_accum,
            "device_memory_gib": None if self.memory.per_rank_bytes is None else self.memory.per_rank_bytes / GIB,
            "device_memory_source": self.memory.source,
            "peak_gib": self.peak_bytes / GIB,
            "peak_rank": self.worst.rank,
            "peak_moment": self.worst.peak.name,
            "fits": self.fits,
            "ranks": [
                {
                    "rank": r.rank,
                    **r.figures(),
                    "fits": self.rank_fits(r),
                    "peak_moment": r.peak.name,
                    "moments_gib": {m.name: m.total / GIB for m in r.moments},
                }
                for r in self.ranks
            ],
        }


def build_plan(config: TrainConfig, device_kind: str, world_size: int) -> Plan:
    """Plan every rank of a job; shapes come from the model built on meta, nothing is allocated."""
    shape = model_shape(config.model)
    acts, prec = activations(config), precisions(config)
    offload = config.offload.target == OffloadTarget.cpu and device_kind == "cuda"
    ranks, planned = [], {}
    for rank, states in enumerate(rank_states(shape, config.zero.stage, world_size)):
        if states not in planned:  # most ranks hold equal shards: plan each distinct one once
            ctx = StepContext(config, shape, states, acts, prec, world_size, device_kind, other_bytes(config, states))
            planned[states] = tuple(fsdp_moments(ctx) if config.zero.uses_fsdp else ddp_moments(ctx))
        offloaded = states.params + states.grads + states.optimizer if offload else 0
        ranks.append(RankPlan(rank, states, acts.total, planned[states], offloaded))
    return Plan(config, device_kind, world_size, shape.num_params, tuple(ranks), device_memory(config, device_kind, world_size))


def planned_device_kind(config: TrainConfig) -> str:
    """The device the plan is for: a named accelerator or device=cuda plan for a GPU even
    where none is visible (mode=plan); auto is a GPU when one is visible."""
    if config.plan.accelerator is not None or config.device.value == "cuda":
        return "cuda"
    if config.device.value == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def planned_world_size(config: TrainConfig, device_kind: str) -> int:
    """nproc as given, never checked against this host (mode=plan plans for any cluster).

    auto: every visible GPU, else 2 CPU ranks, as a training run here would start; planning
    for a GPU where none is visible, one node of 8.
    """
    if config.nproc != "auto":
        return int(config.nproc)
    if device_kind == "cpu":
        return 2
    return torch.cuda.device_count() if torch.cuda.is_available() else 8


def predicted_peak_bytes(config: TrainConfig, world_size: int) -> int:
    """The worst rank's predicted peak tensor memory for this job on the device it runs on."""
    device_kind = "cuda" if config.device.value != "cpu" and torch.cuda.is_available() else "cpu"
    return build_plan(config, device_kind, world_size).peak_bytes


# ----------------------------------------------------------------------------- what the user reads


def describe(config: TrainConfig, world_size: int, device_kind: str) -> str:
    c = config
    return (
        f"model={c.model.name} zero={c.zero.stage.value} precision={c.precision.name} "
        f"checkpointing={c.checkpointing.mode.value} offload={c.offload.target.value} micro_batch={c.micro_batch} "
        f"seq_len={c.seq_len} grad_accum={c.grad_accum} on {world_size} {device_kind} ranks"
    )


def format_table(plan: Plan) -> str:
    """Per-rank table (GiB, or MiB for small jobs); ranks with the same figures share a row."""
    columns = ("params", "grads", "optimizer", "activations", "temporary", "other", "peak")
    unit, scale = ("GiB", 1.0) if plan.peak_bytes >= GIB else ("MiB", 1024.0)
    header = f"{'rank':>9} " + " ".join(f"{name:>11}" for name in columns) + f"  fits   ({unit})"
    rows: list[tuple[list[int], tuple[str, ...], str]] = []
    for rank in plan.ranks:
        figures = rank.figures()
        cells = tuple(f"{figures[name + '_gib'] * scale:11.2f}" for name in columns)
        fits = {True: "yes", False: "NO", None: "?"}[plan.rank_fits(rank)]
        if rows and rows[-1][1] == cells and rows[-1][2] == fits:
            rows[-1][0].append(rank.rank)
        else:
            rows.append(([rank.rank], cells, fits))
    lines = [header]
    for ranks, cells, fits in rows:
        label = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        lines.append(f"{label:>9} " + " ".join(cells) + f"  {fits}")
    return "\n".join(lines)


def format_plan(plan: Plan, way_out: bool = True) -> str:
    """The console report of mode=plan (and of every job before it launches: there a refusal
    comes as the job's error line, so the table ends with the short verdict)."""
    worst = plan.worst
    offloaded = f"; {worst.offloaded / GIB:.2f} GiB of model states per rank in host memory" if worst.offloaded else ""
    lines = [
        f"memory plan: {describe(plan.config, plan.world_size, plan.device_kind)}, {plan.num_params:,} parameters",
        format_table(plan),
        f"peak on rank {worst.rank} at {worst.peak.name}; model states at rest, activations at the end "
        f"of forward, temporary and other at the peak{offloaded}",
        verdict(plan, way_out),
    ]
    return "\n".join(lines)


def verdict(plan: Plan, way_out: bool = True) -> str:
    if plan.fits is None:
        return (
            f"fits: unknown ({plan.memory.source}); set plan.accelerator="
            f"{'|'.join(ACCELERATOR_MIB)} or device_memory_gib=N to compare"
        )
    figures = f"peak {plan.peak_bytes / GIB:.3g} GiB of {plan.memory.per_rank_bytes / GIB:.3g} GiB per rank ({plan.memory.source})"
    if plan.fits:
        return f"fits: {figures}"
    return (refusal(plan) or "") if way_out else f"does not fit: {figures}"


def refusal(plan: Plan) -> str | None:
    """None when every rank fits, else one line with the figures and a way out."""
    if plan.fits is not False:
        return None
    worst, c = plan.worst, plan.config
    parts = " + ".join(f"{name} {value / GIB:.2f}" for name, value in worst.peak.parts.items() if value)
    need = (
        f"{describe(c, plan.world_size, plan.device_kind)} ({plan.num_params / 1e9:.2f}B params) needs "
        f"{plan.peak_bytes / GIB:.2f} GiB on rank {worst.rank} at {worst.peak.name} ({parts})"
    )
    assert plan.memory.per_rank_bytes is not None
    have = f"each rank has {plan.memory.per_rank_bytes / GIB:.2f} GiB ({plan.memory.source})"
    return f"does not fit: {need}, but {have}. {way_out(plan)}"


def preflight(config: TrainConfig, device_kind: str, world_size: int) -> str | None:
    """None when the plan fits, else the one-line refusal (the job refuses it unless plan.enforce=false)."""
    return refusal(build_plan(config, device_kind, world_size))


def _changed(config: TrainConfig, **changes: Any) -> TrainConfig:
    """A copy of the config with nested keys changed (`zero__stage` is zero.stage)."""
    new = copy.deepcopy(config)
    for key, value in changes.items():
        *path, leaf = key.split("__")
        target = functools.reduce(getattr, path, new)
        setattr(target, leaf, value)
    return new


def single_changes(c: TrainConfig, world_size: int, device_kind: str) -> list[tuple[str, dict[str, Any], int]]:
    """Changes a user could make one at a time: (override text, changes, world size)."""
    options: list[tuple[str, dict[str, Any], int]] = []
    if c.checkpointing.mode != CheckpointMode.full:
        options.append(("checkpointing=full", {"checkpointing__mode": CheckpointMode.full}, world_size))
    if c.zero.stage != Stage.stage3:
        options.append(("zero=stage3", {"zero__stage": Stage.stage3}, world_size))
    factor = 2
    while c.micro_batch // factor >= 1:  # the same global batch in more, smaller micro-batches
        mb, accum = c.micro_batch // factor, c.grad_accum * factor
        options.append((f"micro_batch={mb} grad_accum={accum}", {"micro_batch": mb, "grad_accum": accum}, world_size))
        factor *= 2
    if device_kind == "cuda":
        # GPUs each bring their own memory (CPU ranks share one host, so more of them never helps).
        if c.offload.target == OffloadTarget.none:  # FSDP2's CPUOffloadPolicy: stage2 or stage3
            stage = c.zero.stage if c.zero.uses_fsdp else Stage.stage2
            text = "offload=cpu" if c.zero.uses_fsdp else "zero=stage2 offload=cpu"
            options.append((text, {"offload__target": OffloadTarget.cpu, "zero__stage": stage}, world_size))
        options += [(f"zero=stage3 nproc={n}", {"zero__stage": Stage.stage3}, n) for n in (2**k for k in range(13)) if n > world_size]
    return options


def way_out(plan: Plan) -> str:
    """The first few changes that fit (alone, else on top of checkpointing=full), with their peaks."""
    c, fitting, seen = plan.config, [], set()
    bases: list[tuple[str, dict[str, Any]]] = [("", {})]
    if c.checkpointing.mode != CheckpointMode.full:
        bases.append(("checkpointing=full ", {"checkpointing__mode": CheckpointMode.full}))
    for base_text, base in bases:
        for text, changes, world_size in single_changes(_changed(c, **base), plan.world_size, plan.device_kind):
            kind = text.split("=")[0]  # the smallest micro-batch / world size that fits is enough
            if kind in seen:
                continue
            option = build_plan(_changed(c, **base, **changes), plan.device_kind, world_size)
            if option.fits:
                fitting.append(f"{base_text}{text} (peak {option.peak_bytes / GIB:.2f} GiB)")
                seen.add(kind)
            if len(fitting) == 3:
                break
        if fitting:
            break
    tried = "Try " + ", or ".join(fitting) + ", or" if fitting else "Nothing simple fits: a smaller model or more memory per rank, or"
    return f"{tried} plan.enforce=false to try anyway."


def write_plan(out_dir: Path, plan: Plan) -> Path:
    path = out_dir / "plan.json"
    path.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    return path


def summary_fields(plan: Plan) -> dict[str, Any]:
    """What summary.json (and the W&B summary) carry of the plan."""
    worst = plan.worst
    return {
        "memory/predicted_peak_gib": plan.peak_bytes / GIB,
        "plan": {
            "fits": plan.fits,
            "peak_rank": worst.rank,
            "peak_moment": worst.peak.name,
            "device_memory_gib": None if plan.memory.per_rank_bytes is None else plan.memory.per_rank_bytes / GIB,
            "device_memory_source": plan.memory.source,
            **{key: value for key, value in worst.figures().items()},
        },
    }


# ----------------------------------------------------------------------------- sweeps


def sweep_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per sweep point that wrote a plan.json, in job order."""
    rows = []
    for job_dir in sorted(sweep_dir.iterdir(), key=_job_order):
        plan_path = job_dir / "plan.json"
        if not plan_path.is_file():
            continue
        plan = json.loads(plan_path.read_text())
        summary_path = job_dir / "summary.json"
        status = json.loads(summary_path.read_text()).get("status") if summary_path.is_file() else "planned"
        rows.append({"point": job_dir.name, "status": status, **plan})
    return rows


def _job_order(path: Path) -> tuple[int, str]:
    number = path.name.split("_", 1)[0]
    return (int(number) if number.isdigit() else 1 << 30, path.name)


def varying_overrides(names: list[str]) -> list[str]:
    """Each point's `N_key=value,...` directory name cut to the overrides that differ between points."""
    items = [dict(pair.partition("=")[::2] for pair in name.split("_", 1)[-1].split(",") if "=" in pair) for name in names]
    varying = [key for key in dict.fromkeys(k for point in items for k in point) if len({p.get(key) for p in items}) > 1]
    return [" ".join(f"{key}={point[key]}" for key in varying if key in point) or name for name, point in zip(names, items)]


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the sweep's plans: worst-rank peak, when, the memory, fits, status."""
    lines = [
        "| point | peak GiB (worst rank) | at | memory GiB per rank | fits | status |",
        "|---|---:|---|---:|---|---|",
    ]
    for row, label in zip(rows, varying_overrides([row["point"] for row in rows])):
        memory = "?" if row["device_memory_gib"] is None else f"{row['device_memory_gib']:.2f}"
        fits = {True: "yes", False: "no", None: "?"}[row["fits"]]
        peak = f"{row['peak_gib']:.2f} (rank {row['peak_rank']})"
        lines.append(f"| {row['point'].split('_')[0]}: {label} | {peak} | {row['peak_moment']} | {memory} | {fits} | {row['status']} |")
    return "\n".join(lines)


class PlanTable(Callback):
    """Hydra callback: at the end of a multirun, print the fit table of every point and keep
    it as plan_table.md in the sweep directory (conf/train.yaml registers it)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        rows = sweep_rows(sweep_dir)
        if not rows:
            return
        table = format_sweep(rows)
        (sweep_dir / "plan_table.md").write_text(f"# Memory plan of {sweep_dir}\n\n{table}\n")
        print(f"memory plan of the sweep ({len(rows)} points):\n{table}", flush=True)
