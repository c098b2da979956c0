"""A moment of one rank's step, and the temporaries every walk counts alike.

A step is a list of moments (docs/memory_plan.md, "What is modelled"). Each is the rank's model
states at rest (trainer/plan/states.py; its gradients replaced where the step holds others) plus
the activations saved so far, the temporaries alive then, and `other`; ddp_walk.py and
fsdp_walk.py list them, and trainer/plan/build.py calls the largest the peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import DataConfig, ModelConfig, OffloadTarget, ReduceEvery, TrainConfig, uses_fused
from trainer.plan.activations import Activations, Precisions, norm_bytes_per_token, sequence_shards
from trainer.plan.comm import REDUCE_BYTES
from trainer.plan.disk import chunk_temporary_bytes, nvme_buffer_bytes
from trainer.plan.fp8_backward import fp8_w2_backward
from trainer.plan.moe import expert_grad_bytes, expert_rows, moe_backward_peak, router_held_bytes
from trainer.plan.states import ModelShape, RankStates, with_experts


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
    world_size: int  # the ranks model states are sharded over: FSDP2's shard group (HSDP: zero.shard_ranks)
    device_kind: str
    other: int  # rotary table, data tables, Adam's step counters
    ep_rank: int = 0  # parallel.ep: the rank's place in the ep group, whose experts' rows it computes

    @property
    def tokens(self) -> int:
        return self.config.micro_batch * self.config.seq_len

    @property
    def offloaded(self) -> bool:
        """States in host memory while compute runs on the GPU (FSDP2 CPUOffloadPolicy: offload=cpu and nvme)."""
        return self.config.offload.on_host and self.device_kind == "cuda"

    @property
    def moments_on_disk(self) -> bool:
        """offload=nvme: Adam's moments live in a file per rank, streamed through one buffer (trainer/plan/disk.py)."""
        return self.config.offload.target == OffloadTarget.nvme

    def moment(self, name: str, grads: int | None = None, activations: int = 0, temporary: int = 0) -> Moment:
        """Model states at rest plus what the moment adds; `grads` replaces the at-rest gradients. Under
        offload=nvme the optimizer holds its buffer in memory instead of its moments."""
        if self.offloaded:  # on the host: not in the device's figure
            params = grads = optimizer = 0
        else:
            params, optimizer = self.states.params, self.states.optimizer
            grads = self.states.grads if grads is None else grads
            if self.moments_on_disk:
                optimizer = nvme_buffer_bytes(self.config.offload.buffer_mib)
        parts = dict(
            params=params, grads=grads, optimizer=optimizer, activations=activations, temporary=temporary
        )
        return Moment(name, {**parts, "other": self.other})


def incoming_gradient(ctx: StepContext) -> int:
    """The gradient arriving down the residual stream into a block's backward: B·T·D, residual dtype (T / tp
    positions under sequence parallelism)."""
    return ctx.prec.residual * ctx.tokens * ctx.config.model.dim // sequence_shards(ctx.config)


def block_backward_temporary(ctx: StepContext, weight_grad_bytes: int, weight_grad_held: bool) -> int:
    """Early in a block's backward: the gradient arriving from above and the MLP's gradients.

    w2's backward holds the gradient of the SwiGLU product (B·T·M) and of w2's weight; then
    the product's backward holds two B·T·M gradients while w2's saved input is already gone.
    DDP copies each weight gradient into its bucket at once (a transient); FSDP2 keeps the
    block's unsharded weight gradients until the block's reduce-scatter.
    """
    m, n, incoming = ctx.config.model, ctx.tokens, incoming_gradient(ctx)
    if m.is_moe:  # the experts' loop backward (trainer/plan/moe.py); the activations count what it freed
        rows = expert_rows(ctx.config, ctx.ep_rank, shard_ranks=ctx.world_size)
        grad = expert_grad_bytes(ctx.prec.regime, rows.apart)
        return incoming + moe_backward_peak(ctx.config, ctx.prec.compute, grad, rows, ctx.prec.regime)[1]
    nm, w2_grad = ctx.prec.compute * n * m.ffn_dim, weight_grad_bytes * m.dim * m.ffn_dim
    fp8 = fp8_w2_backward(ctx.config, ctx.prec.compute, ctx.prec.regime, incoming)  # 0 without fp8
    if weight_grad_held:
        return max(incoming + 2 * nm + w2_grad, fp8)
    if ctx.prec.regime == "autocast":
        # The bf16 weight gradient's fp32 cast (6 bytes per element at once) comes once the B·T·M
        # input gradient is consumed: measured with MemTracker on DDP, B·T of 16, 128 and 1024.
        return max(incoming + max(w2_grad, 2 * nm), fp8)
    return max(incoming + max(nm + w2_grad, 2 * nm), fp8)


def block_end_temporary(ctx: StepContext) -> int:
    """The end of a block's backward: its attention RMSNorm's backward, beside the gradient arriving
    down the residual (the block's weight gradients are counted by the caller). On CPU torch's
    composite RMSNorm peaks in pow's backward with five fp32 B·T·D tensors beside its fp32 input
    (docs/memory_plan.md, the torch sources and the MemTracker listing); CUDA runs the fused kernel. Under
    sequence parallelism the norm runs on T / tp positions.
    """
    incoming = incoming_gradient(ctx)
    if ctx.device_kind == "cuda":
        return 2 * incoming
    return incoming + 6 * 4 * ctx.tokens * ctx.config.model.dim // sequence_shards(ctx.config)


def ffn_norm_backward(ctx: StepContext) -> tuple[int, int]:
    """A block's ffn_norm backward: what the block's activations hold less by then, and its temporaries.

    The MLP's saved tensors are freed (the norm's output, as w1 and w3 saved it: 4·D per token, one fp32
    tensor or, under autocast, their two bf16 casts; under FSDP2's bf16 parameters one bf16 tensor, 2·D:
    torch's composite RMSNorm computes in fp32, the weight's product included, and casts the result back
    to its bf16 input's dtype (aten/src/ATen/native/layer_norm.cpp `rms_norm_composite`, `type_as(input)`);
    w1's, w3's, SiLU's outputs and the product, B·T·M/tp in the compute dtype), and so are the norm's own (its T / tp
    positions under SP), which its backward unpacks; the temporaries are block_end_temporary's (on CPU
    torch's composite RMSNorm backward), over the norm's T / tp positions. Measured with MemTracker at
    tp=2, with and without SP, fp32 and bf16: to the byte at zero=stage0; at stage3 (dp=2) bf16 without SP
    within 8,208 bytes of a 5,068,972-byte peak, the offset every bf16 block moment of that walk shows.
    """
    m, n, prec = ctx.config.model, ctx.tokens, ctx.prec
    shards = sequence_shards(ctx.config)
    output = 2 * m.dim if prec.regime == "fsdp_mp" else 4 * m.dim
    mlp = (output + 4 * prec.compute * m.ffn_dim) * n
    norm = norm_bytes_per_token(m.dim, prec.regime, ctx.device_kind) * n // shards
    return mlp + norm, block_end_temporary(ctx)


def optimizer_temporary(ctx: StepContext) -> int:
    """Adam's temporaries: the fused kernel (trainer/rank/optim.py's default on CUDA) updates in place
    and makes none; the per-tensor loop (CPU's default) makes `loop_temporary`; offload=nvme's chunked
    loop makes one chunk's (trainer/plan/disk.py), each chunk its own call, so nothing carries over from
    the tensor before. Offloaded states are updated on the host."""
    if ctx.offloaded:
        return 0
    if ctx.moments_on_disk:
        return chunk_temporary_bytes(ctx.config.offload.buffer_mib, ctx.states.largest_numel)
    if uses_fused(ctx.config.optim, ctx.device_kind):
        return 0
    return 4 * ctx.states.loop_temporary


def accumulation_grads(ctx: StepContext) -> int:
    """reduce_every=step: micro-batches before the last keep an unsharded gradient outside buckets
    and shards: DDP in the fp32 parameters' dtype, FSDP2 in the reduce dtype. Under DDP with parallel.ep
    not of the experts, which DDP leaves alone: their `.grad`s (the at-rest gradients) accumulate in place."""
    c = ctx.config
    if c.grad_accum == 1 or c.zero.reduce_every == ReduceEvery.micro_batch:
        return 0
    if c.zero.uses_fsdp:
        return REDUCE_BYTES[c.zero.reduce_dtype] * ctx.shape.num_params
    shape = with_experts(ctx.shape, None) if c.parallel.ep > 1 else ctx.shape
    return 4 * shape.num_params


def other_bytes(m: ModelConfig, data: DataConfig, states: RankStates) -> int:
    """The rotary table (complex64, every position), synthetic data's transition tables
    (int64 successors, float64 probabilities, float64 stationary distribution), Adam's steps and, for a
    mixture of experts, the routers' biases and the step's routing log (trainer/plan/moe.py)."""
    rope = rope_table_bytes(m)
    tables = 16 * m.vocab_size * data.branching + 8 * m.vocab_size if data.kind.value == "synthetic" else 0
    return rope + tables + states.step_counters + router_held_bytes(m)


def rope_table_bytes(m: ModelConfig) -> int:
    """The rotary table a model keeps (complex64, 8 bytes per position and frequency: decoder.py
    `build_rope_table`), once per model on a rank: a pipeline rank holds one per stage it runs
    (trainer/model/pipeline_split.py)."""
    return m.max_seq_len * (m.head_width // 2) * 8
