"""telemetry.trace_steps / trace_ranks (trainer/telemetry/traces.py) in one process: the keys' bounds, one
line each; no profiler at all when tracing is off; a traced step's chrome trace naming its rank and step;
one profiler session for a step the communication probe profiles too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.profiler

import trainer.job
from tests.helpers import compose, compose_config
from trainer.config import ConfigError, TelemetryConfig
from trainer.telemetry.comm import FIELDS, CommProbe
from trainer.telemetry.traces import VIEW, Traces, run_files, trace_path

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "build,line",
    [
        (lambda: TelemetryConfig(trace_steps=[0, 3]), "telemetry.trace_steps must be steps >= 1, got [0, 3]"),
        (lambda: TelemetryConfig(trace_ranks=[-1]), "telemetry.trace_ranks must be ranks >= 0, got [-1]"),
        (
            lambda: TelemetryConfig(trace_steps=[3, 5]).check_traces(steps=4, world_size=2),
            "telemetry.trace_steps must be within 1..4 (steps=4), got [3, 5]",
        ),
        (
            lambda: TelemetryConfig(trace_ranks=[0, 2]).check_traces(steps=4, world_size=2),
            "telemetry.trace_ranks must be within 0..1 (world size 2), got [0, 2]",
        ),
    ],
)
def test_trace_keys_out_of_range_are_refused_naming_the_key(build, line: str) -> None:
    with pytest.raises(ConfigError) as err:
        build()
    assert str(err.value) == line


def test_the_command_line_lists_reach_the_schema_and_the_job_checks_them_against_the_world(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`telemetry.trace_steps=[3]` as typed; off by default, rank 0 as Megatron's; a rank beyond the world ends
    the job before any rank starts, in one line."""
    assert compose_config().telemetry.trace_steps == []
    assert compose_config().telemetry.trace_ranks == [0]
    config = compose_config("steps=4", "telemetry.trace_steps=[3]", "telemetry.trace_ranks=[0,1]").telemetry
    assert (config.trace_steps, config.trace_ranks) == ([3], [0, 1])

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(trainer.job, "exit_unless_sweep", exit_now)
    bad = compose("device=cpu", "nproc=2", "steps=4", "telemetry.trace_ranks=[2]")
    with pytest.raises(SystemExit) as ended:
        trainer.job.check_job(bad, tmp_path)
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: telemetry.trace_ranks must be within 0..1 (world size 2), got [2]"
    ]


@pytest.fixture
def profilers(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every torch.profiler.profile made from here on (they still profile)."""
    made: list[object] = []

    class Counted(torch.profiler.profile):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(torch.profiler, "profile", Counted)
    return made


def matmul() -> None:
    x = torch.randn(64, 64)
    (x @ x).sum()


def test_tracing_off_makes_no_profiler(profilers: list[object], tmp_path: Path) -> None:
    """Off by default, and on a rank not in trace_ranks: every step runs under a null context."""
    for config, rank in ((TelemetryConfig(), 0), (TelemetryConfig(trace_steps=[2], trace_ranks=[0]), 1)):
        traces = Traces(config, CPU, tmp_path, rank)
        for step in range(1, 5):
            with traces.record(step):
                matmul()
    assert profilers == [] and not (tmp_path / "traces").exists()


def test_a_traced_step_leaves_a_chrome_trace_naming_its_rank_and_step(
    profilers: list[object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = Traces(TelemetryConfig(trace_steps=[2], trace_ranks=[1]), CPU, tmp_path, rank=1)
    for step in range(1, 4):
        with traces.record(step):
            matmul()
    assert len(profilers) == 1
    assert capsys.readouterr().out == f"trace of rank 1, step 2: {trace_path(tmp_path, 1, 2)}; {VIEW}\n"
    assert [p.name for p in (tmp_path / "traces").iterdir()] == ["rank1_step2.json"]
    trace = json.loads(trace_path(tmp_path, 1, 2).read_text())
    assert trace["zerolab"] == {"rank": 1, "step": 2}
    assert "aten::mm" in {event.get("name") for event in trace["traceEvents"]}


def test_a_trace_that_cannot_be_written_is_warned_about_and_the_steps_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run directory's `traces` is a file here: no directory can be made."""
    (tmp_path / "traces").write_text("")
    traces = Traces(TelemetryConfig(trace_steps=[1]), CPU, tmp_path, rank=0)
    for step in (1, 2):
        with traces.record(step):
            matmul()
    err = capsys.readouterr().err
    assert err.startswith(
        f"warning: rank 0 could not write its trace of step 1 to {trace_path(tmp_path, 0, 1)}: "
    )
    assert len(err.splitlines()) == 1


def test_a_step_the_comm_probe_profiles_is_traced_by_the_same_profiler(
    profilers: list[object], tmp_path: Path
) -> None:
    """Step 3 is the probe's (the step after the memory tracker's step 2): one session records it, its trace
    is exported and the probe reads its exposed share from the same events (none: no collective ran)."""
    probe = CommProbe(CPU, memory_every=500, last_step=4)
    traces = Traces(TelemetryConfig(trace_steps=[3]), CPU, tmp_path, rank=0)
    for step in range(1, 5):
        with traces.record(step), probe.measure(step, tracked=False):
            matmul()
        if step == 3:
            figures = dict(zip(FIELDS, probe.read()))
    assert len(profilers) == 1
    assert figures["exposed_pct"] == 0.0 and figures["profiled_step_s"] > 0
    assert json.loads(trace_path(tmp_path, 0, 3).read_text())["zerolab"] == {"rank": 0, "step": 3}


def test_run_files_lists_traces_by_rank_then_step_and_the_snapshots(tmp_path: Path) -> None:
    for rank, step in ((10, 1), (2, 12), (2, 3)):
        trace_path(tmp_path, rank, step).parent.mkdir(exist_ok=True)
        trace_path(tmp_path, rank, step).write_text("{}")
    assert [(f.kind, [p.name for p in f.paths]) for f in run_files(tmp_path)] == [
        ("profiler-traces", ["rank2_step3.json", "rank2_step12.json", "rank10_step1.json"])
    ]
    (tmp_path / "memory_snapshots").mkdir()
    (tmp_path / "memory_snapshots" / "rank1_oom.json").write_text("{}")
    assert [f.kind for f in run_files(tmp_path)] == ["profiler-traces", "memory-snapshots"]
