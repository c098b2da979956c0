"""The plan and the step model against torchtitan's 3-D runs (issue 57, acceptance 3 and 4): Llama 3.1 405B on 512
H100s, FSDP 8 x TP 8 x PP 8, local batch 32, global batch 256, seq 8192, full activation checkpointing,
torch.compile, Float8 and async TP (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 5):
1F1B 100 tokens/s per GPU and 82.5 GiB, interleaved 1F1B 128 and 72.7 GiB (torchtitan's max_reserved, the
maximum over PP ranks). The Float8 run's config (train_configs/llama3_405b.toml at the benchmark's commit 9dec370)
sets enable_fsdp_float8_all_gather: precision.fp8_all_gather=true here.

The split. At 9dec370 the micro-batch count defaults to the pipeline degree for both schedules
(torchtitan/parallelisms/pipelining_utils.py `build_pipeline_schedule`): 8 of 4 sequences; from PR #781
(2025-01-07) on, to the stages in total, which makes the interleaved run 16 of 2 (the split issue 57 names).
The throughput holds at both splits. The memory holds only at 16 x 2: at 8 x 4 torch's interleaved schedule runs
every chunk's forward on rank 0 before its first backward (8 micro-batches x 2 chunks in flight, the checkpointed
inputs of as many blocks as 1F1B's 8), so it plans above 1F1B (85.8 GiB, +18%), not 10 GiB below it as measured;
with micro-batches of 2 its in-flight inputs halve. The figures are mode=plan's and mode=advise's own
(advisor.predict_config); no term is fitted to these points. docs/three_d.md and docs/advisor.md have the
breakdown."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.advise.advisor import predict_config, rates_for
from trainer.config import TrainConfig
from trainer.plan import build_plan
from trainer.plan.headroom import HEADROOM
from trainer.units import GIB

WORLD, GLOBAL_BATCH, SEQ = 512, 256, 8192
PUBLISHED = {"1f1b": 100.0, "interleaved_1f1b": 128.0}  # tokens/s per GPU, Table 5
PUBLISHED_GIB = {"1f1b": 82.5, "interleaved_1f1b": 72.7}  # max reserved, Table 5
# (micro_batch, grad_accum) of each schedule, the issue's split first; then today's figures, keyed by micro_batch
SPLITS = {"1f1b": [(4, 8)], "interleaved_1f1b": [(2, 16), (4, 8)]}
PREDICTED = {("1f1b", 4): 91.6, ("interleaved_1f1b", 2): 137.8, ("interleaved_1f1b", 4): 119.2}  # tokens/s
PLANNED_GIB = {("1f1b", 4): 85.27, ("interleaved_1f1b", 2): 77.75, ("interleaved_1f1b", 4): 85.82}  # reserved


def published_layout(schedule: str, micro_batch: int, grad_accum: int) -> TrainConfig:
    """Table 5's job as zerolab spells it: the acceptance command with the run's fp8 all-gather."""
    return compose_config(
        "mode=plan", "model=llama3-405b", "nodes=64", "nproc=8", "plan.accelerator=h100", "device_memory_gib=95",
        f"seq_len={SEQ}", "precision=fp8", "precision.fp8_all_gather=true", "compile=true", "checkpointing=full",
        "zero=stage3", "parallel.tp=8", "parallel.pp=8", f"parallel.pp_schedule={schedule}",
        f"micro_batch={micro_batch}", f"grad_accum={grad_accum}",
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int], tuple[float, float]]:
    """(schedule, micro_batch): (tokens/s per GPU, reserved GiB of the worst rank) of each published split."""
    out = {}
    for schedule, splits in SPLITS.items():
        for micro_batch, grad_accum in splits:
            config = published_layout(schedule, micro_batch, grad_accum)
            plan = build_plan(config, "cuda", WORLD)
            step = predict_config(config, plan, "cuda", WORLD, rates_for(config, WORLD, [micro_batch]))
            out[schedule, micro_batch] = (
                GLOBAL_BATCH * SEQ / step.step_s / WORLD,
                HEADROOM.reserved(plan.peak_bytes) / GIB,
            )
    return out


def test_the_published_splits_are_the_local_batch_of_32() -> None:
    for schedule, splits in SPLITS.items():
        for micro_batch, grad_accum in splits:
            config = published_layout(schedule, micro_batch, grad_accum)
            assert micro_batch * grad_accum * config.parallel.dp(WORLD) == GLOBAL_BATCH
    assert SPLITS["interleaved_1f1b"][0][1] == published_layout("interleaved_1f1b", 2, 16).parallel.stages


def test_torchtitans_405b_runs_within_15pct_interleaved_ranked_above(runs) -> None:
    predicted = {key: tokens for key, (tokens, _) in runs.items()}
    assert predicted == pytest.approx(PREDICTED, rel=0.002), (
        "the step model or the plan's bytes moved: update PREDICTED and docs/advisor.md's table"
    )
    for micro_batch in (2, 4):
        assert predicted["interleaved_1f1b", micro_batch] > predicted["1f1b", 4]  # ranked as measured
    errors = {key: tokens / PUBLISHED[key[0]] - 1 for key, tokens in predicted.items()}
    assert all(abs(error) <= 0.15 for error in errors.values()), errors


def test_torchtitans_405b_memory_within_10pct_interleaved_below(runs) -> None:
    """Acceptance 3 at the issue's split (1F1B 4 x 8, interleaved 2 x 16): reserved within 10% of Table 5 and
    interleaved below 1F1B; at torchtitan's 9dec370 default (interleaved 4 x 8) the plan is 18% over and above
    1F1B (module docstring), pinned here so that a change of it shows."""
    reserved = {key: gib for key, (_, gib) in runs.items()}
    assert reserved == pytest.approx(PLANNED_GIB, abs=0.01), "the plan moved: update docs/three_d.md's table"
    issue = [("1f1b", 4), ("interleaved_1f1b", 2)]
    errors = {key: reserved[key] / PUBLISHED_GIB[key[0]] - 1 for key in issue}
    assert all(abs(error) <= 0.10 for error in errors.values()), errors
    assert reserved["interleaved_1f1b", 2] < reserved["1f1b", 4]
    default = reserved["interleaved_1f1b", 4] / PUBLISHED_GIB["interleaved_1f1b"] - 1
    assert (
        default > 0.10 and reserved["interleaved_1f1b", 4] > reserved["1f1b", 4]
    )  # the default split misses
