"""A mixture of experts in place of a block's SwiGLU MLP (model.n_experts > 0).

Shapes as in decoder.py, and: N tokens (B·T), E experts, K experts per token (top_k), A assignments (N·K),
M an expert's hidden width (model.moe_ffn_dim).

The router scores every expert for every token (softmax over the experts, or a sigmoid of each), picks the
K best (token choice; the aux-loss-free bias shifts the choice, never the weights: DeepSeek-V3, section
2.1.2), and weighs each chosen expert's output by its score, normalised over the K when model.route_norm.
The experts are dropless unless moe.capacity_factor caps the assignments an expert takes per forward; the
residual stream carries a dropped token unchanged. The expert weights are three (E, ., .) tensors, one
slice per expert, as torchtitan's GroupedExperts and transformers' fused Mixtral and Qwen3-MoE experts
hold them, so an expert-parallel rank holds whole experts by a slice of dim 0.

Under parallel.ep > 1 each rank of the ep group holds E / ep experts: the assignments are sorted by expert
and sent to their experts' ranks by one all-to-all, computed there, and sent back by a second
(`ExpertDispatch`). The experts run one after another on every device (a loop of two matmuls each);
torch's grouped GEMM (`F.grouped_mm`) has no CPU backward in torch 2.13, and its CUDA path is not yet
checked against the loop here.

What the router did is written to the model's `RouterLog` while the forward runs: per layer the tokens each
expert was chosen by, the assignments dropped, and the balance and router z-losses, which the training
loop adds to the objective (trainer/rank/loop.py) and logs (trainer/telemetry/metrics.py). Under parallel.pp
only the last stage takes a loss, so each layer's router losses reach backward through its own output instead
(`AttachLoss`, Megatron-LM's MoEAuxLossAutoScaler): the same gradients, on whichever stage holds the layer.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from trainer.config import BalanceLoss, DropPolicy, ModelConfig, MoeConfig, RouterScore

if TYPE_CHECKING:  # trainer/model/context_parallel.py imports the decoder, which imports this module
    from trainer.model.context_parallel import ContextParallel


@dataclass
class RouterLog:
    """What every MoE layer's router did during this step's forwards: written by the layers while the
    model's forward is `open` (so a checkpointed block's recompute during backward writes nothing) and
    while gradients are on (an evaluation's forwards write nothing)."""

    n_layers: int
    n_experts: int
    open: bool = False
    losses: list[torch.Tensor] = field(default_factory=list)
    """The weighted balance and router z-loss terms of the forward just run (`take_losses` empties it)."""
    loads: torch.Tensor | None = None
    """(n_layers, E) int64: the tokens that chose each expert, summed over the step's forwards."""
    dropped: torch.Tensor | None = None
    """(n_layers,) int64: the assignments dropped by a capacity, summed over the step's forwards."""
    balance: torch.Tensor | None = None
    """The step's summed balance losses (unweighted, summed over layers and forwards): logged."""
    watch: RoutingWatch | None = None
    """A plan that runs out of memory past some imbalance: the layers warn, once, when their routing passes it."""
    backward_scale: torch.Tensor | None = None
    """parallel.pp: the gradient each layer's router losses get through its output (`AttachLoss`), the loss's
    own scale (fp16's loss scale, else 1; the schedule divides every gradient by the micro-batches after); None
    without a pipeline, where the loop adds `losses` to the objective."""

    def records(self) -> bool:
        return self.open and torch.is_grad_enabled()

    def record(
        self, layer: int, load_E: torch.Tensor, dropped: torch.Tensor, balance: torch.Tensor | None
    ) -> None:
        if self.loads is None:
            device = load_E.device
            self.loads = torch.zeros(self.n_layers, self.n_experts, dtype=torch.int64, device=device)
            self.dropped = torch.zeros(self.n_layers, dtype=torch.int64, device=device)
            self.balance = torch.zeros((), device=device)
        assert self.dropped is not None and self.balance is not None
        self.loads[layer] += load_E
        self.dropped[layer] += dropped
        if balance is not None:
            self.balance += balance.detach()

    def take_losses(self) -> torch.Tensor | None:
        """The weighted router losses of the forward just run, summed; None when none was asked for."""
        losses, self.losses = self.losses, []
        return torch.stack(losses).sum() if losses else None

    def take_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The step's loads, dropped counts and summed balance loss, and a fresh log for the next step."""
        if self.loads is None:
            return None
        assert self.dropped is not None and self.balance is not None
        taken = (self.loads, self.dropped, self.balance)
        self.loads = self.dropped = self.balance = None
        return taken


@dataclass
class RoutingWatch:
    """The imbalance (an expert's rows over the mean, in one forward) past which the job's plan says a rank runs
    out of memory (trainer/job.py `routing_limit`): the first forward past it prints one line, with its step."""

    oom_imbalance: float
    planned: float
    limit_gib: float
    rank: int
    step: int = 0
    warned: bool = False

    def check(self, layer: int, counts: list[int]) -> None:
        assignments = sum(counts)
        if self.warned or assignments == 0:
            return
        imbalance = max(counts) * len(counts) / assignments
        if imbalance < self.oom_imbalance:
            return
        self.warned = True
        print(
            f"warning: rank {self.rank} step {self.step}: block {layer} sent {max(counts)} of {assignments} "
            f"assignments to one expert, imbalance {imbalance:.2f} (planned: moe.imbalance={self.planned:g}); past "
            f"{self.oom_imbalance:.2f} the plan's peak passes the {self.limit_gib:.3f} GiB a rank has: routing like "
            f"this runs out of memory; plan with moe.imbalance={imbalance:.2f}",
            file=sys.stderr,
            flush=True,
        )


@dataclass(frozen=True)
class ExpertGroup:
    """parallel.ep > 1: the ranks that hold the experts between them, and which slice of them this rank holds."""

    group: dist.ProcessGroup
    size: int
    rank: int


class Router(nn.Module):
    """Token-choice top-K routing: a linear gate to E logits, scores, and the K chosen experts per token."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)
        # The aux-loss-free bias (moe.bias_rate): state the optimizer never steps, saved with the model.
        self.register_buffer("expert_bias", torch.zeros(config.n_experts, dtype=torch.float32))
        self.top_k, self.score, self.normalise = config.top_k, config.router_score, config.route_norm

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gate's fp32 logits, every expert's score, each token's K experts and their weights (fp32)."""
        logits_NE = self.gate(x_ND).float()
        if self.score == RouterScore.softmax:
            scores_NE = logits_NE.softmax(dim=-1)
        else:
            scores_NE = logits_NE.sigmoid()
        _, experts_NK = torch.topk(scores_NE.detach() + self.expert_bias, self.top_k, dim=-1)
        weights_NK = scores_NE.gather(1, experts_NK)
        if self.normalise:
            weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
        return logits_NE, scores_NE, experts_NK, weights_NK


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three stacked weights: w1, w3 (E, M, D) and w2 (E, D, M), all E of them, or this
    rank's E / ep under parallel.ep (DTensors sharded on dim 0, trainer/rank/experts.py)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E, M, D = config.n_experts, config.expert_width, config.dim
        self.w1 = nn.Parameter(torch.empty(E, M, D))
        self.w2 = nn.Parameter(torch.empty(E, D, M))
        self.w3 = nn.Parameter(torch.empty(E, M, D))
        self.ranks = 1  # parallel.ep: the data-parallel ranks whose tokens reach these experts

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights of the experts this rank holds, as plain tensors: under parallel.ep a DTensor's local
        slice, whose gradient is divided by the data-parallel ranks (`MeanOverRanks`)."""
        weights = (self.w1, self.w2, self.w3)
        if self.ranks == 1:
            return weights
        return tuple(MeanOverRanks.apply(w.to_local(), self.ranks) for w in weights)  # type: ignore[return-value]

    def forward(self, x_AD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by expert, `counts[e]` rows for this rank's expert e, through their experts."""
        w1, w2, w3 = self.local_weights()
        outs, start = [], 0
        # One expert after another: each of its rows through w2(silu(w1 x) * w3 x). The weights are cast to
        # the rows' dtype as autocast casts a Linear's, so that bf16 rows meet bf16 weights.
        for e, count in enumerate(counts):
            rows_CD = x_AD[start : start + count]
            start += count
            h_CM = F.silu(rows_CD @ w1[e].to(rows_CD.dtype).T) * (rows_CD @ w3[e].to(rows_CD.dtype).T)
            outs.append(h_CM @ w2[e].to(rows_CD.dtype).T)
        return torch.cat(outs) if outs else x_AD[:0]


class MeanOverRanks(torch.autograd.Function):
    """The identity, whose backward divides the gradient by `ranks`. Under parallel.ep an expert's gradient
    sums every rank's contribution (each rank's loss is the mean over its own tokens), where FSDP2 or DDP
    averages the other parameters' over the ranks; this makes it the same mean. A function in the graph rather than a
    hook on the parameter: a hook registered on the meta-device DTensor parameter left the gradients undivided
    after materialising (`to_empty` swaps a tensor subclass's contents)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ranks: int) -> torch.Tensor:
        ctx.ranks = ranks
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.ranks, None


class SharedExperts(nn.Module):
    """The shared experts: one SwiGLU MLP of n_shared_experts * moe_ffn_dim (decoder.FeedForward's names)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """A block's MLP as a mixture of experts: router, routed experts (dispatched over the ep group when
    parallel.ep > 1) and shared experts."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.n_experts, self.top_k = layer, config.n_experts, config.top_k
        self.router = Router(config)
        self.experts = GroupedExperts(config)
        if config.n_shared_experts > 0:
            self.shared = SharedExperts(config.dim, config.n_shared_experts * config.expert_width)
        self.routing = MoeConfig()  # the run's moe keys (apply_moe_choice)
        self.log: RouterLog | None = None  # the model's (Transformer.__init__)
        self.ep: ExpertGroup | None = None  # parallel.ep > 1 (trainer/rank/experts.py)
        self.context: ContextParallel | None = None  # parallel.cp > 1: the balance loss's all-reduces

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        logits_NE, scores_NE, experts_NK, weights_NK = self.router(x_ND)
        expert_A = experts_NK.flatten()
        by_weight = self.routing.drop_policy == DropPolicy.probs
        weight_A = weights_NK.detach().flatten() if by_weight else None
        order_A, kept_A = assignment_order(expert_A, weight_A, self.capacity(B * T))
        token_A = order_A // self.top_k  # the token of each kept assignment, grouped by expert
        counts_E = torch.bincount(expert_A[order_A], minlength=self.n_experts)
        rows_AD = self.run_experts(x_ND[token_A], counts_E)
        rows_AD = rows_AD * weights_NK.flatten()[order_A, None].to(rows_AD.dtype)
        # In the experts' dtype: under autocast their bf16 output would not add into an fp32 buffer.
        y_ND = x_ND.new_zeros(x_ND.shape, dtype=rows_AD.dtype).index_add_(0, token_A, rows_AD)
        if hasattr(self, "shared"):
            y_ND = y_ND + self.shared(x_ND)
        attached = self.write_log(logits_NE, scores_NE, experts_NK, expert_A, kept_A, B)
        if attached is None:
            return y_ND.view(B, T, D)
        return AttachLoss.apply(y_ND.view(B, T, D), attached, self.log.backward_scale)

    def capacity(self, tokens: int) -> int | None:
        """moe.capacity_factor: the assignments an expert takes in this forward; None: dropless."""
        factor = self.routing.capacity_factor
        return None if factor is None else math.ceil(factor * tokens * self.top_k / self.n_experts)

    def run_experts(self, rows_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The rows (grouped by expert, `counts_E` of each) through their experts: here, or on their ep ranks."""
        watch = None if self.log is None or not self.log.records() else self.log.watch
        if self.ep is None or watch is not None:
            counts = counts_E.tolist()  # the loop needs the counts on the host; so does the watch
            if watch is not None:
                watch.check(self.layer, counts)
            if self.ep is None:
                return self.experts(rows_AD, counts)
        return dispatch_to_experts(self.experts, rows_AD, counts_E, self.ep)

    def write_log(
        self,
        logits_NE: torch.Tensor,
        scores_NE: torch.Tensor,
        experts_NK: torch.Tensor,
        expert_A: torch.Tensor,
        kept_A: torch.Tensor,
        batch: int,
    ) -> torch.Tensor | None:
        """The layer's loads, drops and weighted router losses, into the model's RouterLog; under parallel.pp the
        losses' sum is returned instead, for the forward to attach to its output. A checkpointed block's
        recompute computes the losses again and records nothing: torch.utils.checkpoint requires it to save
        for backward exactly what the forward saved."""
        log = self.log
        if log is None or not torch.is_grad_enabled():
            return None
        routing, losses = self.routing, []
        balance = None
        if routing.balance != BalanceLoss.none:
            cp = self.context.group if self.context is not None else None
            balance = balance_loss(scores_NE, experts_NK, self.n_experts, batch, routing.balance, cp)
            if routing.aux_coeff > 0:
                losses.append(routing.aux_coeff * balance)
        if routing.router_z_coeff > 0:
            losses.append(routing.router_z_coeff * torch.logsumexp(logits_NE, dim=-1).square().mean())
        if not log.records():
            return None
        load_E = torch.bincount(expert_A, minlength=self.n_experts)
        log.record(self.layer, load_E, expert_A.numel() - kept_A.sum(), balance)
        if log.backward_scale is not None and losses:
            return torch.stack(losses).sum()
        log.losses += losses
        return None


class AttachLoss(torch.autograd.Function):
    """The identity on a layer's output whose backward also gives `loss` the gradient `scale`: the loss joins
    the objective from inside a pipeline stage, whose schedule backpropagates only the last stage's loss
    (Megatron-LM's MoEAuxLossAutoScaler; torch has no such op). Nothing is saved for backward, so a
    checkpointed block's recompute, which attaches nothing, saves what the forward saved."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale, ctx.dtype = scale, loss.dtype
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, ctx.scale.to(ctx.dtype).reshape(()), None


def assignment_order(
    expert_A: torch.Tensor, weight_A: torch.Tensor | None, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept assignments' indices grouped by expert (in token order within an expert), and which of all
    the assignments are kept: dropless keeps all; a capacity keeps each expert's first `capacity` in the
    order moe.drop_policy gives (its highest weights for `probs`, its earliest tokens for `position`)."""
    order_A = torch.argsort(expert_A, stable=True)
    if capacity is None:
        return order_A, torch.ones_like(expert_A, dtype=torch.bool)
    return capped_order(expert_A, weight_A, capacity, order_A)


def capped_order(
    expert_A: torch.Tensor, weight_A: torch.Tensor | None, capacity: int, order_A: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`assignment_order` under a capacity. With weights (drop_policy=probs) an expert ranks its assignments
    by weight, highest first (ties by position); without, by position."""
    if weight_A is not None:
        by_weight = torch.argsort(weight_A, descending=True, stable=True)
        ranked = by_weight[torch.argsort(expert_A[by_weight], stable=True)]  # by expert, then weight
    else:
        ranked = order_A
    counts_E = torch.bincount(expert_A)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert = torch.arange(expert_A.numel(), device=expert_A.device) - starts_E[expert_A[ranked]]
    keep_ranked = rank_in_expert < capacity
    kept_A = torch.zeros_like(expert_A, dtype=torch.bool)
    kept_A[ranked[keep_ranked]] = True
    return order_A[kept_A[order_A]], kept_A


def balance_loss(
    scores_NE: torch.Tensor,
    experts_NK: torch.Tensor,
    n_experts: int,
    batch: int,
    kind: BalanceLoss,
    cp: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """E · Σ_e f_e · P_e: f_e the share of the assignments that chose expert e, P_e its mean (normalised)
    score; 1.0 when balanced. aux: over the forward's tokens (Switch Transformer, eq. 4); seq_aux: per
    sequence, then the mean over the sequences (DeepSeek-V3, eq. 17-20).

    parallel.cp > 1 (`cp`, the rank's cp group): each rank holds a share of every sequence, and both sums are
    taken over the whole sequences, as at cp = 1: an all-reduce of the choices and one, differentiable, of the
    scores. Every cp rank then has the same loss; the scores' all-reduce sums their gradients in backward, which
    ZeRO's average over the cp ranks returns to the gradient at cp = 1."""
    probs_NE = scores_NE / scores_NE.sum(dim=-1, keepdim=True)  # sigmoid scores normalised as softmax's are
    rows = batch if kind == BalanceLoss.seq_aux else 1
    probs_RSE = probs_NE.view(rows, -1, n_experts)
    chosen_RSE = torch.zeros_like(probs_RSE).scatter_(2, experts_NK.view(rows, -1, experts_NK.shape[1]), 1.0)
    chosen_RE, probs_RE, tokens = chosen_RSE.sum(dim=1), probs_RSE.sum(dim=1), probs_RSE.shape[1]
    if cp is not None:
        from torch.distributed.nn.functional import all_reduce  # torch's autograd-aware all-reduce

        dist.all_reduce(chosen_RE, group=cp)
        probs_RE = all_reduce(probs_RE, group=cp)
        tokens *= dist.get_world_size(cp)
    share_RE = chosen_RE / chosen_RE.sum(dim=-1, keepdim=True)
    return (n_experts * (share_RE * probs_RE / tokens).sum(dim=-1)).mean()


def dispatch_to_experts(
    experts: GroupedExperts, rows_AD: torch.Tensor, counts_E: torch.Tensor, ep: ExpertGroup
) -> torch.Tensor:
    """parallel.ep > 1: the rows (grouped by expert, all E) to the ranks holding their experts, through them,
    and back, by two all-to-alls. The split sizes are the one host sync (all_to_all_single takes lists)."""
    from trainer.private_apis.of_torch import all_to_all_uneven_autograd

    local = counts_E.numel() // ep.size
    # Every rank learns how many rows of each of its experts each rank sends: an all-to-all of the counts.
    received_RL = torch.empty_like(counts_E)
    dist.all_to_all_single(received_RL, counts_E, group=ep.group)
    sent_R = counts_E.view(ep.size, local).sum(dim=1).tolist()
    received = received_RL.view(ep.size, local)
    got_R = received.sum(dim=1).tolist()
    arrived_AD = all_to_all_uneven_autograd(rows_AD, got_R, sent_R, ep.group)
    # Arrived rows come by source rank, then expert; the experts take them by expert, then source rank.
    by_source = torch.repeat_interleave(
        torch.arange(received.numel(), device=rows_AD.device), received.flatten()
    ).view(-1)
    source_of = by_source // local
    expert_of = by_source % local
    order = torch.argsort(expert_of * ep.size + source_of, stable=True)
    # The rows in arrival order are not needed past their sort (index's backward keeps only `order`): drop them
    # before the experts run, and write the output back into one fresh buffer (index_copy_, not index_copy,
    # which would clone it): R·D twice less at the busiest rank's forward peak (docs/memory_plan.md).
    sorted_AD = arrived_AD[order]
    del arrived_AD, by_source, source_of, expert_of
    out_AD = experts(sorted_AD, received.sum(dim=0).tolist())
    back_AD = out_AD.new_empty(out_AD.shape).index_copy_(0, order, out_AD)  # back in arrival order
    return all_to_all_uneven_autograd(back_AD, sent_R, got_R, ep.group)


def apply_moe_choice(model: nn.Module, routing: MoeConfig) -> None:
    """Give every MoE layer the run's moe keys."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.routing = routing


def moe_layers(model: nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, loads_LE: torch.Tensor, rate: float) -> None:
    """moe.bias_rate > 0, after the optimizer step: each expert's bias moves by `rate` towards balance, by the
    sign of (mean load - its load), centred so the biases keep a zero mean (torchtitan's update).
    `loads_LE` are the step's loads summed over every rank (so that every rank moves them alike)."""
    for moe in moe_layers(model):
        load_E = loads_LE[moe.layer].float()
        delta_E = rate * torch.sign(load_E.mean() - load_E)
        moe.router.expert_bias.add_(delta_E - delta_E.mean())
