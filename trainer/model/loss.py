"""The loss: next-token cross-entropy in fp32, over all logits at once or by chunks of tokens.

`loss=full` (trainer/rank/loop.py `cross_entropy`) projects every token to the vocabulary and takes
the log-softmax in fp32: B·T·V logits, their fp32 copy, the log-softmax saved for backward and its
two gradients, which at a 128k vocabulary are the largest tensors of a step.

`loss=chunked` projects and takes the loss `chunk_tokens` tokens at a time, each chunk under
`torch.utils.checkpoint` (non-reentrant): forward keeps only the chunk's scalar, backward recomputes
the chunk's logits and frees them before the next chunk's. So no fp32 B·T·V tensor is ever whole:
the logits-sized tensors are chunk_tokens·V, at the cost of a second output projection per chunk.
The sum of the chunks' summed losses over the token count is the mean the full loss takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def chunk_loss_sum(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, targets_C: torch.Tensor) -> torch.Tensor:
    """The summed fp32 cross-entropy of one chunk: the output projection, then the loss."""
    return F.cross_entropy(F.linear(hidden_CD, weight_VD).float(), targets_C, reduction="sum")


def chunked_cross_entropy(
    hidden_BTD: torch.Tensor, weight_VD: torch.Tensor, targets_BT: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Mean next-token loss of `hidden_BTD` projected by `weight_VD`, chunk_tokens tokens at a time."""
    hidden_ND, targets_N = hidden_BTD.flatten(0, 1), targets_BT.flatten()
    total = torch.zeros((), device=hidden_ND.device)
    for hidden_CD, targets_C in zip(hidden_ND.split(chunk_tokens), targets_N.split(chunk_tokens)):
        # preserve_rng_state=False: the chunk draws no random numbers, and stashing the generator's
        # state (5 KiB on CPU) per chunk would only cost memory.
        total = total + checkpoint(
            chunk_loss_sum, hidden_CD, weight_VD, targets_C, use_reentrant=False, preserve_rng_state=False
        )
    # The mean over the targets that count, as F.cross_entropy's (data.packing=document ignores some).
    return total / (targets_N != -100).sum()
