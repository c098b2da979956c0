"""Context parallelism in the plan (parallel.cp, parallel.cp_impl; the model's side is
trainer/model/context_parallel.py).

Model states: ZeRO works over dp and cp alike (trainer/layout.py), so FSDP2 (stages 2-3) shards over
dp_shard x cp ranks (`Layout.shard_size`, the rank's shard `Layout.shard_index`) and DDP (stages 0-1)
replicates over dp_replicate x cp (ZeroRedundancyOptimizer, stage1, partitions over all of them).

Activations: a rank holds T / cp positions of every row, and every module but attention runs on them as it
would on a row of T / cp, so the plan walks one rank's step as a job of seq_len T / cp (`cp_local`, as
trainer/plan/tensor_parallel.py's `tp_local` plans one TP rank's layers) and adds what attention's
exchange changes (`CpActivations`):

- ulysses: q, k, v go through an all-to-all each to (B, T, heads / cp, Q), and SDPA saves them, its output
  and its logsumexp: per rank exactly the bytes of T / cp positions with every head. wo saves the output's
  all-to-all result, a tensor of its own, where without cp its input is a view of SDPA's output (the flash
  kernels write it B, T, H, Q): one H·Q tensor more per block (the autograd graph's saved tensors, listed
  at cp = 1 and 2 on CPU: identical shapes, one storage more). The tensors of the
  exchange (each send buffer, the received tensor, its reshape and its reordering copy) are saved by none;
  they are transients of the forward and of the backward's all-to-alls. A document mask is the whole row's,
  B x T x T (SDPA's additive copy per block too: T values per local token times cp).
- allgather: K and V all-gathered (cp x 2B x T / cp x K x Q, then a copy each in row order), which SDPA saves
  in place of the rank's own: 2·K·Q·(cp - 1) more values per local token per block (2·H·Q·(cp - 1) where the
  kernel takes K/V repeated to every query head: CUDA's efficient one in fp32); and every block's
  boolean mask of its queries against all keys (1 or B, 1, T / cp, T), which SDPA turns into an additive
  mask of the compute dtype and the fused kernels save.
- both: the rotary table read at the rank's positions (`index_select`, complex64 T / cp x Q/2: 8 bytes a
  value), made once per forward and saved by every block's apply_rope; the loop holds the whole rows of
  inputs and targets beside the rank's positions of them; the model keeps the positions it indexes by
  (int64: the rank's, the gathered order and its inverse permutation) from its first forward on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from trainer.config import TrainConfig
from trainer.model.attention import SdpaChoice
from trainer.model.checkpointing import should_checkpoint


def cp_local(config: TrainConfig) -> TrainConfig:
    """The job as one cp rank's step sees it: rows of T / cp positions (the config itself at cp = 1).
    `row_length` gives the whole row back."""
    if config.parallel.cp == 1:
        return config
    local = copy.copy(config)  # not dataclasses.replace: T / cp must not meet the job's own checks again
    local.seq_len = config.seq_len // config.parallel.cp
    return local


def row_length(local: TrainConfig) -> int:
    """The whole row's positions of a `cp_local` config: what attention sees."""
    return local.seq_len * local.parallel.cp


@dataclass(frozen=True)
class CpActivations:
    """What attention's exchange adds to a rank's activations of T / cp positions, per micro-batch (bytes)."""

    per_block: int  # saved by each block beyond a T / cp row's set
    kept: int  # made once per forward, saved by every block until the last backward: the rotary table
    rows: int  # the loop's whole rows of inputs and targets beside the rank's positions
    mask: int  # allgather's boolean mask: alive through forward, and kept through backward by checkpointing


def cp_activations(local: TrainConfig, compute: int, choice: SdpaChoice) -> CpActivations:
    """Context parallelism's additions (module docstring) on a `cp_local` config, `compute` the compute dtype's
    bytes, `choice` the run's SDPA kernel: the fused ones save the additive mask (math does not), and a kernel
    that cannot group heads (`repeat_kv`) saves K and V repeated to every query head, over the whole row."""
    cp = local.parallel.cp
    if cp == 1:
        return CpActivations(0, 0, 0, 0)
    m, B, t, T = local.model, local.micro_batch, local.seq_len, row_length(local)
    per_block, mask = 0, 0
    if local.parallel.cp_impl == "ulysses":
        # wo saves the output's all-to-all result, where without cp it saves a view of SDPA's own output
        # (the flash kernels lay it out B, T, H, Q; cuDNN as q, the same): one more H·Q tensor per block
        per_block = m.n_heads * m.head_width * B * t * compute
    else:
        heads = m.n_heads if choice.repeat_kv else m.n_kv_heads  # the K/V heads SDPA saves
        per_block = 2 * heads * m.head_width * (cp - 1) * B * t * compute
        rows = B if local.data.masks_documents else 1  # causal: one (1, 1, t, T) mask for the whole batch
        mask = rows * t * T
        per_block += 0 if choice.saves_scores else compute * mask
    rope = t * (m.head_width // 2) * 8  # complex64
    return CpActivations(per_block, rope, 16 * B * (T - t), mask)


def mask_kept(local: TrainConfig, cp: CpActivations) -> int:
    """allgather's mask beside the batch through backward: where a block is checkpointed its recompute takes
    the mask as an input, which the checkpoint keeps; else it dies with forward's end."""
    checkpointed = any(should_checkpoint(i, local.checkpointing) for i in range(local.model.n_layers))
    return cp.mask if checkpointed else 0


def cp_positions(local: TrainConfig) -> int:
    """The int64 positions a cp rank's model indexes rows by, kept from its first forward on (its own T / cp,
    the gathered order's T and its inverse permutation's T: trainer/model/context_parallel.py `positions`)."""
    if local.parallel.cp == 1:
        return 0
    return 8 * (local.seq_len + 2 * row_length(local))


def per_forward_kept(local: TrainConfig) -> int:
    """What each forward of a stage makes once and its blocks keep until that micro-batch's backward, so a
    pipeline holds it per micro-batch in flight (trainer/plan/pipeline.py `stage_activations`, where the pp = 1
    walk's `batch` counts it once): the rotary angles of the rank's positions (`index_select`, complex64), and
    allgather's mask where a checkpoint keeps it (`mask_kept`)."""
    if local.parallel.cp == 1:
        return 0
    m, B, t, T = local.model, local.micro_batch, local.seq_len, row_length(local)
    rope = t * (m.head_width // 2) * 8
    mask = 0
    if local.parallel.cp_impl == "allgather":
        mask = mask_kept(local, CpActivations(0, 0, 0, (B if local.data.masks_documents else 1) * t * T))
    return rope + mask
