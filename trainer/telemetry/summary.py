"""summary.json: how a job ended, its steady-state figures and where they came from."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from trainer.jsonl import read_jsonl
from trainer.telemetry import keys

REPO_ROOT = Path(__file__).resolve().parent.parent


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """The records of a job's metrics.jsonl."""
    return read_jsonl(out_dir / "metrics.jsonl")


def warmup_end(records: list[dict[str, Any]], total_steps: int, warmup_steps: int | None = None) -> int:
    """The last step that steady-state figures leave out.

    The first steps pay for allocator growth, lazy initialisation and caches; including them
    understates what the configuration sustains. Default: 10% of the steps, at least the first
    log window; `telemetry.warmup_steps` sets it.
    """
    if warmup_steps is not None:
        return warmup_steps
    return max(records[0]["step"], total_steps // 10) if records else 0


def steady_mean(
    records: list[dict[str, Any]], key: str, after_step: int, only: str | None = None
) -> float | None:
    """Time-weighted mean of a per-window rate over the windows after `after_step` (and, with
    `only`, those whose record has that key true).

    Weighting each window by its wall time makes the mean of tokens/s equal total tokens over
    total seconds. With no window past the warm-up, the last window's value stands in.
    """
    weighted = seconds = 0.0
    previous_step = 0
    for record in records:
        steps, previous_step = record["step"] - previous_step, record["step"]
        if record["step"] <= after_step or key not in record or (only and not record.get(only)):
            continue
        window_s = record[keys.STEP_S] * steps
        weighted += record[key] * window_s
        seconds += window_s
    if seconds == 0:
        return records[-1].get(key) if records else None
    return weighted / seconds


def steady_tokens_per_s(
    records: list[dict[str, Any]], total_steps: int, warmup_steps: int | None = None
) -> float | None:
    """Tokens/s over the log windows after warm-up."""
    return steady_mean(records, keys.TOKENS_PER_S, warmup_end(records, total_steps, warmup_steps))


def comm_error(predicted: float, measured: float) -> dict[str, float]:
    """The plan's error against a measurement of bytes per step: in bytes always, in percent (of the measurement;
    positive: the plan over-predicts) where the prediction is not near zero (keys.NEAR_ZERO_BYTES)."""
    error = {keys.COMM_PREDICTION_ERROR_BYTES: predicted - measured}
    if predicted >= keys.NEAR_ZERO_BYTES and measured > 0:
        error[keys.COMM_PREDICTION_ERROR_PCT] = 100.0 * (predicted - measured) / measured
    return error


def worst_memory(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst rank's peak over the whole run, which rank, and the plan next to it: the error of the worst
    window that was compared with it (the records that carry an error), and how many were and were not."""
    measured = [r for r in records if keys.MAX_RANK_PEAK in r]
    figures: dict[str, Any] = {}
    if measured:
        worst = max(measured, key=lambda r: r[keys.MAX_RANK_PEAK])
        for key in (keys.MAX_RANK_PEAK, keys.ARGMAX_RANK, keys.IMBALANCE):
            if key in worst:
                figures[key] = worst[key]
        figures[keys.PEAK_STEP] = worst["step"]
        planned = [r for r in measured if keys.PREDICTED_PEAK in r]
        compared = [r for r in planned if keys.PREDICTION_ERROR_PCT in r]
        if planned:
            figures[keys.MEMORY_COMPARED_WINDOWS] = len(compared)
            figures[keys.MEMORY_EXCLUDED_WINDOWS] = len(planned) - len(compared)
        if compared:
            worst_compared = max(compared, key=lambda r: r[keys.MAX_RANK_PEAK])
            figures[keys.PREDICTION_ERROR_PCT] = worst_compared[keys.PREDICTION_ERROR_PCT]
            figures[keys.MEMORY_ERROR_STEP] = worst_compared["step"]
    predicted = [r[keys.PREDICTED_PEAK] for r in records if keys.PREDICTED_PEAK in r]
    if predicted:
        figures[keys.PREDICTED_PEAK] = predicted[-1]
    rss = [value for r in records for key, value in r.items() if key.endswith(keys.PEAK_RSS_SUFFIX)]
    if rss:
        figures[keys.MAX_RANK_PEAK_RSS] = max(rss)
    return figures | load_memory(records)


def load_memory(records: list[dict[str, Any]]) -> dict[str, Any]:
    """model.weights: every rank's host memory while loading (the first record carries it) and the largest."""
    loaded = {k: v for r in records[:1] for k, v in r.items() if k.endswith(keys.LOAD_SUFFIXES)}
    anon = [v for k, v in loaded.items() if k.endswith(keys.LOAD_SUFFIXES[0])]
    return loaded | ({keys.MAX_RANK_LOAD_HOST: max(anon)} if anon else {})


def steady_comm(records: list[dict[str, Any]], after_step: int) -> dict[str, Any]:
    """Communication per optimizer step over the windows after warm-up (all windows when none is
    past it), each window weighted by its steps; the plan next to the worst rank; the mean exposed share."""
    steady = [r for r in records if r["step"] > after_step] or records
    steps = {id(r): r["step"] - prev["step"] for prev, r in zip([{"step": 0}, *records], records)}
    rank_keys = [
        k for k in dict.fromkeys(k for r in steady for k in r) if k.startswith(keys.COMM_RANK_PREFIX)
    ]
    figures: dict[str, Any] = {}
    for key in rank_keys:
        measured = [(r[key], steps[id(r)]) for r in steady if key in r]
        figures[key] = sum(v * n for v, n in measured) / sum(n for _, n in measured)
    predicted = [r[keys.COMM_PREDICTED_BYTES] for r in records if keys.COMM_PREDICTED_BYTES in r]
    if predicted:
        figures[keys.COMM_PREDICTED_BYTES] = predicted[-1]
        figures.update(compared_comm(steady, steps))
    exposed = [r[keys.COMM_EXPOSED_PCT] for r in records if keys.COMM_EXPOSED_PCT in r]
    if exposed:
        figures[keys.COMM_EXPOSED_PCT] = sum(exposed) / len(exposed)
    return figures


def compared_comm(steady: list[dict[str, Any]], steps: dict[int, int]) -> dict[str, Any]:
    """The plan against the worst rank's bytes per step over the steady windows that every rank measured, each
    window's measurement against the plan of its own steps (keys.COMM_WINDOW_PREDICTED_BYTES where that is not
    the steady figure), the error of their step-weighted means and how many steps they hold."""
    compared = [
        r
        for r in steady
        if keys.COMM_PREDICTION_ERROR_BYTES in r or keys.COMM_PREDICTION_ERROR_PCT in r  # every rank measured
    ]
    if not compared:
        return {}
    count = sum(steps[id(r)] for r in compared)
    planned = sum(
        r.get(keys.COMM_WINDOW_PREDICTED_BYTES, r[keys.COMM_PREDICTED_BYTES]) * steps[id(r)] for r in compared
    )
    ranks = {m.group(1) for r in compared for k in r if (m := keys.COMM_KEY.fullmatch(k))}
    measured = max(
        sum(r[keys.comm_key(int(rank), "bytes_per_step")] * steps[id(r)] for r in compared) / count
        for rank in ranks
    )
    figures: dict[str, Any] = {keys.COMM_COMPARED_STEPS: count, **comm_error(planned / count, measured)}
    if any(keys.COMM_WINDOW_PREDICTED_BYTES in r for r in compared):
        figures[keys.COMM_WINDOW_PREDICTED_BYTES] = planned / count
    return figures


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_name(device_kind: str) -> str:
    if device_kind == "cuda":
        return torch.cuda.get_device_name(0)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def provenance(
    plain_config: dict[str, Any], overrides: list[str], world_size: int, device_kind: str
) -> dict[str, Any]:
    return {
        "config": plain_config,
        "overrides": overrides,
        "world_size": world_size,
        "device": device_name(device_kind),
        "torch_version": torch.__version__,
        "git_revision": git_revision(),
    }


def build_summary(
    status: keys.Status,
    records: list[dict[str, Any]],
    total_steps: int,
    warmup_steps: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """How the job ended and its steady-state figures (docs/design.md section 4), plus `extra` (provenance, error)."""
    summary: dict[str, Any] = {
        "status": keys.Status(status).value,
        "steps_done": records[-1]["step"] if records else 0,
    }
    if records:
        after = warmup_end(records, total_steps, warmup_steps)
        summary[keys.LOSS_FIRST] = records[0][keys.LOSS]
        summary[keys.LOSS_FINAL] = records[-1][keys.LOSS]
        summary[keys.WARMUP_STEPS] = after
        for key in (keys.TOKENS_PER_S, keys.MFU_PCT, keys.STEP_S, keys.DATA_S):
            value = steady_mean(records, key, after)
            if value is not None:
                summary[key] = value
        summary.update(worst_memory(records))
        evaluated = [r for r in records if keys.LOSS_VAL in r]
        if evaluated:  # the last evaluation's held-out loss (eval.every)
            summary[keys.LOSS_VAL] = evaluated[-1][keys.LOSS_VAL]
            summary[keys.PERPLEXITY_VAL] = evaluated[-1][keys.PERPLEXITY_VAL]
        summary.update(steady_comm(records, after))
        for key in dict.fromkeys(k for k in records[-1] if k.startswith(keys.PP_PREFIXES)):
            summary[key] = steady_mean(records, key, after)  # pipeline: idle share and bytes per stage
        summary.update(save_figures(records, after))
        if keys.SKIPPED_STEPS in records[-1]:
            summary[keys.SKIPPED_STEPS] = records[-1][keys.SKIPPED_STEPS]
            summary[keys.LOSS_SCALE] = records[-1][keys.LOSS_SCALE]
    summary.update(extra)
    return summary


def save_figures(records: list[dict[str, Any]], after_step: int) -> dict[str, Any]:
    """The saves' mean blocking and total times (the records that carry them; rank 0's list of every
    save, in the job's `extra`, replaces these where the ranks returned one), the one-time
    preparation's (one record carries it) and the steady throughput of the steps that overlapped
    a background write."""
    figures: dict[str, Any] = {}
    for key in (keys.SAVE_BLOCKING_S, keys.SAVE_TOTAL_S):
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            figures[key] = sum(values) / len(values)
    figures.update(
        {
            key: r[key]
            for r in records
            for key in (keys.SAVE_PREPARE_BLOCKING_S, keys.SAVE_PREPARE_TOTAL_S)
            if key in r
        }
    )
    if any(r["step"] > after_step and r.get(keys.SAVE_WRITING) for r in records):
        figures[keys.TOKENS_PER_S_WRITING] = steady_mean(
            records, keys.TOKENS_PER_S, after_step, keys.SAVE_WRITING
        )
    return figures


def save_means(result: dict[str, Any]) -> dict[str, Any]:
    """summary.json's figures of every save and of their preparation, from rank 0's result
    (trainer/saves/background.py Saves.summary)."""
    saves = result[keys.SAVES]
    figures: dict[str, Any] = {keys.SAVES: saves}
    for key, name in ((keys.SAVE_BLOCKING_S, "blocking_s"), (keys.SAVE_TOTAL_S, "total_s")):
        values = [save[name] for save in saves if save[name] is not None]
        if values:
            figures[key] = sum(values) / len(values)
    figures.update(
        {
            key: result[key]
            for key in (keys.SAVE_PREPARE_BLOCKING_S, keys.SAVE_PREPARE_TOTAL_S)
            if key in result
        }
    )
    return figures


def summary_table(summary: dict[str, Any]) -> str:
    """The end-of-run table on the console: one row per figure that the run produced."""
    rows = [("status", summary["status"])]
    model = summary.get("config", {}).get("model", {})
    if model.get("weights"):  # model.weights: where the run started from
        rows.append(("weights", f"{model['weights']} (sha256 {model['weights_sha256']})"))
    if "failed_rank" in summary:
        rows.append(("failed rank", str(summary["failed_rank"])))
    if keys.LOSS_FIRST in summary:
        rows.append(
            (
                "loss",
                f"{summary[keys.LOSS_FIRST]:.4f} -> {summary[keys.LOSS_FINAL]:.4f} over {summary['steps_done']} steps",
            )
        )
    if keys.LOSS_VAL in summary:
        rows.append(
            ("held-out loss", f"{summary[keys.LOSS_VAL]:.4f} (perplexity {summary[keys.PERPLEXITY_VAL]:.2f})")
        )
    if summary.get(keys.TOKENS_PER_S):
        rows.append(
            (
                "tokens/s (steady)",
                f"{summary[keys.TOKENS_PER_S]:,.0f} (after step {summary[keys.WARMUP_STEPS]})",
            )
        )
    if keys.MFU_PCT in summary:
        basis = " (bf16-equivalent)" if keys.MFU_BASIS in summary else ""
        rows.append(("MFU (steady)", f"{summary[keys.MFU_PCT]:.1f}%{basis}"))
    if keys.STEP_S in summary:
        rows.append(
            (
                "step time (steady)",
                f"{summary[keys.STEP_S] * 1e3:.1f} ms, waiting for data {summary[keys.DATA_S] * 1e3:.1f} ms",
            )
        )
    if keys.MAX_RANK_PEAK in summary:
        rows.append(
            (
                "worst-rank peak",
                f"{summary[keys.MAX_RANK_PEAK]:.4f} GiB on rank {summary[keys.ARGMAX_RANK]} (window ending at step {summary[keys.PEAK_STEP]})",
            )
        )
    if keys.PREDICTED_PEAK in summary:
        rows.append(("predicted peak", f"{summary[keys.PREDICTED_PEAK]:.4f} GiB"))
    rows += plan_error_rows(summary)
    if keys.MAX_RANK_PEAK_RSS in summary:
        rows.append(("worst-rank host RSS", f"{summary[keys.MAX_RANK_PEAK_RSS]:.2f} GiB"))
    if keys.SKIPPED_STEPS in summary:
        rows.append(
            (
                "fp16 skipped steps",
                f"{summary[keys.SKIPPED_STEPS]} (final scale {summary[keys.LOSS_SCALE]:g})",
            )
        )
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def plan_error_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The console's rows of the plan's errors, each with what it compared (like with like, docs/telemetry.md)."""
    rows = []
    if keys.MEMORY_COMPARED_WINDOWS in summary:
        excluded = summary[keys.MEMORY_EXCLUDED_WINDOWS]
        left_out = f", {excluded} left out (planned otherwise)" if excluded else ""
        compared = f"{summary[keys.MEMORY_COMPARED_WINDOWS]} measured windows compared{left_out}"
        if keys.PREDICTION_ERROR_PCT in summary:
            error = f"{summary[keys.PREDICTION_ERROR_PCT]:+.2f}% at step {summary[keys.MEMORY_ERROR_STEP]}"
            rows.append(("peak plan error", f"{error} ({compared})"))
        else:
            rows.append(("peak plan error", f"none ({compared})"))
    if keys.COMM_COMPARED_STEPS in summary:
        error_bytes = f"{summary[keys.COMM_PREDICTION_ERROR_BYTES]:+,.0f} B per step"
        if keys.COMM_PREDICTION_ERROR_PCT in summary:
            error = f"{summary[keys.COMM_PREDICTION_ERROR_PCT]:+.2f}% ({error_bytes})"
        else:
            error = f"{error_bytes} (predicted near zero)"
        rows.append(("comm plan error", f"{error} over {summary[keys.COMM_COMPARED_STEPS]} steps"))
    return rows


SECRET_NAME_PARTS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def redact_secrets(value: Any) -> Any:
    """`value` with every occurrence of a secret from the environment replaced by <redacted>.

    Outputs and the W&B config hold the resolved config and the overrides; a key typed into an
    override must not travel with them. Secrets: WANDB_API_KEY and any variable whose name says
    key, token, secret or password (values shorter than 8 characters are too common to match).
    """
    secrets = [
        v
        for k, v in os.environ.items()
        if any(part in k.upper() for part in SECRET_NAME_PARTS) and len(v) >= 8
    ]
    return _redact(value, secrets) if secrets else value


def _redact(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, "<redacted>")
        return value
    if isinstance(value, dict):
        return {k: _redact(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v, secrets) for v in value]
    return value


def read_summary(out_dir: Path) -> dict[str, Any]:
    """A job's summary.json; empty when it wrote none (a mode=plan job, a job still running) or it cannot be read."""
    try:
        return json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def write_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    (out_dir / "summary.json").write_text(json.dumps(redact_secrets(summary), indent=2, default=str) + "\n")
