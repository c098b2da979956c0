"""Tensor parallelism in the plan (parallel.tp, parallel.sp; the layout is trainer/rank/tensor_parallel.py's).

Model states: each TP rank holds a model whose column-parallel layers (wq, wk, wv, w1, w3, the output head)
have dim 0 divided by tp, whose row-parallel layers (wo, w2) have dim 1 divided by tp, whose embedding holds
vocab / tp rows, and whose norms are whole (replicated). That is the decoder of `tp_local_model`: the same
width D, H / tp and K / tp heads of the same head width, ffn_dim / tp, vocab / tp. The rest of the plan
(states, FSDP2's buffers over dp, the walk) is planned on it and on the dp ranks zero shards over.

Activations are those of the same local model (its H / tp heads, M / tp hidden, V / tp logits); without SP
that is exact for the tensors the layers save, since the residual stream and the norms are replicated.
With SP the norms and residual hold T / tp positions, but each column-parallel layer saves the all-gathered
T positions of its input; the plan keeps the local model's count there (not modelled: SP's smaller norm inputs).

Communication in the tp group, per micro-batch, with B·T·D activations of `b` bytes (fp32: 4):

    per block, SP:      forward  all-gather (attention's input) + reduce-scatter (wo's output)
                                 + all-gather (the MLP's input) + reduce-scatter (w2's output)
                        backward the same four, each one's adjoint (reduce-scatter <-> all-gather)
    per block, no SP:   forward  all-reduce (wo) + all-reduce (w1/w3's input gradient in backward: f's adjoint)
                        i.e. 2 all-reduces forward and 2 backward (Megatron-LM's f and g)
    root:               the embedding's reduce-scatter (SP; all-reduce without) and its backward's all-gather,
                        the output head's all-gather of the final norm (SP) and its backward's reduce-scatter

each payload B·T·D·b bytes (a gather's output, a scatter's input); recomputed blocks (checkpointing) run
their forward's collectives again. gloo runs a reduce-scatter as an all-reduce (trainer/plan/comm.py).
"""

from __future__ import annotations

import copy
import dataclasses

from trainer.config import CheckpointMode, ModelConfig, TrainConfig
from trainer.model.checkpointing import should_checkpoint

Move = tuple[
    str, int, int
]  # as trainer/plan/comm.py: kind of collective, payload bytes per step, calls per step

ACTIVATION_BYTES = 4
"""The residual stream's bytes: fp32 (the embedding's output, and the sums it feeds, stay fp32 under autocast)."""


def tp_local_model(model: ModelConfig, tp: int) -> ModelConfig:
    """The decoder one TP rank holds (module docstring); the model itself at tp = 1."""
    if tp == 1:
        return model
    return dataclasses.replace(
        model,
        n_heads=model.n_heads // tp,
        n_kv_heads=model.n_kv_heads // tp,
        ffn_dim=model.ffn_dim // tp,
        vocab_size=model.vocab_size // tp,
        head_dim=model.head_width,
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


def tp_moves(config: TrainConfig, compute_bytes: int) -> list[Move]:
    """The tp group's collectives per optimizer step (module docstring), `compute_bytes` the compute dtype's. Under autocast the residual stream,
    the norms' outputs and their gradients stay fp32 (4 bytes); wo's and w2's outputs, and their gradients,
    are in the compute dtype."""
    if config.parallel.tp == 1:
        return []
    tokens = config.micro_batch * config.seq_len * config.model.dim
    fp32, compute = tokens * ACTIVATION_BYTES, tokens * compute_bytes
    blocks = config.model.n_layers + recomputed_blocks(config)  # block forwards, recomputes included
    layers, accum = config.model.n_layers, config.grad_accum
    if config.parallel.sp:
        # forward: the norms' outputs gathered, wo's and w2's outputs scattered; backward: each one's adjoint;
        # the root: the embedding's scatter (its backward's gather) and the head's gather (its backward's scatter)
        gathers = (2 * blocks * fp32 + 2 * layers * compute + 2 * fp32, 2 * blocks + 2 * layers + 2)
        scatters = (2 * blocks * compute + 2 * layers * fp32 + 2 * fp32, 2 * blocks + 2 * layers + 2)
        return [
            ("all_gather", accum * gathers[0], accum * gathers[1]),
            ("reduce_scatter", accum * scatters[0], accum * scatters[1]),
        ]
    # forward: wo's and w2's outputs all-reduced and the embedding's; backward: the column-parallel layers'
    # input gradients (Megatron-LM's f) in fp32, and the head's
    reduces = (2 * blocks * compute + fp32 + 2 * layers * fp32 + fp32, 2 * blocks + 2 * layers + 2)
    return [("all_reduce", accum * reduces[0], accum * reduces[1])]
