"""The pass rules of the benchmarks (benchmarks/*.py, loaded by path) and of the acceptance checks
(the package checks/), called with fake measurements: each fails where the figure the docs publish
is missed, without running a benchmark or a check."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from checks import advisor_accuracy, fault_drills, plan_accuracy, plan_vs_published
from tests.helpers import REPO


def benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- plan_vs_published.py


@pytest.fixture(scope="module")
def published() -> Any:
    """The script's whole check, in-process (about 15 s of CPU: every point planned and predicted)."""
    return plan_vs_published.check()


def test_plan_vs_published_figures_and_verdicts(published: Any) -> None:
    """What docs/ and the script print: every prediction (GiB per GPU, tokens/s per GPU) to the figure
    shown, the fits unchanged, and the pass counts (8 of 10 reserved points within 10%, 13 of 14
    tokens/s points within 20%). Dropping an op from the save list moves several memory rows by points."""
    assert [round(r.predicted, 2) for r in published.memory] == [
        24.77, 78.82, 81.05, 68.71, 48.9, 48.9, 64.15, 56.23, 48.9
    ]  # fmt: skip
    assert [round(peak, 2) for _, peak in published.active] == [20.02, 46.83, 40.59]
    assert [round(r.predicted, 2) for r in published.allocator] == [59.41, 49.59, 27.95, 57.17, 86.58]
    assert [round(r.predicted) for r in published.tokens] == [
        2160, 353, 6341, 1909, 2720, 315, 7412, 2812, 1942, 390, 5915, 5943, 2800, 2800, 5835, 5839, 8350
    ]  # fmt: skip
    verdicts = [(v.label, v.within, v.checked, v.passed) for v in published.verdicts]
    assert verdicts == [("reserved", 8, 10, True), ("tokens/s", 13, 14, True)]
    assert published.drift == [] and published.passed


def test_plan_vs_published_exits_1_when_a_prediction_misses_or_a_constant_drifts(
    published: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["plan_vs_published.py"])
    monkeypatch.setattr(plan_vs_published, "check", lambda: published)
    assert plan_vs_published.main() == 0
    # One more reserved point past 10%: 7 of 10 is under the 80% the rule needs.
    first = next(
        i for i, r in enumerate(published.memory) if r.point.role == "validation" and abs(r.error) <= 0.1
    )
    missed = list(published.memory)
    missed[first] = plan_vs_published.Row(missed[first].point, missed[first].point.figure * 1.11)
    failing = plan_vs_published.verdict("reserved", missed + published.allocator, 0.10)
    assert (failing.within, failing.checked, failing.passed) == (7, 10, False)
    for broken in (
        dataclasses.replace(published, verdicts=[failing, published.verdicts[1]]),
        dataclasses.replace(published, drift=["trainer/plan/headroom.py: fit gives ..."]),
    ):
        monkeypatch.setattr(plan_vs_published, "check", lambda broken=broken: broken)
        assert plan_vs_published.main() == 1
    assert "reserved: 7 of 10 validation points within 10% (need 80%): FAIL" in capsys.readouterr().out


# ----------------------------------------------------------------------------- plan_accuracy.py

STATES = {"params": 1000, "grads": 1000, "optimizer": 2000}


def plan_row(error_pct: float, measured_states: dict[str, int] = STATES) -> dict[str, Any]:
    return {"point": "p", "rank": 0, "error_pct": error_pct, "states_predicted": STATES,
            "states_measured": measured_states}  # fmt: skip


def test_plan_accuracy_fails_past_1pct_peak_error_or_at_any_model_state_byte() -> None:
    assert plan_accuracy.parse_args([]).peak_tolerance_pct == 1.0
    assert plan_accuracy.misses([plan_row(0.99), plan_row(-0.99)], 1.0) == []
    assert plan_accuracy.misses([plan_row(1.01)], 1.0) == ["p rank 0: peak +1.01% (tolerance 1%)"]
    assert plan_accuracy.misses([plan_row(-1.5)], 1.0) == ["p rank 0: peak -1.50% (tolerance 1%)"]
    one_byte = {**STATES, "optimizer": 2001}
    assert plan_accuracy.misses([plan_row(0.0, one_byte)], 1.0) == [
        "p rank 0: optimizer 2,000 bytes planned, 2,001 measured"
    ]


def test_plan_accuracy_compares_the_plan_with_what_the_ranks_measured(tmp_path: Path) -> None:
    """The measured side comes from metrics.jsonl, never from plan.json: a rank that measured one
    more optimizer byte than planned (and a peak 2% over) fails, whatever the plan says."""
    gib = 2**30
    planned = {"rank": 0, "params_gib": 1000 / gib, "grads_gib": 1000 / gib, "optimizer_gib": 2000 / gib,
               "peak_gib": 1.0, "peak_moment": "backward: loss"}  # fmt: skip
    measured = {"memory/rank0/params_gib": 1000 / gib, "memory/rank0/grads_gib": 1000 / gib,
                "memory/rank0/optimizer_gib": 2001 / gib}  # fmt: skip
    lines = [{"memory/rank0/peak_allocated_gib": 1.0}, {"memory/rank0/peak_allocated_gib": 1.02, **measured}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    ranks = plan_accuracy.measurements(tmp_path, world_size=1)
    assert ranks == [{"peak_bytes": round(1.02 * gib), "params": 1000, "grads": 1000, "optimizer": 2001}]
    (row,) = plan_accuracy.rows({"plan": {"ranks": [planned]}, "measured": ranks}, "p")
    assert row["states_predicted"] == STATES and row["states_measured"] == {**STATES, "optimizer": 2001}
    assert plan_accuracy.misses([row], 1.0) == [
        "p rank 0: peak -1.96% (tolerance 1%)",
        "p rank 0: optimizer 2,000 bytes planned, 2,001 measured",
    ]


def test_plan_accuracy_runs_fresh_and_reuses_only_this_trees_results(tmp_path: Path) -> None:
    assert plan_accuracy.parse_args([]).reuse is False
    results = tmp_path / "results.jsonl"
    mine = {"overrides": ["a"], "revision": "abc"}
    results.write_text(json.dumps(mine) + "\n" + json.dumps({"overrides": ["b"], "revision": "old"}) + "\n")
    assert plan_accuracy.cached(results, "abc") == {("a",): mine}
    assert plan_accuracy.cached(results, "other") == {}
    assert plan_accuracy.revision().startswith(
        plan_accuracy.subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    )


def test_plan_accuracy_reproduces_the_cases_of_docs_memory_plan() -> None:
    points = plan_accuracy.points(plan_accuracy.parse_args(["--table", "cases"]))
    has = lambda **axes: any(all(p[k] == v for k, v in axes.items()) for p in points)  # noqa: E731
    assert has(precision="fp16", checkpointing="selective")
    assert all(has(zero=z, grad_accum=2) and has(zero=z, nproc=3) for z in plan_accuracy.ALL_STAGES)
    assert has(offload="cpu", zero="stage3") and not has(offload="cpu", zero="stage1")
    assert has(model="wide", seq_len=8, micro_batch=1)
    wide = plan_accuracy.overrides(next(p for p in points if p["model"] == "wide"), 2)
    assert {"model.dim=512", "model.ffn_dim=2048", "model.vocab_size=64", "nproc=2"} <= set(wide)
    grid = plan_accuracy.points(plan_accuracy.parse_args([]))
    assert len(grid) == 32 and {p["model"] for p in grid} == {"125m"}  # the first table's 32 points
    narrowed = plan_accuracy.parse_args(["--table", "cases", "--grids", "3-ranks", "--zero", "stage3"])
    assert [(p["zero"], p["nproc"]) for p in plan_accuracy.points(narrowed)] == [("stage3", 3)]


# ----------------------------------------------------------------------------- telemetry_overhead.py

telemetry_overhead = benchmark("telemetry_overhead")


def test_telemetry_overhead_verdict_is_the_exit_status() -> None:
    assert telemetry_overhead.verdict(0.001, 0.019, 2.0)[0] == 0
    assert telemetry_overhead.verdict(0.021, 0.030, 2.0)[0] == 1
    assert telemetry_overhead.verdict(0.010, 0.030, 2.0)[0] == 3  # spans the budget: not shown to hold


def test_telemetry_overhead_names_every_arm_its_options_run() -> None:
    """--parts, --traces and --layer-norms run arms that ARMS defines (--parts once named two it did not)."""
    for option, arms in telemetry_overhead.OPTION_ARMS.items():
        assert set(arms) <= set(telemetry_overhead.ARMS), (option, set(arms) - set(telemetry_overhead.ARMS))
    assert telemetry_overhead.ARMS["ranks"] == ("logger=none",)
    assert telemetry_overhead.ARMS["wandb"] == ("telemetry.enabled=false", "logger=wandb")


def test_telemetry_overhead_over_budget_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """A fake measurement: `on` 5% slower than `off` in every round (4 cycles of 2 rounds)."""
    off = [{"steady": 10_000.0 + 100 * i, "all_steps": 9_000.0, "cpu_s": 20.0} for i in range(8)]
    on = [{"steady": 0.95 * r["steady"], "all_steps": 8_550.0, "cpu_s": 21.0} for r in off]
    assert telemetry_overhead.report({"on": on, "off": off}, budget_pct=2.0) == 1
    assert "OVER the 2% budget" in capsys.readouterr().out
    assert telemetry_overhead.report({"on": off, "off": off}, budget_pct=2.0) == 0


# ----------------------------------------------------------------------------- timed comparisons


def test_runner_vs_handwritten_fails_below_the_floor() -> None:
    rules = benchmark("runner_vs_handwritten")

    def row(ratio: float) -> tuple[str, str, dict[str, float]]:
        return "tiny", "stage2", {rules.RATIO: ratio, "runner noise": 0.2, "hand-written noise": 0.1}

    assert rules.misses([row(0.866)], 0.85) == []  # docs/gpu.md's stage2 figure passes
    assert rules.misses([row(0.84)], 0.85) == [
        "tiny stage2: runner / hand-written 0.840 < 0.85 (noise: runner 20%, hand-written 10%)"
    ]


def test_step_sync_fails_when_an_arm_is_slower_than_before() -> None:
    rules = benchmark("step_sync")
    assert rules.slower({"after": 1.01, "after-fused": 0.96}, 0.95) == []
    assert rules.slower({"after": 0.94, "after-fused": 1.2}, 0.95) == ["after"]


def test_job_start_fails_over_its_ratio_ceilings() -> None:
    rules = benchmark("job_start")
    # docs/design.md against a1ae575: wall 0.68x, CPU 0.57x, a plan job 0.59x.
    assert rules.over_budget({"train": (0.68, 0.57), "plan": (0.7, 0.59)}, 0.65, 0.75) == []
    assert rules.over_budget({"train": (0.8, 0.66)}, 0.65, 0.75) == [
        "train: wall ratio 0.800 > 0.75",
        "train: CPU ratio 0.660 > 0.65",
    ]
    assert rules.spread([2.0, 2.5, 2.2]) == pytest.approx(0.25)


# ----------------------------------------------------------------------------- advisor_accuracy.py


def advised(predicted: float, measured: float, peak_error: float = 0.0) -> dict[str, Any]:
    return {"configuration": f"c{predicted}", "predicted_tokens_per_s": predicted, "measured_tokens_per_s": measured,
            "predicted_peak_gib": 1.0 + peak_error, "measured_peak_gib": 1.0}  # fmt: skip


def test_advisor_accuracy_docstring_examples_satisfy_its_own_rule(monkeypatch) -> None:
    examples = [line.split("advisor_accuracy.py", 1)[1].split("#")[0] for line in
                advisor_accuracy.__doc__.splitlines() if "checks/advisor_accuracy.py" in line]  # fmt: skip
    assert len(examples) == 2
    for example in examples:
        monkeypatch.setattr(sys, "argv", ["advisor_accuracy.py", *shlex.split(example)])
        args = advisor_accuracy.parse_args()
        assert len(args.zero) * len(args.checkpointing) * len(args.micro_batch) >= advisor_accuracy.MIN_POINTS


def test_advisor_accuracy_judges_ranking_top_pick_and_peaks() -> None:
    good = [advised(100 - i, 100 - i) for i in range(12)]
    assert advisor_accuracy.verdict(good, 12, 2.0) == []
    assert advisor_accuracy.verdict(good[:8], 8, 2.0) == [
        "8 of 8 points measured (needs all, and at least 12)"
    ]
    peaks = [*good[:11], advised(89, 89, peak_error=0.14)]  # docs/advisor.md's stage3 micro_batch 1: +14%
    assert advisor_accuracy.verdict(peaks, 12, 2.0) == ["c89: predicted peak +14.0% off (tolerance 2%)"]
    reversed_ = [advised(100 - i, 50 + i) for i in range(12)]
    assert advisor_accuracy.verdict(reversed_, 12, 2.0) == [
        "Spearman -1.000 < 0.8",
        "top pick at 82.0% of the fastest (< 90%)",  # 50 of 61,
    ]


# ----------------------------------------------------------------------------- fault_drills.py


def test_fault_drills_nothing_lost_needs_the_reported_exit_status_and_status(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    assert fault_drills.Job(130, "", "", tmp_path).ended(130, "interrupted")
    assert not fault_drills.Job(1, "", "", tmp_path).ended(130, "interrupted")
    assert not fault_drills.Job(130, "", "", tmp_path).ended(130, "preempted")
    assert not fault_drills.Job(0, "", "", tmp_path / "none").ended(0, "ok")  # no summary.json


def test_fault_drills_wait_for_a_step_has_a_deadline(tmp_path: Path) -> None:
    class Running:  # a job that never writes a record and never ends
        def poll(self) -> None:
            return None

    start = time.monotonic()
    assert fault_drills.reached_step(tmp_path / "metrics.jsonl", 3, Running(), deadline_s=0.2) is False
    assert time.monotonic() - start < 5
    (tmp_path / "metrics.jsonl").write_text("{}\n" * 3)
    assert fault_drills.reached_step(tmp_path / "metrics.jsonl", 3, Running(), deadline_s=0.2) is True


def test_save_time_judges_the_median_after_the_first_save() -> None:
    rules = benchmark("save_time")
    assert not rules.too_slow([2.2, 0.2, 0.25, 0.3], 0.5)  # the first save's set-up is not judged
    assert rules.too_slow([0.1, 0.6, 0.7, 0.4], 0.5)
