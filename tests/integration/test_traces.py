"""Issue 64 acceptance 4 in one job of 2 CPU ranks and 4 steps: `telemetry.trace_steps=[3]
telemetry.trace_ranks=[0,1]` leaves a chrome trace per rank naming its rank, on the step the communication
probe profiles too (one profiler session: its exposed share is still measured); rank 1 then runs out of
memory at step 4 under `memory.snapshot=oom`. The offline W&B run, read back with W&B's own reader, holds
both traces and the snapshot as artifacts, and the report over the run links them."""

from __future__ import annotations

import json

import pytest

from tests.helpers import TINY, Run, run_trainer, wandb_file, wandb_records
from trainer.report import load_point
from trainer.report.markdown import markdown
from trainer.report.rows import build_rows
from trainer.report.run_dirs import Report
from trainer.telemetry import keys

JOB = (
    *TINY, "nproc=2", "steps=4", "save=off", "logger=wandb",
    "telemetry.trace_steps=[3]", "telemetry.trace_ranks=[0,1]",
    "memory.snapshot=oom", "fault.kind=oom", "fault.rank=1", "fault.step=4",
)  # fmt: skip
TRACES = ["rank0_step3.json", "rank1_step3.json"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_trainer(tmp_path_factory.mktemp("traces") / "run", *JOB, check=False)
    assert (run.returncode, run.summary["status"], run.summary["failed_rank"]) == (1, "oom", 1), run.stderr
    return run


def test_each_traced_rank_leaves_a_chrome_trace_naming_its_rank(run: Run) -> None:
    assert sorted(p.name for p in (run.out_dir / "traces").iterdir()) == TRACES
    for rank, name in enumerate(TRACES):
        with (run.out_dir / "traces" / name).open() as f:
            trace = json.load(f)
        assert (trace["distributedInfo"]["rank"], trace["distributedInfo"]["world_size"]) == (rank, 2)
        assert trace["zerolab"] == {"rank": rank, "step": 3}
        assert any(event.get("name", "").startswith("gloo:") for event in trace["traceEvents"])


def test_the_traced_step_is_still_the_comm_probes_profiled_step(run: Run) -> None:
    exposed = [record["step"] for record in run.records if keys.COMM_EXPOSED_PCT in record]
    assert exposed == [3]


def test_the_wandb_run_holds_the_traces_and_the_oom_snapshot_as_artifacts(run: Run) -> None:
    records = wandb_records(wandb_file(run.out_dir))
    run_id = (run.out_dir / "wandb_run_id").read_text().strip()
    artifacts = {
        r["artifact"]["name"]: (
            r["artifact"]["type"],
            [(c["path"], int(c["size"])) for c in r["artifact"]["manifest"]["contents"]],
        )
        for r in records
        if r["type"] == "artifact"
    }
    snapshot = run.out_dir / "memory_snapshots" / "rank1_oom.json"
    assert artifacts == {
        f"profiler-traces-{run_id}": (
            "profiler-traces",
            [(name, (run.out_dir / "traces" / name).stat().st_size) for name in TRACES],
        ),
        f"memory-snapshots-{run_id}": ("memory-snapshots", [("rank1_oom.json", snapshot.stat().st_size)]),
    }


def test_the_report_over_the_run_links_its_traces_and_snapshot(run: Run) -> None:
    """Linked relative to the report's directory (here a sibling of the run's)."""
    points = [load_point(run.out_dir)]
    report_dir = run.out_dir.parent / "report"
    text = markdown(Report(report_dir, points, [], build_rows(points, []), charts={}, is_sweep=False), None)
    section = text.split("## Traces and memory snapshots\n\n")[1].splitlines()
    up = "../run"
    assert section == [
        f"- `run` profiler-traces: [rank0_step3.json]({up}/traces/rank0_step3.json), "
        f"[rank1_step3.json]({up}/traces/rank1_step3.json)",
        f"- `run` memory-snapshots: [rank1_oom.json]({up}/memory_snapshots/rank1_oom.json)",
    ]
