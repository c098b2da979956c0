"""The GPU check's rows: each a verdict on what its jobs left, judged against the plan and the
assumptions it measures; the table of rows in the order they are reported."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.gpucheck.catalog import Setup, job_dir, oom_overrides
from benchmarks.gpucheck.scheduler import Job, Scheduler, failed

LOSS_TOLERANCE = 0.02
"""Largest relative difference of per-step losses between runs that differ in precision or in
how they compute the same step (fp32 vs bf16, compile, checkpointing, grad_accum, stage2)."""
PLAN_TOLERANCE_PCT = 15.0
"""Peak allocated against the plan: a throughput row passes within this error."""
HOST_TOLERANCE_PCT = 10.0
"""An offloaded rank's host RSS may exceed the plan's host figure for it by at most this much."""
NOT_REACHED = "not reached by the deadline"


@dataclass
class Row:
    check: str
    status: str  # pass | fail | info | skip | error
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    seconds: float = 0.0


def plan_error_pct(job: Job) -> float:
    return job.summary.get("memory/prediction_error_pct", float("nan"))


def memory_figures(job: Job) -> dict[str, Any]:
    """Peak allocated and reserved against the plan's predicted allocated and reserved."""
    reserved = job.most("memory/rank0/peak_reserved_gib")
    predicted_reserved = job.summary.get("plan", {}).get("predicted_reserved_gib")
    return {
        "peak_allocated_gib": round(job.summary.get("memory/max_rank_peak_gib", float("nan")), 3),
        "predicted_allocated_gib": round(job.summary.get("memory/predicted_peak_gib", float("nan")), 3),
        "allocated_error_pct": round(plan_error_pct(job), 1),
        "peak_reserved_gib": round(reserved, 3) if reserved is not None else None,
        "predicted_reserved_gib": round(predicted_reserved, 3) if predicted_reserved is not None else None,
    }


def memory_verdict(figures: dict[str, Any]) -> list[str]:
    """What is wrong with a job's memory against its plan (empty: nothing)."""
    wrong = []
    if not abs(figures["allocated_error_pct"]) <= PLAN_TOLERANCE_PCT:  # NaN: not measured, wrong too
        wrong.append(f"peak allocated off the plan by {figures['allocated_error_pct']}%")
    reserved, predicted = figures["peak_reserved_gib"], figures["predicted_reserved_gib"]
    if predicted is not None and (reserved is None or reserved > predicted):
        wrong.append(f"peak reserved {reserved} GiB over the plan's predicted_reserved_gib {predicted}")
    return wrong


def check_environment(setup: Setup, jobs: dict[str, Job]) -> Row:
    job = jobs["environment"]
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    figures = json.loads((setup.out / "jobs" / "environment.json").read_text())
    needs = ("c_compiler", "python_headers") + (
        () if setup.dry_run else ("triton",)
    )  # inductor on CPU: C++ only
    missing = [k for k in needs if not figures[k]]
    note = f"compile needs {', '.join(missing)}" if missing else ""
    if not setup.dry_run and figures["table"] == "unknown":
        note = "; ".join(filter(None, [note, "device not in trainer/devices.py: no MFU"]))
    return Row("", "info", figures, note or ("dry run: CPU" if setup.dry_run else ""))


def check_gpu_tests(setup: Setup, jobs: dict[str, Job]) -> Row:
    job = jobs["gpu_tests"]
    lines = job.console.splitlines()
    outcome = lines[-1].strip("= ") if lines else "no output"
    if setup.dry_run:  # no CUDA: every test is skipped, which is the point of the marker
        ok = job.status == "ok" and "skipped" in outcome and "failed" not in outcome
        return Row("", "pass" if ok else "fail", {"pytest": outcome}, "dry run: skipped without CUDA")
    return Row("", "pass" if job.status == "ok" else "fail", {"pytest": outcome})


def check_throughput(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    mfu = job.last("throughput/mfu_pct")
    figures = {
        "tokens_per_s": round(job.summary["throughput/tokens_per_s"], 1),
        "mfu_pct": round(mfu, 1) if mfu is not None else None,
        **memory_figures(job),
    }
    wrong = memory_verdict(figures)
    note = (
        "; ".join(wrong)
        or f"plan within ±{PLAN_TOLERANCE_PCT:g}% of peak allocated, reserved within the plan's"
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def reserved_over_model(job: Job) -> float | None:
    """GiB of peak reserved beyond what trainer/plan/headroom.py predicts for the job's peak allocated
    (reserved = (1 + fragmentation) x allocated + workspace + stream cache); > 0: the model is short."""
    from trainer.plan import HEADROOM
    from trainer.units import GIB

    reserved, allocated = (
        job.most("memory/rank0/peak_reserved_gib"),
        job.most("memory/rank0/peak_allocated_gib"),
    )
    if not reserved or not allocated:
        return None
    return reserved - HEADROOM.reserved(int(allocated * GIB)) / GIB


def check_headroom(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The measured headroom against trainer/plan/headroom.py: fails when a figure exceeds its
    assumption, reserved memory exceeds the fitted model's, or a figure could not be measured."""
    from trainer.plan import HEADROOM

    probe = jobs.pop("headroom")
    if probe.status != "ok":
        return Row("", "fail", asdict(HEADROOM), failed(probe))
    measured = json.loads(probe.console.splitlines()[-1])
    over = [f for f in (reserved_over_model(job) for job in jobs.values()) if f is not None]
    measured["reserved_over_model_gib"] = max(over) if len(over) == len(jobs) else None
    compared = {"context_gib": "context_gib", "nccl_world1_gib": "nccl_gib",
                "cublas_workspace_gib": "cublas_workspace_gib"}  # fmt: skip
    wrong = []
    for key, assumed_key in compared.items():
        value, assumed = measured[key], getattr(HEADROOM, assumed_key)
        if value is None or value > assumed:
            wrong.append(f"{key} {'not measured' if value is None else f'{value:.3f} > assumed {assumed:g}'}")
    over_model = measured["reserved_over_model_gib"]
    if over_model is None or over_model > 0:
        wrong.append(
            "reserved_over_model_gib "
            + (
                "not measured"
                if over_model is None
                else f"{over_model:.3f} > 0: reserved above the fitted model"
            )
        )
    figures = {**{k: round(v, 3) if isinstance(v, float) else v for k, v in measured.items()},
               **{f"assumed_{k}": v for k, v in asdict(HEADROOM).items()}}  # fmt: skip
    note = "; ".join(wrong) or "every figure within trainer/plan/headroom.py's assumptions and fit"
    return Row(
        "", "fail" if wrong else "pass", figures, note + f"; nccl at 8 ranks: {measured['nccl_8_ranks']}"
    )


def check_expandable(setup: Setup, jobs: dict[str, Job]) -> Row:
    probe = jobs["headroom"]
    if probe.status != "ok":
        return Row("", "fail", {}, failed(probe))
    active = json.loads(probe.console.splitlines()[-1])["expandable_segments"]
    note = "every allocator segment expandable under the rank's environment (trainer/rank/cuda.py)"
    return Row("", "pass" if active else "fail", {"expandable_segments": active}, note)


def check_resumed(setup: Setup, jobs: dict[str, Job]) -> Row:
    save, resumed = jobs.values()
    if save.status != "ok":
        return Row("", "fail", {}, failed(save))
    figures = {
        "status": resumed.status,
        "first_step": resumed.records[0]["step"] if resumed.records else None,
        "steps_done": resumed.summary.get("steps_done"),
        "final_loss": round(resumed.losses[-1], 4) if resumed.losses else None,
    }
    ok = resumed.status == "ok" and figures["first_step"] == 5 and figures["steps_done"] == 6
    return Row(
        "", "pass" if ok else "fail", figures, "resumed at step 5, ended ok" if ok else failed(resumed)
    )


def check_fp16_overflow(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    scales = [r["precision/loss_scale"] for r in job.records]
    figures = {"scales": scales, "skipped_steps": job.summary.get("precision/skipped_steps")}
    ok = scales[2] == scales[1] / 2 and figures["skipped_steps"] == 1
    return Row("", "pass" if ok else "fail", figures, "scale halves at step 3, one step skipped")


def check_offload_host(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The offloaded rank's host RSS against the plan's host figure for it (trainer/plan/host.py):
    its runtime (plan.cuda_rank_runtime_gib, an assumption this row measures) and its offloaded states."""
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    host = json.loads((job_dir(setup, job.name) / "plan.json").read_text())["host"]
    parts = host["per_rank_gib"]
    planned = sum(parts.values())
    measured = job.summary.get("memory/max_rank_peak_rss_gib")
    figures = {
        "peak_rss_gib": measured,
        "planned_host_gib": round(planned, 3),
        "planned_parts_gib": {k: round(v, 3) for k, v in parts.items()},
        "measured_runtime_gib": None if measured is None else round(measured - planned + parts["runtime"], 3),
    }
    if measured is None:
        return Row("", "fail", figures, "no host RSS was measured")
    error = 100 * (measured - planned) / planned
    figures["error_pct"] = round(error, 1)
    if setup.dry_run:  # a CPU rank offloads nothing: its figures are recorded, not judged
        return Row("", "info", figures, "dry run: CPU, nothing offloaded")
    note = "measured_runtime_gib replaces plan.cuda_rank_runtime_gib's assumption"
    return Row("", "pass" if error <= HOST_TOLERANCE_PCT else "fail", figures, note)


def check_offload(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    losses = job.losses
    figures = {
        "nonfinite_skipped": job.summary.get("train/nonfinite_skipped"),
        "losses": [round(x, 4) for x in losses],
    }
    ok = figures["nonfinite_skipped"] == 1 and all(x == x for i, x in enumerate(losses) if i != 2)
    note = "offload=cpu: the NaN step 3 skipped on the CPU AdamW, every other loss finite"
    return Row("", "pass" if ok else "fail", figures, note)


def check_limit(setup: Setup, jobs: dict[str, Job]) -> Row:
    fits, above = jobs["limit_fits"], jobs["limit_next"]
    micro_batch = next(o for o in fits.overrides if o.startswith("micro_batch="))
    figures = {
        "micro_batch": int(micro_batch.split("=")[1]),
        "status": fits.status,
        "next_status": above.status,
    }
    if fits.status == "ok":
        figures.update(memory_figures(fits))
    if setup.dry_run:  # a cap stands in for the device, which the CPU allocator does not meet exactly
        return Row(
            "", "info", figures, "dry run: CPU has no device limit (device_memory_gib=0.1 in its place)"
        )
    wrong = [failed(fits)] if fits.status != "ok" else memory_verdict(figures)
    if above.status != "oom":
        wrong.append(
            f"micro_batch+1 ended {above.status}, not oom: the plan leaves more than a micro-batch unused"
        )
    note = (
        "; ".join(wrong)
        or "the plan's largest micro-batch runs within its reserved figure; one more ends oom"
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def check_oom(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    figures = {"status": job.status, "failed_phase": job.summary.get("failed_phase")}
    cap = next(o for o in oom_overrides(setup) if o.startswith("device_memory_gib"))
    note = f"{cap}, plan.enforce=false: status oom recorded" if job.status == "oom" else failed(job)
    return Row("", "pass" if job.status == "oom" else "fail", figures, note)


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def check_same_losses(setup: Setup, jobs: dict[str, Job], tolerance: float = LOSS_TOLERANCE) -> Row:
    """The second job's per-step losses against the first's (the reference), and its memory
    against its plan where it is a different configuration (tolerance > 0)."""
    reference, job = jobs.values()
    if reference.status != "ok" or job.status != "ok":
        return Row("", "fail", {}, failed(job if job.status != "ok" else reference))
    diff = largest_relative_difference(job.losses, reference.losses)
    figures: dict[str, Any] = {
        "steps": len(job.losses),
        "max_rel_diff": diff,
        "final": round(job.losses[-1], 4),
    }
    wrong = [] if diff <= tolerance else [f"losses differ by {diff:.3g} relative (allowed {tolerance:g})"]
    if tolerance > 0:
        figures.update(memory_figures(job))
        wrong += memory_verdict(figures)
    return Row(
        "",
        "fail" if wrong else "pass",
        figures,
        "; ".join(wrong) or f"per-step losses within {tolerance:g} of {reference.name}",
    )


def check_checkpointing(setup: Setup, jobs: dict[str, Job]) -> Row:
    row = check_same_losses(setup, jobs)
    reference, job = jobs.values()
    if (
        row.status == "pass"
        and not job.summary["memory/max_rank_peak_gib"] < reference.summary["memory/max_rank_peak_gib"]
    ):
        return Row("", "fail", row.figures, "checkpointing did not lower the peak")
    return row


def check_sync_free(setup: Setup, jobs: dict[str, Job]) -> Row:
    fused, loop = jobs.values()
    if fused.status != "ok" or loop.status != "ok":
        return Row("", "fail", {}, failed(loop if loop.status != "ok" else fused))
    a, b = fused.summary["throughput/tokens_per_s"], loop.summary["throughput/tokens_per_s"]
    figures = {"fused_deferred_tokens_per_s": round(a, 1), "loop_host_read_tokens_per_s": round(b, 1),
               "ratio": round(a / b, 3)}  # fmt: skip
    note = "fused AdamW + device-side skip over per-tensor AdamW + a host read every step"
    return Row(
        "",
        "info",
        figures,
        note + ("; dry run: jobs ran side by side, not a timing" if setup.dry_run else ""),
    )


def check_compile(setup: Setup, jobs: dict[str, Job]) -> Row:
    eager, compiled = jobs.values()
    row = check_same_losses(setup, {"eager": eager, "compiled": compiled}, tolerance=LOSS_TOLERANCE)
    if compiled.status == "ok" and eager.status == "ok":
        a, b = compiled.summary["throughput/tokens_per_s"], eager.summary["throughput/tokens_per_s"]
        row.figures = {"compiled_tokens_per_s": round(a, 1), "eager_tokens_per_s": round(b, 1),
                       "ratio": round(a / b, 3), **row.figures}  # fmt: skip
    return row


@dataclass(frozen=True)
class RowSpec:
    name: str
    jobs: tuple[str, ...]
    check: Callable[[Setup, dict[str, Job]], Row]
    gpu_only: bool = False


def row_specs() -> list[RowSpec]:
    """The table, most valuable first (docs/gpu.md says why this order)."""
    throughput = [RowSpec(f"throughput {m} bf16 {s}", (f"{m}_{s}",), check_throughput)
                  for m in ("125m", "1b") for s in ("stage0", "stage3")]  # fmt: skip
    return [
        RowSpec("environment", ("environment",), check_environment),
        RowSpec("gpu tests", ("gpu_tests",), check_gpu_tests),
        *throughput,
        RowSpec("headroom", ("headroom", "125m_stage0", "125m_stage3", "1b_stage0", "1b_stage3"), check_headroom, True),
        RowSpec("expandable segments", ("headroom",), check_expandable, True),
        RowSpec("cpu save resumed on the device", ("cpu_save", "cpu_save_resumed"), check_resumed),
        RowSpec("device save resumed on the device", ("device_save", "device_save_resumed"), check_resumed),
        RowSpec("fp16 injected overflow", ("fp16_overflow",), check_fp16_overflow),
        RowSpec("fp16 sharded scaler (stage3)", ("fp16_sharded",), check_fp16_overflow),
        RowSpec("offload=cpu skips a NaN step", ("offload",), check_offload),
        RowSpec("offload host memory", ("offload",), check_offload_host),
        RowSpec("plan at the device limit", ("limit_fits", "limit_next"), check_limit),
        RowSpec("oom under device_memory_gib", ("oom",), check_oom),
        RowSpec("fp32 vs bf16 losses", ("125m_stage0", "125m_stage0_fp32"), check_same_losses),
        RowSpec("bf16 runs identical", ("125m_stage0", "125m_stage0_again"), lambda s, j: check_same_losses(s, j, 0.0)),
        RowSpec("checkpointing full", ("125m_stage0", "ckpt_full"), check_checkpointing),
        RowSpec("checkpointing selective", ("125m_stage0", "ckpt_selective"), check_checkpointing),
        RowSpec("grad_accum 2", ("125m_stage0", "grad_accum"), check_same_losses),
        RowSpec("stage2 on one GPU", ("125m_stage0", "stage2"), check_same_losses),
        RowSpec("sync-free step", ("125m_stage0", "125m_stage0_loop"), check_sync_free),
        RowSpec("compile", ("125m_stage0", "125m_stage0_compile"), check_compile),
    ]  # fmt: skip


def evaluate(setup: Setup, scheduler: Scheduler, spec: RowSpec) -> Row:
    """One row: skipped when the deadline left a job unstarted, failed with what was killed when a
    job ran out of time, else the row's own check."""
    if spec.gpu_only and setup.dry_run:
        return Row(spec.name, "skip", {}, "dry run: needs CUDA")
    jobs = {name: scheduler.get(name) for name in spec.jobs}
    unstarted = [job.name for job in jobs.values() if job.status == "skipped"]
    if unstarted:
        return Row(spec.name, "skip", {}, f"{NOT_REACHED}: {', '.join(unstarted)}")
    for job in jobs.values():
        if job.status == "timeout":
            figures = {"job": job.name, "seconds": round(job.seconds, 1), "killed_pids": job.killed,
                       "survivors": job.survivors}  # fmt: skip
            last = " / ".join(job.console.splitlines()[-3:])
            return Row(spec.name, "fail", figures, f"{job.name} killed at its timeout with its {len(job.killed) - 1} "
                       f"descendants ({len(job.survivors)} survived); last lines: {last}")  # fmt: skip
    row = spec.check(setup, jobs)
    row.check = spec.name
    return row
