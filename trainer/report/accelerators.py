"""The report of a mode=advise run across accelerators (advise.accelerators): the advisor's table again, in
report.md, and with logger=wandb a W&B run holding the table and a bar chart of cost per million tokens per
accelerator (tokens/s per GPU where the run had no prices).

    python -m trainer.report ADVICE_RUN_DIR [--out OUT]

The table is rebuilt from the run's advice.json by the same code that printed it (trainer/report/cost.py), so
report and console agree line for line. W&B is a mirror: a failure there is one warning line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainer.console import warn
from trainer.report.cost import rank_rows, table_lines
from trainer.telemetry.summary import redact_secrets

REPORT_MD = "report.md"
COLUMNS = [
    "accelerator",
    "configuration",
    "tokens_per_s_per_gpu",
    "tokens_per_s",
    "days",
    "gpu_hours",
    "gpu_hour_cost",
    "cost_per_million_tokens",
    "cost",
    "fit_error",
]
"""The W&B table's columns (advice.json's row keys)."""


def accelerator_record(path: Path) -> dict[str, Any] | None:
    """A run directory's advice.json `accelerators` record; None for any other directory."""
    try:
        record = json.loads((path / "advice.json").read_text()).get("accelerators")
    except (OSError, ValueError, AttributeError):
        return None
    return record if (path / ".hydra" / "hydra.yaml").is_file() and isinstance(record, dict) else None


def is_accelerator_advice(path: Path) -> bool:
    return accelerator_record(path) is not None


def report_text(dirs: list[Path]) -> str:
    """report.md: each run's table as the advisor printed it."""
    parts = ["# Which accelerator, at what cost (mode=advise, advise.accelerators)", ""]
    for path in dirs:
        record = accelerator_record(path)
        assert record is not None
        parts += [f"## {path}", "", "```text", *table_lines(record), "```", ""]
    return "\n".join(parts)


def write_accelerator_report(dirs: list[Path], out: Path) -> Path:
    """report.md in `out` (printed too), and the W&B run where the advice run logged to W&B."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_MD
    path.write_text(report_text(dirs))
    for run_dir in dirs:
        print("\n".join(table_lines(accelerator_record(run_dir))), flush=True)  # type: ignore[arg-type]
    print(f"report: {path}", flush=True)
    for run_dir in dirs:
        logger = run_logger(run_dir)
        if logger.get("backend") == "wandb":
            mirror_advice(run_dir, out, logger)
    return path


def run_logger(run_dir: Path) -> dict[str, Any]:
    """The run's `logger` settings (Hydra's .hydra/config.yaml); {} where it has none."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return {}
    logger = OmegaConf.load(path).get("logger")
    return OmegaConf.to_container(logger) if logger is not None else {}  # type: ignore[return-value]


def chart_column(record: dict[str, Any]) -> tuple[str, str]:
    """The bar chart's value: cost per million tokens where every row has a price, else tokens/s per GPU."""
    if record["rows"] and all(r.get("gpu_hour_cost") is not None for r in record["rows"]):
        return "cost_per_million_tokens", "cost per million tokens (the user's prices) by accelerator"
    return "tokens_per_s_per_gpu", "tokens/s per GPU by accelerator (no prices given)"


def advice_run_id(run_dir: Path) -> str:
    """Derived from the advice run's directory: reporting it again continues the same W&B run."""
    return "advice-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]


def log_advice(run: Any, record: dict[str, Any]) -> None:
    """The table (ranked, every column) and the bar chart, as W&B's own wandb.Table and wandb.plot.bar."""
    import wandb

    rows, _ = rank_rows(record["rows"], record["rank_by"])
    table = wandb.Table(columns=COLUMNS, data=[[r.get(c) for c in COLUMNS] for r in rows])
    value, title = chart_column(record)
    bars = wandb.Table(
        columns=["accelerator", value],
        data=[[r["accelerator"], r[value]] for r in rows if r.get(value) is not None],
    )
    run.log(
        {
            "advice/accelerators": table,
            f"advice/{value}": wandb.plot.bar(bars, "accelerator", value, title=title),
        }
    )
    run.summary.update({"advice/best_accelerator": rows[0]["accelerator"] if rows else None})


def mirror_advice(run_dir: Path, out: Path, logger: dict[str, Any]) -> str | None:
    """One W&B run (offline without credentials) with the table and the chart; its id, or None after one warning."""
    import wandb

    from trainer.telemetry.wandb_logger import wandb_mode

    record = accelerator_record(run_dir)
    assert record is not None
    try:
        with wandb.init(
            project=logger.get("project") or "zerolab",
            entity=logger.get("entity"),
            name=f"advice across accelerators {run_dir.name}",
            job_type="advice",
            id=advice_run_id(run_dir),
            resume="allow",
            dir=str(out),
            mode=wandb_mode(),
            config={"advice_dir": str(run_dir), "accelerators": [r["accelerator"] for r in record["rows"]]},
        ) as run:
            log_advice(run, record)
            run_id = run.id
    except Exception as err:  # unreachable, misconfigured: report.md is complete without it
        warn(
            redact_secrets(
                f"the advice could not go to W&B ({type(err).__name__}: {err}); report.md is complete"
            )
        )
        return None
    print(f"W&B: advice run {run_id}", flush=True)
    return run_id
