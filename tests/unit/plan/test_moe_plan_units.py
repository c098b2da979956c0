"""A mixture of experts in the memory plan (trainer/plan/moe.py): the rows each expert takes under moe.imbalance,
and the activations the plan counts for a tiny-moe forward equal to the storages autograd saves (fp32, the
router's variants: softmax or sigmoid scores, normalised or not, the balance loss per micro-batch or per sequence
or none, the router z-loss, shared experts; and in half precision, with the casts of the experts' weights and
rows)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import compose_config, saved_storage_bytes
from trainer.config import TrainConfig
from trainer.model.decoder import build_model, init_weights
from trainer.model.moe import apply_moe_choice
from trainer.plan import build_plan
from trainer.plan.activations import activations, precisions
from trainer.plan.moe import expert_casts, expert_rows, routed_rows, weight_cast_bytes
from trainer.plan.states import model_shape

TINY_MOE = ("model=tiny-moe", "micro_batch=2", "seq_len=64", "precision=fp32")


@pytest.mark.parametrize(
    ("imbalance", "expected"),
    [
        (1.0, (32,) * 8),  # 2 x 64 tokens x top 2 = 256 rows over 8 experts
        (2.0, (64,) + (28,) * 3 + (27,) * 4),  # the busiest twice the mean, the other 192 rows shared
        (4.0, (128,) + (19,) * 2 + (18,) * 5),  # every token: the most one expert can take
        (8.0, (128,) + (19,) * 2 + (18,) * 5),  # more than every token is every token
    ],
)
def test_the_busiest_expert_takes_imbalance_times_the_mean(
    imbalance: float, expected: tuple[int, ...]
) -> None:
    rows = expert_rows(compose_config(*TINY_MOE, f"moe.imbalance={imbalance}"))
    assert rows.per_expert == expected
    assert rows.total == 256 and rows.busiest == expected[0]


def test_a_capacity_caps_every_expert() -> None:
    """moe.capacity_factor=1.0: 32 rows per expert at most (ceil(1.0 x 128 x 2 / 8)): the busiest's other 32
    are dropped, not given to the others; at 1.5 (48 rows) the busiest keeps 48 and drops 16."""
    rows = expert_rows(compose_config(*TINY_MOE, "moe.imbalance=2.0", "moe.capacity_factor=1.0"))
    assert rows.per_expert == (32,) + (28,) * 3 + (27,) * 4 and rows.total == 256 - 32
    rows = expert_rows(compose_config(*TINY_MOE, "moe.imbalance=2.0", "moe.capacity_factor=1.5"))
    assert rows.per_expert == (48,) + (28,) * 3 + (27,) * 4 and rows.total == 256 - 16


def model_and_batch(*overrides: str) -> tuple[TrainConfig, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """tiny-moe's config with `overrides`, its model on the CPU (initialised, the moe keys applied) and a batch."""
    config = compose_config(*TINY_MOE, *overrides)
    model = build_model(config.model, device="cpu")
    init_weights(model, seed=0)
    apply_moe_choice(model, config.moe)
    shape = (config.micro_batch, config.seq_len)
    inputs, targets = (torch.randint(0, config.model.vocab_size, shape) for _ in range(2))
    return config, model, inputs, targets


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.route_norm=false", "moe.balance=seq_aux", "moe.router_z_coeff=1e-3"),
        ("model.router_score=sigmoid", "moe.balance=none", "model.n_shared_experts=1"),
        ("model.top_k=1", "moe.imbalance=3.0"),
    ],
)
def test_planned_activations_are_what_autograd_saves(overrides: tuple[str, ...]) -> None:
    """Every block's saved set (the MoE layer's in place of the dense MLP's hidden tensors), the head's and the
    batch's: the plan's total equals the distinct storages autograd saves, parameters and buffers (the router's
    expert_bias) and the rotary tables excluded. Dropless, the saved set is the same whatever the routing."""
    config, model, inputs, targets = model_and_batch(*overrides)
    assert saved_storage_bytes(model, inputs, targets, "fp32") == activations(config).total


@pytest.mark.parametrize(
    "overrides",
    [
        ("precision=bf16",),
        ("precision=fp16", "model.router_score=sigmoid", "moe.balance=none", "model.n_shared_experts=1"),
        ("precision=bf16", "zero=stage3"),
    ],
)
def test_half_precision_activations_are_what_autograd_saves(overrides: tuple[str, ...]) -> None:
    """In half precision the plan's saved set holds each expert's weight casts and, under autocast (stages 0-1),
    each expert's two casts of its fp32 rows and the gate's one cast of the norm's output (trainer/plan/moe.py
    `expert_casts`): what autograd saves, to the byte, beside autocast's cached casts of the nn.Linear weights
    (the attention's, the gate's, the shared experts', the output head's), which the plan counts as temporaries
    (trainer/plan/ddp_walk.py). Under FSDP2's bf16 parameters at ep = 1 the experts' weights are bf16: no casts."""
    config, model, inputs, targets = model_and_batch(*overrides)
    regime = precisions(config.precision, config.zero).regime
    cached = 0
    if regime == "autocast":
        m = config.model
        cached = 2 * (model_shape(m).block_linear_numel * m.n_layers + m.vocab_size * m.dim)
    assert saved_storage_bytes(model, inputs, targets, regime) == activations(config).total + cached


def test_the_weight_casts_are_three_per_expert_where_the_weights_are_not_the_rows_dtype() -> None:
    """fp32 and FSDP2's bf16 parameters at ep = 1 cast nothing; autocast and FSDP2 under parallel.ep over all its
    ranks (the experts apart, fp32) cast each of a rank's E / ep experts' three weights to 2 bytes per element; an
    ep group inside FSDP2's shard group has its experts gathered in bf16: nothing cast."""
    assert [weight_cast_bytes(regime, False) for regime in ("fp32", "autocast", "fsdp_mp")] == [0, 2, 0]
    assert [weight_cast_bytes(regime, True) for regime in ("fp32", "fsdp_mp")] == [0, 2]
    config = compose_config(*TINY_MOE, "precision=bf16", "zero=stage3", "parallel.ep=2", "nproc=2")
    m = config.model
    for rank in (0, 1):
        rows = expert_rows(config, rank, shard_ranks=2)
        assert rows.apart
        assert expert_casts(config, "fsdp_mp", rows) == 3 * (m.n_experts // 2) * m.expert_width * m.dim * 2
        assert expert_casts(config, "fp32", rows) == 0
    inside = compose_config(*TINY_MOE, "precision=bf16", "zero=stage3", "parallel.ep=2", "nproc=4")
    rows = expert_rows(inside, 1, shard_ranks=4)
    assert not rows.apart and expert_casts(inside, "fsdp_mp", rows) == 0


def test_a_dense_models_activations_free_nothing_early() -> None:
    """The MoE terms are zero for a dense model: its block's backward holds its whole saved set."""
    acts = activations(compose_config("model=tiny"))
    assert acts.freed_at_peak == 0 and acts.in_backward == acts.full_block + acts.unread


@pytest.mark.parametrize(
    ("imbalance", "routed", "received"),
    [
        (
            1.0,
            (128, 0, 0, 0, 128, 0, 0, 0),
            (256, 256),
        ),  # each rank's experts the mean group's 128 rows per rank
        (2.0, (128, 128, 0, 0, 0, 0, 0, 0), (512, 0)),  # twice the mean: every row to rank 0's experts
        (1.5, (128, 64, 0, 0, 64, 0, 0, 0), (384, 128)),
    ],
)
def test_under_ep_the_imbalance_is_of_each_ranks_experts(
    imbalance: float, routed: tuple[int, ...], received: tuple[int, int]
) -> None:
    """parallel.ep=2: the unit is the 4 experts a rank holds; the busiest (rank 0's) takes r times the mean 128
    rows of a micro-batch, filling its experts in order, each up to every token (the loop's last experts with the
    fewest: the worst case for the experts' backward peak), and every rank receives ep times its experts' share."""
    config = compose_config(
        *TINY_MOE, "nproc=2", "zero=stage3", "parallel.ep=2", f"moe.imbalance={imbalance}"
    )
    assert routed_rows(config) == routed
    for rank, rows in enumerate(received):
        local = expert_rows(config, rank)
        assert (local.sent, local.total, local.ep, len(local.per_expert)) == (256, rows, 2, 4)
        assert local.per_expert == tuple(2 * r for r in routed[4 * rank : 4 * rank + 4])


def test_under_ep_each_rank_plans_its_own_rows() -> None:
    """The plan of each ep rank is its experts' (plan.json's moe.rows_per_rank); with every row on rank 0 its
    activations are above rank 1's by what the rows weigh; the model states are FSDP2's shards either way."""
    plan = build_plan(
        compose_config(*TINY_MOE, "nproc=2", "zero=stage3", "parallel.ep=2", "moe.imbalance=2.0"), "cpu", 2
    )
    assert plan.to_json()["moe"]["rows_per_rank"] == [512, 0]
    busy, idle = plan.ranks
    assert busy.states == idle.states and busy.activations > idle.activations
    assert busy.peak_total > idle.peak_total


def test_under_ep_fsdp2_moves_no_expert_weight_and_the_ep_group_its_rows() -> None:
    """The shard group's all-gathers and reduce-scatters are ep=1's less the experts' stacked weights; the ep
    group's all-to-alls per rank: per layer and forward the counts (8 x E) and two row exchanges, per backward two,
    each at max(A, R) rows x D x 4 bytes (A = 256 rows sent, R received: 512 and 0 at imbalance 2)."""
    ep1, ep2 = (
        build_plan(
            compose_config(*TINY_MOE, "nproc=2", "zero=stage3", f"parallel.ep={ep}", "moe.imbalance=2.0"),
            "cpu",
            2,
        )
        for ep in (1, 2)
    )
    experts = 4 * 3 * 8 * 96 * 128  # per layer, fp32: w1, w2, w3 of 8 experts
    shard1, shard2 = (plan.comm.groups["shard"].bytes_by_collective for plan in (ep1, ep2))
    assert shard1["all_gather"] - shard2["all_gather"] == 2 * 4 * experts  # forward and stage3's backward
    assert shard1["all_reduce"] - shard2["all_reduce"] == 4 * experts  # gloo's reduce-scatter
    assert "ep" not in ep1.comm.groups
    ep = ep2.comm.groups["ep"]
    row = 128 * 4
    assert [r["all_to_all"] for r in ep.per_rank] == [
        4 * (64 + 2 * 512 * row) + 4 * 2 * 512 * row,
        4 * (64 + 2 * 256 * row) + 4 * 2 * 256 * row,
    ]
    assert ep.bytes_by_collective == ep.per_rank[0] and ep.calls_by_collective["all_to_all"] == 4 * 3 + 4 * 2


def test_under_ddp_a_rank_holds_its_experts_states_and_ddp_reduces_the_rest() -> None:
    """zero=stage0 at ep=2: params, gradients and Adam's moments are ep=1's less half the experts' (each rank holds 4
    of 8); DDP's all-reduce is ep=1's less every expert's gradient; before the experts' backward a rank holds only
    DDP's buckets, and under checkpointing=full block 0's backward, with the three later layers' expert gradients,
    is walked too."""
    ep1, ep2 = (
        build_plan(
            compose_config(*TINY_MOE, "nproc=2", "zero=stage0", f"parallel.ep={ep}", "moe.imbalance=1.0"),
            "cpu",
            2,
        )
        for ep in (1, 2)
    )
    experts = 4 * 3 * 8 * 96 * 128  # per layer, fp32: w1, w2, w3 of 8 experts
    one, two = ep1.ranks[0].states, ep2.ranks[0].states
    assert (one.params - two.params, one.grads - two.grads) == (2 * experts, 2 * experts)
    assert one.optimizer - two.optimizer == 2 * 2 * experts
    world1, world2 = (plan.comm.groups["world"].bytes_by_collective for plan in (ep1, ep2))
    assert world1["all_reduce"] - world2["all_reduce"] == 4 * experts
    loss = next(m for m in ep2.ranks[0].moments if m.name == "backward: loss")
    assert loss.parts["grads"] == two.grads - 2 * experts  # the buckets alone
    full = build_plan(
        compose_config(*TINY_MOE, "nproc=2", "zero=stage0", "parallel.ep=2", "checkpointing=full"), "cpu", 2
    )
    block0 = next(m for m in full.ranks[0].moments if m.name == "backward: block 0")
    assert block0.parts["grads"] == two.grads - experts // 2  # three of the four layers' halves
