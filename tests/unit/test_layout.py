"""trainer/layout.py: the one formula that places a rank on the job's axes (pp, dp_replicate, dp_shard,
tp; pp outermost, tp innermost), its groups and their links, and what it refuses."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.config import ConfigError
from trainer.layout import Layout, check_world
from trainer.plan import build_plan


def test_coords_in_pp_dp_tp_order_and_back() -> None:
    layout = Layout(pp=2, dp_shard=3, tp=2)
    assert layout.coords(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert layout.coords(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 2, "cp": 0, "tp": 1}
    assert layout.coords(6) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert [layout.rank_at(**layout.coords(r)) for r in range(12)] == list(range(12))
    assert layout.world_size == 12 and layout.dp == 3 and layout.size("pp", "tp") == 4


def test_cp_sits_between_dp_and_tp_and_zero_works_over_it() -> None:
    """parallel.cp: a cp group is tp ranks apart; the batch is split over dp only, and ZeRO folds cp into
    FSDP2's shard group (or DDP's replicas)."""
    layout = Layout(dp_shard=2, cp=2, tp=2)
    assert layout.coords(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}
    assert layout.group("cp", 5).members == (5, 7)
    assert [layout.dp_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.shard_index(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.shard_size() == 4 and layout.dp == 2
    assert layout.zero_axes(uses_fsdp=True) == ("dp_shard", "cp")
    assert Layout(dp_replicate=2, cp=2).zero_axes(uses_fsdp=False) == ("dp_replicate", "cp")
    assert Layout(cp=2).zero_axes(uses_fsdp=True) == ("cp",)
    assert Layout().zero_axes(uses_fsdp=True) == ("dp_shard",)
    assert Layout().zero_axes(uses_fsdp=False) == ("dp_replicate",)


def test_groups_tp_consecutive_inside_a_node_pp_strided_across_nodes() -> None:
    layout = Layout(pp=2, dp_shard=2, tp=2, ranks_per_node=4)
    tp, pp, dp = layout.group("tp", 5), layout.group("pp", 5), layout.group("dp", 5)
    assert tp.members == (4, 5) and tp.intra_node
    assert pp.members == (1, 5) and not pp.intra_node  # stage 0 on node 0, stage 1 on node 1
    assert dp.members == (5, 7) and dp.intra_node
    assert layout.per_node("dp") == 2 and layout.per_node("pp") == 1


def test_the_two_stage_formulas_that_disagreed_are_one() -> None:
    """tp=2, pp=2 on 4 ranks: the plan took a rank's stage as rank // tp % pp (rank 1: stage 0) and telemetry
    as rank % pp (rank 1: stage 1). The layout says rank 1 is the second TP rank of stage 0, and the plan's
    pipeline_stage reads it from the layout."""
    layout = Layout(pp=2, tp=2)
    assert [layout.coords(r)["pp"] for r in range(4)] == [0, 0, 1, 1]
    assert [layout.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    plan = build_plan(compose_config("parallel.pp=2", "grad_accum=2"), "cpu", 2)
    assert [plan.pipeline_stage(r) for r in range(2)] == [0, 1]


def test_pp_is_outside_dp_a_pipeline_spans_replicas() -> None:
    """dp=2, pp=2: the old runtime mesh (dp, pp) put rank 1 on stage 1 of replica 0; pp outermost puts it
    on stage 0 of replica 1, and the data it reads follows its dp index."""
    config = compose_config("parallel.pp=2", "grad_accum=2")
    layout = Layout.from_config(config, 4)
    assert [(layout.coords(r)["pp"], layout.dp_index(r)) for r in range(4)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    plan = build_plan(config, "cpu", 4)
    assert [plan.pipeline_stage(r) for r in range(4)] == [0, 0, 1, 1]


def test_hsdp_groups_replicate_across_shard_groups() -> None:
    config = compose_config("zero=stage3", "zero.shard_ranks=2")
    layout = Layout.from_config(config, 4)
    assert (layout.dp_replicate, layout.dp_shard) == (2, 2)
    assert layout.group("dp_shard", 3).members == (2, 3)
    assert layout.group("dp_replicate", 3).members == (1, 3)
    assert layout.group("dp", 3).members == (0, 1, 2, 3)


def test_hpz_groups_are_consecutive_members_of_the_shard_group() -> None:
    config = compose_config("zero=stage3", "zero.hpz_ranks=2", "nodes=2")
    layout = Layout.from_config(config, 8)
    assert layout.group("hpz", 5).members == (4, 5) and layout.group("hpz", 5).intra_node
    assert layout.group("dp_shard", 5).members == tuple(range(8))
    assert not layout.group("dp_shard", 5).intra_node  # 2 nodes of 4 ranks


def test_under_cp_hpz_groups_are_consecutive_members_of_the_folded_shard_group() -> None:
    """FSDP2 shards over dp_shard x cp (one flattened dim) and views its ranks as (-1, hpz): at dp 2 x cp 2
    the hpz pairs are the two cp ranks of one dp index, at dp 4 x cp 2 with hpz 4 two dp indices' cp pairs."""
    layout = Layout.from_config(compose_config("parallel.cp=2", "zero=stage3", "zero.hpz_ranks=2"), 4)
    assert (layout.dp_shard, layout.cp, layout.shard_size()) == (2, 2, 4)
    assert [layout.group("hpz", rank).members for rank in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    layout = Layout.from_config(compose_config("parallel.cp=2", "zero=stage3", "zero.hpz_ranks=4"), 8)
    assert layout.group("hpz", 5).members == (4, 5, 6, 7)


def test_ddp_ranks_are_replicas() -> None:
    layout = Layout.from_config(compose_config("zero=stage1"), 4)
    assert (layout.dp_replicate, layout.dp_shard) == (4, 1)


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (("zero=stage3", "zero.shard_ranks=3"), 4, r"^zero.shard_ranks=3 must divide the world size 4"),
        (("zero=stage3", "zero.hpz_ranks=2"), 2, r"^zero.hpz_ranks=2 must divide the shard group of 2 ranks"),
        (
            ("parallel.cp=2", "zero=stage3", "zero.hpz_ranks=4"),
            4,
            r"^zero.hpz_ranks=4 must divide the shard group of 4 ranks, other than 1 and 4 .*allowed: 2$",
        ),
        (("parallel.pp=2", "grad_accum=2"), 3, r"^parallel.pp=2 \* parallel.tp=1 must divide the world of 3"),
    ],
)
def test_refuses_what_does_not_fill_the_world(overrides: tuple[str, ...], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Layout.from_config(compose_config(*overrides), world)


@pytest.mark.parametrize(
    ("overrides", "nodes", "nproc", "way_out"),
    [
        # 4 nodes of 8: no tp inside a node leaves one replica (it once offered parallel.tp=32)
        (("model=llama3-70b", "parallel.tp=8"), 4, 8, ""),
        (("model=llama3-70b", "parallel.tp=2", "parallel.pp=2", "grad_accum=2"), 1, 8, ", or parallel.tp=4"),
        # one node of 16 ranks, 8 kv heads: tp=16 would leave one replica but splits no kv head evenly
        (("model=llama3-70b", "parallel.tp=2"), 1, 16, ""),
    ],
)
def test_stage0_with_tp_offers_only_a_valid_tp(
    overrides: tuple[str, ...], nodes: int, nproc: int, way_out: str
) -> None:
    """Issue 60: the one-replica way out is a tp inside a node that divides the model's heads, or none."""
    config = compose_config("mode=plan", *overrides)
    tp = config.parallel.tp
    dp = nodes * nproc // (tp * config.parallel.pp)
    with pytest.raises(ConfigError) as err:
        check_world(config, nproc, nodes)
    assert str(err.value) == (
        f"parallel.tp={tp} with zero=stage0 on {dp} data-parallel replicas is not supported (torch's DDP holds "
        f"tensor-parallel parameters as local tensors); use zero=stage2 or stage3{way_out}"
    )
