"""benchmarks/gpu_check.py's verdicts (benchmarks/gpucheck/rows.py) on CPU, from jobs as the GPU would leave them: the check fails
when measured memory exceeds what the plan assumes (issue 28, item 1) and says what one GPU cannot
measure (issue 27, item 9); benchmarks/headroom_probe.py's arithmetic."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks.gpucheck import rows as check
from tests.conftest import REPO
from trainer.plan.headroom import HEADROOM


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


probe = load("headroom_probe")
SETUP = check.Setup(dry_run=False, out=Path("unused"), deadline=0.0)


def throughput_job(
    peak_gib: float, reserved_gib: float, predicted_reserved_gib: float, error_pct: float = 2.0
):
    summary = {
        "status": "ok",
        "throughput/tokens_per_s": 1000.0,
        "memory/max_rank_peak_gib": peak_gib,
        "memory/predicted_peak_gib": peak_gib * (1 + error_pct / 100),
        "memory/prediction_error_pct": error_pct,
        "plan": {"predicted_reserved_gib": predicted_reserved_gib},
    }
    records = [{"memory/rank0/peak_reserved_gib": reserved_gib, "memory/rank0/peak_allocated_gib": peak_gib}]
    return check.Job("125m_stage0", "ok", summary, records)


def test_a_throughput_row_fails_when_reserved_exceeds_the_plans_predicted_reserved() -> None:
    within = check.check_throughput(SETUP, {"j": throughput_job(10.0, 10.4, 10.6)})
    over = check.check_throughput(SETUP, {"j": throughput_job(10.0, 10.9, 10.6)})
    assert within.status == "pass" and within.figures["predicted_reserved_gib"] == 10.6
    assert over.status == "fail" and "over the plan's predicted_reserved_gib 10.6" in over.note
    assert over.figures["peak_reserved_gib"] == 10.9  # recorded either way


def probe_job(**measured: object) -> check.Job:
    figures = {
        "context_gib": 0.4,
        "cublas_workspace_gib": 1 / 32,
        "nccl_world1_gib": 0.2,
        "nccl_8_ranks": probe.NOT_MEASURABLE_HERE,
        "expandable_segments": True,
        "other_processes_gib": 0.0,
        **measured,
    }
    return check.Job("headroom", "ok", console=json.dumps(figures))


def headroom_row(probe_job: check.Job, reserved_gib: float = 10.4) -> check.Row:
    jobs = {"headroom": probe_job, **{n: throughput_job(10.0, reserved_gib, 11.0) for n in ("a", "b")}}
    return check.check_headroom(SETUP, jobs)


def test_headroom_passes_within_the_assumptions_and_names_what_one_gpu_cannot_measure() -> None:
    row = headroom_row(probe_job())
    assert row.status == "pass", row.note
    # 10.4 GiB reserved for 10 GiB allocated, against 10 x 1.1733 + 1.28125 = 13.01425 GiB from the fit
    assert row.figures["reserved_over_model_gib"] == pytest.approx(10.4 - 13.01425, abs=1e-3)
    assert row.figures["assumed_context_gib"] == 0.5
    assert "nccl at 8 ranks: not measurable on one GPU" in row.note


@pytest.mark.parametrize(
    ("measured", "reserved", "named"),
    [
        ({"context_gib": 0.6}, 10.4, "context_gib 0.600 > assumed 0.5"),
        ({"cublas_workspace_gib": 1 / 16}, 10.4, "cublas_workspace_gib 0.062 > assumed 0.03125"),
        ({"nccl_world1_gib": 0.7}, 10.4, "nccl_world1_gib 0.700 > assumed 0.5"),
        ({}, 13.5, "reserved_over_model_gib 0.486 > 0: reserved above the fitted model"),
        ({"context_gib": None}, 10.4, "context_gib not measured"),
    ],
)
def test_headroom_fails_when_a_figure_exceeds_its_assumption_or_is_not_measured(
    measured: dict, reserved: float, named: str
) -> None:
    row = headroom_row(probe_job(**measured), reserved)
    assert row.status == "fail" and named in row.note, row.note


def test_the_limit_row_fails_when_the_next_micro_batch_does_not_run_out_of_memory() -> None:
    fits = throughput_job(120.0, 124.0, 125.0)
    fits.overrides = ("model=1b", "micro_batch=48")
    oom = check.Job("limit_next", "oom")
    assert check.check_limit(SETUP, {"limit_fits": fits, "limit_next": oom}).status == "pass"
    row = check.check_limit(SETUP, {"limit_fits": fits, "limit_next": check.Job("limit_next", "ok")})
    assert row.status == "fail" and row.figures["micro_batch"] == 48
    assert "more than a micro-batch unused" in row.note


def test_the_probe_takes_this_process_own_figure_else_the_devices_growth() -> None:
    gib = 2**30
    assert probe.own_context_bytes(process=3 * gib, before=9 * gib, after=12 * gib, reserved=2 * gib) == gib
    assert probe.own_context_bytes(process=None, before=9 * gib, after=12 * gib, reserved=2 * gib) == gib
    assert probe.own_context_bytes(process=None, before=None, after=12 * gib, reserved=gib) is None


def test_headroom_assumptions_are_what_the_row_compares() -> None:
    assert {"context_gib", "nccl_gib", "cublas_workspace_gib", "fragmentation", "stream_cache_gib"} <= set(
        vars(HEADROOM)
    )
