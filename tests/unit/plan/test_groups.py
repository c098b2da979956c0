"""HSDP and hpZ before launch: the keys' checks, the groups and their links, the per-group communication
plan, the memory plan's secondary shards and the tiered step time (issue 25's 70b example)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import compose_config
from trainer.advise.calibrate import accelerator_rates
from trainer.advise.predict import predict_step, predict_step_tiers
from trainer.config import ConfigError, Stage, TrainConfig, ZeroConfig
from trainer.model.decoder import flops_per_token
from trainer.plan import build_plan, plan_comm
from trainer.plan.comm import PARAM_BYTES
from trainer.plan.groups import INTRA_NODE, NETWORK, shard_groups
from trainer.plan.states import model_shape, padded_numel

# ----------------------------------------------------------------------------- keys and groups


@pytest.mark.parametrize(
    ("zero", "message"),
    [
        (
            dict(stage=Stage.stage1, shard_ranks=2),
            "zero.shard_ranks shards FSDP2's states (zero=stage2 or stage3)",
        ),
        (
            dict(stage=Stage.stage2, hpz_ranks=2),
            "zero.hpz_ranks (hpZ: reshard_after_forward=<int>) needs zero=stage3",
        ),
        (dict(stage=Stage.stage3, shard_ranks=0), "zero.shard_ranks must be >= 1"),
        (dict(stage=Stage.stage3, hpz_ranks=1), "zero.hpz_ranks must be >= 2"),
    ],
)
def test_the_keys_alone_refuse_what_no_world_allows(zero: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ZeroConfig(**zero)


@pytest.mark.parametrize(
    ("zero", "world", "message"),
    [
        (
            dict(shard_ranks=16),
            8,
            "zero.shard_ranks=16 is larger than the world (8 ranks); allowed: a divisor of 8: 1, 2, 4, 8",
        ),
        (dict(shard_ranks=3), 8, "zero.shard_ranks=3 must divide the world size 8"),
        (dict(hpz_ranks=3), 8, "zero.hpz_ranks=3 must divide the shard group of 8 ranks, other than 1 and 8"),
        (dict(hpz_ranks=8), 8, "allowed: 2, 4"),
        (dict(shard_ranks=2, hpz_ranks=2), 4, "hpZ needs a shard group of 4 or more ranks"),
    ],
)
def test_sizes_torch_refuses_are_one_line_naming_the_key(zero: dict, world: int, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        shard_groups(ZeroConfig(stage=Stage.stage3, **zero), world)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_beside_cp_a_shard_group_is_shard_ranks_x_cp_ranks() -> None:
    """zero.shard_ranks counts dp ranks; cp folds into each shard group (trainer/rank/mesh.py `dp_shard_cp`):
    8 ranks of dp 4 x cp 2, shard_ranks=2 -> shard groups of 4, replicated twice, cp a group of its own (one
    communicator more), and at shard_ranks=1 the shard group is the cp group (none more)."""
    hsdp = shard_groups(ZeroConfig(stage=Stage.stage3, shard_ranks=2), 8, cp=2)
    assert (hsdp.shard, hsdp.replicate, hsdp.nccl_communicators(0)) == (4, 2, 4)
    alone = shard_groups(ZeroConfig(stage=Stage.stage3, shard_ranks=1), 8, cp=2)
    assert (alone.shard, alone.replicate, alone.nccl_communicators(0)) == (2, 4, 3)
    with pytest.raises(ConfigError) as caught:
        shard_groups(ZeroConfig(stage=Stage.stage3, shard_ranks=3), 8, cp=2)
    assert str(caught.value).startswith("zero.shard_ranks=3 must divide the 4 data-parallel ranks")
    assert "a shard group is zero.shard_ranks x 2 ranks" in str(caught.value)


def test_a_node_per_shard_group_keeps_it_inside_the_node_and_replicates_across_the_network() -> None:
    hsdp = shard_groups(ZeroConfig(stage=Stage.stage3, shard_ranks=8), 64, 8)
    assert (hsdp.shard, hsdp.replicate, hsdp.link("shard"), hsdp.link("replicate")) == (
        8,
        8,
        INTRA_NODE,
        NETWORK,
    )
    hpz = shard_groups(ZeroConfig(stage=Stage.stage3, hpz_ranks=8), 64, 8)
    assert (hpz.link("shard"), hpz.link("hpz"), hpz.hsdp) == (NETWORK, INTRA_NODE, False)
    assert shard_groups(ZeroConfig(stage=Stage.stage3, shard_ranks=16), 64, 8).link("shard") == NETWORK
    assert shard_groups(ZeroConfig(stage=Stage.stage3, shard_ranks=2), 4, 4).link("replicate") == INTRA_NODE


# ----------------------------------------------------------------------------- plans


def test_hsdp_pads_to_the_shard_group_and_all_reduces_each_gradient_shard_across_groups() -> None:
    config = compose_config("model=tiny", "zero=stage3", "zero.shard_ranks=2", "nproc=4")
    comm = plan_comm(config, 4, backend="nccl")
    shape = model_shape(config.model)
    root, block = (sum(padded_numel(s, 2) for s in part) for part in (shape.root, shape.block))
    L, padded = config.model.n_layers, root + config.model.n_layers * block
    shard, replicate = comm.groups["shard"], comm.groups["replicate"]
    assert shard.bytes_by_collective["all_gather"] == 4 * (root + 2 * L * block)  # fp32: forward + backward
    assert shard.bytes_by_collective["reduce_scatter"] == 4 * padded
    assert replicate.bytes_by_collective == {
        "all_reduce": 4 * padded // 2,
        "all_gather": 0,
        "reduce_scatter": 0,
        "broadcast": 0,
        "all_to_all": 0,
    }
    assert (shard.ranks, replicate.ranks) == (2, 2)
    assert comm.total == shard.total + replicate.total
    assert comm.to_json()["groups"]["replicate"]["bytes_per_step"] == replicate.total


def test_hpz_moves_backwards_all_gathers_into_the_secondary_group() -> None:
    flat = plan_comm(compose_config("model=tiny", "zero=stage3", "nproc=4"), 4, backend="nccl")
    hpz = plan_comm(
        compose_config("model=tiny", "zero=stage3", "zero.hpz_ranks=2", "nproc=4"), 4, backend="nccl"
    )
    assert hpz.bytes_by_collective == flat.bytes_by_collective  # the same bytes, in other groups
    config = compose_config("model=tiny", "zero=stage3", "nproc=4")
    block = sum(padded_numel(s, 4) for s in model_shape(config.model).block)
    assert hpz.groups["hpz"].bytes_by_collective["all_gather"] == 4 * config.model.n_layers * block
    assert hpz.groups["hpz"].calls_by_collective["all_gather"] == config.model.n_layers
    assert hpz.groups["shard"].total + hpz.groups["hpz"].total == flat.groups["shard"].total


def test_hpz_holds_a_secondary_shard_of_every_block_between_forward_and_backward() -> None:
    base = ("model=tiny", "zero=stage3", "nproc=4", "precision=bf16")
    flat, hpz = (build_plan(compose_config(*base, *extra), "cpu", 4) for extra in ((), ("zero.hpz_ranks=2",)))
    shape = model_shape(flat.config.model)
    secondary = (
        PARAM_BYTES[flat.config.precision.compute_dtype] * sum(padded_numel(s, 4) for s in shape.block) // 2
    )
    L = flat.config.model.n_layers

    def at(plan, name: str) -> int:
        return next(m.total for m in plan.ranks[0].moments if m.name == name)

    assert at(hpz, "forward: loss") - at(flat, "forward: loss") == L * secondary
    assert at(hpz, "forward: last block") - at(flat, "forward: last block") == (L - 1) * secondary
    assert at(hpz, "optimizer step") == at(flat, "optimizer step")  # none left after backward


def test_hsdp_model_states_are_the_shard_groups() -> None:
    hsdp = build_plan(compose_config("model=tiny", "zero=stage3", "zero.shard_ranks=2", "nproc=4"), "cpu", 4)
    two = build_plan(compose_config("model=tiny", "zero=stage3", "nproc=2"), "cpu", 2)
    assert [r.states for r in hsdp.ranks] == [r.states for r in two.ranks] * 2


# ----------------------------------------------------------------------------- step time by tier


def seventy_b(*extra: str) -> TrainConfig:
    return compose_config(
        "model=70b", "nodes=8", "nproc=8", "zero=stage3", "checkpointing=full", "micro_batch=2",
        "seq_len=4096", "precision=bf16", "plan.accelerator=a100-80gb", "device=cuda", *extra,
    )  # fmt: skip


def test_the_70b_example_is_network_bound_and_exposes_what_does_not_fit_behind_compute() -> None:
    """Issue 25: 70b on 8 nodes x 8 a100-80gb, micro_batch=2, on a network of 20 GB/s bus bandwidth across
    nodes (plan.network_bus_gbps=20: one HDR NIC a node, NVIDIA/nccl#412): 27.1 s of all-gather +
    reduce-scatter wire time against 21.4 s of compute at the published fit; collectives sharing the
    network are serialised on it before overlap."""
    config = seventy_b()
    comm = plan_comm(config, 64, backend="nccl")
    rates = accelerator_rates("a100-80gb", config.precision.compute_dtype, 64, network_bus_gbps=20)
    flops = flops_per_token(config.model, config.seq_len)
    tiered = predict_step_tiers(config, 64, comm, 10**9, flops, rates)
    network = tiered.links[NETWORK]
    assert network.wire_s == pytest.approx(27.1, abs=0.05)
    assert tiered.compute_s == pytest.approx(21.4, abs=0.05)  # trainer/advise/throughput.py's fit
    assert tiered.exposed_comm_s >= network.wire_s - tiered.compute_s > 0.5
    assert tiered.limiter.startswith("network")
    # Each collective on a link of its own credited every overlap: well under the shortfall.
    alone = predict_step(config, 64, comm.bytes_by_collective, 10**9, flops, rates)
    assert alone.exposed_comm_s < network.wire_s - tiered.compute_s and alone.limiter == "compute"


def test_on_dgx_a100_nodes_the_70b_example_is_compute_bound() -> None:
    """The table's DGX A100: 8 HDR NICs a node, 192 GB/s all-reduce bus bandwidth across nodes
    (NVIDIA/nccl#812): the same bytes take 27.1 x 20 / 192 = 2.82 s, hidden behind compute."""
    config = seventy_b()
    comm = plan_comm(config, 64, backend="nccl")
    rates = accelerator_rates("a100-80gb", config.precision.compute_dtype, 64)
    step = predict_step_tiers(config, 64, comm, 10**9, flops_per_token(config.model, config.seq_len), rates)
    assert step.links[NETWORK].wire_s == pytest.approx(27.108 * 20 / 192, rel=1e-3)
    assert step.limiter == "compute"


def test_an_hsdp_replicate_group_runs_on_one_rail() -> None:
    """One rank a node: its all-reduce crosses the network on its own NIC, 1/8 of the node's 192 GB/s."""
    config = seventy_b("zero.shard_ranks=8")
    comm = plan_comm(config, 64, backend="nccl")
    rates = accelerator_rates("a100-80gb", config.precision.compute_dtype, 64)
    step = predict_step_tiers(config, 64, comm, 10**9, flops_per_token(config.model, config.seq_len), rates)
    payload = comm.groups["replicate"].bytes_by_collective["all_reduce"]
    assert step.wire_s["replicate/all_reduce"] == pytest.approx(payload * 2 * 7 / 8 / 24e9)


def test_hsdp_and_hpz_keep_their_inner_collectives_on_nvlink() -> None:
    rates = accelerator_rates("a100-80gb", seventy_b().precision.compute_dtype, 64)
    for extra, inner in ((("zero.shard_ranks=8",), "shard"), (("zero.hpz_ranks=8",), "hpz")):
        config = seventy_b(*extra)
        comm = plan_comm(config, 64, backend="nccl")
        step = predict_step_tiers(
            config, 64, comm, 10**9, flops_per_token(config.model, config.seq_len), rates
        )
        assert comm.groups[inner].link == INTRA_NODE
        assert step.wire_s[f"{inner}/all_gather"] == pytest.approx(
            comm.groups[inner].bytes_by_collective["all_gather"]
            * 7
            / 8
            / rates.link_bus_bytes_per_s[INTRA_NODE]
        )
        assert step.links[NETWORK].wire_s < 27.1 and not step.limiter.startswith("network")


def test_without_overlap_every_link_exposes_all_its_wire_time() -> None:
    config = seventy_b("zero.shard_ranks=8")
    rates = dataclasses.replace(
        accelerator_rates("a100-80gb", config.precision.compute_dtype, 64), overlap=False
    )
    comm = plan_comm(config, 64, backend="nccl")
    step = predict_step_tiers(config, 64, comm, 10**9, flops_per_token(config.model, config.seq_len), rates)
    assert step.exposed_comm_s == pytest.approx(sum(step.wire_s.values()))


@pytest.mark.parametrize(("world", "hpz"), [(8, 2), (8, 4), (64, 2), (64, 4)])
def test_hpz_groups_are_hpz_ranks_wide_whatever_the_shard_group(world: int, hpz: int) -> None:
    """hpZ's group is zero.hpz_ranks consecutive ranks (torch's mesh.view(-1, H)), not shard / hpz:
    at 2 over 64 ranks, 8 a node, 2 ranks inside a node, where shard / hpz would be 32 across the network."""
    groups = shard_groups(ZeroConfig(stage=Stage.stage3, hpz_ranks=hpz), world, 8)
    assert (groups.size("hpz"), groups.link("hpz")) == (hpz, INTRA_NODE)
    comm = plan_comm(compose_config("model=tiny", "zero=stage3", f"zero.hpz_ranks={hpz}"), world, "nccl")
    assert comm.groups["hpz"].ranks == hpz


def test_hpz_2_over_8_ranks_keeps_half_of_each_blocks_all_gather() -> None:
    """The secondary shard is 1/hpz of a block's all-gather output: at hpz=2 over 8 ranks, half of the
    tiny model's fp32 block (196,864 elements, every dim 0 divisible by 8), from each block's forward
    to its backward."""
    base = ("model=tiny", "zero=stage3")
    flat, hpz = (build_plan(compose_config(*base, *extra), "cpu", 8) for extra in ((), ("zero.hpz_ranks=2",)))
    (flat_loss,) = [m.total for m in flat.ranks[0].moments if m.name == "forward: loss"]
    (hpz_loss,) = [m.total for m in hpz.ranks[0].moments if m.name == "forward: loss"]
    assert hpz_loss - flat_loss == 4 * 4 * 196_864 // 2  # 4 blocks
