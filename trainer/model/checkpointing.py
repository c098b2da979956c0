"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

Applied on the meta-device model before sharding, so FSDP2 shards the wrapped blocks.

- full / selective: torch.utils.checkpoint (non-reentrant) around every block, or every Nth:
  the block keeps its input only and reruns whole in backward.
- op: per-operator selective checkpointing as torchtitan runs it, on torch's own
  `create_selective_checkpoint_contexts`: every block is checkpointed, but the outputs of the
  ops in `checkpointing.save_ops` are kept (MUST_SAVE) and only the rest is recomputed, except
  that every second matmul is recomputed all the same (torchtitan's "every other mm").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from trainer.config import CheckpointingConfig, CheckpointMode
from trainer.model.op_names import resolve_op
from trainer.private_apis.of_torch import CheckpointImpl, checkpoint_wrapper

# The matmuls of torchtitan's alternation: aten.linear too, for backends that keep it whole (on CPU
# and CUDA it decomposes into aten.mm before the dispatch mode sees it).
MM_OPS = ("aten.mm", "aten.linear")


# The matmuls of a block's forward in the order they run (trainer/model/decoder.py), what the
# policy's count goes by; tests/unit/model/test_checkpointing.py checks the plan built on it against a real block.
BLOCK_MATMULS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


def op_saved_matmuls(save_ops: list[str]) -> tuple[str, ...]:
    """The matmuls whose outputs mode=op keeps: the 1st, 3rd, ... of BLOCK_MATMULS, if the save list has a matmul op."""
    saved = any(op_saves(save_ops, name) for name in MM_OPS)
    return BLOCK_MATMULS[::2] if saved else ()


def op_saves(save_ops: list[str], op: str | None) -> bool:
    """Whether mode=op keeps the outputs of `op` (e.g. the SDPA op a run's kernel runs; None: no such op)."""
    return op is not None and resolve_op(op) in {resolve_op(name) for name in save_ops}


def should_checkpoint(layer_index: int, config: CheckpointingConfig) -> bool:
    if config.mode in (CheckpointMode.full, CheckpointMode.op):
        return True
    if config.mode == CheckpointMode.selective:
        return layer_index % config.every_n_layers == 0
    return False


def op_policy_context(save_ops: list[str]) -> Callable[[], Any]:
    """The `context_fn` of one checkpointed block: a fresh policy (and matmul count) per forward.

    torchtitan's policy (pytorch/torchtitan@1f02964, torchtitan/distributed/activation_checkpoint.py
    lines 105-139, `_apply_op_sac`; unchanged at b5bcd76, lines 243-287): count the matmuls of the
    block's forward; save the output of every op in the save list, except the 2nd, 4th, ... matmul,
    which is recomputed; recompute everything else. Left out, as this decoder has no use for
    them: its forced recompute of MoE router matmuls by shape and its saving of CUDA->CPU copies.
    The forward and the recompute keep counts of their own (torchtitan's `ctx.is_recompute`
    keys): torch 2.13 replays the forward's decisions by index, but torch 2.11 calls the policy
    again while it recomputes, and one count shared by both would run on there and hand wq's
    output to wk, wv's to wo and w1's to w3.
    """
    saved = frozenset(resolve_op(name) for name in save_ops)
    mm_ops = frozenset(resolve_op(name) for name in MM_OPS)

    def context_fn() -> Any:
        matmuls = {False: 0, True: 0}  # keyed by ctx.is_recompute

        def policy(ctx: SelectiveCheckpointContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if func in mm_ops:
                matmuls[ctx.is_recompute] += 1
                if matmuls[ctx.is_recompute] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def apply_activation_checkpointing(model: nn.Module, config: CheckpointingConfig) -> int:
    """Wrap the chosen transformer blocks in torch.utils.checkpoint (non-reentrant); returns how many."""
    # Non-reentrant: works with FSDP2's hooks and with inputs that need no grad (and SAC needs it).
    extra = {"context_fn": op_policy_context(config.save_ops)} if config.mode == CheckpointMode.op else {}
    wrapped = 0
    # By name: a pipeline stage's blocks keep their index in the whole model (trainer/model/pipeline_split.py),
    # and every_n_layers counts the model's blocks.
    for name, block in list(model.layers.named_children()):
        if should_checkpoint(int(name), config):
            wrapped_block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
            model.layers.register_module(name, wrapped_block)
            wrapped += 1
    return wrapped
