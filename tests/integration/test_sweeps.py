"""Multirun sweeps run as a user runs them: `python -m trainer -m ...`, 2 CPU ranks per point.

One named sweep with W&B (offline, read back with `wandb leet inspect --json`) is run once per
module and re-run into its directory; an out-of-memory sweep, a fail-fast sweep and two jobs
started at the same moment each run once.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib.image
import pytest

from tests.helpers import (
    REPO,
    compose,
    point_dirs,
    read_csv,
    run_sweep,
    settings,
    summary,
    table_rows,
    trainer_args,
    wandb_records,
    wandb_run,
    wandb_summary,
)
from trainer.faults.oom import CATEGORIES
from trainer.report import COLUMNS
from trainer.report.wandb_report import load_report_json
from trainer.sweep import SweepCallback
from trainer.telemetry.wandb_logger import sweep_group

POINT = ("nproc=2", "device=cpu", "model=tiny", "steps=5", "seq_len=64", "log_every=1")
REPORT_FILES = ("results.csv", "report.md", "throughput.png", "memory.png", "losses.png")
# A cap that micro_batch=1 stays far below and that micro_batch=64 at seq_len 256 (~0.8 GiB of
# activations per rank, the plan says) cannot fit; plan.enforce=false so that it runs and fails.
CAPPED = (
    "device_memory_gib=0.25",
    "nproc=2",
    "device=cpu",
    "model=tiny",
    "steps=2",
    "seq_len=256",
    "log_every=1",
)


@dataclass
class Sweep:
    dir: Path
    proc: subprocess.CompletedProcess[str]
    report_bytes: dict[str, bytes]


@pytest.fixture(scope="module")
def named_sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Acceptance 1 and 3: the named sweep micro_batch_x_stage, its grid narrowed on the command
    line to micro_batch=1,2 x zero=stage2,stage3 (its 16 points take too long for the suite)."""
    sweep_dir = tmp_path_factory.mktemp("named") / "sweep"
    proc = run_sweep(
        sweep_dir,
        "+sweeps=micro_batch_x_stage",
        "micro_batch=1,2",
        "zero=stage2,stage3",
        *POINT,
        "logger=wandb",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Sweep(sweep_dir, proc, {name: (sweep_dir / name).read_bytes() for name in REPORT_FILES})


def test_every_point_runs_in_its_own_directory_and_the_report_has_a_row_each(named_sweep: Sweep) -> None:
    points = point_dirs(named_sweep.dir)
    grid = {(mb, stage) for mb, stage in itertools.product(("1", "2"), ("stage2", "stage3"))}
    assert {(settings(p)["micro_batch"], settings(p)["zero"]) for p in points} == grid and len(points) == 4
    assert [(summary(p)["status"], summary(p)["steps_done"]) for p in points] == [("ok", 5)] * 4
    rows = read_csv(named_sweep.dir / "results.csv")
    assert [row["dir"] for row in rows] == [p.name for p in points]
    for row, point in zip(rows, points):
        assert row["status"] == "ok"
        assert float(row["tokens_per_s"]) == summary(point)["throughput/tokens_per_s"]
        assert float(row["final_loss"]) == summary(point)["loss/final"]
        assert (
            row["overrides"] == f"micro_batch={settings(point)['micro_batch']} zero={settings(point)['zero']}"
        )
    fastest = max(rows, key=lambda row: float(row["tokens_per_s"]))
    assert [row["fastest"] for row in rows] == [str(row is fastest) for row in rows]
    table = table_rows(named_sweep.dir / "report.md")
    assert [line.split(" | ")[2] for line in table] == [
        "**ok, fastest**" if row is fastest else "ok" for row in rows
    ]
    for name in ("throughput.png", "memory.png", "losses.png"):
        assert matplotlib.image.imread(named_sweep.dir / name).shape[:2] == (550, 900)


def test_points_and_the_report_are_wandb_runs_in_one_group(named_sweep: Sweep) -> None:
    points = point_dirs(named_sweep.dir)
    runs = [wandb_run(next(p.glob("wandb/offline-run-*/run-*.wandb"))) for p in points]
    assert {run["run_group"] for run in runs} == {sweep_group(named_sweep.dir)}
    assert len({run["run_id"] for run in runs}) == 4
    report_file = next(named_sweep.dir.glob("wandb/offline-run-*/run-report-*.wandb"))
    report_run = wandb_run(report_file)
    assert (report_run["run_group"], report_run["job_type"]) == (sweep_group(named_sweep.dir), "report")
    history = next(r["history"]["item"] for r in wandb_records(report_file) if r["type"] == "history")
    assert history["sweep/results._type"] == "table-file"
    assert {history[f"sweep/{chart}._type"] for chart in ("throughput", "memory", "losses")} == {"image-file"}
    table = json.loads(
        next(report_file.parent.glob("files/media/table/sweep/results_*.table.json")).read_text()
    )
    assert table["columns"] == COLUMNS
    csv_rows = read_csv(named_sweep.dir / "results.csv")
    index = COLUMNS.index("tokens_per_s")
    assert [row[index] for row in table["data"]] == [float(row["tokens_per_s"]) for row in csv_rows]


def test_every_run_has_its_tags_typed_swept_values_and_summary_json_as_its_summary(
    named_sweep: Sweep,
) -> None:
    """Issue 9, acceptance 2: read back with `wandb leet inspect --json`."""
    for point in point_dirs(named_sweep.dir):
        run_file = next(point.glob("wandb/offline-run-*/run-*.wandb"))
        run, end, local = wandb_run(run_file), wandb_summary(run_file), summary(point)
        chosen = settings(point)
        assert sorted(end["tags"]) == sorted(
            [
                f"zero={chosen['zero']}",
                "model=tiny",
                "precision=fp32",
                "checkpointing=none",
                "offload=none",
                "sweep",
            ]
        )
        assert run["config"]["update"]["swept"] == {
            "micro_batch": int(chosen["micro_batch"]),
            "zero": chosen["zero"],
        }
        figures = {k: v for k, v in local.items() if k not in ("config", "overrides")}
        assert {k: end["summary"][k] for k in figures} == figures
        steady = (
            "throughput/steady_tokens_per_s",
            "throughput/steady_mfu_pct",
        )  # MFU only where the device's peak is known
        assert [end["summary"].get(k) for k in steady] == [
            local["throughput/tokens_per_s"],
            local.get("throughput/mfu_pct"),
        ]
        losses = [
            json.loads(line)["loss/train"] for line in (point / "metrics.jsonl").read_text().splitlines()
        ]
        assert end["summary"]["loss/train"] == {"min": min(losses), "last": losses[-1]}


def test_a_report_over_run_and_sweep_directories_together(named_sweep: Sweep, tmp_path: Path) -> None:
    """Issue 9, acceptance 3: two point directories and the whole sweep, into a new outputs/reports/ directory."""
    points = point_dirs(named_sweep.dir)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "trainer.report", str(points[0]), str(points[3]), str(named_sweep.dir)]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out,) = (tmp_path / "outputs" / "reports").glob("*/*")
    rows = read_csv(out / "results.csv")
    compared = [points[0], points[3], *points]
    assert [row["dir"] for row in rows] == [p.name for p in compared] and [
        int(row["point"]) for row in rows
    ] == list(range(6))
    assert [float(row["tokens_per_s"]) for row in rows] == [
        summary(p)["throughput/tokens_per_s"] for p in compared
    ]
    assert len(table_rows(out / "report.md")) == 6 and (out / "throughput.png").exists()
    runs = (
        load_report_json(out / "wandb_report.json").blocks[2].runsets[0]
    )  # the W&B Report's run set: the compared runs
    assert (
        runs.filters
        == f'Metric("ID") in {sorted({(p / "wandb_run_id").read_text().strip() for p in points})!r}'
    )
    stray = tmp_path / "stray"
    stray.mkdir()
    proc = subprocess.run(
        [*args, str(stray)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert (proc.returncode, proc.stderr.splitlines()) == (
        2,
        [
            f"error: {stray} is neither a run directory (.hydra/ and summary.json) nor a sweep directory (point directories with .hydra/)"
        ],
    )


def test_wandb_unreachable_costs_one_warning_per_job_and_the_local_report_is_complete(tmp_path: Path) -> None:
    """Issue 9, acceptance 5: online with a key of the right shape and no server to reach."""
    env = {
        **os.environ,
        "WANDB_MODE": "online",
        "WANDB_API_KEY": "f00dfacecafe" * 3 + "beef",
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_INIT_TIMEOUT": "2",  # what each job waits for the server: one warning, whatever the wait
    }
    proc = run_sweep(tmp_path, "micro_batch=1,2", *POINT, "steps=2", "logger=wandb", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [summary(p)["status"] for p in point_dirs(tmp_path)] == ["ok", "ok"]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert [w.startswith("warning: W&B could not start") for w in warnings] == [True, True, False], (
        warnings
    )  # one per job, then the report's
    assert "the report could not go to W&B" in warnings[2]
    assert [row["status"] for row in read_csv(tmp_path / "results.csv")] == ["ok", "ok"]
    assert all((tmp_path / name).exists() for name in (*REPORT_FILES, "wandb_report.json"))


def test_rerunning_into_the_same_directory_runs_no_job_and_rewrites_the_same_report(
    named_sweep: Sweep,
) -> None:
    """Acceptance 4."""
    points = point_dirs(named_sweep.dir)
    before = {
        p: ((p / "metrics.jsonl").read_bytes(), len(list(p.glob("wandb/offline-run-*")))) for p in points
    }
    for name in REPORT_FILES:
        (named_sweep.dir / name).unlink()
    proc = run_sweep(
        named_sweep.dir,
        "+sweeps=micro_batch_x_stage",
        "micro_batch=1,2",
        "zero=stage2,stage3",
        *POINT,
        "logger=wandb",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("skipped: ") == 4
    assert {
        p: ((p / "metrics.jsonl").read_bytes(), len(list(p.glob("wandb/offline-run-*")))) for p in points
    } == before
    assert {name: (named_sweep.dir / name).read_bytes() for name in REPORT_FILES} == named_sweep.report_bytes
    report_runs = {
        wandb_run(f)["run_id"] for f in named_sweep.dir.glob("wandb/offline-run-*/run-report-*.wandb")
    }
    assert len(report_runs) == 1  # the same W&B report run, continued


@pytest.fixture(scope="module")
def oom_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """micro_batch=64 cannot fit the cap; micro_batch=1 does."""
    sweep_dir = tmp_path_factory.mktemp("oom_sweep")
    proc = run_sweep(sweep_dir, "micro_batch=1,64", "plan.enforce=false", *CAPPED, "logger=wandb")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir


def test_a_point_that_runs_out_of_memory_is_a_result(oom_sweep: Path) -> None:
    """Acceptance 2: micro_batch=64 cannot fit the cap; the sweep records it as oom and exits 0."""
    tmp_path = oom_sweep
    fits, too_big = (summary(p) for p in point_dirs(tmp_path))
    assert (
        fits["status"] == "ok"
        and fits["memory/max_rank_peak_gib"] < 0.25 < too_big["memory/predicted_peak_gib"]
    )
    assert too_big["status"] == "oom"
    records = [
        json.loads(f.read_text()) for f in sorted((point_dirs(tmp_path)[1] / "failures").glob("rank*.json"))
    ]
    first_oom = next(r for r in records if r["oom"])
    # Activations fill up during the first forward: that is where and when it runs out.
    assert (too_big["failed_rank"], too_big["failed_step"], too_big["failed_phase"]) == (
        first_oom["rank"],
        1,
        "forward",
    )
    assert "CPU out of memory under device_memory_gib: tried to allocate" in too_big["error"]
    wandb_end = wandb_summary(next(point_dirs(tmp_path)[1].glob("wandb/offline-run-*/run-*.wandb")))
    assert {k: wandb_end["summary"][k] for k in ("status", "failed_rank", "failed_step", "failed_phase")} == {
        k: too_big[k] for k in ("status", "failed_rank", "failed_step", "failed_phase")
    }
    row = read_csv(tmp_path / "results.csv")[1]
    assert (row["status"], row["failed_rank"], row["failed_step"], row["failed_phase"]) == (
        "oom",
        str(first_oom["rank"]),
        "1",
        "forward",
    )
    assert f"**oom** (rank {first_oom['rank']}, step 1, forward)" in table_rows(tmp_path / "report.md")[1]
    assert "**ok, fastest**" in table_rows(tmp_path / "report.md")[0]


def test_the_report_of_a_sweep_with_an_oom_point_says_where_the_memory_went(oom_sweep: Path) -> None:
    """Issue 37's report: per point and rank, the plan against what was measured by category, a table in
    report.md and where_memory.png. The point that fits: its plan.json row against its largest tracked
    peak; the rank that ran out: summary.json's `oom` (the plan's nearest moment, what it held)."""
    fits, too_big = point_dirs(oom_sweep)
    oom = summary(too_big)["oom"]

    def row(point: int, rank: int, at: str, plan: dict[str, float], measured: dict[str, float] | None) -> str:
        cells = [f"{plan[p]:.4f} / {'-' if measured is None else f'{measured[p]:.4f}'}" for p in CATEGORIES]
        return f"| {point} | {rank} | {at} | {' | '.join(cells)} |"

    expected = []
    records = [json.loads(line) for line in (fits / "metrics.jsonl").read_text().splitlines()]
    for rank_plan in json.loads((fits / "plan.json").read_text())["ranks"]:
        rank = rank_plan["rank"]
        tracked = [r for r in records if f"memory/rank{rank}/at_peak/activations_gib" in r]
        peak = max(tracked, key=lambda r: r[f"memory/rank{rank}/peak_allocated_gib"])
        measured = {p: peak[f"memory/rank{rank}/at_peak/{name}_gib"] for p, (_, name) in CATEGORIES.items()}
        expected.append(row(0, rank, "peak", {p: rank_plan[f"{p}_gib"] for p in CATEGORIES}, measured))
    expected.append(row(1, oom["rank"], f"oom, {oom['moment']}", oom["plan_gib"], oom["measured_gib"]))
    other = 1 - oom["rank"]  # it never reached a tracked peak: the plan alone
    other_plan = json.loads((too_big / "plan.json").read_text())["ranks"][other]
    expected.append(row(1, other, "peak", {p: other_plan[f"{p}_gib"] for p in CATEGORIES}, None))
    lines = (oom_sweep / "report.md").read_text().splitlines()
    table = lines[lines.index("## Where the memory went") + 4 :]
    assert sorted(table[2 : 2 + len(expected)]) == sorted(expected)
    assert "![Where the memory went](where_memory.png)" in lines
    # Two bars (plan, measured) per row of the table, 1.2 inches each past 6 inches, at 100 dpi.
    assert matplotlib.image.imread(oom_sweep / "where_memory.png").shape == (550, 600, 4)


def test_fail_fast_stops_the_sweep_at_the_first_point_that_does_not_end_ok(tmp_path: Path) -> None:
    """Here the plan refuses micro_batch=64 up front (no ranks start): the sweep stops there, exit 1."""
    proc = run_sweep(tmp_path, "micro_batch=64,1", "fail_fast=true", *CAPPED, "logger=none")
    assert proc.returncode == 1
    assert "fail_fast" in proc.stderr
    points = point_dirs(tmp_path)
    assert [(settings(p)["micro_batch"], summary(p)["status"]) for p in points] == [
        ("64", "refused")
    ]  # micro_batch=1 never ran
    assert [row["status"] for row in read_csv(tmp_path / "results.csv")] == ["refused"]


def test_two_jobs_started_at_the_same_moment_do_not_collide(tmp_path: Path) -> None:
    """Acceptance 5: two 2-rank jobs at once, both asking for the same timestamped directory
    (day resolution, so they surely ask for the same one): each gets its own directory and its
    own rendezvous port, and both finish ok with complete, unmixed metrics."""
    point = (*POINT, "steps=3", "telemetry.enabled=false", "logger=none")
    args = trainer_args(*point, f"hydra.run.dir={tmp_path}/runs/${{now:%Y-%m-%d}}")
    first = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert first.poll() is None  # the first is still running when the second starts
    outputs = [job.communicate(timeout=600) for job in (first, second)]
    assert (first.returncode, second.returncode) == (0, 0), [err[-2000:] for _, err in outputs]
    today = datetime.date.today().isoformat()
    runs = sorted((tmp_path / "runs").iterdir())
    assert [d.name for d in runs] == [today, f"{today}_1"]
    for run in runs:
        assert summary(run)["status"] == "ok"
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3]


def test_sweeps_started_in_the_same_second_get_their_own_directories(tmp_path: Path) -> None:
    """The same for two sweeps: each claims its own sweep directory, and the points (composed again
    from the recorded overrides, as Hydra's launcher does) land in it."""
    claimed = []
    for _ in range(2):
        cfg = compose(f"hydra.sweep.dir={tmp_path}/${{now:%Y-%m-%d}}", hydra=True)
        SweepCallback().on_multirun_start(cfg)
        point_cfg = compose(*cfg.hydra.overrides.hydra, hydra=True)
        assert point_cfg.hydra.sweep.dir == cfg.hydra.sweep.dir
        claimed.append(Path(cfg.hydra.sweep.dir))
    today = datetime.date.today().isoformat()
    assert claimed == [tmp_path / today, tmp_path / f"{today}_1"] and all(d.is_dir() for d in claimed)
