"""The mixture of experts (trainer/model/moe.py) against references written plainly, one token at a time."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.config import BalanceLoss, DropPolicy, ModelConfig, MoeConfig, RouterScore
from trainer.model.decoder import build_model, init_weights
from trainer.model.moe import MoE, RouterLog, balance_loss

TINY_MOE = dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, n_experts=4, top_k=2)


def moe_layer(routing: MoeConfig | None = None, **shape: object) -> tuple[MoE, RouterLog]:
    config = ModelConfig(**{**TINY_MOE, **shape})  # type: ignore[arg-type]
    model = build_model(config, "cpu")
    init_weights(model, seed=0)
    layer = model.layers[0].feed_forward
    assert isinstance(layer, MoE) and model.router_log is not None
    layer.routing = routing or MoeConfig()
    return layer, model.router_log


def reference_output(
    layer: MoE, x_ND: torch.Tensor, kept: set[tuple[int, int]] | None = None
) -> torch.Tensor:
    """Token by token: its top_k experts by score (+ bias), each one's SwiGLU output times its weight."""
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    out = torch.zeros_like(x_ND)
    for n, x_D in enumerate(x_ND):
        logits_E = layer.router.gate.weight @ x_D
        scores_E = logits_E.softmax(-1) if layer.router.score == RouterScore.softmax else logits_E.sigmoid()
        chosen = torch.topk(scores_E + layer.router.expert_bias, layer.top_k).indices.tolist()
        weights = scores_E[chosen] / scores_E[chosen].sum() if layer.router.normalise else scores_E[chosen]
        for e, weight in zip(chosen, weights):
            if kept is None or (n, e) in kept:
                out[n] += weight * (w2[e] @ (F.silu(w1[e] @ x_D) * (w3[e] @ x_D)))
    return out


@pytest.mark.parametrize("score", [RouterScore.softmax, RouterScore.sigmoid])
@pytest.mark.parametrize("route_norm", [True, False])
def test_dropless_output_equals_the_token_by_token_reference(score: RouterScore, route_norm: bool) -> None:
    layer, _ = moe_layer(router_score=score, route_norm=route_norm)
    x_BTD = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = layer(x_BTD).flatten(0, 1)
        expected = reference_output(layer, x_BTD.flatten(0, 1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def capacity_reference(
    layer: MoE, x_ND: torch.Tensor, capacity: int, policy: DropPolicy
) -> set[tuple[int, int]]:
    """The (token, expert) assignments an expert keeps: its first `capacity` by position, or by weight
    (highest first, ties by position), each expert taken alone."""
    logits = x_ND @ layer.router.gate.weight.T
    scores = logits.softmax(-1)
    chosen = torch.topk(scores, layer.top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
    kept: set[tuple[int, int]] = set()
    for e in range(layer.n_experts):
        mine = [
            (n, float(weights[n, k]))
            for n in range(x_ND.shape[0])
            for k in range(layer.top_k)
            if chosen[n, k] == e
        ]
        if policy == DropPolicy.probs:
            mine.sort(key=lambda pair: -pair[1])  # stable: ties keep the earlier token first
        kept.update((n, e) for n, _ in mine[:capacity])
    return kept


@pytest.mark.parametrize("policy", [DropPolicy.probs, DropPolicy.position])
def test_a_capacity_drops_what_the_reference_drops(policy: DropPolicy) -> None:
    """capacity_factor=1.0 over 32 tokens, top 2 of 4: each expert keeps ceil(32 * 2 / 4) = 16 assignments."""
    layer, log = moe_layer(MoeConfig(capacity_factor=1.0, drop_policy=policy, balance=BalanceLoss.none))
    x_BTD = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(2))
    kept = capacity_reference(layer, x_BTD.flatten(0, 1).detach(), math.ceil(32 * 2 / 4), policy)
    log.open = True
    out = layer(x_BTD).flatten(0, 1)
    log.open = False
    loads, dropped, _ = log.take_step()  # type: ignore[misc]
    assert int(dropped.sum()) == 32 * 2 - len(kept) > 0
    assert int(loads.sum()) == 32 * 2  # the loads count what the tokens chose, dropped or not
    with torch.no_grad():
        torch.testing.assert_close(
            out, reference_output(layer, x_BTD.flatten(0, 1), kept), rtol=1e-5, atol=1e-6
        )


def test_the_balance_loss_is_one_when_balanced_and_grows_with_imbalance() -> None:
    """E * sum_e f_e P_e: uniform scores and choices give 1; every token on experts 0 and 1 with most of the
    score there gives 4 * (0.5 * 0.4 + 0.5 * 0.4) = 1.6. Per sequence (seq_aux) it is the mean of each sequence's."""
    n, E = 8, 4
    uniform = torch.full((n, E), 1 / E)
    round_robin = torch.tensor([[i % E, (i + 1) % E] for i in range(n)])
    assert balance_loss(uniform, round_robin, E, 1, BalanceLoss.aux).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.4, 0.4, 0.1, 0.1]]).repeat(n, 1)
    first_two = torch.tensor([[0, 1]]).repeat(n, 1)
    assert balance_loss(skewed, first_two, E, 1, BalanceLoss.aux).item() == pytest.approx(4 * (0.5 * 0.4 * 2))
    # Two sequences, each on its own two experts: balanced over the batch, not within a sequence.
    mirrored = torch.cat((skewed[:4], skewed[:4].flip(-1)))
    own_two = torch.cat((first_two[:4], first_two[:4] + 2))
    assert balance_loss(mirrored, own_two, E, 2, BalanceLoss.aux).item() == pytest.approx(1.0)
    assert balance_loss(mirrored, own_two, E, 2, BalanceLoss.seq_aux).item() == pytest.approx(1.6)


def test_an_evaluation_and_a_recompute_write_nothing_to_the_log() -> None:
    """The log records only while the model's forward is open and gradients are on."""
    layer, log = moe_layer()
    x = torch.randn(1, 4, 32)
    layer(x)  # the log is closed: as during a checkpointed block's recompute in backward
    log.open = True
    with torch.no_grad():
        layer(x)  # an evaluation
    assert log.take_step() is None and log.take_losses() is None
    layer(x)
    assert log.take_losses() is not None and log.take_step() is not None


def test_under_autocast_the_experts_output_adds_up_in_their_dtype() -> None:
    """precision=bf16 at stage0/1 runs the model under autocast: the experts' bf16 rows are combined in bf16 (an fp32
    buffer refused them), close to the fp32 layer's output."""
    layer, _ = moe_layer()
    x_BTD = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = layer(x_BTD)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = layer(x_BTD)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=0.05, atol=0.01)
