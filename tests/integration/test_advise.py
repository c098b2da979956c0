"""mode=advise on this host, end to end: calibrate (2 real gloo ranks), rank, then verify the best
two as real jobs (advise.verify=2) and set measured beside predicted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_trainer
from trainer.report import command


@pytest.mark.slow  # the default run's 20 minutes (README)
def test_verify_runs_the_best_and_reports_measured_beside_predicted(tmp_path: Path) -> None:
    out, cache = tmp_path / "advice", tmp_path / "cache"
    proc = run_trainer(
        out,
        "mode=advise",
        "global_batch=4",
        "nproc=2",
        "device=cpu",
        "logger=none",
        "seq_len=32",
        "advise.stages=[stage0,stage2]",
        "advise.checkpointing=[none]",
        "advise.reduce_dtypes=[fp32]",
        "advise.micro_batches=[2]",
        "advise.verify=2",
        "advise.verify_steps=4",
        f"advise.cache_dir={cache}",
        check=False,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    advice = json.loads((out / "advice.json").read_text())
    assert len(list(cache.glob("calibration-*.json"))) == 1  # measured once, cached with date and host
    assert "measured on" in advice["rates"]["source"] and advice["rates"]["compute_flops"]["64"] > 0
    ranked = [c for c in advice["candidates"] if c["fits"]]
    assert len(ranked) == 2
    rows = advice["verify"]
    assert [row["configuration"].split()[0] for row in rows] == [c["zero"] for c in ranked]  # best first
    for row, candidate in zip(rows, ranked):
        assert row["status"] == "ok" and row["measured_tokens_per_s"] > 0
        assert row["predicted_tokens_per_s"] == candidate["predicted_tokens_per_s"]
        assert abs(row["measured_peak_gib"] - row["predicted_peak_gib"]) <= 0.2 * row["predicted_peak_gib"]
        assert (Path(row["run_dir"]) / "summary.json").is_file()
    assert "tokens/s pred" in proc.stdout and proc.stdout.count(" ok ") >= 2


def test_across_accelerators_one_row_each_ranked_by_the_users_prices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 65's acceptance command: one row per accelerator with tokens/s, days, GPU-hours and cost per million
    tokens, the cost columns arithmetic from the row's tokens/s and the prices given; `python -m trainer.report`
    prints the same table. A price missing for one listed accelerator: one line naming it, exit 2, nothing planned."""
    out = tmp_path / "advice"
    proc = run_trainer(
        out,
        "mode=advise",
        "model=llama3-8b",
        "global_batch=256",
        "seq_len=8192",
        "precision=bf16",
        "advise.accelerators=[h100,a100-80gb]",
        "nodes=1",
        "nproc=8",
        "advise.gpu_hour_cost={h100: 2.5, a100-80gb: 1.5}",
        "advise.tokens=1e12",
        "logger=none",
    )
    record = json.loads((out / "advice.json").read_text())["accelerators"]
    rows = {row["accelerator"]: row for row in record["rows"]}
    assert set(rows) == {"h100", "a100-80gb"}
    for name, price in (("h100", 2.5), ("a100-80gb", 1.5)):
        tps = rows[name]["tokens_per_s"]
        assert rows[name]["cost_per_million_tokens"] == pytest.approx(price * 8e6 / (tps * 3600))
        assert rows[name]["gpu_hours"] == pytest.approx(8 * 1e12 / tps / 3600)
    table = proc.stdout.split("across accelerators:", 1)[1].splitlines()
    assert "cost/1M tok" in table[1] and "days" in table[1] and "GPU-hours" in table[1]
    ranked = [line.split()[1] for line in table[2:4]]
    cheaper = min(rows, key=lambda name: rows[name]["cost_per_million_tokens"])
    assert ranked[0] == cheaper and sorted(ranked) == ["a100-80gb", "h100"]
    # the report prints the same table (trainer/report/accelerators.py)
    capsys.readouterr()
    command.main([str(out), "--out", str(tmp_path / "report")])  # python -m trainer.report, in this process
    assert "\n".join(table[:4]) in capsys.readouterr().out

    refused = run_trainer(
        tmp_path / "refused",
        "mode=advise",
        "global_batch=16",
        "nproc=8",
        "advise.accelerators=[h100,b200]",
        "advise.gpu_hour_cost={h100: 2.5}",
        "logger=none",
        check=False,
    )
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith("error: advise.gpu_hour_cost has no price for b200 ")
    )
    assert not (tmp_path / "refused" / "advice.json").exists()
