"""The activation table: what one micro-batch's autograd graph saves on a rank, block by block.

The bytes per token are re-derived from what zerolab's block saves in each precision regime
(fp32, autocast at stages 0-1, FSDP2's mixed precision at stages 2-3), attention kernel, device
kind and checkpointing mode; the derivation, its table and how it was checked are in
docs/memory_plan.md ("What is modelled": Activations, Per-operator checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import (
    CheckpointMode,
    DType,
    LossKind,
    ModelConfig,
    PrecisionConfig,
    TrainConfig,
    ZeroConfig,
)
from trainer.model.attention import config_choice, sdpa_op
from trainer.model.checkpointing import op_saved_matmuls, op_saves, should_checkpoint
from trainer.model.fp8 import autocast_input_saving
from trainer.plan.context_parallel import cp_activations, mask_kept, row_length
from trainer.plan.moe import (
    dense_mlp_hidden_bytes,
    expert_grad_bytes,
    expert_rows,
    moe_backward_peak,
    moe_saved_bytes,
)

BATCH_BYTES_PER_TOKEN = 16  # int64 inputs and targets
DOCUMENTS_BYTES_PER_TOKEN = 8  # data.packing=document: each position's int64 document number, with the batch
NLL_TOTAL_WEIGHT = 4  # nll_loss's fp32 total weight, saved for its backward


@dataclass(frozen=True)
class Precisions:
    """Bytes per element where the compute dtype shows, for one stage and precision."""

    regime: str  # fp32 | autocast (stages 0-1, bf16/fp16) | fsdp_mp (stages 2-3, bf16/fp16)
    compute: int  # matmul outputs, attention
    residual: int  # the residual stream between blocks
    param: int  # the weights matmuls read (FSDP2's unsharded copy; autocast's cached cast)


def precisions(precision: PrecisionConfig, zero: ZeroConfig) -> Precisions:
    if precision.compute_dtype == DType.float32:
        return Precisions("fp32", 4, 4, 4)
    if zero.uses_fsdp:
        return Precisions("fsdp_mp", 2, 2, 2)
    return Precisions("autocast", 2, 4, 2)  # embedding output and residual adds stay fp32


def block_bytes_per_token(m: ModelConfig, regime: str, device_kind: str = "cpu") -> int:
    """Saved activations of one transformer block, per token (docs/memory_plan.md's table).

    q and the SDPA output are H·Q wide (HQ, = D unless `head_dim` sets Q apart). q/k RMSNorm
    (Qwen3) saves, in every regime, its fp32 input (upcast) and x·rstd of each head and an fp32
    rstd per head: 8·(HQ + KQ) + 4·(H + K); its output only passes through the rotary embedding, whose
    complex multiply saves the table alone (decoder.py `apply_rope`).
    On CUDA the block's two RMSNorms run the fused kernel and save less (`fused_norm_saving`); the
    q/k norms are counted as on CPU (not yet checked against the CUDA kernel).
    """
    D, M, H, HQ, KQ = m.dim, m.ffn_dim, m.n_heads, m.n_heads * m.head_width, m.n_kv_heads * m.head_width
    stats = 4 * H + 8  # SDPA logsumexp (fp32 per head) and the two RMSNorm rstd (fp32)
    qk_norm = 8 * (HQ + KQ) + 4 * (H + m.n_kv_heads) if m.qk_norm else 0
    fused = 2 * fused_norm_saving(D, regime) if device_kind == "cuda" else 0
    if regime == "fp32":
        return 4 * (6 * D + 2 * HQ + 2 * KQ + 4 * M) + stats + qk_norm - fused
    if regime == "autocast":
        return 26 * D + 4 * HQ + 4 * KQ + 8 * M + stats + qk_norm - fused
    return 20 * D + 4 * HQ + 4 * KQ + 8 * M + stats + qk_norm - fused


def fused_norm_saving(dim: int, regime: str) -> int:
    """Bytes per token one RMSNorm saves less on CUDA than on CPU: torch's fused kernel saves its
    input (D in the residual dtype) where the CPU decomposition saves an fp32 upcast and x·rstd
    (4D + 4D); why, with torch's sources: docs/memory_plan.md, "What is modelled"."""
    residual = 2 if regime == "fsdp_mp" else 4
    return 8 * dim - residual * dim


def head_bytes_per_token(m: ModelConfig, regime: str, device_kind: str = "cpu", chunked: bool = False) -> int:
    """Saved after the blocks, per token: final RMSNorm (input, x·rstd, output; on CUDA the fused
    kernel's input only, `fused_norm_saving`) and log_softmax (fp32).

    loss=chunked saves no log-softmax (each chunk's is recomputed in backward) and, as the chunks'
    checkpoint input, the norm output itself: fp32 under autocast, where the full loss saves the
    head's bf16 cast of it.
    """
    fused = fused_norm_saving(m.dim, regime) if device_kind == "cuda" else 0
    if chunked:
        return 4 * m.dim + 4 * m.dim + (2 if regime == "fsdp_mp" else 4) * m.dim + 4 - fused
    norm_output = 4 * m.dim if regime == "fp32" else 2 * m.dim
    return 4 * m.dim + 4 * m.dim + norm_output + 4 + 4 * m.vocab_size - fused


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch on one rank."""

    blocks: tuple[int, ...]  # saved by each block in forward (its input only when checkpointed)
    full_block: int  # one block's full set (a checkpointed block recomputes it in backward)
    head: int  # final norm + fp32 log-softmax
    log_softmax: int
    batch: int
    unread: int = 0  # checkpointing=op: a block's saved outputs its recompute stops before reading (w2's)
    inputs_kept: tuple[int, ...] = ()  # per block: its checkpointed input, alive beside its recompute
    # a pipeline stage: its first block's saved input that is its receive buffer (counted with the buffers)
    received: int = 0
    # model.n_experts > 0: what a block's set has freed by its backward's peak, the experts' (trainer/plan/moe.py)
    freed_at_peak: int = 0

    @property
    def in_backward(self) -> int:
        """What a block holds at the start of its backward: its full set back, and what stays unread
        until its backward ends (the policy's storage lives as long as the block's graph); under a mixture of
        experts, less what the block's backward has freed by the experts' peak."""
        return self.full_block + self.unread - self.freed_at_peak

    def in_backward_of(self, block: int) -> int:
        """in_backward, plus block `block`'s checkpointed input where its recompute does not save the
        input itself (`checkpoint_input_kept`)."""
        return self.in_backward + (self.inputs_kept[block] if self.inputs_kept else 0)

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.head + self.batch - self.received

    @property
    def before_last_block(self) -> int:
        """Saved by every block but the last, plus the batch: what the last block adds to (less `received`,
        which the first block's set counts)."""
        return sum(self.blocks[:-1]) + self.batch - self.received


def attention_extra_per_token(config: TrainConfig, device_kind: str) -> int:
    """What the run's SDPA kernel (trainer/model/attention.py) saves per token beyond the flash kernel's
    q, k, v, output and logsumexp, which block_bytes_per_token counts.

    cuDNN's kernel (attention=cudnn) saves what flash saves, K/V unrepeated: nothing more (its two philox
    scalars are left out as flash's rng state is). K/V repeated for a kernel that cannot group heads:
    2·(H - K)·Q more values. Math: its scaled
    q, the repeated K and V and the B·H·T·T softmax output, and no logsumexp, all in fp32 on CPU and
    CUDA alike: torch's math kernel upcasts half dtypes unless
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True), which zerolab leaves off (the GPU
    check's first run, 2026-12-04: 125m bf16 under math held 2.73 GiB more than a bf16 count, the
    fp32 count's difference is 2.67). (Math's transient pre-softmax scores, alive for one op in
    forward, are not modelled.) Under parallel.cp (a `cp_local` config) each local query's scores span the
    whole row under either exchange (trainer/plan/context_parallel.py); allgather's repeated K/V of the whole
    row are not counted (not measured).
    """
    m, prec = config.model, precisions(config.precision, config.zero)
    choice = config_choice(config, device_kind)
    HQ, H, KQ, T = m.n_heads * m.head_width, m.n_heads, m.n_kv_heads * m.head_width, row_length(config)
    flash = prec.compute * (HQ + 2 * KQ) + 4 * H
    if choice.saves_scores:
        return 4 * (3 * HQ + H * T) - flash
    return 2 * (HQ - KQ) * prec.compute if choice.repeat_kv else 0


def document_packing(config: TrainConfig) -> bool:
    """data.packing=document, which data=text alone reads (trainer/data.py): the model gets each token's document."""
    return config.data.masks_documents


def document_mask_per_token(config: TrainConfig, device_kind: str) -> int:
    """data.packing=document: what each block's attention saves of the block-causal mask, per token.

    The mask (trainer/model/decoder.py `block_causal_mask`) is B·T·T bools, made once per forward and
    handed to every block. SDPA turns a boolean attn_mask into an additive one in q's dtype (0 where
    True, -inf where False: aten's `convert_boolean_attn_mask`) before it dispatches, so every block
    makes a B·1·T·T tensor of the compute dtype, which the fused kernels (CPU's flash, CUDA's
    efficient and cuDNN) save for backward: T values per token. Math's composite adds it to the scores, whose
    backward needs nothing of it. Measured (MemTracker, tiny, fp32, 1 CPU rank, micro_batch=2): 4 x 2·T·T
    fp32 beyond concat packing's peak at T = 128 and 512, and the document numbers (DOCUMENTS_BYTES_PER_TOKEN).
    Under parallel.cp=ulysses each rank's blocks attend whole rows under the row's mask (cp x T values per local
    token); allgather's mask is its own (trainer/plan/context_parallel.py)."""
    if not document_packing(config) or cp_gathers(config):
        return 0
    choice = config_choice(config, device_kind)
    T = row_length(config)
    return (
        0
        if choice.saves_scores
        else precisions(config.precision, config.zero).compute * T * config.parallel.cp
    )


def cp_gathers(config: TrainConfig) -> bool:
    """parallel.cp > 1 with the K/V all-gather, whose mask trainer/plan/context_parallel.py counts."""
    return config.parallel.cp > 1 and config.parallel.cp_impl == "allgather"


def document_mask_kept(config: TrainConfig) -> int:
    """data.packing=document: the boolean mask itself (B·T·T bytes), beside the batch from forward through
    backward where a block is checkpointed (its recompute takes the mask as an input, which the checkpoint
    keeps); without checkpointing it dies with forward's end, SDPA having saved its own copy (above). Under
    parallel.cp=ulysses it is the whole row's (B·T·T); allgather's is counted with context parallelism's."""
    if not document_packing(config) or cp_gathers(config):
        return 0
    checkpointed = any(should_checkpoint(i, config.checkpointing) for i in range(config.model.n_layers))
    return config.micro_batch * row_length(config) ** 2 if checkpointed else 0


def op_checkpointed_bytes_per_token(config: TrainConfig, device_kind: str) -> int:
    """checkpointing=op: what a block keeps from its forward to its backward, per token.

    Its input (as every checkpointed block) and the outputs the policy saves
    (trainer/model/checkpointing.py): the 1st, 3rd, 5th and 7th matmul (wq, wv, w1, w2) when the
    save list has aten.mm, and the SDPA op's output and fp32 logsumexp when it has the op the
    run's kernel runs (math has none: its composite op decomposes first). The saved outputs are
    kept whether or not backward needs them (w2's output, which no backward reads, included).
    """
    m, prec = config.model, precisions(config.precision, config.zero)
    HQ, KQ = m.n_heads * m.head_width, m.n_kv_heads * m.head_width  # HQ = D unless `head_dim` sets it apart
    widths = {"wq": HQ, "wk": KQ, "wv": KQ, "wo": m.dim, "w1": m.ffn_dim, "w3": m.ffn_dim, "w2": m.dim}
    save_ops = config.checkpointing.save_ops
    kept = prec.residual * m.dim + sum(prec.compute * widths[name] for name in op_saved_matmuls(save_ops))
    choice = config_choice(config, device_kind, m)
    if op_saves(save_ops, sdpa_op(choice, device_kind)):
        kept += prec.compute * HQ + 4 * m.n_heads
    return kept


def fp8_saving_per_token(config: TrainConfig, prec: Precisions, device_kind: str) -> int:
    """precision=fp8: what a block saves less than under bf16, per token. torchao's Float8Linear saves
    its high-precision input and weight for backward, not their fp8 casts (trainer/model/fp8.py), so
    under FSDP2's bf16 parameters it saves exactly what nn.Linear does; under autocast it differs
    only in which casts of the norms' outputs it keeps (`autocast_input_saving`)."""
    if not config.precision.is_fp8 or prec.regime != "autocast":
        return 0
    return autocast_input_saving(config.model, config.precision, device_kind)


def checkpoint_input_kept(prec: Precisions, device_kind: str) -> int:
    """Bytes per element of a checkpointed block's input that stay alive beside its recomputed set:
    the checkpoint's frame keeps the input for the recompute, which saves that same tensor except
    under FSDP2's half-precision residual on CPU, where RMSNorm saves an fp32 upcast instead
    (docs/memory_plan.md, "What is modelled": the torch source and the measurement)."""
    return prec.residual if norm_upcasts_input(prec, device_kind) else 0


def norm_upcasts_input(prec: Precisions, device_kind: str) -> bool:
    """Whether a block's RMSNorm saves an fp32 upcast of its input rather than the input itself: under FSDP2's
    half-precision residual on CPU (torch's composite rms_norm; in fp32 and autocast's fp32 residual the upcast
    is the input, and CUDA's fused kernel saves its input)."""
    return prec.regime == "fsdp_mp" and device_kind == "cpu"


def norm_bytes_per_token(dim: int, regime: str, device_kind: str) -> int:
    """What one of a block's RMSNorms saves per token (block_bytes_per_token's share of it): on CPU its fp32
    upcast input and x·rstd (8·D) and its fp32 rstd; on CUDA the fused kernel's input instead."""
    fused = fused_norm_saving(dim, regime) if device_kind == "cuda" else 0
    return 8 * dim + 4 - fused


def sequence_shards(config: TrainConfig) -> int:
    """How many ranks the residual stream's sequence is split over: parallel.tp under sequence parallelism
    (trainer/rank/tensor_parallel.py: the norms, the residual adds and a checkpointed block's input hold
    T / tp positions), else 1."""
    return config.parallel.tp if config.parallel.sequence_parallel else 1


def sequence_parallel_saving(config: TrainConfig, device_kind: str) -> tuple[int, int]:
    """Bytes per micro-batch one block and the head save less under sequence parallelism: each norm
    (a block's two, the head's final one) saves its tensors for its T / tp positions only, so a rank saves
    1 / tp of them; the column-parallel layers after it save their all-gathered input whole (all T), as
    block_bytes_per_token counts it."""
    shards = sequence_shards(config)
    if shards == 1:
        return 0, 0
    prec = precisions(config.precision, config.zero)
    tokens = config.micro_batch * config.seq_len
    norm = norm_bytes_per_token(config.model.dim, prec.regime, device_kind) * tokens
    saved = norm - norm // shards
    return 2 * saved, saved


def moe_block_change(config: TrainConfig, prec: Precisions, ep_rank: int = 0, shard_ranks: int = 0) -> int:
    """model.n_experts > 0: what a block saves more (or less) with a mixture of experts in place of the dense MLP
    the table counts (trainer/plan/moe.py); 0 for a dense model."""
    if not config.model.is_moe:
        return 0
    saved = moe_saved_bytes(
        config, prec.compute, expert_rows(config, ep_rank, shard_ranks=shard_ranks), prec.regime
    )
    return saved - dense_mlp_hidden_bytes(config, prec.compute)


def activations(
    config: TrainConfig, device_kind: str = "cpu", ep_rank: int = 0, shard_ranks: int = 0
) -> Activations:
    """One rank's activations; under parallel.cp `config` is the rank's `cp_local` job (T / cp positions),
    and context parallelism's additions come on top (trainer/plan/context_parallel.py); under parallel.ep those
    of ep rank `ep_rank`, whose experts compute the rows trainer/plan/moe.py gives it (`shard_ranks`: FSDP2's
    shard group, where an ep group inside it has FSDP2 gather the experts)."""
    m, prec = config.model, precisions(config.precision, config.zero)
    tokens = config.micro_batch * config.seq_len
    block_sp, head_sp = sequence_parallel_saving(config, device_kind)
    cp = cp_activations(config, prec.compute, config_choice(config, device_kind))
    full = (
        (
            block_bytes_per_token(m, prec.regime, device_kind)
            + attention_extra_per_token(config, device_kind)
            + document_mask_per_token(config, device_kind)
            - fp8_saving_per_token(config, prec, device_kind)
        )
        * tokens
        - block_sp
        + cp.per_block
        + moe_block_change(config, prec, ep_rank, shard_ranks)
    )
    # non-reentrant checkpoint keeps the block's input: T / tp positions of it under sequence parallelism
    checkpointed, unread = prec.residual * m.dim * tokens // sequence_shards(config), 0
    if config.checkpointing.mode == CheckpointMode.op:
        checkpointed = op_checkpointed_bytes_per_token(config, device_kind) * tokens
        # Early stop ends the recompute once w2's input is back, before w2 runs: its saved output is never read.
        unread = (
            prec.compute * m.dim * tokens if "w2" in op_saved_matmuls(config.checkpointing.save_ops) else 0
        )
    blocks = tuple(
        checkpointed if should_checkpoint(i, config.checkpointing) else full for i in range(m.n_layers)
    )
    kept = checkpoint_input_kept(prec, device_kind) * m.dim * tokens // sequence_shards(config)
    inputs_kept = tuple(kept if should_checkpoint(i, config.checkpointing) else 0 for i in range(m.n_layers))
    # the documents of whole rows (every cp rank's mask needs the row's)
    documents = (
        DOCUMENTS_BYTES_PER_TOKEN * config.micro_batch * row_length(config) if document_packing(config) else 0
    )
    held = cp.kept + cp.rows + mask_kept(config, cp)  # parallel.cp's rotary table, whole rows, kept mask
    batch = BATCH_BYTES_PER_TOKEN * tokens + documents + document_mask_kept(config) + held
    freed = 0
    if m.is_moe:  # the experts' backward peak (trainer/plan/moe.py): what the block's set has freed by then
        rows = expert_rows(config, ep_rank, shard_ranks=shard_ranks)
        freed, _ = moe_backward_peak(
            config, prec.compute, expert_grad_bytes(prec.regime, rows.apart), rows, prec.regime
        )
    if config.loss.kind == LossKind.chunked:  # nothing of the loss is saved: recomputed per chunk
        head = head_bytes_per_token(m, prec.regime, device_kind, chunked=True) * tokens
        if head_sp:  # sequence parallelism: the final norm's T / tp positions, and the chunks' whole input
            head += prec.residual * m.dim * tokens // sequence_shards(config) - head_sp
        return Activations(blocks, full, head, 0, batch, unread, inputs_kept, freed_at_peak=freed)
    head = head_bytes_per_token(m, prec.regime, device_kind) * tokens + NLL_TOTAL_WEIGHT - head_sp
    return Activations(
        blocks, full, head, 4 * m.vocab_size * tokens, batch, unread, inputs_kept, freed_at_peak=freed
    )
