"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

Applied on the meta-device model before sharding, so FSDP2 shards the wrapped blocks.
"""

from __future__ import annotations

from torch import nn

from trainer.config import CheckpointingConfig, CheckpointMode
from trainer.private_apis.of_torch import CheckpointImpl, checkpoint_wrapper


def should_checkpoint(layer_index: int, config: CheckpointingConfig) -> bool:
    if config.mode == CheckpointMode.full:
        return True
    if config.mode == CheckpointMode.selective:
        return layer_index % config.every_n_layers == 0
    return False


def apply_activation_checkpointing(model: nn.Module, config: CheckpointingConfig) -> int:
    """Wrap the chosen transformer blocks in torch.utils.checkpoint (non-reentrant); returns how many."""
    wrapped = 0
    for index, block in enumerate(model.layers):
        if should_checkpoint(index, config):
            # Non-reentrant: works with FSDP2's hooks and with inputs that need no grad.
            model.layers[index] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            wrapped += 1
    return wrapped
