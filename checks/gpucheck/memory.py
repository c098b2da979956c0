"""The rows that judge memory: each job's peak against its plan, the headroom the plan assumes,
the plan at the device limit, an offloaded rank's host memory; and the candidate headroom fit."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from checks.gpucheck.catalog import Setup, job_dir
from checks.gpucheck.report import Row
from checks.gpucheck.scheduler import Job, failed

PLAN_TOLERANCE_PCT = 3.0
"""Peak allocated against the plan on the GPU: within ±3%, a bound the CUDA-only terms the plan
counts exceed (the fused RMSNorm's fp32 temporaries are 6-12% of a peak), so a term missed or
counted twice fails the row."""
DRY_PLAN_TOLERANCE_PCT = 15.0
"""The same on CPU (a dry run): the tiny model at 32 tokens, where the plan's fixed terms weigh most
(stage3 is 3.9% off there); the CPU plan's 1% is checks/plan_accuracy.py's, at real shapes."""
HOST_TOLERANCE_PCT = 10.0
"""An offloaded rank's host RSS may exceed the plan's host figure for it by at most this much."""


def plan_tolerance_pct(setup: Setup) -> float:
    return DRY_PLAN_TOLERANCE_PCT if setup.dry_run else PLAN_TOLERANCE_PCT


def signed_error_pct(measured: float | None, predicted: float | None) -> float | None:
    """100 x (measured - predicted) / predicted: > 0 when the job used more than planned."""
    if measured is None or not predicted:
        return None
    return round(100 * (measured - predicted) / predicted, 1)


def memory_figures(job: Job) -> dict[str, Any]:
    """Peak allocated and reserved against the plan's predicted allocated and reserved, each as a
    signed error."""
    reserved = job.most("memory/rank0/peak_reserved_gib")
    predicted_reserved = job.summary.get("plan", {}).get("predicted_reserved_gib")
    return {
        "peak_allocated_gib": round(job.summary.get("memory/max_rank_peak_gib", float("nan")), 3),
        "predicted_allocated_gib": round(job.summary.get("memory/predicted_peak_gib", float("nan")), 3),
        "allocated_error_pct": round(job.summary.get("memory/prediction_error_pct", float("nan")), 1),
        "peak_reserved_gib": round(reserved, 3) if reserved is not None else None,
        "predicted_reserved_gib": round(predicted_reserved, 3) if predicted_reserved is not None else None,
        "reserved_error_pct": signed_error_pct(reserved, predicted_reserved),
    }


def memory_verdict(setup: Setup, figures: dict[str, Any]) -> list[str]:
    """What is wrong with a job's memory against its plan (empty: nothing). Allocated is judged both
    ways; reserved fails above the plan (a plan that admits what does not fit), and below it is
    recorded as a signed error for the headroom fit, not judged: the reserved model is fitted on
    8-GPU FSDP2 runs and is generous to one rank."""
    wrong, bound = [], plan_tolerance_pct(setup)
    if not abs(figures["allocated_error_pct"]) <= bound:  # NaN: not measured, wrong too
        wrong.append(
            f"peak allocated off the plan by {figures['allocated_error_pct']}% (allowed ±{bound:g}%)"
        )
    reserved, predicted = figures["peak_reserved_gib"], figures["predicted_reserved_gib"]
    if predicted is not None and (reserved is None or reserved > predicted):
        wrong.append(
            f"peak reserved {reserved} GiB over the plan's predicted_reserved_gib {predicted} "
            f"({figures['reserved_error_pct']:+}%)"
            if reserved is not None
            else "peak reserved not measured"
        )
    return wrong


def check_throughput(setup: Setup, jobs: dict[str, Job]) -> Row:
    """Memory against the plan; tokens/s and MFU as summary.json has them (the steady window)."""
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    mfu = job.summary.get("throughput/mfu_pct")
    figures = {
        "tokens_per_s": round(job.summary["throughput/tokens_per_s"], 1),
        "mfu_pct": round(mfu, 1) if mfu is not None else None,
        **memory_figures(job),
    }
    wrong = memory_verdict(setup, figures)
    note = "; ".join(wrong) or (
        f"plan within ±{plan_tolerance_pct(setup):g}% of peak allocated, reserved within the plan's"
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def peaks(job: Job) -> tuple[float | None, float | None]:
    """The job's highest (allocated, reserved) GiB on rank 0."""
    return job.most("memory/rank0/peak_allocated_gib"), job.most("memory/rank0/peak_reserved_gib")


def reserved_over_model(job: Job) -> float | None:
    """GiB of peak reserved beyond what trainer/plan/headroom.py predicts for the job's peak allocated
    (reserved = (1 + fragmentation) x allocated + workspace + stream cache); > 0: the model is short."""
    from trainer.plan import HEADROOM
    from trainer.units import GIB

    allocated, reserved = peaks(job)
    if not reserved or not allocated:
        return None
    return reserved - HEADROOM.reserved(int(allocated * GIB)) / GIB


def headroom_fit(jobs: list[Job]) -> dict[str, Any] | None:
    """A candidate for trainer/plan/headroom.py's model from these jobs: reserved = a x allocated + b,
    least squares over each job's (peak allocated, peak reserved); None under two distinct points."""
    points = [(a, r) for a, r in map(peaks, jobs) if a and r]
    n = len(points)
    if n < 2 or len({a for a, _ in points}) < 2:
        return None
    mean_a, mean_r = sum(a for a, _ in points) / n, sum(r for _, r in points) / n
    slope = sum((a - mean_a) * (r - mean_r) for a, r in points) / sum((a - mean_a) ** 2 for a, _ in points)
    worst = max(abs(r - (slope * a + mean_r - slope * mean_a)) for a, r in points)
    return {"fragmentation": round(slope - 1, 4), "constant_gib": round(mean_r - slope * mean_a, 3),
            "points": n, "worst_residual_gib": round(worst, 3)}  # fmt: skip


def headroom_verdict(measured: dict[str, Any]) -> list[str]:
    """Each measured figure against its assumption in trainer/plan/headroom.py, and reserved against the fit."""
    from trainer.plan import HEADROOM

    compared = {"context_gib": "context_gib", "nccl_world1_gib": "nccl_one_rank_gib",
                "cublas_workspace_gib": "cublas_workspace_gib"}  # fmt: skip
    wrong = []
    for key, assumed_key in compared.items():
        value, assumed = measured[key], getattr(HEADROOM, assumed_key)
        if value is None or value > assumed:
            wrong.append(f"{key} {'not measured' if value is None else f'{value:.3f} > assumed {assumed:g}'}")
    over_model = measured["reserved_over_model_gib"]
    if over_model is None:
        wrong.append("reserved_over_model_gib not measured")
    elif over_model > 0:
        wrong.append(f"reserved_over_model_gib {over_model:.3f} > 0: reserved above the fitted model")
    return wrong


def check_headroom(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The measured headroom against trainer/plan/headroom.py: fails when a figure exceeds its
    assumption, reserved memory exceeds the fitted model's, or a figure could not be measured; the
    throughput jobs' candidate fit goes into the results beside it."""
    from trainer.plan import HEADROOM

    probe = jobs.pop("headroom")
    if probe.status != "ok":
        return Row("", "fail", asdict(HEADROOM), failed(probe))
    measured = json.loads(probe.console.splitlines()[-1])
    over = [f for f in (reserved_over_model(job) for job in jobs.values()) if f is not None]
    measured["reserved_over_model_gib"] = max(over) if len(over) == len(jobs) else None
    wrong = headroom_verdict(measured)
    figures = {**{k: round(v, 3) if isinstance(v, float) else v for k, v in measured.items()},
               **{f"assumed_{k}": v for k, v in asdict(HEADROOM).items()},
               "candidate_fit": headroom_fit(list(jobs.values()))}  # fmt: skip
    note = "; ".join(wrong) or "every figure within trainer/plan/headroom.py's assumptions and fit"
    return Row(
        "", "fail" if wrong else "pass", figures, note + f"; nccl at 8 ranks: {measured['nccl_8_ranks']}"
    )


def check_expandable(setup: Setup, jobs: dict[str, Job]) -> Row:
    probe = jobs["headroom"]
    if probe.status != "ok":
        return Row("", "fail", {}, failed(probe))
    active = json.loads(probe.console.splitlines()[-1])["expandable_segments"]
    note = "every allocator segment expandable under the rank's environment (trainer/cuda.py)"
    return Row("", "pass" if active else "fail", {"expandable_segments": active}, note)


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


def device_gib(setup: Setup) -> float | None:
    """The device's memory, as the environment job found it (None in a dry run or before it ran)."""
    path = setup.out / "jobs" / "environment.json"
    return json.loads(path.read_text()).get("memory_gib") if path.exists() else None


def measured_largest_micro_batch(
    micro_batch: int, reserved: float | None, next_reserved: float | None, device: float | None
) -> int | None:
    """The largest micro-batch one rank's reserved memory says fits the device, by the growth from
    `micro_batch` to one more: what the plan's largest is compared with."""
    if None in (reserved, next_reserved, device) or next_reserved <= reserved:  # type: ignore[operator]
        return None
    return micro_batch + int((device - reserved) // (next_reserved - reserved))  # type: ignore[operator]


def check_limit(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The plan's largest micro-batch at the device limit, judged on what the single rank reserves:
    it must run within its plan; one more must end ok or oom (never crash), and where it runs, the
    room the plan left is reported in micro-batches, not failed: the reserved model the plan applies
    is fitted on 8-GPU FSDP2 runs, and one DDP rank reserves about what it allocates."""
    fits, above = jobs["limit_fits"], jobs["limit_next"]
    micro_batch = int(next(o for o in fits.overrides if o.startswith("micro_batch=")).split("=")[1])
    figures: dict[str, Any] = {"micro_batch": micro_batch, "status": fits.status, "next_status": above.status}
    if fits.status == "ok":
        figures.update(memory_figures(fits))
    next_reserved = peaks(above)[1] if above.status == "ok" else None
    figures["next_peak_reserved_gib"] = round(next_reserved, 3) if next_reserved is not None else None
    if setup.dry_run:  # a cap stands in for the device, which the CPU allocator does not meet exactly
        return Row(
            "", "info", figures, "dry run: CPU has no device limit (device_memory_gib=0.1 in its place)"
        )
    figures["device_gib"] = device_gib(setup)
    largest = measured_largest_micro_batch(
        micro_batch, figures.get("peak_reserved_gib"), next_reserved, figures["device_gib"]
    )
    figures["measured_largest_micro_batch"] = largest
    wrong = [failed(fits)] if fits.status != "ok" else memory_verdict(setup, figures)
    if above.status not in ("ok", "oom"):
        wrong.append(f"micro_batch+1 ended {above.status}, neither ok nor oom: {failed(above)}")
    room = (
        f"; micro_batch+1 ran: one rank's reserved says up to {largest} fit" if above.status == "ok" else ""
    )
    note = "; ".join(wrong) or f"the plan's largest micro-batch runs within its plan{room}"
    return Row("", "fail" if wrong else "pass", figures, note)
