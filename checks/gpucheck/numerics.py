"""The rows that judge losses: a run against a reference run step by step (precision, checkpointing,
the loss, the attention kernel, accumulation, compile), a run against itself (reproducibility), and
the loss scaler's and the non-finite policy's steps."""

from __future__ import annotations

from typing import Any

from checks.gpucheck.catalog import REPO, Setup
from checks.gpucheck.memory import memory_figures, memory_verdict
from checks.gpucheck.report import Row
from checks.gpucheck.scheduler import Job, failed

LOSS_TOLERANCE = 0.02
"""Largest relative difference of per-step losses between runs that differ in precision or in
how they compute the same step (fp32 vs bf16, compile, checkpointing, the loss, the attention
kernel, grad_accum, stage2)."""
FIRST_STEP_TOLERANCE = 1e-4
"""Largest relative difference of the first step's loss between two runs of the same bf16 job: a
forward before any update, where a real source of difference (data order, initialisation, a missed
seed) shows at once. Not 0: the GPU check's first run (2026-12-04, H200) measured 1.6e-6."""
REPRODUCIBLE_TOLERANCE = LOSS_TOLERANCE / 2
"""Largest relative difference of per-step losses between two runs of the same bf16 job, over all
steps: run-to-run noise must stay well inside the band the comparisons are judged by. Not near 0:
flash attention's backward and cuBLAS's split-K reductions add in a non-deterministic order on
CUDA, and AdamW's first updates, each about lr in size whatever the gradient's magnitude, carry
those last-bit differences into the next losses. The first run measured 6.0e-3 at step 3 of 6
(125m, micro_batch 4). Bitwise equality is recorded beside it (CPU runs are bitwise equal)."""


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
    """The same job twice: the first step's loss within FIRST_STEP_TOLERANCE, every step's within
    REPRODUCIBLE_TOLERANCE, bitwise equality recorded."""
    if (row := both_ok(jobs)) is not None:
        return row
    figures, wrong = compare_losses(jobs, REPRODUCIBLE_TOLERANCE)
    reference, job = jobs.values()
    first = largest_relative_difference(job.losses[:1], reference.losses[:1])
    figures["first_step_rel_diff"] = first
    if first > FIRST_STEP_TOLERANCE:
        wrong.append(f"first step's losses differ by {first:.3g} relative (allowed {FIRST_STEP_TOLERANCE:g})")
    figures["bitwise"] = figures["max_rel_diff"] == 0.0
    note = "; ".join(wrong) or (
        f"first step's loss within {FIRST_STEP_TOLERANCE:g}, per-step losses within {REPRODUCIBLE_TOLERANCE:g} relative"
        + (", bitwise equal" if figures["bitwise"] else " (not bitwise: CUDA's non-deterministic reductions)")
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def check_checkpointing(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The same losses, and a lower peak wherever the plan says checkpointing lowers it: at the dry run's tiny
    shapes a one-rank job peaks in the embedding's backward, past every block, which checkpointing leaves as
    it is (its plan says so); at the GPU's shapes the activations set the peak."""
    row = check_same_losses(setup, jobs)
    reference, job = jobs.values()
    peak, planned = "memory/max_rank_peak_gib", "memory/predicted_peak_gib"
    planned_lower = job.summary[planned] < reference.summary[planned]
    if row.status == "pass" and planned_lower and not job.summary[peak] < reference.summary[peak]:
        return Row("", "fail", row.figures, "checkpointing did not lower the peak (its plan does)")
    if row.status == "pass" and not planned_lower and job.summary[peak] > reference.summary[peak]:
        return Row("", "fail", row.figures, "checkpointing raised the peak, which its plan keeps")
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


FP8_LOSS_TOLERANCE = 0.02
"""fp8 against bf16, per step: the bound bf16 is held to against fp32 (CPU: within 0.24% over 6 steps)."""
FP8_RATIO_BAND = 0.15
"""The measured fp8/bf16 tokens/s may differ from the advisor's predicted ratio by this much either way:
the fit has one published model (Llama-3.1-8B on 8 H100) and is held there to 1.5 points; 125m on one
H200 is the first point off it (small GEMMs, where the casts weigh most), a data point for the fit first."""


def check_fp8(setup: Setup, jobs: dict[str, Job]) -> Row:
    """125m compiled, fp8 (tensorwise) against bf16: the losses track, and the tokens/s ratio is set
    beside trainer/advise/fp8.py's prediction for the same shapes on an H200."""
    if (row := both_ok(jobs)) is not None:
        return row
    bf16, fp8 = jobs.values()
    figures, wrong = compare_losses(jobs, FP8_LOSS_TOLERANCE)
    measured = fp8.summary["throughput/tokens_per_s"] / bf16.summary["throughput/tokens_per_s"]
    predicted = predicted_fp8_ratio(bf16.overrides)
    figures = {"measured_ratio": round(measured, 3), "predicted_ratio": round(predicted, 3), **figures,
               **memory_figures(fp8)}  # fmt: skip
    if setup.dry_run:  # CPU runs the emulated path: its speed is not fp8's
        return Row("", "info", figures, "dry run: emulated fp8 on CPU, speed not judged")
    if abs(measured - predicted) > FP8_RATIO_BAND:
        wrong.append(
            f"fp8/bf16 tokens/s {measured:.3f}, the advisor predicted {predicted:.3f} (band {FP8_RATIO_BAND})"
        )
    note = (
        "; ".join(wrong)
        or f"losses within {FP8_LOSS_TOLERANCE:g}; ratio within {FP8_RATIO_BAND} of the advisor's"
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def predicted_fp8_ratio(overrides: tuple[str, ...]) -> float:
    """trainer/advise/fp8.py's tensorwise speed-up for a job's model, micro-batch and sequence on an H200,
    taking its step as compute (one GPU: no collectives), over the linears the job converts
    (precision.fp8_filter, default auto: torchao's small-GEMM filter)."""
    from omegaconf import OmegaConf

    from trainer.advise.calibrate import ACCELERATORS
    from trainer.advise.fp8 import LLAMA31_8B, compute_factor, fit_cast_cost
    from trainer.config import Fp8Filter, Fp8Recipe, ModelConfig
    from trainer.model.fp8 import fp8_split

    given = dict(o.split("=", 1) for o in overrides)
    preset = OmegaConf.load(REPO / "conf" / "model" / f"{given['model']}.yaml")
    dims = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len")
    model = ModelConfig(**{k: preset[k] for k in dims})
    cost = fit_cast_cost(LLAMA31_8B, ACCELERATORS["h100"].hbm_tbps, "tensorwise")
    h200 = ACCELERATORS["h200"].hbm_tbps
    fp8_filter = Fp8Filter(given.get("precision.fp8_filter", Fp8Filter.auto.value))
    converted = fp8_split(model, fp8_filter, Fp8Recipe.tensorwise).converted
    step = (int(given["seq_len"]), int(given["micro_batch"]))
    return 1 / compute_factor(model, *step, "h200", h200, cost, converted)


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
