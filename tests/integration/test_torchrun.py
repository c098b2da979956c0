"""Started under torchrun, the runner joins the ranks torchrun made instead of launching its own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, Run, run_trainer, wandb_file, wandb_records, wandb_summary

SETTINGS = [*TINY, "steps=4", "zero=stage3"]


@pytest.fixture(scope="module")
def joined(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A torchrun job with W&B (offline, tests/conftest.py): shared by the tests below."""
    with_wandb = [s for s in SETTINGS if not s.startswith("logger=")] + ["logger=wandb"]
    run = torchrun(tmp_path_factory.mktemp("torchrun") / "run", *with_wandb)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_torchrun_ranks_train_like_the_runners_own(joined: Run, tmp_path: Path) -> None:
    launched = run_trainer(tmp_path / "launched", *SETTINGS, "nproc=2")
    assert joined.summary["status"] == "ok"
    assert joined.losses == launched.losses  # same ranks, same data, same numbers
    assert (
        joined.summary["memory/predicted_peak_gib"] == launched.summary["memory/predicted_peak_gib"]
    )  # planned alike


def test_torchrun_job_has_one_wandb_run_owned_by_rank0_with_metrics_jsonl_as_history(joined: Run) -> None:
    """Acceptance 4: rank 0's process fed the run from metrics.jsonl and ended it with the job's status."""
    path = wandb_file(joined.out_dir)  # exactly one run: rank 1 started none
    assert len(list(joined.out_dir.rglob("*.wandb"))) == 1
    history = [r["history"]["item"] for r in wandb_records(path) if r["type"] == "history"]
    records = joined.records
    assert len(records) == 4
    assert [
        {k: v for k, v in item.items() if not k.startswith("_")} for item in history
    ] == records  # W&B's own keys aside
    end = wandb_summary(wandb_file(joined.out_dir))
    assert (end["state"], end["exit_code"], end["summary"]["status"]) == (
        "finished",
        0,
        joined.summary["status"],
    )
    assert "zero=stage3" in end["tags"] and "sweep" not in end["tags"]


def torchrun(out: Path, *overrides: str) -> Run:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", "-m", "trainer", *overrides, f"hydra.run.dir={out}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    return Run(proc.returncode, proc.stdout, proc.stderr, out)


def test_torchrun_job_is_planned_and_refused_by_rank0_before_training(tmp_path: Path) -> None:
    run = torchrun(tmp_path / "refused", *TINY, "steps=4", "device_memory_gib=0.01")
    # torchrun ends 1 when a rank fails (its own convention); the refusal is each rank's exit status 2,
    # which torchrun's ChildFailedError report lists rank by rank. The first rank to end sets it; a
    # rank still ending then is SIGTERMed by torchrun's agent (-15), so 2 is all a rank may report else.
    assert run.returncode == 1, run.stderr[-3000:]
    exits = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", run.stderr))
    assert "2" in exits.values() and set(exits.values()) <= {"2", "-15"}, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: does not fit")]
    assert len(errors) == 1, run.stderr[-3000:]  # rank 0 says it once; rank 1 exits quietly
    assert run.summary["status"] == "refused" and run.summary["world_size"] == 2
    assert json.loads((run.out_dir / "plan.json").read_text())["world_size"] == 2
    assert not (run.out_dir / "metrics.jsonl").exists()
