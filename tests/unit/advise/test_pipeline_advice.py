"""Pipeline parallelism in the step-time model and the advisor (trainer/advise/predict.py, advisor.py): the bubble
and the sends between stages in the predicted step, and pp with its schedule among the candidates."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.advise.advisor import check_advice_inputs, choices, layouts, pp_options, schedule_options
from trainer.advise.calibrate import accelerator_rates
from trainer.advise.predict import predict_step_tiers
from trainer.config import ConfigError, DType
from trainer.plan import NETWORK, build_plan

EXAMPLE = (
    "mode=plan", "model=llama3-405b", "nodes=128", "nproc=4", "parallel.pp=8", "zero=stage3",
    "zero.reduce_every=step", "precision=bf16", "seq_len=8192", "micro_batch=1", "grad_accum=16",
    "plan.accelerator=h100",
)  # fmt: skip


@pytest.mark.parametrize(("schedule", "rounds"), [("1f1b", 16), ("gpipe", 16), ("interleaved_1f1b", 32)])
def test_step_adds_the_bubble_and_the_sends_between_stages(schedule: str, rounds: int) -> None:
    """f = (pp - 1) / (rounds + pp - 1), rounds m (v·m interleaved); the sends P: the busiest stage's bytes over the
    slowest boundary's link (pp outermost, trainer/layout.py: stages 64 ranks apart, each boundary crosses the
    network between nodes of 4); the bubble (C + P)·f / (1 - f)."""
    config = compose_config(*EXAMPLE, f"parallel.pp_schedule={schedule}")
    plan = build_plan(config, "cuda", 512)
    rates = accelerator_rates(
        "h100", DType.bfloat16, 512, model=config.model, seq_len=8192, micro_batches=[1]
    )
    step = predict_step_tiers(config, 512, plan.comm, 1, 1e9, rates, "cuda")
    share = 7 / (rounds + 7)
    assert step.bubble == pytest.approx(share, rel=1e-12)
    assert set(plan.comm.p2p.links) == {NETWORK}
    p2p_s = max(plan.comm.p2p.sent) / rates.group_bus_bytes_per_s(NETWORK, 1)
    assert step.p2p_s == pytest.approx(p2p_s, rel=1e-12)
    assert step.bubble_s == pytest.approx((step.compute_s + p2p_s) * share / (1 - share), rel=1e-12)
    no_pipeline = step.compute_s + step.exposed_comm_s + step.optimizer_s + step.offload_s
    assert step.step_s == pytest.approx(no_pipeline + step.p2p_s + step.bubble_s, rel=1e-12)


def test_advisor_considers_pp_dividing_the_world_whatever_the_blocks() -> None:
    """Stages split unevenly (trainer/model/pipeline_split.py): llama3-405b's 126 blocks allow pp=8, as torchtitan
    runs it; pp divides the world over tp (whole pipelines of whole TP groups), up to the blocks' count."""
    llama405 = compose_config("mode=advise", "global_batch=1024", "model=llama3-405b", "nodes=64", "nproc=8")
    assert pp_options(llama405, 512) == [None, 2, 4, 8, 16, 32, 64]  # 128 would leave stages without a block
    assert pp_options(llama405, 512, 8) == [None, 2, 4, 8, 16, 32, 64]  # 512 / tp = 64
    tiny = compose_config("mode=advise", "global_batch=64", "model=tiny", "nproc=4", "nodes=2")
    assert pp_options(tiny, 8) == [None, 2, 4]
    assert pp_options(tiny, 8, 2) == [None, 2, 4]
    one_node = compose_config("mode=advise", "global_batch=64", "model=tiny", "nproc=8")
    assert pp_options(one_node, 8) == [None]


def test_tp_and_pp_are_searched_together_and_the_batch_divides_by_dp() -> None:
    """torchtitan's 405B layout, FSDP 8 x TP 8 x PP 8 with global batch 256 on 512 ranks: 32 sequences per
    data-parallel rank (not 256 / 512)."""
    llama405 = compose_config("mode=advise", "global_batch=256", "model=llama3-405b", "nodes=64", "nproc=8")
    check_advice_inputs(llama405, 512)  # 256 does not divide by 512 ranks, but by dp = 8
    pairs = layouts(llama405, 512)
    assert (8, 8) in pairs and (None, None) not in pairs  # dp = 512 does not divide 256
    assert all(256 % (512 // (tp or 1) // (pp or 1)) == 0 for tp, pp in pairs)
    tiny = compose_config("mode=advise", "global_batch=64", "model=tiny", "nproc=4", "nodes=2")
    rows = [row for row in choices(tiny, 8, "cuda") if row["parallel.tp"] and row["parallel.pp"]]
    assert {(row["parallel.tp"], row["parallel.pp"]) for row in rows} == {(2, 2), (2, 4)}
    assert {row["micro_batch"] * row["grad_accum"] for row in rows if row["parallel.pp"] == 4} == {64}  # dp 1


def test_a_batch_no_layout_splits_is_refused_naming_each_data_parallel_degree() -> None:
    tiny = compose_config("mode=advise", "global_batch=3", "model=tiny", "nproc=4", "nodes=4")
    with pytest.raises(ConfigError) as info:
        check_advice_inputs(tiny, 16)
    assert str(info.value) == (
        "global_batch (3) must be divisible by the data-parallel ranks, world / (parallel.tp x parallel.pp), of a "
        "layout the advisor considers on 16 ranks (nodes=4 x nproc=4): 16 (tp=1 pp=1), 8 (tp=1 pp=2), "
        "4 (tp=1 pp=4), 2 (tp=2 pp=4); nearest: 2 or 4"
    )


def test_schedules_follow_the_micro_batches() -> None:
    """1F1B with a micro-batch per stage; interleaved (2 stages per rank) with whole rounds; GPipe, which has
    1F1B's bubble and holds more, only where 1F1B cannot run."""
    assert schedule_options(None, 8, 4) == [None]
    assert schedule_options(2, 1, 4) == ["gpipe"]
    assert schedule_options(2, 3, 4) == ["1f1b"]
    assert schedule_options(2, 4, 4) == ["1f1b", "interleaved_1f1b"]
    assert schedule_options(4, 4, 4) == ["1f1b"]  # 8 stages would exceed tiny's 4 blocks


def test_pipeline_candidates_compose_as_the_runtime_does() -> None:
    """Stage1 only without tp (trainer/config/composition.py), and no offload: it composes, but the advisor leaves
    it out beside a pipeline (advisor.py `choices` says why); one reduction per step; DDP beside TP only where one
    data-parallel replica is left."""
    tiny = compose_config("mode=advise", "global_batch=64", "model=tiny", "nproc=4", "nodes=2")
    every = choices(tiny, 8, "cuda")
    rows = [row for row in every if row["parallel.pp"] is not None]
    assert {row["zero"] for row in rows} == {"stage0", "stage1", "stage2", "stage3"}
    assert {row["zero"] for row in rows if row["parallel.tp"]} == {"stage0", "stage2", "stage3"}
    assert {
        8 // 2 // row["parallel.pp"] for row in rows if row["parallel.tp"] and row["zero"] == "stage0"
    } == {1}
    assert {row["offload"] for row in rows} == {"none"}
    assert {row["offload"] for row in every if row["parallel.pp"] is None} == {"none", "cpu"}
    assert {row["zero.reduce_every"] for row in rows} == {"step"}
    assert {(row["parallel.pp"], row["parallel.pp_schedule"]) for row in rows} == {
        (2, "gpipe"), (2, "1f1b"), (2, "interleaved_1f1b"), (4, "gpipe"), (4, "1f1b"),
    }  # fmt: skip
    assert {row["micro_batch"] * row["grad_accum"] for row in rows if row["parallel.pp"] == 4} == {32, 64}


def test_tp_collectives_are_busy_time_the_bubble_stretches_and_each_rank_sends_over_one_nic() -> None:
    """tp=8 x pp=8 (pp outermost: every boundary crosses nodes): the busy time the bubble stretches is compute, the
    tp group's collectives (on every micro-batch's path) and the sends; a node's 8 ranks send their boundaries
    at once, each over one NIC."""
    config = compose_config(
        *(o for o in EXAMPLE if o not in ("nodes=128", "nproc=4", "parallel.pp=8")),
        "nodes=64", "nproc=8", "parallel.tp=8", "parallel.pp=8", "parallel.pp_schedule=1f1b",
    )  # fmt: skip
    plan = build_plan(config, "cuda", 512)
    rates = accelerator_rates(
        "h100", DType.bfloat16, 512, model=config.model, seq_len=8192, micro_batches=[1]
    )
    step = predict_step_tiers(config, 512, plan.comm, 1, 1e9, rates, "cuda")
    tp = plan.comm.groups["tp"]
    nvlink = rates.link_bus_bytes_per_s["intra-node"]
    wire = {"all_reduce": 2 * 7 / 8, "all_gather": 7 / 8, "reduce_scatter": 7 / 8}
    assert step.tp_s == pytest.approx(
        sum(b * wire[k] / nvlink for k, b in tp.bytes_by_collective.items() if b)
    )
    assert step.p2p_s == pytest.approx(max(plan.comm.p2p.sent) / (rates.link_bus_bytes_per_s[NETWORK] / 8))
    share = 7 / (16 + 7)
    busy = step.compute_s + step.tp_s + step.p2p_s
    assert step.bubble_s == pytest.approx(busy * share / (1 - share), rel=1e-12)
