"""Pipeline parallelism in the step-time model and the advisor (trainer/advise/predict.py, advisor.py): the bubble
and the sends between stages in the predicted step, and pp with its schedule among the candidates."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.advise.advisor import choices, pp_options, schedule_options
from trainer.advise.calibrate import accelerator_rates
from trainer.advise.predict import predict_step_tiers
from trainer.config import DType
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


def test_advisor_considers_pp_dividing_the_blocks_and_the_world() -> None:
    """llama3-405b's 126 blocks and 512 ranks share one divisor > 1; tiny's 4 blocks on 8 ranks two."""
    llama405 = compose_config("mode=advise", "global_batch=1024", "model=llama3-405b", "nodes=64", "nproc=8")
    assert pp_options(llama405, 512) == [None, 2]
    tiny = compose_config("mode=advise", "global_batch=64", "model=tiny", "nproc=4", "nodes=2")
    assert pp_options(tiny, 8) == [None, 2, 4]
    one_node = compose_config("mode=advise", "global_batch=64", "model=tiny", "nproc=8")
    assert pp_options(one_node, 8) == [None]


def test_schedules_follow_the_micro_batches() -> None:
    """GPipe always; 1F1B with a micro-batch per stage; interleaved (2 stages per rank) with whole rounds."""
    assert schedule_options(None, 8, 4) == [None]
    assert schedule_options(2, 1, 4) == ["gpipe"]
    assert schedule_options(2, 3, 4) == ["gpipe", "1f1b"]
    assert schedule_options(2, 4, 4) == ["gpipe", "1f1b", "interleaved_1f1b"]
    assert schedule_options(4, 4, 4) == ["gpipe", "1f1b"]  # 8 stages would exceed tiny's 4 blocks


def test_pipeline_candidates_compose_as_the_runtime_does() -> None:
    """No tp, stage1 or offload beside pp (trainer/config/composition.py); one reduction per step."""
    tiny = compose_config("mode=advise", "global_batch=64", "model=tiny", "nproc=4", "nodes=2")
    rows = [row for row in choices(tiny, 8, "cuda") if row["parallel.pp"] is not None]
    assert {row["zero"] for row in rows} == {"stage0", "stage2", "stage3"}
    assert {row["parallel.tp"] for row in rows} == {None}
    assert {row["offload"] for row in rows} == {"none"}
    assert {row["zero.reduce_every"] for row in rows} == {"step"}
    assert {(row["parallel.pp"], row["parallel.pp_schedule"]) for row in rows} == {
        (2, "gpipe"), (2, "1f1b"), (2, "interleaved_1f1b"), (4, "gpipe"), (4, "1f1b"),
    }  # fmt: skip
    assert {row["micro_batch"] * row["grad_accum"] for row in rows if row["parallel.pp"] == 4} == {32}  # dp 2
