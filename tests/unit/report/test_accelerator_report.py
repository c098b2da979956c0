"""Issue 65: `python -m trainer.report` on a mode=advise run across accelerators prints and writes the advisor's
table again, and with logger=wandb logs it to W&B with a bar chart of cost per million tokens (wandb.init is
replaced by a recorder: an offline run costs ~10 s on the shared cores; the chart and table objects are W&B's own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import wandb
from omegaconf import OmegaConf

from trainer.report import command
from trainer.report.accelerators import is_accelerator_advice, log_advice
from trainer.report.cost import cost_figures, table_lines


def row(name: str, tokens_per_s: float | None, price: float | None, fit_error: str) -> dict[str, Any]:
    return {
        "accelerator": name, "world_size": 8, "tokens_per_s": tokens_per_s, "mfu_pct": 40.0, "fit_error": fit_error,
        "configuration": None if tokens_per_s is None else "stage3 ckpt=none offload=none reduce=fp32 mb=1x16",
        "command": None if tokens_per_s is None else "python -m trainer zero=stage3", "gpu_hour_cost": price,
        **cost_figures(tokens_per_s, 8, price, 1e12),
    }  # fmt: skip


def advice_dir(path: Path, priced: bool = True, logger: str = "wandb") -> dict[str, Any]:
    """A finished advice run's directory: Hydra's record and advice.json's `accelerators` table."""
    price = (lambda p: p) if priced else (lambda p: None)
    record = {
        "model": "llama3-8b", "global_batch": 256, "seq_len": 8192, "precision": "bf16", "nodes": 1, "nproc": 8,
        "tokens": 1e12, "rank_by": "cost",
        "rows": [
            row("h100", 46_389.0, price(2.5), "+1%..+25%"),
            row("b200", 116_595.0, price(4.0), "unvalidated"),
            row("a100-80gb", 22_160.0, price(1.5), "-6%..+10%"),
        ],
    }  # fmt: skip
    (path / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {}}}), path / ".hydra" / "hydra.yaml")
    OmegaConf.save(
        OmegaConf.create({"logger": {"backend": logger, "project": "zerolab"}}),
        path / ".hydra" / "config.yaml",
    )
    (path / "advice.json").write_text(json.dumps({"accelerators": record}))
    return record


def test_the_report_prints_and_writes_the_advisors_table_and_logs_it_to_wandb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    runs: list[dict[str, Any]] = []

    class Run:
        id = "advice-test"
        summary: dict[str, Any] = {}

        def __init__(self, **kwargs: Any) -> None:
            runs.append({"init": kwargs, "logged": {}})

        def __enter__(self) -> Run:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def log(self, data: dict[str, Any]) -> None:
            runs[-1]["logged"].update(data)

    monkeypatch.setattr(wandb, "init", Run)
    run_dir, out = tmp_path / "advice", tmp_path / "report"
    record = advice_dir(run_dir)
    assert is_accelerator_advice(run_dir) and not is_accelerator_advice(tmp_path)
    command.main([str(run_dir), "--out", str(out)])
    lines = table_lines(record)
    assert "\n".join(lines) in (out / "report.md").read_text()
    printed = capsys.readouterr().out
    assert "\n".join(lines) in printed and "W&B: advice run advice-test" in printed
    # ranked by cost per million tokens: b200 4.0 x 8 x 1e6 / (116,595 x 3600) = 0.0762, h100 0.1198, a100 0.1504
    assert [line.split()[1] for line in lines[2:5]] == ["b200", "h100", "a100-80gb"]
    assert "0.07624" in lines[2] and "76,237" in lines[2] and "unvalidated" in lines[2]
    [run] = runs  # one W&B run, in the report's directory, offline (WANDB_MODE), continued on a re-report
    assert (
        run["init"]["dir"] == str(out)
        and run["init"]["id"].startswith("advice-")
        and run["init"]["resume"] == "allow"
    )
    assert set(run["logged"]) == {"advice/accelerators", "advice/cost_per_million_tokens"}


def test_the_wandb_chart_is_a_bar_of_cost_per_million_tokens_per_accelerator(tmp_path: Path) -> None:
    logged: dict[str, Any] = {}

    class Run:
        summary: dict[str, Any] = {}

        def log(self, data: dict[str, Any]) -> None:
            logged.update(data)

    record = advice_dir(tmp_path / "a")
    log_advice(Run(), record)
    chart = logged["advice/cost_per_million_tokens"]
    assert isinstance(chart, wandb.plot.CustomChart)
    bars = {name: value for name, value in chart.table.data}
    assert bars == pytest.approx(
        {
            "b200": 4.0 * 8e6 / (116_595 * 3600),
            "h100": 2.5 * 8e6 / (46_389 * 3600),
            "a100-80gb": 1.5 * 8e6 / (22_160 * 3600),
        }
    )
    assert (
        logged["advice/accelerators"].columns[0] == "accelerator"
        and Run.summary["advice/best_accelerator"] == "b200"
    )
    logged.clear()
    log_advice(Run(), advice_dir(tmp_path / "b", priced=False))  # no prices: tokens/s per GPU instead
    assert {n: v for n, v in logged["advice/tokens_per_s_per_gpu"].table.data}["b200"] == pytest.approx(
        116_595 / 8
    )
