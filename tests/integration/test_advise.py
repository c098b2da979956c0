"""mode=advise on this host, end to end: calibrate (2 real gloo ranks), rank, then verify the best
two as real jobs (advise.verify=2) and set measured beside predicted."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_trainer


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
