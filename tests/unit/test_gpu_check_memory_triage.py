"""The GPU check's OOM-triage rows (checks/gpucheck/rows.py check_oom, check_auto_batch) on CPU, from jobs
as the GPU or a dry run would leave them: a snapshot that loads passes, one that does not fails; auto passes
only with the plan's proposal confirmed in at most 4 probes."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from checks.gpucheck import rows as check
from checks.gpucheck.scheduler import Job

OOM = {"status": "oom", "failed_phase": "forward", "oom": {"moment": "step 1 (forward, block 3, micro-batch 0)",
                                                             "plan_moment": "forward: block", "held_gib": 9.8,
                                                             "most_over": "activations"}}  # fmt: skip


def snapshot_dir(out: Path) -> Path:
    path = out / "jobs" / "oom" / "memory_snapshots"
    path.mkdir(parents=True)
    return path


def test_oom_passes_with_a_snapshot_that_loads(tmp_path: Path) -> None:
    (snapshot_dir(tmp_path) / "rank0_oom.pickle").write_bytes(
        pickle.dumps({"segments": [], "device_traces": []})
    )
    row = check.check_oom(check.Setup(False, tmp_path, 0.0), {"oom": Job("oom", "oom", summary=OOM)})
    assert (row.status, row.figures["most_over"], row.figures["snapshot"]) == (
        "pass", "activations", str(tmp_path / "jobs" / "oom" / "memory_snapshots" / "rank0_oom.pickle"),
    )  # fmt: skip


def test_oom_fails_unexplained_where_it_ran_out_before_the_first_step(tmp_path: Path) -> None:
    """The first GPU run's cap (1b in 2 GiB) ran out building the model: no moment of the plan to set the
    held memory beside. On CUDA the rank's held total stands beside the plan (no split: the tensor
    tracker runs on CPU ranks), which explains the row without a `most_over`."""
    (snapshot_dir(tmp_path) / "rank0_oom.pickle").write_bytes(pickle.dumps({"segments": []}))
    setup = check.Setup(False, tmp_path, 0.0)
    at_setup = {
        "status": "oom",
        "failed_phase": "setup",
        "oom": {"moment": "step 0 (setup)", "held_gib": 1.9},
    }
    row = check.check_oom(setup, {"oom": Job("oom", "oom", summary=at_setup)})
    assert row.status == "fail" and "not explained by a plan moment" in row.note, row.note
    on_cuda = {**OOM, "oom": {**OOM["oom"], "most_over": None}}
    row = check.check_oom(setup, {"oom": Job("oom", "oom", summary=on_cuda)})
    assert (row.status, row.figures["held_gib"], row.figures["most_over"]) == ("pass", 9.8, None)


def test_oom_fails_without_a_loadable_snapshot(tmp_path: Path) -> None:
    (snapshot_dir(tmp_path) / "rank0_oom.pickle").write_bytes(b"truncated")
    row = check.check_oom(check.Setup(False, tmp_path, 0.0), {"oom": Job("oom", "oom", summary=OOM)})
    assert (row.status, row.figures["snapshot"]) == ("fail", None)
    assert row.note.endswith("no loadable snapshot")


def test_a_dry_run_reads_the_held_split_instead(tmp_path: Path) -> None:
    (snapshot_dir(tmp_path) / "rank0_oom.json").write_text(json.dumps({"rank": 0, "at": "oom", "gib": {}}))
    row = check.check_oom(check.Setup(True, tmp_path, 0.0), {"oom": Job("oom", "oom", summary=OOM)})
    assert row.status == "pass"


def auto_job(chosen: int, statuses: list[str]) -> Job:
    tried = [{"micro_batch": 3 + i, "status": s, "measured_peak_gib": 30.0} for i, s in enumerate(statuses)]
    return Job("auto_batch", "ok", summary={"status": "ok", "micro_batch_auto": {"proposed": 3, "chosen": chosen,
                                                                                  "tried": tried}})  # fmt: skip


def test_auto_passes_with_the_plans_proposal_confirmed(tmp_path: Path) -> None:
    setup = check.Setup(False, tmp_path, 0.0)
    row = check.check_auto_batch(setup, {"auto_batch": auto_job(3, ["ok", "oom"])})
    assert (row.status, row.figures["chosen"], row.figures["probes"]) == (
        "pass",
        3,
        [(3, "ok", 30.0), (4, "oom", 30.0)],
    )
    assert check.check_auto_batch(setup, {"auto_batch": auto_job(2, ["oom", "ok"])}).status == "fail"
    assert check.check_auto_batch(setup, {"auto_batch": auto_job(3, ["ok"] * 5)}).status == "fail"
