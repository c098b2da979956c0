"""summary.json: how a job ended, its steady-state figures and where they came from."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from trainer.jsonl import read_jsonl

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


def steady_mean(records: list[dict[str, Any]], key: str, after_step: int) -> float | None:
    """Time-weighted mean of a per-window rate over the windows after `after_step`.

    Weighting each window by its wall time makes the mean of tokens/s equal total tokens over
    total seconds. With no window past the warm-up, the last window's value stands in.
    """
    weighted = seconds = 0.0
    previous_step = 0
    for record in records:
        steps, previous_step = record["step"] - previous_step, record["step"]
        if record["step"] <= after_step or key not in record:
            continue
        window_s = record["time/step_s"] * steps
        weighted += record[key] * window_s
        seconds += window_s
    if seconds == 0:
        return records[-1].get(key) if records else None
    return weighted / seconds


def steady_tokens_per_s(
    records: list[dict[str, Any]], total_steps: int, warmup_steps: int | None = None
) -> float | None:
    """Tokens/s over the log windows after warm-up."""
    return steady_mean(records, "throughput/tokens_per_s", warmup_end(records, total_steps, warmup_steps))


def worst_memory(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst rank's peak over the whole run, which rank, and the plan next to it."""
    measured = [r for r in records if "memory/max_rank_peak_gib" in r]
    figures: dict[str, Any] = {}
    if measured:
        worst = max(measured, key=lambda r: r["memory/max_rank_peak_gib"])
        for key in (
            "memory/max_rank_peak_gib",
            "memory/argmax_rank",
            "memory/imbalance",
            "memory/prediction_error_pct",
        ):
            if key in worst:
                figures[key] = worst[key]
        figures["memory/peak_step"] = worst["step"]
    predicted = [r["memory/predicted_peak_gib"] for r in records if "memory/predicted_peak_gib" in r]
    if predicted:
        figures["memory/predicted_peak_gib"] = predicted[-1]
    rss = [value for r in records for key, value in r.items() if key.endswith("/peak_rss_gib")]
    if rss:
        figures["memory/max_rank_peak_rss_gib"] = max(rss)
    return figures


def steady_comm(records: list[dict[str, Any]], after_step: int) -> dict[str, Any]:
    """Communication per optimizer step over the windows after warm-up (all windows when none is
    past it), each window weighted by its steps; the plan next to the worst rank; the mean exposed share."""
    steady = [r for r in records if r["step"] > after_step] or records
    steps = {id(r): r["step"] - prev["step"] for prev, r in zip([{"step": 0}, *records], records)}
    keys = [k for k in dict.fromkeys(k for r in steady for k in r) if k.startswith("comm/rank")]
    figures: dict[str, Any] = {}
    for key in keys:
        measured = [(r[key], steps[id(r)]) for r in steady if key in r]
        figures[key] = sum(v * n for v, n in measured) / sum(n for _, n in measured)
    predicted = [r["comm/predicted_bytes_per_step"] for r in records if "comm/predicted_bytes_per_step" in r]
    totals = [v for k, v in figures.items() if k.endswith("/bytes_per_step")]
    if predicted:
        figures["comm/predicted_bytes_per_step"] = predicted[-1]
        if totals and max(totals) > 0:
            figures["comm/prediction_error_pct"] = 100.0 * (predicted[-1] - max(totals)) / max(totals)
    exposed = [r["comm/exposed_pct"] for r in records if "comm/exposed_pct" in r]
    if exposed:
        figures["comm/exposed_pct"] = sum(exposed) / len(exposed)
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
    status: str,
    records: list[dict[str, Any]],
    total_steps: int,
    warmup_steps: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """How the job ended and its steady-state figures (docs/design.md section 4), plus `extra` (provenance, error)."""
    summary: dict[str, Any] = {"status": status, "steps_done": records[-1]["step"] if records else 0}
    if records:
        after = warmup_end(records, total_steps, warmup_steps)
        summary["loss/first"] = records[0]["loss/train"]
        summary["loss/final"] = records[-1]["loss/train"]
        summary["throughput/warmup_steps"] = after
        for key in ("throughput/tokens_per_s", "throughput/mfu_pct", "time/step_s", "time/data_s"):
            value = steady_mean(records, key, after)
            if value is not None:
                summary[key] = value
        summary.update(worst_memory(records))
        summary.update(steady_comm(records, after))
        if "precision/skipped_steps" in records[-1]:
            summary["precision/skipped_steps"] = records[-1]["precision/skipped_steps"]
            summary["precision/loss_scale"] = records[-1]["precision/loss_scale"]
    summary.update(extra)
    return summary


def summary_table(summary: dict[str, Any]) -> str:
    """The end-of-run table on the console: one row per figure that the run produced."""
    rows = [("status", summary["status"])]
    if "failed_rank" in summary:
        rows.append(("failed rank", str(summary["failed_rank"])))
    if "loss/first" in summary:
        rows.append(
            (
                "loss",
                f"{summary['loss/first']:.4f} -> {summary['loss/final']:.4f} over {summary['steps_done']} steps",
            )
        )
    if summary.get("throughput/tokens_per_s"):
        rows.append(
            (
                "tokens/s (steady)",
                f"{summary['throughput/tokens_per_s']:,.0f} (after step {summary['throughput/warmup_steps']})",
            )
        )
    if "throughput/mfu_pct" in summary:
        rows.append(("MFU (steady)", f"{summary['throughput/mfu_pct']:.1f}%"))
    if "time/step_s" in summary:
        rows.append(
            (
                "step time (steady)",
                f"{summary['time/step_s'] * 1e3:.1f} ms, waiting for data {summary['time/data_s'] * 1e3:.1f} ms",
            )
        )
    if "memory/max_rank_peak_gib" in summary:
        rows.append(
            (
                "worst-rank peak",
                f"{summary['memory/max_rank_peak_gib']:.4f} GiB on rank {summary['memory/argmax_rank']} (window ending at step {summary['memory/peak_step']})",
            )
        )
    if "memory/predicted_peak_gib" in summary:
        rows.append(("predicted peak", f"{summary['memory/predicted_peak_gib']:.4f} GiB"))
    if "memory/max_rank_peak_rss_gib" in summary:
        rows.append(("worst-rank host RSS", f"{summary['memory/max_rank_peak_rss_gib']:.2f} GiB"))
    if "precision/skipped_steps" in summary:
        rows.append(
            (
                "fp16 skipped steps",
                f"{summary['precision/skipped_steps']} (final scale {summary['precision/loss_scale']:g})",
            )
        )
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


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


def write_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    (out_dir / "summary.json").write_text(json.dumps(redact_secrets(summary), indent=2, default=str) + "\n")
