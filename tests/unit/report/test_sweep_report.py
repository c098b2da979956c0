"""The sweep report (trainer/report/: rows, charts, report.md) from point directories laid out as a sweep leaves them."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
from omegaconf import OmegaConf

import trainer.report as rpt
from tests.helpers import CPU_OOM
from trainer.report import charts
from trainer.report import command as compare


def records_for(rng: random.Random, steps: int, ranks: int = 2, fp16: bool = False) -> list[dict[str, Any]]:
    """metrics.jsonl lines with the keys the ranks write (docs/design.md section 4)."""
    records = []
    for step in range(1, steps + 1):
        record: dict[str, Any] = {"step": step, "loss/train": 6.3 - 0.1 * step + rng.random() * 0.01}
        for rank in range(ranks):
            record[f"memory/rank{rank}/peak_allocated_gib"] = rng.uniform(0.01, 0.05)
        if fp16:
            record["precision/loss_scale"] = 2.0 ** rng.randint(10, 16)
        records.append(record)
    return records


def make_point(
    sweep: Path,
    num: int,
    overrides: list[str],
    summary: dict[str, Any] | None,
    records: list[dict[str, Any]] | None = None,
    plan: dict[str, Any] | None = None,
) -> Path:
    """A point directory as Hydra and the job leave it: .hydra/, summary.json, metrics.jsonl, plan.json."""
    path = sweep / f"{num}_{','.join(overrides)}"
    (path / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {"num": num}}}), path / ".hydra" / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(overrides), path / ".hydra" / "overrides.yaml")
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if records:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if plan is not None:
        (path / "plan.json").write_text(json.dumps(plan))
    return path


def ok_summary(rng: random.Random, records: list[dict[str, Any]]) -> dict[str, Any]:
    peaks = {k: v for r in records for k, v in r.items() if k.endswith("peak_allocated_gib")}
    return {
        "status": "ok",
        "throughput/tokens_per_s": rng.uniform(500, 5000),
        "memory/max_rank_peak_gib": max(peaks.values()),
        "memory/argmax_rank": 0,
        "memory/predicted_peak_gib": rng.uniform(0.01, 0.05),
        "precision/skipped_steps": 0,
        "loss/final": records[-1]["loss/train"],
    }


@pytest.fixture
def grid(tmp_path: Path) -> Path:
    """micro_batch 1,2,4 x zero stage2,stage3 with fixed keys beside them; micro_batch=4 stage3 ran out of memory."""
    rng = random.Random(0)
    num = 0
    for micro_batch in (1, 2, 4):
        for stage in ("stage2", "stage3"):
            overrides = ["device=cpu", f"micro_batch={micro_batch}", "steps=5", f"zero={stage}"]
            if (micro_batch, stage) == (4, "stage3"):
                oom = {
                    "status": "oom",
                    "failed_rank": 1,
                    "failed_step": 1,
                    "failed_phase": "forward",
                    "error": f"rank 1 ran out of memory: {CPU_OOM}",
                }
                make_point(tmp_path, num, overrides, oom)
            else:
                records = records_for(rng, 5)
                make_point(tmp_path, num, overrides, ok_summary(rng, records), records)
            num += 1
    return tmp_path


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_results_csv_has_one_row_per_point_in_job_order_with_the_summary_figures(tmp_path: Path) -> None:
    rng = random.Random(1)
    summaries = {}
    for num in range(
        12
    ):  # 12 points: directory names sort 0, 1, 10, 11, 2, ... but rows follow the job number
        records = records_for(rng, 3)
        summaries[num] = ok_summary(rng, records)
        make_point(tmp_path, num, [f"seed={num}"], summaries[num], records)
    rpt.write_report(tmp_path)
    rows = read_csv(tmp_path / "results.csv")
    assert [int(r["point"]) for r in rows] == list(range(12))
    for row in rows:
        summary = summaries[int(row["point"])]
        assert (
            float(row["tokens_per_s"]) == summary["throughput/tokens_per_s"]
        )  # exact: floats written as repr
        assert float(row["max_rank_peak_gib"]) == summary["memory/max_rank_peak_gib"]
        assert float(row["predicted_peak_gib"]) == summary["memory/predicted_peak_gib"]
        assert float(row["final_loss"]) == summary["loss/final"]
        assert row["status"] == "ok" and row["overrides"] == f"seed={row['point']}"


def test_only_the_swept_keys_name_a_point(grid: Path) -> None:
    report = rpt.write_report(grid)
    assert report.swept == ["micro_batch", "zero"]
    assert [row["overrides"] for row in report.rows][:2] == [
        "micro_batch=1 zero=stage2",
        "micro_batch=1 zero=stage3",
    ]


def test_the_fastest_point_that_fits_is_marked_and_failed_points_never_are(tmp_path: Path) -> None:
    rng = random.Random(2)
    speeds = [1000.0, 3000.0, 2000.0]
    for num, speed in enumerate(speeds):
        records = records_for(rng, 3)
        make_point(
            tmp_path,
            num,
            [f"micro_batch={num + 1}"],
            {**ok_summary(rng, records), "throughput/tokens_per_s": speed},
            records,
        )
    # A crashed point measured a higher rate before it died: it does not fit, so it is not the fastest.
    crashed = {
        "status": "crashed",
        "throughput/tokens_per_s": 2 * max(speeds),
        "error": "rank 0 failed: RuntimeError: boom",
    }
    make_point(tmp_path, 3, ["micro_batch=8"], crashed, records_for(rng, 1))
    report = rpt.write_report(tmp_path)
    assert [row["fastest"] for row in report.rows] == [False, True, False, False]
    text = (tmp_path / "report.md").read_text()
    assert text.count("**ok, fastest**") == 1
    assert f"Fastest point that fits: #1 `micro_batch=2`, {max(speeds):,.0f} tokens/s." in text
    assert [r["fastest"] for r in read_csv(tmp_path / "results.csv")] == ["False", "True", "False", "False"]


def test_oom_and_refused_points_show_where_and_why(tmp_path: Path) -> None:
    rng = random.Random(3)
    records = records_for(rng, 3)
    make_point(tmp_path, 0, ["micro_batch=1"], ok_summary(rng, records), records)
    oom = {
        "status": "oom",
        "failed_rank": 1,
        "failed_step": 3,
        "failed_phase": "backward",
        "error": f"rank 1 ran out of memory at step 3 (backward): {CPU_OOM}",
    }
    make_point(tmp_path, 1, ["micro_batch=64"], oom)
    plan = {
        "num_params": 918656,
        "peak_gib": 0.79,
        "peak_rank": 1,
        "fits": False,
        "ranks": [{"rank": 0, "peak_gib": 0.71}, {"rank": 1, "peak_gib": 0.79}],
    }
    reason = "does not fit: needs 0.79 GiB on rank 1, but each rank has 0.25 GiB (device_memory_gib=0.25)"
    make_point(tmp_path, 2, ["micro_batch=256"], {"status": "refused", "reason": reason}, plan=plan)
    report = rpt.write_report(tmp_path)
    oom_row, refused_row = report.rows[1], report.rows[2]
    assert (oom_row["status"], oom_row["failed_rank"], oom_row["failed_step"], oom_row["failed_phase"]) == (
        "oom",
        1,
        3,
        "backward",
    )
    assert refused_row["status"] == "refused" and refused_row["predicted_peak_gib"] == plan["peak_gib"]
    text = (tmp_path / "report.md").read_text()
    assert "| 1 | `micro_batch=64` | **oom** (rank 1, step 3, backward) |" in text
    assert f"- #2 `micro_batch=256`: refused: {reason}" in text
    assert "0.7900" in text  # the refused point's predicted peak in the table


def test_skipped_steps_count_fp16_overflows_and_nonfinite_skips(tmp_path: Path) -> None:
    make_point(
        tmp_path,
        0,
        ["nonfinite=skip"],
        {"status": "ok", "precision/skipped_steps": 2, "train/nonfinite_skipped": 1},
    )
    assert rpt.write_report(tmp_path).rows[0]["skipped_steps"] == 2 + 1


def test_throughput_chart_draws_each_stage_against_micro_batch_and_marks_failures(grid: Path) -> None:
    report = rpt.write_report(grid)
    fig, ax = plt.subplots()
    charts.plot_throughput(ax, report)
    lines = {line.get_label(): line.get_xydata().tolist() for line in ax.lines}
    for stage in ("stage2", "stage3"):
        expected = [
            [int(p.settings["micro_batch"]), row["tokens_per_s"]]
            for p, row in zip(report.points, report.rows)
            if p.settings["zero"] == stage and row["status"] == "ok"
        ]
        assert lines[f"zero={stage}"] == expected
    failed = [
        int(p.settings["micro_batch"]) for p, row in zip(report.points, report.rows) if row["status"] != "ok"
    ]
    markers = [offset.tolist() for collection in ax.collections for offset in collection.get_offsets()]
    assert markers == [[x, 0] for x in failed] == [[4, 0]]
    assert [t.get_text() for t in ax.texts] == ["oom: rank 1, step 1, forward"]
    plt.close(fig)


def test_a_run_that_kept_the_default_micro_batch_sits_at_its_configs_micro_batch(
    grid: Path, tmp_path: Path
) -> None:
    """A comparison of a sweep over micro_batch with a run that set none (python -m trainer.report RUN
    SWEEP): the run's micro-batch is its config's; one that records none at all gives bars, not a crash."""
    rng = random.Random(3)
    records = records_for(rng, 5)
    summary = {**ok_summary(rng, records), "config": {"micro_batch": 8}}
    run = make_point(tmp_path / "runs", 0, ["device=cpu"], summary, records)
    for name in ("with_config", "without"):
        (tmp_path / name).mkdir()
    report = rpt.write_report(tmp_path / "with_config", compare.load_compared([run, grid]))
    fig, ax = plt.subplots()
    assert charts.plot_throughput(ax, report) and sorted(ax.get_xticks()) == [1, 2, 4, 8]
    plt.close(fig)
    (run / "summary.json").write_text(json.dumps({**summary, "config": {}}))
    report = rpt.write_report(tmp_path / "without", compare.load_compared([run, grid]))
    assert report.charts["throughput"].exists() and report.swept[0] == "micro_batch"


def test_memory_chart_has_every_ranks_highest_peak(grid: Path) -> None:
    report = rpt.write_report(grid)
    fig, ax = plt.subplots()
    charts.plot_memory(ax, report)
    bars = {container.get_label(): [bar.get_height() for bar in container] for container in ax.containers}
    for rank in (0, 1):
        key = f"memory/rank{rank}/peak_allocated_gib"
        expected = [max(r[key] for r in p.records) for p in report.points if p.records]
        assert bars[f"rank {rank}"] == expected
    plt.close(fig)


def test_loss_scale_chart_appears_only_with_an_fp16_point(tmp_path: Path) -> None:
    rng = random.Random(4)
    fp32 = records_for(rng, 4)
    make_point(tmp_path, 0, ["precision=fp32"], ok_summary(rng, fp32), fp32)
    assert "loss_scale" not in rpt.write_report(tmp_path).charts
    fp16 = records_for(rng, 4, fp16=True)
    make_point(tmp_path, 1, ["precision=fp16"], ok_summary(rng, fp16), fp16)
    report = rpt.write_report(tmp_path)
    assert report.charts["loss_scale"].exists()
    fig, ax = plt.subplots()
    charts.plot_loss_scale(ax, report)
    (line,) = ax.lines
    assert line.get_label() == "precision=fp16"
    assert list(line.get_ydata()) == [r["precision/loss_scale"] for r in fp16]
    plt.close(fig)


def test_the_throughput_charts_title_speaks_of_failed_points_only_when_there_are_some(grid: Path) -> None:
    titles = []
    for report in (rpt.write_report(grid), ok_only(rpt.write_report(grid))):
        fig, ax = plt.subplots()
        charts.plot_throughput(ax, report)
        titles.append(ax.get_title())
        plt.close(fig)
    assert titles == ["Throughput per point (✕ at 0: did not end ok)", "Throughput per point"]


def ok_only(report: rpt.Report) -> rpt.Report:
    """The same report without its failed points."""
    keep = [i for i, row in enumerate(report.rows) if row["status"] == "ok"]
    return rpt.Report(
        report.sweep_dir,
        [report.points[i] for i in keep],
        report.swept,
        [report.rows[i] for i in keep],
        report.charts,
    )


def test_writing_the_report_again_gives_the_same_bytes(grid: Path) -> None:
    rpt.write_report(grid)
    names = ["results.csv", "report.md", "throughput.png", "memory.png", "losses.png"]
    first = {name: (grid / name).read_bytes() for name in names}
    rpt.write_report(grid)
    assert {name: (grid / name).read_bytes() for name in names} == first


def test_the_command_refuses_a_directory_that_is_neither_a_run_nor_a_sweep_in_one_line(
    grid: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    stray = tmp_path_factory.mktemp("stray")
    with pytest.raises(SystemExit) as exit_info:
        compare.main([str(grid), str(stray), "--out", str(stray / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {stray} is neither a run directory (.hydra/ and summary.json) nor a sweep directory (point directories with .hydra/)"
    ]
    assert not (stray / "out").exists() and not (grid / "report.md").exists()


def test_comm_chart_puts_each_point_at_its_bytes_and_the_memory_its_stage_saved(tmp_path: Path) -> None:
    """comm.png: x = the worst rank's measured bytes per step, y = stage0's peak minus this point's, at
    the same micro-batch; results.csv carries the measured and planned bytes."""
    mib, gib = 2**20, 2**30
    for num, (stage, peak_mib, sent_mib) in enumerate([("stage0", 30, 3.5), ("stage3", 20, 10.0)]):
        summary = {
            "status": "ok",
            "memory/max_rank_peak_gib": peak_mib * mib / gib,
            "comm/predicted_bytes_per_step": int(sent_mib * mib),
            "comm/rank0/bytes_per_step": sent_mib * mib,
            "comm/rank1/bytes_per_step": sent_mib * mib - 8,
            "config": {"zero": {"stage": stage}},
        }
        make_point(tmp_path, num, ["micro_batch=2", f"zero={stage}"], summary)
    report = rpt.write_report(tmp_path)
    assert report.charts["comm"].is_file()
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [float(r["comm_bytes_per_step"]) for r in rows] == [3.5 * mib, 10.0 * mib]
    assert [int(r["predicted_comm_bytes_per_step"]) for r in rows] == [int(3.5 * mib), 10 * mib]
    fig, ax = plt.subplots()
    assert charts.plot_comm(ax, report)
    points = sorted(tuple(xy) for c in ax.collections for xy in c.get_offsets().tolist())
    assert points == [(3.5, 0.0), (10.0, pytest.approx(10.0))]
    plt.close(fig)
