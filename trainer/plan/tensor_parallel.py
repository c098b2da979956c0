"""Tensor parallelism in the plan (parallel.tp, parallel.sp; the layout is trainer/rank/tensor_parallel.py's).

Model states: each TP rank holds a model whose column-parallel layers (wq, wk, wv, w1, w3, the output head)
have dim 0 divided by tp, whose row-parallel layers (wo, w2) have dim 1 divided by tp, whose embedding holds
vocab / tp rows, and whose norms are whole (replicated). That is the decoder of `tp_local_model`: the same
width D, H / tp and K / tp heads of the same head width, ffn_dim / tp, vocab / tp. The rest of the plan
(states, FSDP2's buffers over dp, the walk) is planned on it and on the dp ranks zero shards over.

Activations are those of the same local model (its H / tp heads, M / tp hidden, V / tp logits); without SP
that is exact for the tensors the layers save, since the residual stream and the norms are replicated.
With SP the norms, the residual and a checkpointed block's input hold T / tp positions, while each
column-parallel layer saves the all-gathered T positions of its input (trainer/plan/activations.py
`sequence_parallel_saving`). zero=stage0 runs without DDP (one data-parallel replica): its walk, with
loss_parallel's and the all-gathers' temporaries, is trainer/plan/tp_walk.py.

Communication in the tp group, per micro-batch, with B·T·D activations of `b` bytes (fp32: 4):

    per block, SP:      forward  all-gather (attention's input) + reduce-scatter (wo's output)
                                 + all-gather (the MLP's input) + reduce-scatter (w2's output)
                        backward the same four, each one's adjoint (reduce-scatter <-> all-gather; wq, wk
                        and wv share one gathered input, PrepareModuleInput's, so one adjoint for the three)
    per block, no SP:   forward  all-reduce (wo's output) + all-reduce (w2's output)
                        backward all-reduce of each column-parallel layer's input gradient (wq, wk, wv, w1, w3:
                        each layer converts its input on its own, Megatron-LM's f, so five)
    root:               the embedding's reduce-scatter (SP; all-reduce without) and its backward's all-gather,
                        the output head's all-gather of the final norm (SP) and its backward's reduce-scatter

each payload B·T·D·b bytes (a gather's output, a scatter's input); recomputed blocks (checkpointing) run
their forward's collectives again. gloo runs a reduce-scatter as an all-reduce (trainer/plan/comm.py).
"""

from __future__ import annotations

import copy
import dataclasses

from trainer.config import CheckpointMode, LossKind, ModelConfig, ReduceEvery, TpLocalModel, TrainConfig
from trainer.model.checkpointing import should_checkpoint
from trainer.plan.activations import precisions

Move = tuple[
    str, int, int
]  # as trainer/plan/comm.py: kind of collective, payload bytes per step, calls per step


def tp_local_model(model: ModelConfig, tp: int) -> ModelConfig:
    """The decoder one TP rank holds (module docstring); the model itself at tp = 1."""
    if tp == 1:
        return model
    fields = {field.name: getattr(model, field.name) for field in dataclasses.fields(ModelConfig)}
    return TpLocalModel(
        **{
            **fields,
            "n_heads": model.n_heads // tp,
            "n_kv_heads": model.n_kv_heads // tp,
            "ffn_dim": model.ffn_dim // tp,
            "vocab_size": model.vocab_size // tp,
            "head_dim": model.head_width,
        },
        tp=tp,
    )


def tp_local(config: TrainConfig) -> TrainConfig:
    """The job as one TP rank sees it: its local model (the config itself at tp = 1)."""
    if config.parallel.tp == 1:
        return config
    local = copy.copy(
        config
    )  # not dataclasses.replace: the local model must not meet the job's own checks again
    local.model = tp_local_model(config.model, config.parallel.tp)
    return local


def recomputed_blocks(config: TrainConfig) -> int:
    """Blocks whose forward runs again in backward (checkpointing full, selective, op)."""
    if config.checkpointing.mode == CheckpointMode.none:
        return 0
    return sum(should_checkpoint(i, config.checkpointing) for i in range(config.model.n_layers))


def tp_moves(
    config: TrainConfig, compute_bytes: int, backend: str, embedding: bool = True, head: bool = True
) -> list[Move]:
    """The tp group's collectives per optimizer step (module docstring), `compute_bytes` the compute dtype's.
    `config.model.n_layers` blocks; a pipeline rank (parallel.pp > 1) passes its stages' blocks, and whether it
    holds the `embedding` (the first stage) and the final norm, the output `head` and the loss (the last).

    Under autocast the residual stream, the norms' outputs and the gradients of fp32 tensors stay fp32
    (4 bytes); wo's and w2's outputs, and their gradients, are in the compute dtype. Besides the activations:
    with SP each norm's weight gradient is partial over the sequence shards and all-reduced (fp32, D each);
    loss_parallel all-reduces three fp32 values per token (the logits' max, the sum of exponentials, the
    target's logit).
    """
    if config.parallel.tp == 1:
        return []
    m, tp = config.model, config.parallel.tp
    tokens = config.micro_batch * config.seq_len
    # The residual stream's bytes: fp32 in fp32 and under autocast (the embedding's output, and the sums it
    # feeds, stay fp32), the parameters' dtype under FSDP2's mixed precision (activations.py `precisions`);
    # measured at tp=2 pp=2 stage3 bf16: every residual collective at 2 bytes an element.
    residual = precisions(config.precision, config.zero).residual
    stream, compute = tokens * m.dim * residual, tokens * m.dim * compute_bytes
    blocks = m.n_layers + recomputed_blocks(config)  # block forwards, recomputes included
    layers, accum, ends = m.n_layers, config.grad_accum, int(embedding) + int(head)
    loss = loss_all_reduces(config)  # loss=chunked: chunked_loss_moves adds its recomputes'
    reduces = [(loss * 4 * tokens, loss)] if head else []
    norm_grads: list[Move] = []  # per step, not per micro-batch (norm_reductions)
    if config.parallel.sequence_parallel:
        norms = 2 * layers + int(head)  # the blocks' and the final norm's weight gradients
        norm_grads = [
            ("all_reduce", 4 * m.dim * norms * norm_reductions(config), norms * norm_reductions(config))
        ]
        # forward: the norms' outputs gathered, wo's and w2's outputs scattered; backward: the adjoints;
        # the root: the embedding's scatter (its backward's gather) and the head's gather (its backward's scatter)
        gathered = 2 * blocks * stream + 2 * layers * compute + ends * stream
        # ProcessGroupGloo's flight-recorder entry of a functional all_gather_into_tensor lists its output as
        # one rank's chunk ([1, *input]), measured with torch 2.13 at tp=2; NCCL's lists the whole output.
        gathered //= tp if backend == "gloo" else 1
        gathers = [("all_gather", gathered, 2 * blocks + 2 * layers + ends)]
        scatters = [
            (
                "reduce_scatter",
                2 * blocks * compute + 2 * layers * stream + ends * stream,
                2 * blocks + 2 * layers + ends,
            )
        ]
    else:
        # forward: wo's and w2's outputs and the embedding's; backward: each column-parallel layer's input
        # gradient (wq, wk, wv, w1, w3: Megatron-LM's f, one per layer) and the head's, in the residual stream's dtype
        gathers, scatters = [], []
        reduces.append(
            (2 * blocks * compute + ends * stream + 5 * layers * stream, 2 * blocks + 5 * layers + ends)
        )
    moves = [*gathers, *scatters, ("all_reduce", sum(b for b, _ in reduces), sum(c for _, c in reduces))]
    if head and config.loss.kind == LossKind.chunked:
        moves += chunked_loss_moves(config, stream, backend)
        norm_grads += [] if config.parallel.sequence_parallel else final_norm_grad(config)
    return [(kind, accum * payload, accum * calls) for kind, payload, calls in moves] + norm_grads


def chunked_loss_moves(config: TrainConfig, stream: int, backend: str) -> list[Move]:
    """What loss=chunked adds to the head's collectives per micro-batch (`stream`: the final norm's B·T·D
    output, residual dtype), measured on 2 gloo ranks (tp=2, one chunk and three): each chunk's recompute runs
    the loss's all-reduces again (`loss_all_reduces`); under SP the final norm's output gradient arrives Partial (the
    chunks project the all-gathered output, not the head's module, whose ColwiseParallel would reduce-scatter it
    once, in the stream's dtype), and DTensor's backward through the norm reduce-scatters it three times, each
    fp32 B·T·D (torch's composite RMSNorm computes in fp32; measured at stage3 bf16, dp=2, where the stream
    is bf16), and all-gathers one fp32 value a token (gloo lists one rank's chunk, as tp_moves' gathers)."""
    tokens, tp = config.micro_batch * config.seq_len, config.parallel.tp
    chunks = -(-tokens // min(config.loss.chunk_tokens, tokens))
    # the loss's all-reduces per chunk, forward and recompute, less those of tp_moves' one loss
    loss = loss_all_reduces(config)
    moves: list[Move] = [("all_reduce", loss * 4 * tokens, 2 * loss * chunks - loss)]
    if config.parallel.sequence_parallel:
        gathered = 4 * tokens // (tp if backend == "gloo" else 1)
        fp32 = 4 * tokens * config.model.dim
        moves += [("reduce_scatter", 3 * fp32 - stream, 2), ("all_gather", gathered, 1)]
    return moves


def loss_all_reduces(config: TrainConfig) -> int:
    """The loss's all-reduces of one fp32 value a token over the TP group, per pass over the tokens:
    loss_parallel's three, and with loss.z_loss > 0 the z-loss's two, the max and the sum of exponentials of
    the vocabulary-sharded logits (trainer/model/loss.py `sharded_squared_logsumexp_sum`; measured at tp=2,
    loss=chunked in three chunks: 2,048 bytes a step more than without it, fp32 B·T = 128 tokens)."""
    return 3 + (2 if config.loss.z_loss > 0 else 0)


def final_norm_grad(config: TrainConfig) -> list[Move]:
    """loss=chunked without SP: the final norm's weight gradient is Partial (its output's gradient is each TP
    rank's local sum, trainer/rank/tensor_parallel.py `replicate_norm`), all-reduced as the SP norms' are
    (`norm_reductions`): D values in the gradient's dtype (fp32; bf16 under FSDP2's bf16 parameters, measured
    at tp=2 dp=2 stage3: 256 bytes on the tiny model)."""
    reductions = norm_reductions(config)
    width = precisions(config.precision, config.zero).residual
    return [("all_reduce", width * config.model.dim * reductions, reductions)]


def norm_reductions(config: TrainConfig) -> int:
    """How many times a step all-reduces the sequence-parallel norms' Partial weight gradients: in every backward
    without FSDP2 (trainer/rank/tensor_parallel.py `replicate_partial_grads`, a post-accumulate hook), with it
    at each of FSDP2's gradient reductions (every micro-batch, or once under zero.reduce_every=step and in a
    pipeline, whose PipelineStage syncs only the last backward): measured at tp=2 pp=2 interleaved_1f1b stage3,
    one all-reduce of the norms a step where 1f1b stage0 has four."""
    if config.zero.uses_fsdp and config.zero.reduce_every == ReduceEvery.step:
        return 1
    return config.grad_accum
