"""A mixture of experts in the memory plan (model.n_experts > 0, trainer/model/moe.py): what one MoE layer saves
for backward and what its backward holds, as a function of the rows each expert takes (docs/memory_plan.md,
"Mixture of experts").

Shapes as in trainer/model/moe.py: N tokens of a micro-batch (B·T), E experts, K chosen per token (top_k),
A = N·K assignments (rows), D the width, M an expert's hidden width, C an expert's rows.

The experts' parameters, gradients and Adam state are counted by trainer/plan/states.py from the model's shapes
(all E at ep = 1), and the router's fp32 `expert_bias` buffer (E per layer) is in the model, so in `other` with the
rest of what the tracker finds there before a step. Here: the activations and the block's backward.

The routing is the plan's input, `moe.imbalance` r (`expert_rows`): the busiest expert takes r times the mean
(A / E rows), at most every token (N), and the others share what is left evenly; r = 1 is balanced. The saved
set of a dropless layer is the same whatever the split (every row is saved once); the split shows in the
experts' backward, which runs one expert at a time (the busiest one's hidden gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainer.config import BalanceLoss, TrainConfig


@dataclass(frozen=True)
class ExpertRows:
    """The rows of one micro-batch each of a rank's experts computes."""

    per_expert: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.per_expert)

    @property
    def busiest(self) -> int:
        return max(self.per_expert, default=0)


def expert_rows(config: TrainConfig, imbalance: float | None = None) -> ExpertRows:
    """Each expert's rows of one micro-batch under `moe.imbalance` (or `imbalance`): the busiest takes r times
    the mean A / E, rounded, at most N (a token chooses an expert once); the others share the rest evenly (the
    first ones one row more where it does not divide). Under a capacity (moe.capacity_factor) no expert computes
    more than its capacity: the rest of its rows are dropped, not given to the others."""
    m = config.model
    tokens = config.micro_batch * config.seq_len
    assignments, experts = tokens * m.top_k, m.n_experts
    r = config.moe.imbalance if imbalance is None else imbalance
    cap = tokens if config.moe.capacity_factor is None else min(tokens, capacity(config, tokens))
    busiest = min(tokens, round(r * assignments / experts))  # routed to it; it computes `cap` of them at most
    rest, others = assignments - busiest, experts - 1
    if others == 0:
        return ExpertRows((min(cap, busiest),))
    share, extra = divmod(rest, others)
    rows = [min(cap, busiest)] + [min(cap, share + (1 if i < extra else 0)) for i in range(others)]
    return ExpertRows(tuple(rows))


def moe_fields(config: TrainConfig) -> dict[str, Any]:
    """plan.json's `moe` (model.n_experts > 0): the routing the plan assumed, the rows each expert of a rank takes
    per micro-batch under it."""
    m = config.model
    return {
        "experts": m.n_experts,
        "top_k": m.top_k,
        "imbalance": config.moe.imbalance,
        "rows_per_expert": list(expert_rows(config).per_expert),
        "capacity_factor": config.moe.capacity_factor,
    }


def capacity(config: TrainConfig, tokens: int) -> int:
    """moe.capacity_factor's rows per expert and micro-batch (trainer/model/moe.py MoE.capacity)."""
    factor = config.moe.capacity_factor
    assert factor is not None
    return math.ceil(factor * tokens * config.model.top_k / config.model.n_experts)


def moe_saved_bytes(config: TrainConfig, compute: int, rows: ExpertRows) -> int:
    """What one MoE layer saves for backward per micro-batch, beyond the ffn_norm's output (which the gate saves
    as a dense MLP's w1 and w3 do, and the block's table counts). Listed from autograd's saved tensors of a
    tiny-moe layer (fp32: 799,776 bytes at N = 128, E = 8, K = 2, D = 128, M = 96):

    - router: the scores (softmax's or sigmoid's fp32 output, N·E), the chosen experts (gather's int64 index,
      N·K), and under model.route_norm the weights and their sum (div's operands: fp32 N·K and N);
    - dispatch: the tokens of the rows (int64, A: index's and index_add_'s), the gathered rows (A·D), and each
      expert's w1 and w3 outputs, SiLU's output and the product (4·C·M, C summed: 4·A·M);
    - combine: the rows' order (int64, A: the weights' index), the weight of each row (fp32, A), the experts'
      output (A·D, the weighting's operand) and the weighted rows (A·D, index_add_'s source);
    - the balance loss, where it joins the objective (moe.balance != none and moe.aux_coeff > 0): the scores'
      sum (fp32, N) and each expert's share of the assignments (fp32 E per sequence under seq_aux, else E);
      the router z-loss (moe.router_z_coeff > 0): the fp32 logits and their logsumexp (N·E + N).
    """
    m, moe = config.model, config.moe
    tokens = config.micro_batch * config.seq_len
    E, K, D, M = m.n_experts, m.top_k, m.dim, m.expert_width
    A = rows.total
    router = tokens * (4 * E + 8 * K) + (tokens * (4 * K + 4) if m.route_norm else 0)
    dispatch = 8 * A + compute * A * D + 4 * compute * A * M
    combine = 8 * A + 4 * A + 2 * compute * A * D
    balance = 0
    if moe.balance != BalanceLoss.none and moe.aux_coeff > 0:
        sequences = config.micro_batch if moe.balance == BalanceLoss.seq_aux else 1
        balance = 4 * tokens + 4 * E * sequences
    z_loss = 4 * tokens * (E + 1) if moe.router_z_coeff > 0 else 0
    shared = 0
    if m.n_shared_experts > 0:  # one SwiGLU MLP of n_shared * M: its four hidden tensors, as a dense MLP's
        shared = 4 * compute * tokens * m.n_shared_experts * M
    return router + dispatch + combine + balance + z_loss + shared


def dense_mlp_hidden_bytes(config: TrainConfig, compute: int) -> int:
    """What the block's table (trainer/plan/activations.py block_bytes_per_token) counts for a dense MLP's
    hidden tensors per micro-batch (w1's, w3's, SiLU's outputs and their product): the MoE layer's replace them."""
    return 4 * compute * config.micro_batch * config.seq_len * config.model.ffn_dim


def moe_freed_at_peak(config: TrainConfig, compute: int, rows: ExpertRows) -> int:
    """What the MoE layer's saved set has freed by its backward's peak (`moe_backward_temporary`): everything
    autograd made after the experts ran, whose backward runs first (the combine's order, weights, experts' output
    and weighted rows; the balance and z-losses; the shared experts' hidden tensors), and the hidden tensors of
    the expert the loop ran last (E - 1, the first whose backward runs) and the product of the next (E - 2),
    whose w2 backward is under way."""
    m, moe = config.model, config.moe
    tokens = config.micro_batch * config.seq_len
    E, D, M = m.n_experts, m.dim, m.expert_width
    A = rows.total
    combine = 8 * A + 4 * A + 2 * compute * A * D
    balance = 0
    if moe.balance != BalanceLoss.none and moe.aux_coeff > 0:
        sequences = config.micro_batch if moe.balance == BalanceLoss.seq_aux else 1
        balance = 4 * tokens + 4 * E * sequences
    z_loss = 4 * tokens * (E + 1) if moe.router_z_coeff > 0 else 0
    shared = 4 * compute * tokens * m.n_shared_experts * M
    last = rows.per_expert[-1]
    current = rows.per_expert[-2] if len(rows.per_expert) > 1 else 0
    return combine + balance + z_loss + shared + 4 * compute * last * M + compute * current * M


def moe_backward_temporary(config: TrainConfig, compute: int, param: int, rows: ExpertRows) -> int:
    """The peak of an MoE layer's backward beyond the block's saved set (less `moe_freed_at_peak`) and the
    gradient arriving down the residual: the experts' loop backward, one expert at a time from the last.

    Each expert's weights are a slice (`w1[e]`) of a stacked (E, ., .) parameter, so each expert's weight
    gradient comes back through select's backward as a whole (E, M, D) tensor, which autograd adds into the
    gradient it accumulates for that parameter until every expert's backward ran (a new sum each time): from
    the second expert on, the three accumulated gradients, the new one and their sum, 5 x E·M·D in the
    weights' dtype. Beside them: the gradient of the experts' output (A·D, whose slices each expert's backward
    reads), the rows' accumulated gradient (A·D: slice's backward, whole likewise) and the gradient of the
    expert's product (C·M). The peak is the second expert's (E - 2) w2 sum. Listed with a dispatch-mode
    tracker over tiny-moe's step (fp32, zero=stage0, one rank) and MemTracker's peak."""
    m = config.model
    E, D, M = m.n_experts, m.dim, m.expert_width
    current = rows.per_expert[-2] if len(rows.per_expert) > 1 else rows.per_expert[-1]
    return 5 * param * E * M * D + 2 * compute * rows.total * D + compute * current * M
