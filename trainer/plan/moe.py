"""A mixture of experts in the memory plan (model.n_experts > 0, trainer/model/moe.py): what one MoE layer saves
for backward and what its backward holds, as a function of the rows each expert takes (docs/memory_plan.md,
"Mixture of experts").

Shapes as in trainer/model/moe.py: N tokens of a micro-batch (B·T), E experts, K chosen per token (top_k),
A = N·K assignments (rows), D the width, M an expert's hidden width, C an expert's rows.

The experts' parameters, gradients and Adam state are counted by trainer/plan/states.py from the model's shapes
(all E at ep = 1), and the router's fp32 `expert_bias` buffer (E per layer) is in the model, so in `other` with the
rest of what the tracker finds there before a step. Here: the activations and the block's backward.

The routing is the plan's input, `moe.imbalance` r (`routed_rows`), read per unit of experts whose rows set a
rank's memory: at ep = 1 each expert (the loop runs them one at a time), under parallel.ep the E / ep experts one
rank holds (what it receives). The busiest unit takes r times the mean, at most what a token can send it (one row
per expert); the others share what is left evenly; within a unit of several experts the rows fill its experts in
order, each up to every token of the micro-batch. That fill leaves the loop's last experts, whose backward runs
first and frees their hidden tensors before the experts' peak, with the fewest rows: the worst case for the peak
(`moe_freed_at_peak`). r = 1 is balanced. Every rank's tokens are assumed routed alike, so under ep a rank
receives ep times its experts' share of one micro-batch, and the busiest unit is ep rank 0's. Dropless, the
saved set at ep = 1 is the same whatever the split (every row is saved once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainer.config import BalanceLoss, ModelConfig, TrainConfig


@dataclass(frozen=True)
class ExpertRows:
    """One rank's rows of one micro-batch: what its tokens send to the experts, and what each expert it holds
    computes (received from every rank of the ep group; all E experts' own rows at ep = 1)."""

    sent: int  # its tokens' kept assignments, A (less what a capacity drops)
    per_expert: tuple[int, ...]  # rows each of its experts computes, in the loop's order
    ep: int = 1
    apart: bool = (
        False  # FSDP2 or DDP leaves the experts alone (ep over all of ZeRO's ranks): fp32 under FSDP2
    )

    @property
    def total(self) -> int:
        """R: the rows its experts compute (A at ep = 1)."""
        return sum(self.per_expert)

    @property
    def busiest(self) -> int:
        return max(self.per_expert, default=0)


def routed_rows(config: TrainConfig, imbalance: float | None = None) -> tuple[int, ...]:
    """The rows one rank's micro-batch sends each of the E experts under `moe.imbalance` (or `imbalance`), a
    capacity's drops taken off (moe.capacity_factor: no expert computes more than its capacity; the rest of its
    rows are dropped, not given to the others). The module docstring says how the rows are spread."""
    m = config.model
    tokens = config.micro_batch * config.seq_len
    experts, top_k, ep = m.n_experts, m.top_k, config.parallel.ep
    size = 1 if ep == 1 else experts // ep  # experts per unit
    units = experts // size
    r = config.moe.imbalance if imbalance is None else imbalance
    most = tokens * min(top_k, size)  # a token sends a unit one row per expert, top_k at most
    busiest = min(most, round(r * tokens * top_k / units))
    share, extra = divmod(tokens * top_k - busiest, units - 1) if units > 1 else (0, 0)
    per_unit = [busiest] + [min(most, share + (1 if i < extra else 0)) for i in range(units - 1)]
    cap = tokens if config.moe.capacity_factor is None else min(tokens, capacity(config, tokens))
    rows = []
    for total in per_unit:
        for _ in range(size):  # fill the unit's experts in order, each up to every token
            taken = min(tokens, total)
            rows.append(min(cap, taken))
            total -= taken
    return tuple(rows)


def expert_rows(
    config: TrainConfig, ep_rank: int = 0, imbalance: float | None = None, shard_ranks: int = 0
) -> ExpertRows:
    """The rows of ep rank `ep_rank` (0 at ep = 1): its tokens' kept assignments, and its experts' rows from every
    rank of the ep group (each routing alike: `routed_rows`). `shard_ranks`: FSDP2's shard group, whether the ep
    group lies inside it (`expert_shard_ranks`; 0: ep spans ZeRO's ranks)."""
    routed, ep = routed_rows(config, imbalance), config.parallel.ep
    local = config.model.n_experts // ep
    mine = routed[ep_rank * local : (ep_rank + 1) * local]
    apart = ep > 1 and not expert_shard_ranks(config, shard_ranks)
    return ExpertRows(sum(routed), tuple(ep * rows for rows in mine), ep, apart)


def expert_shapes(m: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """One MoE layer's stacked expert weights (trainer/model/moe.py GroupedExperts): w1, w3 (E, M, D), w2 (E, D, M);
    none for a dense model."""
    if not m.is_moe:
        return ()
    E, M, D = m.n_experts, m.expert_width, m.dim
    return ((E, M, D), (E, D, M), (E, M, D))


def expert_shard_ranks(config: TrainConfig, shard_ranks: int) -> int:
    """parallel.ep inside FSDP2's shard group (1 < ep < its `shard_ranks`, trainer/rank/mesh.py `expert_mesh`):
    the ranks FSDP2 shards each rank's E / ep experts over, shard_ranks / ep; 0 where FSDP2 leaves the experts
    alone (ep equal to the group, trainer/rank/experts.py) or holds them like any weight (ep = 1, or DDP)."""
    ep = config.parallel.ep
    return shard_ranks // ep if config.zero.uses_fsdp and 1 < ep < shard_ranks else 0


def expert_shard_dim(local_experts: int, ranks: int) -> int:
    """The dim FSDP2 shards a rank's stacked expert weights on over the `ranks` holding the same experts: the
    expert dim where they split evenly, else the next (torchtitan shards dim 1 where dp_shard_mod_ep x ep
    passes the experts: FSDP2 pads dim 0 to a multiple of the ranks, which would hold the experts several times
    over). The run (trainer/rank/sharding.py `shard_experts`) and the plan both take it from here."""
    return 0 if local_experts % ranks == 0 else 1


def expert_local_shapes(m: ModelConfig, ep: int, ranks: int) -> tuple[tuple[int, ...], ...]:
    """A rank's E / ep experts of one MoE layer as FSDP2 holds them unsharded over `ranks` (its all-gather
    output: the shard dim padded to a multiple of `ranks`)."""
    shapes = []
    for shape in expert_shapes(m):
        local = [shape[0] // ep, *shape[1:]]
        dim = expert_shard_dim(local[0], ranks)
        local[dim] = -(-local[dim] // ranks) * ranks
        shapes.append(tuple(local))
    return tuple(shapes)


def as_fsdp_shard(shape: tuple[int, ...], ep: int, ranks: int) -> tuple[int, ...]:
    """A stacked expert weight rewritten so that FSDP2's dim-0 rule over every ep x `ranks` rank
    (trainer/plan/states.py `rank_states`) gives each rank what it holds of its E / ep experts sharded over
    `ranks`: unchanged on the expert dim (E / ep / ranks experts each, the same split), else one row per rank of
    its dim-1 shard."""
    local = shape[0] // ep
    if expert_shard_dim(local, ranks) == 0:
        return shape
    return (ep * ranks, local * -(-shape[1] // ranks) * math.prod(shape[2:]))


def router_held_bytes(m: ModelConfig) -> int:
    """What a mixture of experts holds all step beside its parameters, counted in `other`: every router's fp32
    `expert_bias` buffer (E per layer), and the model's RouterLog, made at the step's first MoE forward and taken
    at its end: each layer's loads (int64 E), drops (int64) and the summed balance loss (fp32)."""
    if not m.is_moe:
        return 0
    return 4 * m.n_experts * m.n_layers + 8 * m.n_experts * m.n_layers + 8 * m.n_layers + 4


def moe_fields(config: TrainConfig) -> dict[str, Any]:
    """plan.json's `moe` (model.n_experts > 0): the routing the plan assumed: the rows one rank's micro-batch sends
    each expert, and under parallel.ep the rows each ep rank's experts compute."""
    m = config.model
    return {
        "experts": m.n_experts,
        "top_k": m.top_k,
        "imbalance": config.moe.imbalance,
        "ep": config.parallel.ep,
        "rows_per_expert": list(routed_rows(config)),
        "rows_per_rank": [expert_rows(config, rank).total for rank in range(config.parallel.ep)],
        "capacity_factor": config.moe.capacity_factor,
    }


def capacity(config: TrainConfig, tokens: int) -> int:
    """moe.capacity_factor's rows per expert and micro-batch (trainer/model/moe.py MoE.capacity)."""
    factor = config.moe.capacity_factor
    assert factor is not None
    return math.ceil(factor * tokens * config.model.top_k / config.model.n_experts)


def moe_saved_bytes(config: TrainConfig, compute: int, rows: ExpertRows, regime: str = "fp32") -> int:
    """What one MoE layer saves for backward per micro-batch, beyond the ffn_norm's output (which the gate saves
    as a dense MLP's w1 and w3 do, and the block's table counts). Listed from autograd's saved tensors of a
    tiny-moe layer (fp32: 799,776 bytes at N = 128, E = 8, K = 2, D = 128, M = 96; under ep=2 at zero=stage3
    1,590,304 on the rank receiving R = 512 rows, 275,488 on the one receiving none):

    - router: the scores (softmax's or sigmoid's fp32 output, N·E), the chosen experts (gather's int64 index,
      N·K), and under model.route_norm the weights and their sum (div's operands: fp32 N·K and N);
    - dispatch: the tokens of the rows (int64, A: index's and index_add_'s); the rows the experts read (R·D),
      and each expert's w1 and w3 outputs, SiLU's output and the product (4·C·M, C summed: 4·R·M). Under
      parallel.ep the rows a rank sends are not saved (the all-to-all's backward needs only the splits), the
      rows it received are, sorted by expert (R·D, and their order, int64 R), and so is the experts' output
      (R·D: index_copy's source, putting it back in arrival order);
    - combine: the rows' order (int64, A: the weights' index), the weight of each row (fp32, A), the experts'
      output back at the token's rank (A·D, the weighting's operand) and the weighted rows (A·D, index_add_'s
      source);
    - the balance loss, where it joins the objective (moe.balance != none and moe.aux_coeff > 0): the scores'
      sum (fp32, N) and each expert's share of the assignments (fp32 E per sequence under seq_aux, else E);
      the router z-loss (moe.router_z_coeff > 0): the fp32 logits and their logsumexp (N·E + N);
    - in half precision the weight of each row in the rows' dtype (compute, A: the weighting casts it), and the
      casts of `expert_casts`.
    """
    m = config.model
    tokens = config.micro_batch * config.seq_len
    E, K, D, M = m.n_experts, m.top_k, m.dim, m.expert_width
    A, R = rows.sent, rows.total
    router = tokens * (4 * E + 8 * K) + (tokens * (4 * K + 4) if m.route_norm else 0)
    dispatch = 8 * A + compute * R * D + 4 * compute * R * M
    if rows.ep > 1:
        dispatch += 8 * R + compute * R * D
    combine = 8 * A + compute * A + 2 * compute * A * D
    shared = (
        4 * compute * tokens * m.n_shared_experts * M
    )  # one SwiGLU MLP of n_shared x M: a dense MLP's four
    return router + dispatch + combine + losses_saved(config) + shared + expert_casts(config, regime, rows)


def weight_cast_bytes(regime: str, apart: bool) -> int:
    """Bytes per element of the copy of an expert's weight each of its matmuls saves beyond the parameter: none
    where the weights are already in the rows' dtype (fp32, or FSDP2's bf16 unsharded parameters at ep = 1); 2
    under autocast (its matmuls cast the fp32 slices w1[e] and w3[e], views that its weight cache skips, and
    GroupedExperts casts w2[e] for the bf16 hidden rows) and under parallel.ep with FSDP2's half precision (the
    experts' fp32 weights, which FSDP2 leaves alone, `apart`, cast per expert by GroupedExperts; an ep group inside
    FSDP2's shard group has its experts gathered in bf16 like the rest)."""
    if regime == "autocast" or (regime == "fsdp_mp" and apart):
        return 2
    return 0


def expert_casts(config: TrainConfig, regime: str, rows: ExpertRows) -> int:
    """What one MoE layer saves more in half precision than `moe_saved_bytes`' fp32 listing says with the compute
    dtype put in: each expert's three weight casts (`weight_cast_bytes`, E / ep experts), and under autocast
    (stages 0-1) the rows: the ffn_norm's output reaches the experts in fp32, and autocast casts each expert's rows
    once for w1 and once for w3 (two bf16 copies saved, where the fp32 listing saves the rows once), while the
    gate saves one bf16 cast of the norm's output where the block's table counts a dense MLP's two (w1's and w3's).
    """
    m = config.model
    tokens = config.micro_batch * config.seq_len
    E, D, M = m.n_experts // rows.ep, m.dim, m.expert_width
    casts = weight_cast_bytes(regime, rows.apart) * 3 * E * M * D
    if regime == "autocast":
        shared = 4 * tokens * D if m.n_shared_experts > 0 else 0  # the shared MLP's w1 and w3 cast it again
        casts += 2 * rows.total * D - 2 * tokens * D + shared
    return casts


def losses_saved(config: TrainConfig) -> int:
    """What the router's losses save where they join the objective: the balance loss (moe.balance != none and
    moe.aux_coeff > 0) the scores' sum and each expert's share, the z-loss (moe.router_z_coeff > 0) the logits
    and their logsumexp."""
    m, moe = config.model, config.moe
    tokens = config.micro_batch * config.seq_len
    balance = 0
    if moe.balance != BalanceLoss.none and moe.aux_coeff > 0:
        sequences = config.micro_batch if moe.balance == BalanceLoss.seq_aux else 1
        balance = 4 * tokens + 4 * m.n_experts * sequences
    z_loss = 4 * tokens * (m.n_experts + 1) if moe.router_z_coeff > 0 else 0
    return balance + z_loss


def dense_mlp_hidden_bytes(config: TrainConfig, compute: int) -> int:
    """What the block's table (trainer/plan/activations.py block_bytes_per_token) counts for a dense MLP's
    hidden tensors per micro-batch (w1's, w3's, SiLU's outputs and their product): the MoE layer's replace them."""
    return 4 * compute * config.micro_batch * config.seq_len * config.model.ffn_dim


def router_gradients(config: TrainConfig, assignments: int) -> int:
    """Gradients that reach the router before the experts' backward and wait there (autograd runs the later-made
    nodes first, and the router's were made before the experts): the weights' (fp32, one per row sent), and
    where the router's losses join the objective the scores' (balance loss) or the logits' (z-loss), fp32 N·E
    each, and the scalar gradient of each layer's loss term below, still to be run."""
    m, moe = config.model, config.moe
    tokens = config.micro_batch * config.seq_len
    terms = int(moe.balance != BalanceLoss.none and moe.aux_coeff > 0) + int(moe.router_z_coeff > 0)
    return 4 * assignments + terms * (4 * tokens * m.n_experts + 4 * (m.n_layers - 1))


def expert_grad_bytes(regime: str, apart: bool) -> int:
    """Bytes per element of an expert weight's gradient as the loop's backward makes it: the unsharded bf16
    weights' under FSDP2's half-precision parameters (ep = 1, or an ep group inside its shard group), else fp32
    (the fp32 weights themselves, or the fp32 local weights FSDP2 leaves alone, `apart`, cast per expert: the
    cast's backward comes first)."""
    return 2 if regime == "fsdp_mp" and not apart else 4


def moe_backward_peak(
    config: TrainConfig, compute: int, grad: int, rows: ExpertRows, regime: str = "fp32"
) -> tuple[int, int]:
    """The peak of an MoE layer's backward: what its saved set has freed by then, and the temporaries beside the
    rest of it and the gradient arriving down the residual. The experts' loop backward runs one expert at a time
    from the last; before it, everything autograd made after the experts ran (the combine's order, weights,
    returned and weighted rows; under ep the experts' output index_copy kept; the router's losses; the shared
    experts' hidden tensors) has run and been freed.

    Each expert's weights are a slice (`w1[e]`) of a stacked (E, ., .) parameter (E / ep of them under ep), so
    each expert's weight gradient comes back through select's backward as a whole (E, M, D) tensor, W, which
    autograd adds into the gradient it accumulates for that parameter until every expert's backward ran (a new
    sum each time); each expert's rows' gradient likewise comes back through slice's backward as a whole R·D
    tensor, added into the rows' accumulated gradient. Beside them the gradient of the experts' output (R·D,
    whose slices each expert's backward reads). The larger of two moments of the second expert's backward (the
    first with every accumulated gradient made):

    - its w2 sum: the three accumulated W, the new one and their sum (5 W), the two R·D gradients and that of its
      product (C·M), with the first expert's hidden tensors and its own product freed;
    - its rows' sum: the three W, the rows' accumulated gradient, the new one and their sum beside the output's
      (4 x R·D), with both experts' hidden tensors freed: the peak where R·D passes W (under ep, where a rank
      receives many rows);

    both beside the gradients waiting at the router (`router_gradients`). Under parallel.ep a third comes first,
    before any expert's backward: index_copy_'s backward (putting the output back in arrival order) writes the
    gradient of the experts' output (R·D, `index_select`) beside the gradient of the rows in arrival order the
    all-to-all's backward returned (R·D), the combine's saved set freed, the experts' output still held (index_copy's
    saved source): the peak on a rank receiving many rows (tiny-moe at ep=4 with every row on rank 0, zero=stage3:
    753,664 bytes above the rows' sum, measured 753,680). And where the experts are the rank's own (`apart`: ep
    over every ZeRO rank, their gradients held whole) a fourth comes last, the dispatch's backward: the experts'
    three gradients made (3 W) and their saved sets freed, the sent rows' gradient back from the all-to-all (A·D)
    and index's backward writing the ffn_norm output's (new_zeros, then index_put: 2 x N·D, in that output's
    dtype): the peak on a rank receiving few rows when W is small (tiny-moe at ep=4, on the ranks receiving none:
    65,536 bytes above the w2 sum, measured 65,552). In half precision (`expert_casts`) the
    weight casts of the experts whose backward ran are freed (the first expert's three and the second's w2 by its
    w2 sum; both experts' six by the rows' sum), and under autocast the rows' two casts of each of them; the rows'
    accumulated gradient, its new one and their sum are fp32 there (each expert's bf16 gradient of its rows' casts
    is cast back to the fp32 rows').

    Listed with a dispatch-mode tracker over tiny-moe's steps (fp32; zero=stage0 at ep = 1, the w2 sum; zero=
    stage3 at ep=2 with every row on rank 0, the rows' sum) and held against MemTracker's peak."""
    m = config.model
    tokens = config.micro_batch * config.seq_len
    local, D, M = m.n_experts // rows.ep, m.dim, m.expert_width
    A, R = rows.sent, rows.total
    before = 8 * A + compute * A + 2 * compute * A * D + (compute * R * D if rows.ep > 1 else 0)
    before += losses_saved(config) + 4 * compute * tokens * m.n_shared_experts * M
    first = rows.per_expert[-1] if rows.per_expert else 0
    second = rows.per_expert[-2] if len(rows.per_expert) > 1 else 0
    W, RD = grad * local * M * m.dim, compute * R * D
    cast = weight_cast_bytes(regime, rows.apart) * M * D  # one expert's one weight
    rows_cast = 2 * compute * D if regime == "autocast" else 0  # per row: its two casts
    rows_grad = 4 * R * D if regime == "autocast" else RD  # the rows' gradient
    waiting = router_gradients(config, A)
    w2_sum = (
        before + 4 * compute * first * M + compute * second * M + 4 * cast + rows_cast * first,
        5 * W + RD + rows_grad + compute * second * M + waiting,
    )
    rows_sum = (
        before + 4 * compute * (first + second) * M + 6 * cast + rows_cast * (first + second),
        3 * W + RD + 3 * rows_grad + waiting,
    )
    peaks = [w2_sum, rows_sum]
    if rows.ep > 1:  # the experts' output gradient, before any expert's backward
        peaks.append((before - RD, 2 * RD + waiting))
    if rows.ep > 1 and rows.apart:  # the dispatch's backward, after every expert's
        width = 4 if regime == "autocast" else compute  # the ffn_norm output's dtype (fp32 under autocast)
        saved = RD + 4 * compute * R * M + 8 * R + 3 * local * cast + rows_cast * R
        peaks.append((before + saved, 3 * W + width * (A + 2 * tokens) * D + waiting))
    return max(peaks, key=lambda peak: peak[1] - peak[0])
