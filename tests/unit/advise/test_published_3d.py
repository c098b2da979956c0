"""The step model against torchtitan's 3-D runs (issue 57, acceptance 4): Llama 3.1 405B on 512 H100s, FSDP 8 x
TP 8 x PP 8, local batch 32, global batch 256, seq 8192, full activation checkpointing, torch.compile, Float8 and
async TP (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 5): 1F1B 100 tokens/s per GPU,
interleaved 1F1B 128. At the benchmark's torchtitan commit (9dec370, 2024-12-26) the schedule's micro-batch count
defaults to the pipeline degree (torchtitan/parallelisms/pipelining_utils.py `build_pipeline_schedule`:
`n_microbatches = job_config.experimental.pipeline_parallel_degree`), for both schedules: 8 micro-batches of 4
sequences, the interleaved schedule with 2 stages per rank (`generate_split_points`).

The figures are mode=advise's own (advisor.predict_config) on plan.accelerator=h100, as the acceptance command
plans it. zerolab has no async TP: its TP collectives are on every micro-batch's critical path (4.05 s of NVLink per
step here, the plan's bytes: the residual stream in bf16 under FSDP2's policy), and the bubble (1F1B 7/15,
interleaved 7/23) stretches them with the compute: 1F1B comes out 8.5% below the published figure, interleaved
7.1% below. No term is fitted to these points; docs/advisor.md ("Against torchtitan's 405B 3-D runs") has the
breakdown."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.advise.advisor import predict_config, rates_for, unchecked_replace
from trainer.config import Fp8Recipe, TrainConfig
from trainer.plan import build_plan

WORLD, GLOBAL_BATCH, SEQ = 512, 256, 8192
PUBLISHED = {"1f1b": 100.0, "interleaved_1f1b": 128.0}  # tokens/s per GPU, Table 5
SPLIT = {"1f1b": (4, 8), "interleaved_1f1b": (4, 8)}  # (micro_batch, grad_accum): torchtitan's default
PREDICTED = {"1f1b": 91.5, "interleaved_1f1b": 118.9}  # what the model says today (docs/advisor.md)


def published_layout(schedule: str) -> TrainConfig:
    """Table 5's job as zerolab spells it; precision=fp8 and compile=true set unchecked, as the composition table
    refuses them beside parallel.tp today (trainer/config/composition.py): the step model times them all the same."""
    micro_batch, grad_accum = SPLIT[schedule]
    config = compose_config(
        "mode=plan", "model=llama3-405b", "nodes=64", "nproc=8", "plan.accelerator=h100", f"seq_len={SEQ}",
        "precision=bf16", "checkpointing=full", "zero=stage3", "zero.reduce_every=step", "parallel.tp=8",
        "parallel.pp=8", f"parallel.pp_schedule={schedule}", f"micro_batch={micro_batch}", f"grad_accum={grad_accum}",
    )  # fmt: skip
    fp8 = unchecked_replace(config.precision, name="fp8", fp8_recipe=Fp8Recipe.tensorwise)
    return unchecked_replace(config, precision=fp8, compile=True)


def tokens_per_gpu(schedule: str) -> float:
    config = published_layout(schedule)
    plan = build_plan(config, "cuda", WORLD)
    step = predict_config(config, plan, "cuda", WORLD, rates_for(config, WORLD, [config.micro_batch]))
    return GLOBAL_BATCH * SEQ / step.step_s / WORLD


def test_the_published_split_is_the_local_batch_of_32() -> None:
    for schedule, (micro_batch, grad_accum) in SPLIT.items():
        config = published_layout(schedule)
        assert micro_batch * grad_accum * config.parallel.dp(WORLD) == GLOBAL_BATCH
        assert grad_accum == config.parallel.pp  # torchtitan's default micro-batch count: the pipeline degree


def test_torchtitans_405b_runs_within_15pct_interleaved_ranked_above() -> None:
    predicted = {schedule: tokens_per_gpu(schedule) for schedule in PUBLISHED}
    assert predicted == pytest.approx(PREDICTED, rel=0.002), (
        "the step model or the plan's bytes moved: update PREDICTED and docs/advisor.md's table"
    )
    assert predicted["interleaved_1f1b"] > predicted["1f1b"]  # ranked as measured
    errors = {schedule: predicted[schedule] / PUBLISHED[schedule] - 1 for schedule in PUBLISHED}
    assert all(abs(error) <= 0.15 for error in errors.values()), errors
