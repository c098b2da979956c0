"""The W&B Report of a sweep (trainer/report/wandb_report.py), built offline from point directories laid
out as a 2-rank sweep leaves them, with every way to W&B's server made to raise."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import requests
import wandb
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.reports.v2.interface as wr_interface
from omegaconf import OmegaConf

import trainer.report as rpt
from trainer.report import command as compare
from trainer.report.wandb_report import (
    REPORT_FILE,
    STEADY_MFU,
    STEADY_TOKENS,
    load_report_json,
    report_run_id,
)
from trainer.telemetry.wandb_logger import sweep_group

GRID = [(micro_batch, stage) for micro_batch in (1, 2) for stage in ("stage2", "stage3")]
FIXED = ["nproc=2", "device=cpu", "model=tiny", "steps=3", "logger=wandb"]


def records_for(rng: random.Random, steps: int, fp16: bool) -> list[dict[str, Any]]:
    """metrics.jsonl lines with the keys 2 CPU ranks write on every step (log_every=1)."""
    records = []
    for step in range(1, steps + 1):
        peaks = [rng.uniform(0.01, 0.05) for _ in range(2)]
        record: dict[str, Any] = {
            "step": step, "loss/train": 6.2 - 0.1 * step, "optim/lr": 1e-3 * step, "throughput/tokens_per_s": rng.uniform(900, 1100),
            "throughput/mfu_pct": rng.uniform(1, 2), "time/step_s": 0.2, "memory/rank0/peak_allocated_gib": peaks[0],
            "memory/rank1/peak_allocated_gib": peaks[1], "memory/max_rank_peak_gib": max(peaks), "memory/argmax_rank": peaks.index(max(peaks)),
            "memory/predicted_peak_gib": 0.04,
        }  # fmt: skip
        if fp16:
            record.update(
                {"precision/loss_scale": 2.0**16, "precision/overflow": 0, "precision/skipped_steps": 0}
            )
        records.append(record)
    return records


def make_sweep(sweep_dir: Path, precision: str = "fp32") -> list[Path]:
    """A finished 4-point sweep: multirun.yaml, and per point .hydra/, summary.json, metrics.jsonl, wandb_run_id."""
    rng = random.Random(0)
    OmegaConf.save(
        OmegaConf.create({"logger": {"backend": "wandb", "project": "zerolab", "entity": "team"}}),
        mkdirs(sweep_dir) / "multirun.yaml",
    )
    points = []
    for num, (micro_batch, stage) in enumerate(GRID):
        overrides = [f"micro_batch={micro_batch}", f"zero={stage}", f"precision={precision}", *FIXED]
        path = mkdirs(sweep_dir / f"{num}_{','.join(overrides[:2])}" / ".hydra").parent
        OmegaConf.save(
            OmegaConf.create({"hydra": {"job": {"num": num}, "mode": "MULTIRUN"}}),
            path / ".hydra" / "hydra.yaml",
        )
        OmegaConf.save(OmegaConf.create(overrides), path / ".hydra" / "overrides.yaml")
        records = records_for(rng, 3, fp16=precision == "fp16")
        config = {
            "micro_batch": micro_batch,
            "zero": {"stage": stage},
            "logger": {"backend": "wandb", "project": "zerolab", "entity": "team"},
        }
        summary = {
            "status": "ok", "throughput/tokens_per_s": rng.uniform(900, 1100), "throughput/mfu_pct": 1.5,
            "memory/max_rank_peak_gib": max(r["memory/max_rank_peak_gib"] for r in records), "memory/argmax_rank": 1,
            "memory/predicted_peak_gib": 0.04, "loss/final": records[-1]["loss/train"], "config": config,
        }  # fmt: skip
        (path / "summary.json").write_text(json.dumps(summary))
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (path / "wandb_run_id").write_text(f"run{num}\n")
        points.append(path)
    return points


def mkdirs(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


class ServerCalled(AssertionError):
    pass


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way to W&B's server raises: the public API, the reports library's client, any HTTP request."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ServerCalled("the W&B server was asked while building the report")

    monkeypatch.setattr(wandb, "Api", refuse)
    monkeypatch.setattr(wandb.apis.public, "Api", refuse)
    monkeypatch.setattr(wr_interface, "_get_api", refuse)
    monkeypatch.setattr(wr_interface, "execute_graphql", refuse)
    monkeypatch.setattr(requests.Session, "request", refuse)


def test_the_refusals_do_refuse(no_server: None) -> None:
    """The guard itself: a run set naming a project asks the server for its id while serialising."""
    with pytest.raises(ServerCalled):
        wr.Runset(entity="team", project="zerolab")._to_model()
    with pytest.raises(ServerCalled):
        requests.get("https://api.wandb.ai/graphql")


def panels_of(report: Any) -> list[tuple[Any, Any]]:
    """(panel, its grid's run set) for every panel of every grid."""
    return [
        (panel, block.runsets[0])
        for block in report.blocks
        if isinstance(block, wr.PanelGrid)
        for panel in block.panels
    ]


def test_a_sweeps_report_is_built_offline_with_every_panel_and_round_trips(
    tmp_path: Path, no_server: None
) -> None:
    """Acceptance 1: a 4-point micro_batch x zero sweep."""
    make_sweep(tmp_path)
    rpt.write_report(tmp_path)
    report = load_report_json(tmp_path / REPORT_FILE)  # the library's own loader
    assert (report.project, report.entity, report.title) == (
        "zerolab",
        "team",
        f"Sweep report: {sweep_group(tmp_path)}",
    )
    panels = panels_of(report)
    kinds = [type(panel).__name__ for panel, _ in panels]
    assert kinds == [
        "ParallelCoordinatesPlot",
        "ScatterPlot",
        "LinePlot",
        "LinePlot",
        "LinePlot",
        "WeavePanelSummaryTable",
    ]
    runs_filter = f"Metric(\"Group\") == '{sweep_group(tmp_path)}' and Metric(\"JobType\") != 'report'"
    (
        (coords, coords_runs),
        (scatter, scatter_runs),
        (worst, _),
        (per_rank, _),
        (loss, loss_runs),
        (table, table_runs),
    ) = panels
    assert [column.metric for column in coords.columns] == [
        wr.Config("micro_batch"), wr.Config("zero.stage"), wr.SummaryMetric(STEADY_TOKENS), wr.SummaryMetric(STEADY_MFU),
        wr.SummaryMetric("memory/max_rank_peak_gib"), wr.SummaryMetric("memory/predicted_peak_gib"),
    ]  # fmt: skip
    assert (scatter.x, scatter.y) == (wr.Config("micro_batch"), wr.SummaryMetric(STEADY_TOKENS))
    # Written `config.zero.stage`; the loader gives back the backend path of the nested key.
    assert scatter_runs.groupby == [
        "config.zero.value.stage"
    ]  # throughput against micro_batch, grouped by stage
    step = wr.Metric("step")  # the optimizer step every record carries (wandb_run.define_metrics)
    assert (worst.x, worst.y) == (
        step,
        [wr.Metric("memory/max_rank_peak_gib"), wr.Metric("memory/predicted_peak_gib")],
    )
    assert (per_rank.x, per_rank.y) == (
        step,
        [wr.Metric("memory/rank0/peak_allocated_gib"), wr.Metric("memory/rank1/peak_allocated_gib")],
    )
    assert (loss.x, loss.y) == (step, [wr.Metric("loss/train")])
    assert table.table_name == "sweep/results"
    assert [runs.filters for runs in (coords_runs, scatter_runs, loss_runs)] == [runs_filter] * 3
    assert table_runs.filters == f"Metric(\"ID\") == '{report_run_id(tmp_path)}'"
    assert all(
        runs.project == "" for _, runs in panels
    )  # no project: nothing to look up until it is published
    assert (
        "config:micro_batch.value" in coords_runs.pinned_columns
        and f"summary:{STEADY_TOKENS}" in coords_runs.pinned_columns
    )
    # Serialised again, the loaded report gives the same spec: the file is the report's own form.
    assert json.loads(report._to_model().model_dump_json(by_alias=True, exclude_none=True)) == json.loads(
        (tmp_path / REPORT_FILE).read_text()
    )


def test_fp16_points_add_the_loss_scale_panel(tmp_path: Path, no_server: None) -> None:
    make_sweep(tmp_path, precision="fp16")
    rpt.write_report(tmp_path)
    lines = [
        panel
        for panel, _ in panels_of(load_report_json(tmp_path / REPORT_FILE))
        if isinstance(panel, wr.LinePlot)
    ]
    scale = [panel for panel in lines if panel.y == [wr.Metric("precision/loss_scale")]]
    assert len(scale) == 1 and scale[0].log_y is True


def test_recorded_communication_adds_a_panel_of_every_ranks_bytes_and_the_plans(
    tmp_path: Path, no_server: None
) -> None:
    for point in make_sweep(tmp_path):
        records = [json.loads(line) for line in (point / "metrics.jsonl").read_text().splitlines()]
        for record in records:
            record.update(
                {
                    "comm/rank0/bytes_per_step": 4e6,
                    "comm/rank1/bytes_per_step": 4e6,
                    "comm/predicted_bytes_per_step": 4e6,
                }
            )
        (point / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rpt.write_report(tmp_path)
    comm = [
        panel
        for panel, _ in panels_of(load_report_json(tmp_path / REPORT_FILE))
        if "bytes" in (getattr(panel, "title", None) or "")
    ]
    assert len(comm) == 1
    assert comm[0].y == [
        wr.Metric(k)
        for k in ("comm/rank0/bytes_per_step", "comm/rank1/bytes_per_step", "comm/predicted_bytes_per_step")
    ]


def test_a_comparison_filters_the_runs_by_their_ids(tmp_path: Path, no_server: None) -> None:
    points = make_sweep(tmp_path / "sweep")
    out = tmp_path / "out"
    out.mkdir()
    from trainer.report.command import load_compared

    rpt.write_report(out, load_compared([points[0], points[3]]))
    panels = panels_of(load_report_json(out / REPORT_FILE))
    assert panels[0][1].filters == "Metric(\"ID\") in ['run0', 'run3']"
    assert [column.metric for column in panels[0][0].columns][:2] == [
        wr.Config("micro_batch"),
        wr.Config("zero.stage"),
    ]


def test_without_the_reports_library_the_local_report_is_complete_and_one_warning_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    make_sweep(tmp_path)
    monkeypatch.setitem(
        __import__("sys").modules, "wandb_workspaces.reports.v2", None
    )  # import fails as when not installed
    report = rpt.write_report(tmp_path)
    assert not (tmp_path / REPORT_FILE).exists()
    assert (
        len(report.rows) == 4
        and (tmp_path / "results.csv").exists()
        and (tmp_path / "throughput.png").exists()
    )
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "wandb-workspaces" in warnings[0]
    assert "W&B Report" not in (tmp_path / "report.md").read_text()


def test_publishing_points_the_run_sets_at_the_project_saves_and_links_the_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m trainer.report --wandb DIR`, with the library's calls to the server stood in for."""
    make_sweep(tmp_path)
    rpt.write_report(tmp_path)
    assert "python -m trainer.report --wandb" in (tmp_path / "report.md").read_text()
    saved: list[Any] = []

    def save(report: Any, draft: bool = False, clone: bool = False) -> Any:
        saved.append(
            [
                (runs.entity, runs.project)
                for block in report.blocks
                if isinstance(block, wr.PanelGrid)
                for runs in block.runsets
            ]
        )
        report.id = "R1"
        return report

    monkeypatch.setattr(wr.Report, "save", save)
    monkeypatch.setattr(
        wr.Report,
        "url",
        property(lambda report: f"https://wandb.test/{report.entity}/{report.project}/reports/{report.id}"),
    )
    monkeypatch.setattr(
        wr_interface, "execute_graphql", lambda api, query, variables: {"project": {"internalId": "P1"}}
    )
    monkeypatch.setattr(wr_interface, "_get_api", lambda: None)
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--wandb", str(tmp_path)])
    assert exit_info.value.code == 0
    assert saved == [[("team", "zerolab")] * 4]
    assert (
        "W&B Report: https://wandb.test/team/zerolab/reports/R1"
        in (tmp_path / "report.md").read_text().splitlines()
    )
    assert load_report_json(tmp_path / REPORT_FILE).id == "R1"  # publishing again updates the same Report


def test_publishing_without_a_server_is_one_warning_and_leaves_report_md(
    tmp_path: Path, no_server: None, capsys: pytest.CaptureFixture[str]
) -> None:
    make_sweep(tmp_path)
    rpt.write_report(tmp_path)
    before = (tmp_path / "report.md").read_text()
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--wandb", str(tmp_path)])
    assert exit_info.value.code == 1
    assert [line.split(" (")[0] for line in capsys.readouterr().err.splitlines()] == [
        "warning: the W&B Report could not be saved"
    ]
    assert (tmp_path / "report.md").read_text() == before
