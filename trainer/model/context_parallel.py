"""Context parallelism (`parallel.cp`): each rank of a cp group holds 1/cp of every sequence, and attention
sees the whole of it through one of two exchanges.

The split is head-tail balanced (torchtitan's and Megatron's load balancing for causal attention): the
sequence is cut into 2 * cp equal chunks and rank r holds chunks r and 2 * cp - 1 - r, in that order. A
causal query at position p attends p + 1 keys, so a rank's attention work is the sum of (p + 1) over its
positions, and the pairs (r, 2 * cp - 1 - r) make those sums equal on every rank (`attention_pairs`); a
contiguous split would give the last rank nearly 2 * cp - 1 times the first's.

Every module but attention works on a rank's T / cp tokens as it would on T (the norms, the MLP, the
projections and the loss are per token); the rotary tables are read at the rank's own positions. The
two exchanges, `parallel.cp_impl`:

- ulysses (DeepSpeed-Ulysses, arXiv:2309.14509): q, k and v go from (all heads, T / cp positions) to
  (heads / cp, all T positions) by one all-to-all each, attention runs on whole sequences of its heads
  exactly as without cp (causal, or the block-causal mask of the whole row), and one all-to-all takes
  the output back. Each rank sends (cp - 1) / cp of each tensor.
- allgather (Megatron-Core's context parallelism with the K/V exchange as one all-gather rather than a
  ring): K and V are all-gathered over the group, each rank's T / cp queries attend all T keys, held in
  the order they were gathered (rank after rank), under a mask of their true positions (causal, and
  same-document under data.packing=document): T / cp x T bools, one per forward for every layer. Its
  backward is the reduce-scatter of the K/V gradients.

The ranks of a cp group read the same samples (trainer/layout.py): each takes its positions of the
inputs and targets (`local`), and the mean loss is the group's: a rank's summed loss over the row's
counted targets (data.packing=document ignores some, unevenly across chunks), times cp because ZeRO
averages the gradients over cp as over dp (`loss_factor`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer.model.decoder import block_causal_mask
from trainer.private_apis.of_torch import all_gather_autograd, all_to_all_autograd

IMPLS = ("ulysses", "allgather")


def chunk_ranks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp) rank `rank` holds: the head-tail pair."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The positions of a row rank `rank` holds, in the order it holds them."""
    chunk = seq_len // (2 * cp)
    return [p for c in chunk_ranks(cp, rank) for p in range(c * chunk, (c + 1) * chunk)]


def attention_pairs(seq_len: int, cp: int, rank: int) -> int:
    """The (query, key) pairs causal attention computes for rank `rank`'s queries: its share of the
    attention FLOPs (4 * Q FLOPs a pair forward, per head)."""
    return sum(p + 1 for p in local_positions(seq_len, cp, rank))


@dataclass(frozen=True)
class Positions:
    """A row's positions under the head-tail split."""

    mine: torch.Tensor
    """This rank's, in the order it holds them."""
    gathered: torch.Tensor
    """Every rank's, rank after rank: the order of an all-gather or all-to-all over the group."""
    to_row: torch.Tensor
    """The permutation that puts a gathered row back in row order (`gathered`'s argsort)."""


Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""Attention on (B, T, heads, Q) tensors, a mask (None: causal), returning (B, T, H, Q): the layer's SDPA."""


@dataclass
class ContextParallel:
    """One rank's place in its cp group, and the two exchanges; set on the model by `apply_context_parallel`."""

    group: dist.ProcessGroup
    size: int
    rank: int
    impl: str
    _indices: dict[tuple[int, str], Positions] = field(default_factory=dict, repr=False)

    def positions(self, seq_len: int, device: torch.device) -> Positions:
        """The positions of a row of `seq_len` (cached per length and device)."""
        key = (seq_len, str(device))
        if key not in self._indices:
            self._indices[key] = self.make_positions(seq_len, device)
        return self._indices[key]

    @torch.inference_mode(False)  # an index saved for backward must not be an inference tensor (eval first)
    def make_positions(self, seq_len: int, device: torch.device) -> Positions:
        gathered = [p for r in range(self.size) for p in local_positions(seq_len, self.size, r)]
        mine = torch.tensor(local_positions(seq_len, self.size, self.rank), device=device)
        gathered_T = torch.tensor(gathered, device=device)
        return Positions(mine, gathered_T, gathered_T.argsort())

    def local(self, rows_BT: torch.Tensor) -> torch.Tensor:
        """This rank's positions of whole rows (tokens or targets)."""
        return rows_BT.index_select(1, self.positions(rows_BT.shape[1], rows_BT.device).mine)

    def loss_factor(
        self, local_targets_BT: torch.Tensor, full_targets_BT: torch.Tensor, ignore: int
    ) -> torch.Tensor:
        """What turns this rank's mean loss into its part of the group's: cp x its counted targets over the
        row's (both known here: every rank of the group holds the whole row). On the device: no host sync."""
        counted = (local_targets_BT != ignore).sum()
        return self.size * counted / (full_targets_BT != ignore).sum().clamp(min=1)

    def mask(
        self, documents_BT: torch.Tensor | None, seq_len: int, device: torch.device
    ) -> torch.Tensor | None:
        """The attention mask a layer takes. Ulysses attends whole rows: the row's block-causal mask, or
        None (causal). All-gather: this rank's queries against every key, by their true positions."""
        if self.impl == "ulysses":
            return None if documents_BT is None else block_causal_mask(documents_BT)
        at = self.positions(seq_len, device)
        allowed_tT = at.mine[:, None] >= at.gathered[None, :]
        if documents_BT is None:
            return allowed_tT[None, None]
        keys_BT = documents_BT.index_select(1, at.gathered)
        same_BtT = documents_BT.index_select(1, at.mine)[:, :, None] == keys_BT[:, None, :]
        return (same_BtT & allowed_tT)[:, None]

    def attend(
        self, core: Core, q_BtHQ: torch.Tensor, k_BtKQ: torch.Tensor, v_BtKQ: torch.Tensor, mask: Any
    ) -> torch.Tensor:
        """Attention of this rank's queries over the whole sequence: (B, T / cp, H, Q) out."""
        if self.impl == "ulysses":
            q, k, v = (self.to_heads(x) for x in (q_BtHQ, k_BtKQ, v_BtKQ))
            return self.to_sequence(core(q, k, v, mask))
        B, t, K, Q = k_BtKQ.shape
        kv_2BtKQ = torch.cat((k_BtKQ, v_BtKQ))  # one all-gather for both
        gathered = all_gather_autograd(kv_2BtKQ, self.group).view(self.size, 2, B, t, K, Q)
        # Keys in the order gathered: the mask reads their true positions (`mask`).
        k_BTKQ, v_BTKQ = (gathered[:, i].transpose(0, 1).reshape(B, -1, K, Q) for i in (0, 1))
        return core(q_BtHQ, k_BTKQ, v_BTKQ, mask)

    def to_heads(self, x_BtNQ: torch.Tensor) -> torch.Tensor:
        """(B, T / cp, N heads, Q) -> (B, T, N / cp heads, Q) in row order: one all-to-all."""
        B, t, N, Q = x_BtNQ.shape
        send = x_BtNQ.reshape(B, t, self.size, N // self.size, Q).permute(2, 0, 1, 3, 4).contiguous()
        got = all_to_all_autograd(send, self.group)  # (cp source, B, t, N/cp, Q)
        to_row = self.positions(t * self.size, x_BtNQ.device).to_row
        return got.transpose(0, 1).reshape(B, t * self.size, N // self.size, Q)[:, to_row]

    def to_sequence(self, o_BTnQ: torch.Tensor) -> torch.Tensor:
        """(B, T, H / cp heads, Q) in row order -> (B, T / cp, H, Q) of this rank's positions: one all-to-all."""
        B, T, n, Q = o_BTnQ.shape
        t = T // self.size
        gathered = self.positions(T, o_BTnQ.device).gathered
        send = o_BTnQ[:, gathered].reshape(B, self.size, t, n, Q).transpose(0, 1).contiguous()
        got = all_to_all_autograd(send, self.group)  # (cp source heads, B, t, n, Q)
        return got.permute(1, 2, 0, 3, 4).reshape(B, t, self.size * n, Q)
