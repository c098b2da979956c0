"""checks/gpu_check.py's verdicts (checks/gpucheck/rows.py) on CPU, from jobs as the GPU would leave them: the check fails
when measured memory exceeds what the plan assumes (issue 28, item 1) and says what one GPU cannot
measure (issue 27, item 9); each row judging what it claims, with a measurement that fails it, the
bundle and the schedule's estimate (issue 40); checks/headroom_probe.py's arithmetic."""

from __future__ import annotations

import json
import pickle
import tarfile
from pathlib import Path

import pytest

from checks import gpu_check
from checks import headroom_probe as probe
from checks.gpucheck import catalog, memory, perf, rates, report
from checks.gpucheck import rows as check
from tests.helpers import REPO, compose
from trainer.plan.headroom import HEADROOM

SETUP = check.Setup(dry_run=False, out=Path("unused"), deadline=0.0)
DRY = check.Setup(dry_run=True, out=Path("unused"), deadline=0.0)


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
    assert row.figures["assumed_context_gib"] == 0.75
    assert "nccl at 8 ranks: not measurable on one GPU" in row.note


@pytest.mark.parametrize(
    ("measured", "reserved", "named"),
    [
        ({"context_gib": 0.8}, 10.4, "context_gib 0.800 > assumed 0.75"),
        ({"cublas_workspace_gib": 1 / 16}, 10.4, "cublas_workspace_gib 0.062 > assumed 0.03125"),
        ({"nccl_world1_gib": 0.7}, 10.4, "nccl_world1_gib 0.700 > assumed 0.545"),
        ({}, 13.5, "reserved_over_model_gib 0.486 > 0: reserved above the fitted model"),
        ({"context_gib": None}, 10.4, "context_gib not measured"),
    ],
)
def test_headroom_fails_when_a_figure_exceeds_its_assumption_or_is_not_measured(
    measured: dict, reserved: float, named: str
) -> None:
    row = headroom_row(probe_job(**measured), reserved)
    assert row.status == "fail" and named in row.note, row.note


def test_the_limit_row_is_judged_on_what_the_single_rank_reserves(tmp_path: Path) -> None:
    """The plan's largest micro-batch must run within its plan; one more may run (the reserved model
    is fitted on 8-GPU FSDP2 runs: the room is reported in micro-batches) or end oom, never crash."""
    setup = check.Setup(dry_run=False, out=tmp_path, deadline=0.0)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "environment.json").write_text(json.dumps({"memory_gib": 139.8}))
    fits = throughput_job(120.0, 121.0, 125.0)
    fits.overrides = ("model=1b", "micro_batch=48")
    oom = check.Job("limit_next", "oom")
    assert check.check_limit(setup, {"limit_fits": fits, "limit_next": oom}).status == "pass"
    ran = check.Job("limit_next", "ok", records=[{"memory/rank0/peak_reserved_gib": 123.5}])
    row = check.check_limit(setup, {"limit_fits": fits, "limit_next": ran})
    # (139.8 - 121.0) / (123.5 - 121.0) = 7.5 more micro-batches: 55 fit one rank
    assert row.status == "pass" and row.figures["measured_largest_micro_batch"] == 55, row.note
    crashed = check.Job("limit_next", "crashed", summary={"error": "boom"})
    row = check.check_limit(setup, {"limit_fits": fits, "limit_next": crashed})
    assert row.status == "fail" and "neither ok nor oom" in row.note
    over = throughput_job(120.0, 126.0, 125.0)
    over.overrides = fits.overrides
    row = check.check_limit(setup, {"limit_fits": over, "limit_next": oom})
    assert row.status == "fail" and row.figures["reserved_error_pct"] == 0.8, row.note  # 126 / 125


def test_the_probe_takes_this_process_own_figure_else_the_devices_growth() -> None:
    gib = 2**30
    assert probe.own_context_bytes(process=3 * gib, before=9 * gib, after=12 * gib, reserved=2 * gib) == gib
    assert probe.own_context_bytes(process=None, before=9 * gib, after=12 * gib, reserved=2 * gib) == gib
    assert probe.own_context_bytes(process=None, before=None, after=12 * gib, reserved=gib) is None


@pytest.mark.parametrize(
    ("measured_key", "assumed"),
    [
        ("context_gib", HEADROOM.context_gib),
        ("nccl_world1_gib", HEADROOM.nccl_one_rank_gib),
        ("cublas_workspace_gib", HEADROOM.cublas_workspace_gib),
    ],
)
def test_headroom_assumptions_are_what_the_row_compares(measured_key: str, assumed: float) -> None:
    """Each measured figure is held against its own assumption: at it passes, a MiB above it fails."""
    at = {"context_gib": HEADROOM.context_gib, "nccl_world1_gib": HEADROOM.nccl_one_rank_gib,
          "cublas_workspace_gib": HEADROOM.cublas_workspace_gib, "reserved_over_model_gib": 0.0}  # fmt: skip
    assert memory.headroom_verdict(at) == []
    over = memory.headroom_verdict({**at, measured_key: assumed + 2**-10})
    assert over == [f"{measured_key} {assumed + 2**-10:.3f} > assumed {assumed:g}"]
    assert memory.headroom_verdict({**at, "reserved_over_model_gib": 0.001}) == [
        "reserved_over_model_gib 0.001 > 0: reserved above the fitted model"
    ]


# ----------------------------------------------------------------------------- issue 40: what each row judges


def loss_job(name: str, losses: list[float], **summary: object) -> check.Job:
    return check.Job(
        name,
        "ok",
        {"status": "ok", **summary},
        [{"step": i + 1, "loss/train": x} for i, x in enumerate(losses)],
    )


def test_reproducibility_is_judged_at_its_stated_tolerance_with_bitwise_equality_recorded() -> None:
    reference = loss_job("125m_stage0", [10.0, 9.0, 8.0])
    same = check.check_reproducible(SETUP, {"a": reference, "b": loss_job("again", [10.0, 9.0, 8.0])})
    close = check.check_reproducible(
        SETUP, {"a": reference, "b": loss_job("again", [10.0 * (1 + 5e-5), 9.0, 8.0 * (1 + 9e-3)])}
    )
    apart = check.check_reproducible(
        SETUP, {"a": reference, "b": loss_job("again", [10.0, 9.0, 8.0 * (1 + 1.1e-2)])}
    )
    first = check.check_reproducible(
        SETUP, {"a": reference, "b": loss_job("again", [10.0 * (1 + 2e-4), 9.0, 8.0])}
    )
    assert (same.status, same.figures["bitwise"]) == ("pass", True)
    assert (close.status, close.figures["bitwise"]) == ("pass", False)
    assert apart.status == "fail" and "allowed 0.01" in apart.note, apart.note
    assert first.status == "fail" and "first step's losses differ by 0.0002" in first.note, first.note


def test_allocated_is_judged_at_3_percent_on_the_gpu_and_reserved_as_a_signed_error() -> None:
    at_2 = check.check_throughput(SETUP, {"j": throughput_job(10.0, 10.4, 10.6, error_pct=2.0)})
    at_4 = check.check_throughput(SETUP, {"j": throughput_job(10.0, 10.4, 10.6, error_pct=-4.0)})
    dry = check.check_throughput(DRY, {"j": throughput_job(0.02, None, None, error_pct=-4.0)})
    assert at_2.status == "pass" and at_2.figures["reserved_error_pct"] == -1.9  # 10.4 / 10.6 - 1
    assert at_4.status == "fail" and "off the plan by -4.0% (allowed ±3%)" in at_4.note
    assert dry.status == "pass", dry.note  # the tiny model on CPU: ±15%
    over = check.check_throughput(SETUP, {"j": throughput_job(10.0, 10.9, 10.6)})
    assert over.status == "fail" and "(+2.8%)" in over.note and over.figures["reserved_error_pct"] == 2.8


def test_mfu_is_summary_jsons_steady_figure_not_the_last_window() -> None:
    job = throughput_job(10.0, 10.4, 10.6)
    job.summary["throughput/mfu_pct"] = 41.04
    job.records[0]["throughput/mfu_pct"] = 55.0
    assert check.check_throughput(SETUP, {"j": job}).figures["mfu_pct"] == 41.0


def test_compile_is_judged_on_losses_and_its_memory_only_reported() -> None:
    eager = loss_job("125m_stage0", [10.0, 9.0], **{"throughput/tokens_per_s": 1000.0})
    memory = {"throughput/tokens_per_s": 1500.0, "memory/max_rank_peak_gib": 8.0, "memory/predicted_peak_gib": 10.0,
              "memory/prediction_error_pct": 25.0}  # fmt: skip
    close = check.check_compile(SETUP, {"e": eager, "c": loss_job("compile", [10.01, 9.0], **memory)})
    apart = check.check_compile(SETUP, {"e": eager, "c": loss_job("compile", [10.5, 9.0], **memory)})
    assert (
        close.status == "pass"
        and close.figures["allocated_error_pct"] == 25.0
        and close.figures["ratio"] == 1.5
    )
    assert apart.status == "fail" and "losses differ by 0.05" in apart.note


def fit_job(allocated: float, reserved: float) -> check.Job:
    return check.Job("j", "ok", records=[{"memory/rank0/peak_allocated_gib": allocated,
                                          "memory/rank0/peak_reserved_gib": reserved}])  # fmt: skip


def test_the_candidate_headroom_fit_is_the_least_squares_line_of_the_jobs_peaks() -> None:
    fit = memory.headroom_fit([fit_job(10, 11.0), fit_job(20, 21.5), fit_job(30, 32.0)])
    assert fit == {"fragmentation": 0.05, "constant_gib": 0.5, "points": 3, "worst_residual_gib": 0.0}
    assert memory.headroom_fit([fit_job(10, 11.0)]) is None  # one point fits no line
    assert memory.headroom_fit([fit_job(10, 11.0), fit_job(10, 12.0)]) is None  # nor one allocated figure
    assert headroom_row(probe_job()).figures["candidate_fit"] is None  # the row's jobs: one allocated figure


def test_the_advisor_row_compares_predicted_and_measured_tokens_per_s(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    advice = {"125m_stage0": {"tokens_per_s": 1500.0, "step_s": 1.0, "limiter": "compute"}}
    (tmp_path / "jobs" / "advice.json").write_text(json.dumps(advice))
    setup = check.Setup(dry_run=False, out=tmp_path, deadline=0.0)
    plans = check.Job("plans", "ok")

    def row(measured: float, setup: check.Setup = setup) -> check.Row:
        job = check.Job("125m_stage0", "ok", {"throughput/tokens_per_s": measured})
        return check.check_advisor(setup, {"plans": plans, "125m_stage0": job})

    assert row(1000.0).status == "pass" and row(1000.0).figures["125m_stage0"]["ratio"] == 1.5
    assert row(500.0).status == "fail" and "advised 3.00x" in row(500.0).note
    assert row(500.0, check.Setup(dry_run=True, out=tmp_path, deadline=0.0)).status == "info"


def test_the_gpu_schedule_fits_the_deadline_and_docs_gpu_md_gives_it() -> None:
    """The performance run (the rows run without --rows) within 420 s (issue 59, item 7)."""
    gpu = check.Setup(dry_run=False, out=Path("/tmp/unused"), deadline=0.0)
    jobs = check.jobs_for(check.chosen_rows(None), catalog.all_jobs(gpu))
    estimate = catalog.schedule_estimate(jobs, gpu_check.WORKERS)
    assert estimate <= gpu_check.DEADLINE_S == 420
    assert f"**{estimate:.0f} s" in (REPO / "docs" / "gpu.md").read_text()
    # the scheduler's rules: exclusive alone, `after` waits, else up to `workers` at once
    spec = catalog.JobSpec
    jobs = [spec("a", estimate_s=10), spec("b", estimate_s=10), spec("x", estimate_s=5, exclusive=True),
            spec("c", estimate_s=10, after="x"), spec("d", estimate_s=10)]  # fmt: skip
    assert catalog.schedule_estimate(jobs, 2) == 10 + 5 + 10


def test_a_dry_run_sweeps_the_fault_and_comparison_jobs_each_point_composed_as_its_command_line(
    tmp_path: Path,
) -> None:
    """Every fault and comparison job is a point of the dry run's one sweep, and the file its point
    picks composes the config its own command line does: what each row judges is unchanged."""
    from checks.gpucheck.scheduler import sweep_args

    dry = check.Setup(dry_run=True, out=tmp_path, deadline=0.0)
    (sweep,) = [spec for spec in catalog.all_jobs(dry) if spec.points]
    performance = [
        p.name for p in sweep.points[len(catalog.fault_jobs(dry)) + len(catalog.comparison_jobs(dry)) :]
    ]
    assert sweep.points[: -len(performance)] == (*catalog.fault_jobs(dry), *catalog.comparison_jobs(dry))
    assert performance == ["125m_text", "1b_mb32", "1b_compiled", "1b_compiled_mb16", "1b_fp8_compiled",
                           "125m_stage0_compile"]  # fmt: skip
    assert not any(spec.points for spec in catalog.all_jobs(check.Setup(False, tmp_path, 0.0)))
    searchpath = next(arg for arg in sweep_args(dry, sweep) if arg.startswith("hydra.searchpath="))
    base = ("device=cpu", "nproc=1", "logger=none", "save=off")
    for point in sweep.points:
        assert compose(*base, searchpath, f"+gpucheck={point.name}") == compose(*base, *point.overrides), (
            point
        )


def test_the_bundle_holds_the_results_and_one_archive_without_checkpoints(tmp_path: Path) -> None:
    out, bundle = tmp_path / "out", tmp_path / "bundle"
    (out / "jobs" / "save" / "checkpoints" / "step_00000004").mkdir(parents=True)
    (out / "jobs" / "save" / "checkpoints" / "step_00000004" / "model.distcp").write_bytes(b"0" * 1000)
    (out / "jobs" / "save" / "summary.json").write_text('{"status": "ok"}')
    (out / "logs").mkdir()
    (out / "logs" / "save.log").write_text("step 4/4\n")
    results = report.Report(out, dry_run=True, bundle=bundle)
    results.add(check.Row("first", "pass"))
    results.add(check.Row("second", "fail", {"x": 1}, "why"))
    assert sorted(p.name for p in bundle.iterdir()) == ["gpu_check.tar.gz", "results.json", "results.md"]
    assert [r["check"] for r in json.loads((bundle / "results.json").read_text())["rows"]] == [
        "first",
        "second",
    ]
    assert (bundle / "results.md").read_text() == (out / "results.md").read_text()
    with tarfile.open(bundle / "gpu_check.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["jobs/save/summary.json", "logs/save.log"]


def test_the_sync_free_row_informs_with_the_ratio_and_fails_when_a_job_failed() -> None:
    fused = check.Job("125m_stage0", "ok", {"throughput/tokens_per_s": 1200.0})
    loop = check.Job("125m_stage0_loop", "ok", {"throughput/tokens_per_s": 1000.0})
    row = check.check_sync_free(SETUP, {"a": fused, "b": loop})
    assert row.status == "info" and row.figures["ratio"] == 1.2
    crashed = check.Job("125m_stage0_loop", "crashed", summary={"error": "boom"})
    assert check.check_sync_free(SETUP, {"a": fused, "b": crashed}).status == "fail"


# ----------------------------------------------------------------------------- every verdict, from recorded jobs


def memory_job(name: str, losses: list[float], error_pct: float, reserved_gib: float = 10.4) -> check.Job:
    """A job whose summary and records say its losses, peak allocated 10 GiB off its plan by
    `error_pct`, and reserved `reserved_gib` against the plan's 10.6."""
    job = throughput_job(10.0, reserved_gib, 10.6, error_pct=error_pct)
    job.name = name
    job.records = [{**job.records[0], "step": i + 1, "loss/train": x} for i, x in enumerate(losses)]
    return job


def test_a_loss_row_judges_losses_and_the_jobs_peak_allocated_against_its_plan() -> None:
    reference = memory_job("125m_stage0", [10.0, 9.0], 0.0)
    row = check.check_same_losses(SETUP, {"a": reference, "b": memory_job("ckpt_op", [10.1, 9.0], 2.0)})
    assert row.status == "pass", row.note
    off_plan = check.check_same_losses(SETUP, {"a": reference, "b": memory_job("ckpt_op", [10.1, 9.0], 3.5)})
    assert off_plan.status == "fail" and off_plan.note == "peak allocated off the plan by 3.5% (allowed ±3%)"
    assert (
        check.check_same_losses(DRY, {"a": reference, "b": memory_job("b", [10.1, 9.0], 3.5)}).status
        == "pass"
    )
    over = check.check_same_losses(SETUP, {"a": reference, "b": memory_job("b", [10.1, 9.0], 1.0, 10.9)})
    assert over.status == "fail" and "over the plan's predicted_reserved_gib 10.6" in over.note
    apart = check.check_same_losses(SETUP, {"a": reference, "b": memory_job("b", [10.3, 9.0], 1.0)})
    assert apart.status == "fail" and apart.note == "losses differ by 0.03 relative (allowed 0.02)"
    crashed = check.Job("b", "crashed", {"error": "boom"})
    assert check.check_same_losses(SETUP, {"a": reference, "b": crashed}).note == "b: status crashed: boom"


def test_checkpointing_must_also_lower_the_peak() -> None:
    reference = memory_job("125m_stage0", [10.0, 9.0], 0.0)
    lower = memory_job("ckpt_full", [10.0, 9.0], 0.0)
    lower.summary["memory/max_rank_peak_gib"] = 6.0
    lower.summary["memory/predicted_peak_gib"] = 6.0
    assert check.check_checkpointing(SETUP, {"a": reference, "b": lower}).status == "pass"
    same = memory_job("ckpt_full", [10.0, 9.0], 0.0)
    same.summary["memory/predicted_peak_gib"] = 6.0  # planned lower, measured the same
    row = check.check_checkpointing(SETUP, {"a": reference, "b": same})
    assert (row.status, row.note) == ("fail", "checkpointing did not lower the peak (its plan does)")
    # where the plan keeps the peak (a one-rank job at tiny shapes peaks past every block), the same peak passes
    kept = memory_job("ckpt_full", [10.0, 9.0], 0.0)
    assert check.check_checkpointing(SETUP, {"a": reference, "b": kept}).status == "pass"
    raised = memory_job("ckpt_full", [10.0, 9.0], 0.0)
    raised.summary["memory/max_rank_peak_gib"] = 10.5
    row = check.check_checkpointing(SETUP, {"a": reference, "b": raised})
    assert (row.status, row.note) == ("fail", "checkpointing raised the peak, which its plan keeps")


def test_the_fp16_and_offload_rows_judge_the_steps_they_name() -> None:
    def scaled(scales: list[float], skipped: int) -> check.Job:
        records = [{"precision/loss_scale": x} for x in scales]
        return check.Job("fp16_overflow", "ok", {"precision/skipped_steps": skipped}, records)

    assert check.check_fp16_overflow(SETUP, {"j": scaled([8.0, 8.0, 4.0], 1)}).status == "pass"
    assert check.check_fp16_overflow(SETUP, {"j": scaled([8.0, 8.0, 8.0], 1)}).status == "fail"
    assert check.check_fp16_overflow(SETUP, {"j": scaled([8.0, 8.0, 4.0], 2)}).status == "fail"

    def offloaded(losses: list[float], skipped: int) -> check.Job:
        return loss_job("offload", losses, **{"train/nonfinite_skipped": skipped})

    nan = float("nan")
    assert check.check_offload(SETUP, {"j": offloaded([3.0, 2.9, nan, 2.8], 1)}).status == "pass"
    assert check.check_offload(SETUP, {"j": offloaded([3.0, nan, nan, 2.8], 1)}).status == "fail"
    assert check.check_offload(SETUP, {"j": offloaded([3.0, 2.9, nan, 2.8], 0)}).status == "fail"
    assert check.check_offload(SETUP, {"j": check.Job("offload", "crashed")}).status == "fail"


def test_the_offload_host_row_holds_the_measured_rss_against_the_plans_host_figure(tmp_path: Path) -> None:
    setup = check.Setup(dry_run=False, out=tmp_path, deadline=0.0)
    plan_json = tmp_path / "jobs" / "offload" / "plan.json"
    plan_json.parent.mkdir(parents=True)
    parts = {"runtime": 2.0, "tensors": 0.0, "pinned": 5.0, "pageable": 3.0}  # 10 GiB planned
    plan_json.write_text(json.dumps({"host": {"per_rank_gib": parts}}))

    def rss(gib: float | None) -> check.Job:
        return check.Job("offload", "ok", {} if gib is None else {"memory/max_rank_peak_rss_gib": gib})

    within = check.check_offload_host(setup, {"j": rss(10.9)})
    assert within.status == "pass" and within.figures["measured_runtime_gib"] == 2.9
    assert check.check_offload_host(setup, {"j": rss(11.1)}).figures["error_pct"] == 11.0
    assert check.check_offload_host(setup, {"j": rss(11.1)}).status == "fail"
    assert check.check_offload_host(setup, {"j": rss(None)}).note == "no host RSS was measured"
    dry = check.Setup(dry_run=True, out=tmp_path, deadline=0.0)
    assert check.check_offload_host(dry, {"j": rss(20.0)}).status == "info"


def test_the_resume_oom_and_gpu_tests_rows_fail_on_the_wrong_ending(tmp_path: Path) -> None:
    save = check.Job("cpu_save", "ok")

    def resumed(first: int, done: int, status: str = "ok") -> check.Job:
        return check.Job("resumed", status, {"steps_done": done}, [{"step": first, "loss/train": 2.0}])

    assert check.check_resumed(SETUP, {"s": save, "r": resumed(5, 6)}).status == "pass"
    assert check.check_resumed(SETUP, {"s": save, "r": resumed(1, 6)}).status == "fail"
    assert check.check_resumed(SETUP, {"s": save, "r": resumed(5, 6, "crashed")}).status == "fail"
    assert (
        check.check_resumed(SETUP, {"s": check.Job("cpu_save", "crashed"), "r": resumed(5, 6)}).status
        == "fail"
    )
    setup = check.Setup(dry_run=False, out=tmp_path, deadline=0.0)
    assert check.check_oom(setup, {"j": check.Job("oom", "oom")}).status == "fail"  # no snapshot left
    snapshots = catalog.job_dir(setup, "oom") / "memory_snapshots"
    snapshots.mkdir(parents=True)
    (snapshots / "rank0_oom.pickle").write_bytes(pickle.dumps({"segments": []}))
    explained = {"failed_phase": "forward", "oom": {"plan_moment": "forward: last block", "held_gib": 9.87}}
    assert check.check_oom(setup, {"j": check.Job("oom", "oom", explained)}).status == "pass"
    assert check.check_oom(setup, {"j": check.Job("oom", "ok")}).status == "fail"
    tests = {"pass": "== 12 passed in 3.0s ==", "fail": "== 1 failed, 11 passed in 3.0s =="}
    assert (
        check.check_gpu_tests(SETUP, {"gpu_tests": check.Job("t", "ok", console=tests["pass"])}).status
        == "pass"
    )
    assert (
        check.check_gpu_tests(SETUP, {"gpu_tests": check.Job("t", "failed", console=tests["fail"])}).status
        == "fail"
    )
    skipped = check.Job("t", "ok", console="== 12 skipped in 1.0s ==")
    assert check.check_gpu_tests(DRY, {"gpu_tests": skipped}).status == "pass"
    assert (
        check.check_gpu_tests(DRY, {"gpu_tests": check.Job("t", "ok", console=tests["fail"])}).status
        == "fail"
    )
    assert check.check_throughput(SETUP, {"j": check.Job("125m_stage0", "crashed")}).status == "fail"


def test_the_fp8_row_sets_the_measured_ratio_beside_the_advisors_and_judges_it() -> None:
    from checks.gpucheck.numerics import FP8_RATIO_BAND, check_fp8, predicted_fp8_ratio

    overrides = ("model=125m", "precision=bf16", "zero=stage0", "micro_batch=8", "seq_len=1024")
    predicted = predicted_fp8_ratio(overrides)
    # torchao's small-GEMM filter (precision.fp8_filter=auto) converts w1 and w3 only at 125m: little to lose
    assert round(predicted, 3) == 0.982
    # every linear converted, as the H200 run of 2026-12-04 did: 125m's 768-wide GEMMs, fp8 does not pay
    assert round(predicted_fp8_ratio((*overrides, "precision.fp8_filter=all")), 3) == 0.913

    def job(name: str, tokens_per_s: float, loss: float = 5.0) -> check.Job:
        summary = {"status": "ok", "throughput/tokens_per_s": tokens_per_s}
        return check.Job(name, "ok", summary, [{"loss/train": loss, "step": 1}], overrides=overrides)

    near = {"bf16": job("bf16", 1000.0), "fp8": job("fp8", 1000.0 * (predicted + FP8_RATIO_BAND - 0.01))}
    row = check_fp8(SETUP, near)
    assert row.status == "pass" and row.figures["predicted_ratio"] == 0.982, row.note
    far = {"bf16": job("bf16", 1000.0), "fp8": job("fp8", 1000.0 * (predicted + FP8_RATIO_BAND + 0.01))}
    assert check_fp8(SETUP, far).status == "fail"
    assert check_fp8(DRY, far).status == "info"
    diverged = {"bf16": job("bf16", 1000.0), "fp8": job("fp8", 982.0, loss=5.2)}
    assert check_fp8(SETUP, diverged).status == "fail"  # 4% off bf16's loss


def test_rows_chosen_by_name_run_their_jobs_and_the_jobs_those_wait_for() -> None:
    rows = check.chosen_rows(["plan at the device limit", "oom under device_memory_gib"])
    assert [row.name for row in rows] == ["plan at the device limit", "oom under device_memory_gib"]
    on_gpu = check.jobs_for(rows, catalog.all_jobs(SETUP))
    assert [job.name for job in on_gpu] == ["plans", "limit_fits", "limit_next", "oom"]
    reference, sweep = check.jobs_for(check.chosen_rows(["bf16 runs reproducible"]), catalog.all_jobs(DRY))
    assert (reference.name, [point.name for point in sweep.points]) == ("125m_stage0", ["125m_stage0_again"])

    def names(jobs: list[catalog.JobSpec]) -> list[tuple[str, ...]]:
        return [(job.name, *(point.name for point in job.points)) for job in jobs]

    for setup in (SETUP, DRY):  # every row: every job (a dry run's rows that need CUDA read jobs it lacks)
        every = catalog.all_jobs(setup)
        assert names(check.jobs_for(check.chosen_rows(None, every=True), every)) == names(every)
    with pytest.raises(ValueError, match=r"^--rows: no row named 'oom'; rows: environment, kernel rates, "):
        check.chosen_rows(["oom"])


# ----------------------------------------------------------------------------- issue 59: the performance run


def full_rates(rate: float = 700.0) -> dict:
    """A kernel-rates file as the GPU's job writes it, every figure present."""
    shapes = rates.gemm_shapes(("125m", "1b"), 8 * 1024)
    sdpa = {b: {"fwd_ms": 1.0, "fwd_bwd_ms": 3.0, "fwd_tflops": 400.0, "fwd_bwd_tflops": 450.0}
            for b in rates.SDPA_BACKENDS}  # fmt: skip
    return {"device": "NVIDIA H200", "peak_bf16_tflops": 989.0,
            "gemm": {"bf16": dict.fromkeys(shapes, rate), "fp8": dict.fromkeys(shapes, 2 * rate), "fp8_unavailable": None},
            "sdpa": sdpa, "copy_gbps": 3900.0, "adamw_params_per_s": 2e10, "dispatch_us": 6.0}  # fmt: skip


def rates_row(tmp_path: Path, measured: dict, status: str = "ok") -> check.Row:
    (tmp_path / "jobs").mkdir(exist_ok=True)
    (tmp_path / "jobs" / catalog.KERNEL_RATES_FILE).write_text(json.dumps(measured))
    setup = check.Setup(dry_run=False, out=tmp_path, deadline=0.0)
    return perf.check_kernel_rates(setup, {"kernel_rates": check.Job("kernel_rates", status)})


def test_the_kernel_rates_row_fails_on_a_missing_shape_or_a_large_gemm_under_the_floor(
    tmp_path: Path,
) -> None:
    assert rates.gemm_shapes(("1b",), 8192)["1b.w13.fwd 8192x2048x8192"] == (8192, 2048, 8192)
    assert len(rates.gemm_shapes(("125m", "1b"), 8192)) == 2 * 6 * 3  # 6 linears, 3 GEMMs each
    row = rates_row(tmp_path, full_rates())
    assert row.status == "pass" and row.figures["bf16_gemm_tflops"] == [700.0, 700.0], row.note
    lacking = full_rates()
    del lacking["gemm"]["fp8"]["1b.output.wgrad 32000x8192x2048"]
    row = rates_row(tmp_path, lacking)
    assert row.status == "fail" and row.note == "fp8 GEMM 1b.output.wgrad 32000x8192x2048 not measured"
    slow = full_rates()
    slow["gemm"]["bf16"]["1b.w13.fwd 8192x2048x8192"] = 0.39 * 989  # 2.7e11 FLOP: under the floor
    slow["gemm"]["bf16"]["125m.wq.fwd 8192x768x768"] = 0.1 * 989  # 9.7e9 FLOP: reported only
    row = rates_row(tmp_path, slow)
    assert (
        row.status == "fail"
        and row.note == "bf16 GEMM 1b.w13.fwd 8192x2048x8192 at 386 TFLOPS, under 40% of the 989 peak"
    )
    no_fp8 = {
        **full_rates(),
        "gemm": {**full_rates()["gemm"], "fp8": {}, "fp8_unavailable": "compute capability 8.0 < 8.9"},
    }
    assert rates_row(tmp_path, no_fp8).status == "pass"  # refused, and says why
    no_copy = {**full_rates(), "copy_gbps": None}
    assert rates_row(tmp_path, no_copy).note == "copy_gbps not measured"
    assert rates_row(tmp_path, full_rates(), status="exit 1").status == "fail"


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def step_trace(*kernels: dict) -> dict:
    return {
        "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0}, *kernels]
    }


def test_the_breakdown_sums_kernel_time_by_category_and_fails_when_it_cannot_name_it() -> None:
    trace = step_trace(kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 1000, 6000),
                       kernel("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 7000, 1000),
                       kernel("void at::native::vectorized_elementwise_kernel<4, ...>", 8000, 2000),
                       kernel("void at::native::(anonymous)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 11000, 500),
                       kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 11500, 500))  # fmt: skip
    figures = perf.breakdown(trace)
    assert figures["kernel_ms"] == {"communication": 0.5, "attention": 1.0, "optimizer": 0.5, "gemm": 6.0,
                                    "elementwise": 2.0, "other": 0.0}  # fmt: skip
    # the step: the first host op (0) to the last kernel's end (12 ms); busy 10 of its 12 ms
    assert (figures["kernel_count"], figures["step_ms"], figures["busy_ms"], figures["gpu_busy_pct"]) == (
        5,
        12.0,
        10.0,
        83.3,
    )
    assert perf.breakdown_verdict(figures) == []
    unnamed = perf.breakdown(
        step_trace(kernel("nvjet_gemm", 0, 6000), kernel("mystery_kernel_v2", 6000, 2000))
    )
    assert perf.breakdown_verdict(unnamed) == [
        "'other' holds 25% of kernel time (allowed 20%): unnamed kernels"
    ]
    twice = perf.breakdown(step_trace(kernel("nvjet_gemm", 0, 6000), kernel("nvjet_gemm", 0, 6000)))
    assert perf.breakdown_verdict(twice) == ["kernels sum to 12.0 ms, over the step's 6.0 ms (allowed +5%)"]
    assert perf.breakdown_verdict(perf.breakdown(step_trace())) == ["no CUDA kernel in the profiled step"]


def traced_job(
    setup: check.Setup, name: str, tokens_per_s: float | None, trace: bool = True, **kw: object
) -> check.Job:
    if trace:
        path = catalog.job_dir(setup, name) / perf.STEP_TRACE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(step_trace(kernel("nvjet_gemm", 1000, 9000))))
    summary = {"status": "ok"} | ({"throughput/tokens_per_s": tokens_per_s} if tokens_per_s else {})
    return check.Job(name, "ok", summary, **kw)


def test_the_breakdown_row_reads_the_baselines_profiled_step(tmp_path: Path) -> None:
    setup = check.Setup(dry_run=False, out=tmp_path, deadline=0.0)
    row = perf.check_breakdown(setup, {"1b_stage0": traced_job(setup, "1b_stage0", 1000.0)})
    assert row.status == "pass" and row.figures["gpu_busy_pct"] == 90.0, row.note
    row = perf.check_breakdown(setup, {"j": traced_job(setup, "untraced", 1000.0, trace=False)})
    assert row.status == "fail" and row.note.startswith("no trace at")


def test_the_cupti_ab_reports_the_ratio_and_fails_only_on_a_missing_measurement_or_a_slower_teardown(
    tmp_path: Path,
) -> None:
    setup = check.Setup(dry_run=False, out=tmp_path, deadline=0.0)

    def row(torn_down: float | None, attached: float | None, trace: bool = True) -> check.Row:
        name = "attached" if trace else "attached_untraced"
        jobs = {"a": traced_job(setup, "1b_stage0", torn_down), "b": traced_job(setup, name, attached, trace)}
        return perf.check_cupti(setup, jobs)

    faster = row(1100.0, 1000.0)
    assert faster.status == "pass" and faster.figures["ratio"] == 1.1, faster.note
    assert row(980.0, 1000.0).status == "pass"  # within the 3% noise
    slower = row(960.0, 1000.0)
    assert slower.status == "fail" and slower.note == "torn down 0.960x attached: slower beyond 3% noise"
    assert row(1100.0, None).note == "attached: no tokens/s"
    assert row(1100.0, 1000.0, trace=False).status == "fail"  # no profiled step: nothing was torn down


def test_a_larger_micro_batch_must_not_be_slower_and_an_eager_ones_memory_is_planned() -> None:
    small = check.Job("1b_stage0", "ok", {"throughput/tokens_per_s": 1000.0})
    large = throughput_job(40.0, 41.0, 42.0)
    large.summary["throughput/tokens_per_s"] = 1100.0
    row = perf.check_batch_scaling(SETUP, {"a": small, "b": large})
    assert (
        row.status == "pass" and row.figures["over_1b_stage0"] == 1.1 and "peak_allocated_gib" in row.figures
    )
    large.summary["throughput/tokens_per_s"] = 950.0
    assert perf.check_batch_scaling(SETUP, {"a": small, "b": large}).status == "fail"  # 0.95: slower
    off_plan = throughput_job(40.0, 41.0, 42.0, error_pct=-4.0)
    assert perf.check_batch_scaling(SETUP, {"a": small, "b": off_plan}).status == "fail"
    compiled = check.Job(
        "1b_compiled_mb16", "ok", {"throughput/tokens_per_s": 1200.0}, overrides=("compile=true",)
    )
    row = perf.check_batch_scaling(SETUP, {"a": small, "b": compiled})
    assert row.status == "pass" and "peak_allocated_gib" not in row.figures  # compile's memory: not planned


def test_the_text_row_needs_finite_falling_losses() -> None:
    corpus, synthetic = (
        check.Job("text_corpus", "ok"),
        check.Job("125m_stage0", "ok", {"throughput/tokens_per_s": 1000.0}),
    )

    def row(losses: list[float]) -> check.Row:
        text = loss_job("125m_text", losses, **{"throughput/tokens_per_s": 900.0})
        return perf.check_text(SETUP, {"c": corpus, "s": synthetic, "t": text})

    assert row([10.4, 7.0, 5.6]).status == "pass" and row([10.4, 7.0, 5.6]).figures["over_synthetic"] == 0.9
    assert row([10.4, float("nan"), 5.6]).status == "fail"
    assert row([10.4, 10.5]).note == "the loss did not fall on a corpus of repeated words"
    assert (
        perf.check_text(
            SETUP, {"c": check.Job("text_corpus", "exit 1"), "s": synthetic, "t": synthetic}
        ).status
        == "fail"
    )


def test_the_text_rows_cache_entry_is_the_one_the_trainer_makes_from_the_corpus(tmp_path: Path) -> None:
    """The helper writes the token cache from its documents (the GPU host has no `datasets`): the same
    tokens, starts and meta as trainer/text/cache.py's own tokenize reading corpus.txt."""
    pytest.importorskip("datasets")
    import numpy as np

    from trainer.text.cache import entry_dir, tokenize
    from trainer.text.tokenizer import TokenizerFiles

    corpus = perf.make_text_corpus(tmp_path / "text", tmp_path / "cache")
    files = TokenizerFiles.of(str(tmp_path / "text"))
    entry = entry_dir(str(tmp_path / "cache"), [corpus], "text", files)
    tokens, starts, meta = tokenize([corpus], "text", files, "data.files", progress=False)
    assert np.array_equal(np.load(entry / "tokens.npy"), tokens) and np.array_equal(
        np.load(entry / "starts.npy"), starts
    )
    assert json.loads((entry / "meta.json").read_text())["documents"] == meta.documents == perf.DOCUMENTS
    assert meta.tokens >= 30 * 8 * 1025  # one 125m job's reads at micro_batch 8, seq_len 1024


def test_the_performance_run_times_each_job_alone_after_its_compile_warmup() -> None:
    jobs = check.jobs_for(check.chosen_rows(None), catalog.all_jobs(SETUP))
    names = [job.name for job in jobs]
    timed = [job for job in jobs if job.exclusive]
    assert [job.name for job in timed] == ["kernel_rates", "1b_stage0", "1b_stage0_cupti_attached", "1b_mb32",
                                            "1b_compiled", "1b_compiled_mb16", "1b_fp8_compiled", "125m_stage0",
                                            "125m_stage0_compile"]  # fmt: skip
    for job in timed:
        if "compile=true" in job.overrides:
            warmup = jobs[names.index(job.warmed_by)]
            assert names.index(warmup.name) < names.index("kernel_rates") and not warmup.exclusive
            assert warmup.overrides[: len(job.overrides)] == job.overrides  # the same graphs, 2 steps
    attached = jobs[names.index("1b_stage0_cupti_attached")]
    assert attached.env == (("TEARDOWN_CUPTI", "0"),) and attached.unique
    assert attached.overrides == jobs[names.index("1b_stage0")].overrides
    assert catalog.TRACE_STEP in attached.overrides


def test_rows_that_passed_on_the_gpu_run_only_by_name_with_their_reason() -> None:
    every = check.chosen_rows(None, every=True)
    default = check.chosen_rows(None)
    assert [row.name for row in every if not row.on_request] == [row.name for row in default]
    assert all(row.on_request.startswith(("passed on the H200", "failed on the H200")) for row in every
               if row not in default)  # fmt: skip
    assert check.chosen_rows(["sync-free step"])[0].on_request == check.PASSED  # named: it runs
    # a compiled timing named alone brings its warm-up; the text row its corpus
    named = check.jobs_for(
        check.chosen_rows(["compile 1b", "text data, document packing"]), catalog.all_jobs(SETUP)
    )
    assert [job.name for job in named] == ["text_corpus", "1b_compiled_warmup", "125m_text", "1b_stage0", "1b_compiled",
                                           "125m_stage0"]  # fmt: skip
