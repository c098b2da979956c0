"""advise.verify=K: run the K best configurations on this host and set measured beside predicted.

Each one is a real job through the runner, `python -m trainer <its command line>` in a child
process (its own Hydra run, ranks, plan and summary.json in <advice dir>/verify/<n>/), one after
another so that they do not share the cores they are timed on. The job's steady-state tokens/s
(warm-up excluded, trainer/telemetry/summary.py) and worst-rank peak (tensor-level tracking on CPU) are
what is measured.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.overrides import split_override
from trainer.telemetry import keys
from trainer.telemetry.summary import read_summary
from trainer.units import GIB

VERIFY_KEYS = ("steps", "log_every", "save", "hydra.run.dir")


@dataclass(frozen=True)
class Proposal:
    """A ranked configuration to run: what trainer/advise/advisor.py predicted for it and its command line."""

    label: str
    args: list[str]
    """The overrides that run it (advise.command_args)."""
    tokens_per_s: float
    peak_bytes: int


def verify_overrides(proposal: Proposal, steps: int, run_dir: Path) -> list[str]:
    """The proposal's command line plus a short run: steps, a log window of 2 steps (the first is
    warm-up), nothing saved, its own directory."""
    kept = [o for o in proposal.args if split_override(o)[0] not in VERIFY_KEYS]
    return [*kept, f"steps={steps}", "log_every=2", "save=off", f"hydra.run.dir={run_dir}"]


def verify(proposals: list[Proposal], steps: int, out_dir: Path) -> list[dict[str, Any]]:
    """Run each proposal as a job of `steps` steps (advise.verify_steps); print and return predicted against measured."""
    rows = []
    for number, proposal in enumerate(proposals, 1):
        run_dir = out_dir / "verify" / str(number)
        args = verify_overrides(proposal, steps, run_dir)
        print(
            f"verify {number}/{len(proposals)}: {shlex.join(['python', '-m', 'trainer', *args])}", flush=True
        )
        done = subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True)
        rows.append(measured_row(proposal, run_dir, done.returncode, done.stderr))
    print(format_verify(rows), flush=True)
    return rows


def measured_row(proposal: Proposal, run_dir: Path, returncode: int, stderr: str) -> dict[str, Any]:
    summary = read_summary(run_dir)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    return {
        "configuration": proposal.label,
        "status": summary.get("status", f"exit {returncode}"),
        "error": errors[-1] if errors else None,
        "predicted_tokens_per_s": proposal.tokens_per_s,
        "measured_tokens_per_s": summary.get(keys.TOKENS_PER_S),
        "predicted_peak_gib": proposal.peak_bytes / GIB,
        "measured_peak_gib": summary.get(keys.MAX_RANK_PEAK),
        "run_dir": str(run_dir),
    }


def format_verify(rows: list[dict[str, Any]]) -> str:
    lines = [
        "verified on this host (steady-state tokens/s; worst-rank peak, tensor-level on CPU):",
        f"{'#':>3} {'configuration':<52} {'status':>8} {'tokens/s pred':>14} {'measured':>10} {'peak GiB pred':>14} {'measured':>9}",
    ]
    for i, row in enumerate(rows, 1):
        tokens = row["measured_tokens_per_s"]
        peak = row["measured_peak_gib"]
        lines.append(
            f"{i:>3} {row['configuration']:<52} {row['status']:>8} {row['predicted_tokens_per_s']:>14,.0f} "
            f"{'-' if tokens is None else f'{tokens:,.0f}':>10} {row['predicted_peak_gib']:>14.3f} {'-' if peak is None else f'{peak:.3f}':>9}"
        )
    return "\n".join(lines)
