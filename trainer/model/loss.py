"""The loss: next-token cross-entropy in fp32, over all logits at once or by chunks of tokens.

`loss=full` (`full_loss`) projects every token to the vocabulary and takes
the log-softmax in fp32: B·T·V logits, their fp32 copy, the log-softmax saved for backward and its
two gradients, which at a 128k vocabulary are the largest tensors of a step.

`loss=chunked` projects and takes the loss `chunk_tokens` tokens at a time, each chunk under
`torch.utils.checkpoint` (non-reentrant): forward keeps only the chunk's scalar, backward recomputes
the chunk's logits and frees them before the next chunk's. So no fp32 B·T·V tensor is ever whole:
the logits-sized tensors are chunk_tokens·V, at the cost of a second output projection per chunk.
The sum of the chunks' summed losses over the token count is the mean the full loss takes.

`loss.z_loss` > 0 adds the z-loss, z_loss * mean over the tokens that count of logsumexp(logits)^2 (PaLM,
Chowdhery et al. 2022, section 5, with 1e-4: it draws the softmax's log-normaliser log Z towards 0, which
PaLM found made training more stable; OLMo-core trains with 1e-5), from the same fp32
logits as the cross-entropy: the whole logits' under loss=full, each chunk's (recomputed with it in
backward) under loss=chunked. Off (0.0, the default) the loss is computed by exactly the ops it was
before, so the losses are bitwise those of a job without the key (docs/stability.md, "z-loss").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100
"""A target the loss skips (F.cross_entropy's default; data.packing=document's padding)."""


class LossTerms(NamedTuple):
    """A micro-batch's loss: the mean cross-entropy, and the z-loss term when loss.z_loss > 0."""

    cross_entropy: torch.Tensor
    z_loss: torch.Tensor | None = None
    """z_loss * mean logsumexp(logits)^2, already weighted: what the objective adds; None when off."""

    @classmethod
    def of_chunked(cls, output: torch.Tensor, z_weight: float) -> LossTerms:
        """The terms from the model's forward given targets (`chunked_cross_entropy`'s result)."""
        return cls(output[0], output[1]) if z_weight > 0 else cls(output)

    def scaled(self, factor: torch.Tensor) -> LossTerms:
        """Both terms times `factor` (parallel.cp: a rank's share of its group's mean)."""
        return LossTerms(self.cross_entropy * factor, None if self.z_loss is None else self.z_loss * factor)


def full_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, z_weight: float = 0.0) -> LossTerms:
    """loss=full: the mean next-token loss, computed in fp32 whatever the compute dtype, and the z-loss."""
    logits_NV, targets_N = logits_BTV.float().flatten(0, 1), targets_BT.flatten()
    if z_weight <= 0:
        return LossTerms(F.cross_entropy(logits_NV, targets_N))
    count = (targets_N != IGNORE_INDEX).sum()
    if type(logits_NV).__name__ == "DTensor":  # the DTensor import stays out of the job process
        ce = F.cross_entropy(logits_NV, targets_N)  # loss_parallel's, as without the z-loss
        return LossTerms(ce, z_weight * sharded_squared_logsumexp_sum(logits_NV, targets_N) / count)
    ce_sum, z_sum = cross_entropy_and_z_sums(logits_NV, targets_N)
    return LossTerms(ce_sum / count, z_weight * z_sum / count)


def cross_entropy_and_z_sums(
    logits_NV: torch.Tensor, targets_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy and the summed logsumexp(logits)^2 over the tokens that count, fp32 logits.

    logsumexp is read off the log-softmax the cross-entropy takes anyway: at the target, logit - log-prob =
    logsumexp. torch.logsumexp would save the fp32 logits for its backward and return a B·T·V gradient of its
    own beside log_softmax's: measured on the default job (fp32, stage0) its peak grew by 8·B·T·V bytes
    (+6%, off the plan); nll_loss of the logits saves them too (+4·B·T·V). Indexing saves only the indices,
    and its backward's B·T·V tensor is made after log_softmax's backward has freed the log-probabilities
    and their gradient: autograd runs the later-made of two ready nodes first, and the index is made first.
    """
    counted_N = targets_N != IGNORE_INDEX
    rows_N = torch.arange(targets_N.numel(), device=targets_N.device)
    logit_N = logits_NV[rows_N, targets_N.where(counted_N, 0)]  # made before log_softmax: see above
    ce_N = F.nll_loss(F.log_softmax(logits_NV, dim=-1), targets_N, reduction="none")  # 0 where ignored
    lse_N = (logit_N + ce_N) * counted_N
    return ce_N.sum(), lse_N.square().sum()


def sharded_squared_logsumexp_sum(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """parallel.tp > 1: the sum of logsumexp(logits)^2 over the tokens that count, of vocabulary-sharded
    logits (a DTensor sharded on its last dim, loss_parallel's input).

    Not from the log-softmax: loss_parallel fuses log_softmax's backward into nll_loss's, which assumes it is
    the only use of the log-probabilities. Nor by torch.logsumexp, which DTensor computes by all-gathering the
    whole logits (measured, torch 2.13: CommDebugMode counts one all_gather_into_tensor).
    So from its parts, each a reduction DTensor takes shard by shard: the max and the sum of exponentials,
    each one all-reduce of N values over the TP group.
    """
    from torch.distributed.tensor import DTensor, Replicate

    # Each reduction made Replicate at once: left Partial, every later use (and log's backward, which saves
    # its input) would all-reduce it again (measured: 4 all-reduces a step, not 2).
    replicate = [Replicate()] * logits_NV.device_mesh.ndim
    peak_N1 = logits_NV.detach().amax(dim=-1, keepdim=True).redistribute(placements=replicate)  # no gradient
    sumexp_N = (logits_NV - peak_N1).exp().sum(dim=-1).redistribute(placements=replicate)
    lse_N = sumexp_N.log() + peak_N1.squeeze(-1)
    counted_N = targets_N != IGNORE_INDEX
    counted = DTensor.from_local(counted_N, lse_N.device_mesh, lse_N.placements, run_check=False)
    return (lse_N.square() * counted).sum()


def chunk_loss_sum(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, targets_C: torch.Tensor) -> torch.Tensor:
    """The summed fp32 cross-entropy of one chunk: the output projection, then the loss."""
    return F.cross_entropy(F.linear(hidden_CD, weight_VD).float(), targets_C, reduction="sum")


def chunk_loss_and_z_sums(
    hidden_CD: torch.Tensor, weight_VD: torch.Tensor, targets_C: torch.Tensor
) -> torch.Tensor:
    """loss.z_loss > 0: [the chunk's summed cross-entropy, its summed logsumexp^2], from one projection. Under
    parallel.tp > 1 the logits are vocabulary-sharded (a DTensor): the cross-entropy loss_parallel's, the
    logsumexp from its sharded parts, as `full_loss` takes them."""
    logits_CV = F.linear(hidden_CD, weight_VD).float()
    if type(logits_CV).__name__ == "DTensor":  # the DTensor import stays out of the job process
        ce = F.cross_entropy(logits_CV, targets_C, reduction="sum")
        return torch.stack([ce, sharded_squared_logsumexp_sum(logits_CV, targets_C)])
    return torch.stack(cross_entropy_and_z_sums(logits_CV, targets_C))


def chunked_cross_entropy(
    hidden_BTD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_BT: torch.Tensor,
    chunk_tokens: int,
    z_weight: float = 0.0,
) -> torch.Tensor:
    """Mean next-token loss of `hidden_BTD` projected by `weight_VD`, chunk_tokens tokens at a time; with
    `z_weight` > 0 the pair [mean loss, z-loss] (`LossTerms.of_chunked` names them)."""
    hidden_ND, targets_N = hidden_BTD.flatten(0, 1), targets_BT.flatten()
    sums = chunk_loss_sum if z_weight <= 0 else chunk_loss_and_z_sums
    # Under TP the chunks' sums are Replicate DTensors, which add to a plain 0-dim tensor but not to a plain
    # pair: the pair's total starts from the first chunk's.
    total = torch.zeros((), device=hidden_ND.device) if z_weight <= 0 else None
    for hidden_CD, targets_C in zip(hidden_ND.split(chunk_tokens), targets_N.split(chunk_tokens)):
        # preserve_rng_state=False: the chunk draws no random numbers, and stashing the generator's
        # state (5 KiB on CPU) per chunk would only cost memory.
        chunk = checkpoint(
            sums, hidden_CD, weight_VD, targets_C, use_reentrant=False, preserve_rng_state=False
        )
        total = chunk if total is None else total + chunk
    # The mean over the targets that count, as F.cross_entropy's (data.packing=document ignores some).
    means = total / (targets_N != IGNORE_INDEX).sum()
    if z_weight <= 0:
        return means
    return torch.stack([means[0], z_weight * means[1]])
