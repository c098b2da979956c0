"""summary.json: how a job ended, its steady-state figures and where they came from."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steady_tokens_per_s(records: list[dict[str, Any]], total_steps: int) -> float | None:
    """Tokens/s over the log windows after warm-up (the first 10% of steps, at least one window).

    The first steps pay for allocator growth, lazy initialisation and caches; including them
    understates what the configuration sustains.
    """
    warmup_end = max(records[0]["step"], total_steps // 10) if records else 0
    tokens = seconds = 0.0
    previous_step = 0
    for record in records:
        steps = record["step"] - previous_step
        previous_step = record["step"]
        if record["step"] <= warmup_end:
            continue
        seconds += record["time/step_s"] * steps
        tokens += record["throughput/tokens_per_s"] * record["time/step_s"] * steps
    if seconds == 0:
        return records[-1]["throughput/tokens_per_s"] if records else None
    return tokens / seconds


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_name(device_kind: str) -> str:
    if device_kind == "cuda":
        return torch.cuda.get_device_name(0)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def provenance(plain_config: dict[str, Any], overrides: list[str], world_size: int, device_kind: str) -> dict[str, Any]:
    return {
        "config": plain_config,
        "overrides": overrides,
        "world_size": world_size,
        "device": device_name(device_kind),
        "torch_version": torch.__version__,
        "git_revision": git_revision(),
    }


def build_summary(status: str, records: list[dict[str, Any]], total_steps: int, **extra: Any) -> dict[str, Any]:
    summary: dict[str, Any] = {"status": status, "steps_done": records[-1]["step"] if records else 0}
    if records:
        summary["loss/first"] = records[0]["loss/train"]
        summary["loss/final"] = records[-1]["loss/train"]
        summary["throughput/tokens_per_s"] = steady_tokens_per_s(records, total_steps)
        if "precision/skipped_steps" in records[-1]:
            summary["precision/skipped_steps"] = records[-1]["precision/skipped_steps"]
    summary.update(extra)
    return summary


def write_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
