"""The rows that judge losses: a run against a reference run step by step (precision, checkpointing,
the loss, the attention kernel, accumulation, compile), a run against itself (reproducibility), and
the loss scaler's and the non-finite policy's steps."""

from __future__ import annotations

from typing import Any

from benchmarks.gpucheck.catalog import Setup
from benchmarks.gpucheck.memory import memory_figures, memory_verdict
from benchmarks.gpucheck.report import Row
from benchmarks.gpucheck.scheduler import Job, failed

LOSS_TOLERANCE = 0.02
"""Largest relative difference of per-step losses between runs that differ in precision or in
how they compute the same step (fp32 vs bf16, compile, checkpointing, the loss, the attention
kernel, grad_accum, stage2)."""
REPRODUCIBLE_TOLERANCE = 1e-3
"""Largest relative difference of per-step losses between two runs of the same bf16 job. Not 0:
flash attention's backward (and cuBLAS's split-K reductions) add in a non-deterministic order on
CUDA unless deterministic algorithms are on, and bf16 carries those last-bit differences on; they
stay orders of magnitude below this over 30 steps, while a real source of difference (data order,
initialisation, a missed seed) moves the first step's loss by far more. Bitwise equality is
recorded beside it (CPU runs are bitwise equal)."""


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def compare_losses(jobs: dict[str, Job], tolerance: float) -> tuple[dict[str, Any], list[str]]:
    """The second job's per-step losses against the first's: the figures, and what is wrong."""
    reference, job = jobs.values()
    diff = largest_relative_difference(job.losses, reference.losses)
    figures: dict[str, Any] = {
        "steps": len(job.losses),
        "max_rel_diff": diff,
        "final": round(job.losses[-1], 4),
    }
    wrong = [] if diff <= tolerance else [f"losses differ by {diff:.3g} relative (allowed {tolerance:g})"]
    return figures, wrong


def both_ok(jobs: dict[str, Job]) -> Row | None:
    """The failed row when either job did not end ok, else None."""
    reference, job = jobs.values()
    if reference.status != "ok" or job.status != "ok":
        return Row("", "fail", {}, failed(job if job.status != "ok" else reference))
    return None


def check_same_losses(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The second job's per-step losses within LOSS_TOLERANCE of the first's (the reference), and
    its memory against its own plan."""
    if (row := both_ok(jobs)) is not None:
        return row
    figures, wrong = compare_losses(jobs, LOSS_TOLERANCE)
    figures.update(memory_figures(jobs[list(jobs)[1]]))
    wrong += memory_verdict(setup, figures)
    reference = next(iter(jobs.values())).name
    note = (
        "; ".join(wrong)
        or f"per-step losses within {LOSS_TOLERANCE:g} of {reference}, memory within its plan"
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def check_reproducible(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The same job twice: per-step losses within REPRODUCIBLE_TOLERANCE, bitwise equality recorded."""
    if (row := both_ok(jobs)) is not None:
        return row
    figures, wrong = compare_losses(jobs, REPRODUCIBLE_TOLERANCE)
    figures["bitwise"] = figures["max_rel_diff"] == 0.0
    note = "; ".join(wrong) or (
        f"per-step losses within {REPRODUCIBLE_TOLERANCE:g} relative"
        + (", bitwise equal" if figures["bitwise"] else " (not bitwise: CUDA's non-deterministic reductions)")
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def check_checkpointing(setup: Setup, jobs: dict[str, Job]) -> Row:
    row = check_same_losses(setup, jobs)
    reference, job = jobs.values()
    if (
        row.status == "pass"
        and not job.summary["memory/max_rank_peak_gib"] < reference.summary["memory/max_rank_peak_gib"]
    ):
        return Row("", "fail", row.figures, "checkpointing did not lower the peak")
    return row


def check_compile(setup: Setup, jobs: dict[str, Job]) -> Row:
    """Judged on losses only: the plan's memory rule is the eager step's, which it disclaims for
    compile (trainer/plan COMPILE_NOTE); the compiled job's memory and the tokens/s ratio are reported."""
    if (row := both_ok(jobs)) is not None:
        return row
    eager, compiled = jobs.values()
    figures, wrong = compare_losses(jobs, LOSS_TOLERANCE)
    a, b = compiled.summary["throughput/tokens_per_s"], eager.summary["throughput/tokens_per_s"]
    figures = {"compiled_tokens_per_s": round(a, 1), "eager_tokens_per_s": round(b, 1), "ratio": round(a / b, 3),
               **figures, **memory_figures(compiled)}  # fmt: skip
    note = (
        "; ".join(wrong) or f"per-step losses within {LOSS_TOLERANCE:g} of eager; memory reported, not judged"
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def check_fp16_overflow(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    scales = [r["precision/loss_scale"] for r in job.records]
    figures = {"scales": scales, "skipped_steps": job.summary.get("precision/skipped_steps")}
    ok = scales[2] == scales[1] / 2 and figures["skipped_steps"] == 1
    return Row("", "pass" if ok else "fail", figures, "scale halves at step 3, one step skipped")


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
