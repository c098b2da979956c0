"""stability.spike on 2 CPU ranks: a loss spike that only rank 1 sees (fault.kind=loss_spike multiplies its
step-4 loss by 100) is acted on by both ranks at step 4: `log` records it, `skip` leaves every rank's
shard of the weights and the optimizer state bitwise as they were, `rollback` reloads the step-3 save
and trains on as a run that never read step 4's batches does. One sweep (log, skip, rollback) and one
reference run (stability.skip_steps=[4])."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import TINY, Run, point_dirs, run_sweep, run_trainer, settings

# zero=stage3: each rank holds half of every tensor, so a save equal to the step before is so on both ranks.
COMMON = (
    *TINY,
    "nproc=2",
    "zero=stage3",
    "steps=5",
    "stability.spike.window=2",
    "fault.kind=loss_spike",
    "fault.step=4",
    "fault.rank=1",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("spikes")
    proc = run_sweep(
        root / "sweep",
        *COMMON,
        "save.every=1",
        "save.keep=5",
        "stability.spike.action=log,skip,rollback",
        "hydra.sweep.subdir=${hydra.job.num}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found: dict[str, Any] = {"console": proc.stdout}
    for point in point_dirs(root / "sweep"):
        found[settings(point)["stability.spike.action"]] = Run(0, "", "", point)
    # Step 4 is read past: the fault of step 4 never fires, nothing spikes.
    found["reference"] = run_trainer(root / "reference", *COMMON, "save.every=5", "stability.skip_steps=[4]")
    return found


def events(run: Run) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run.out_dir / "spikes.jsonl").read_text().splitlines()]


def saved(run: Run, step: int) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of a save (DCP's own converter), flattened by name."""
    target = run.out_dir / f"step_{step}.pt"
    dcp_to_torch_save(run.out_dir / "checkpoints" / f"step_{step:08d}", target)
    state = torch.load(target, weights_only=False)
    return {
        f"{part}.{name}": value
        for part in ("model", "optim")
        for name, value in flatten(state[part]).items()
        if torch.is_tensor(value)
    }


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(
            flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
        )
    return out


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 10
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def test_log_records_the_spike_and_takes_the_step(runs: dict[str, Any]) -> None:
    run = runs["log"]
    [event] = events(run)
    assert (event["step"], event["action"], list(event["ratios"])) == (4, "log", ["1"])
    assert event["ratios"]["1"] > 90  # 100 x the loss over the median of the two before
    assert [r["stability/loss_spikes"] for r in run.records] == [0, 0, 0, 1, 1]
    assert run.summary["status"] == "ok" and run.summary["stability/loss_spikes"] == 1
    assert "loss spike at step 4 on rank 1 (" in runs["console"]
    assert "step taken (1 so far, stability.spike.action=log)" in runs["console"]
    assert not torch.equal(saved(run, 3)["model.output.weight"], saved(run, 4)["model.output.weight"])


def test_only_rank_1_saw_it_and_skip_leaves_both_ranks_shards_bitwise_unchanged(runs: dict[str, Any]) -> None:
    run = runs["skip"]
    [event] = events(run)
    assert (event["step"], event["action"], list(event["ratios"])) == (4, "skip", ["1"])
    # Both halves of every tensor (rank 0's and rank 1's) as they were after step 3; step 5 trains again.
    assert_equal(saved(run, 3), saved(run, 4))
    assert not torch.equal(saved(run, 4)["model.output.weight"], saved(run, 5)["model.output.weight"])
    assert run.summary["stability/loss_spikes"] == 1 and run.summary["train/nonfinite_skipped"] == 0


def test_rollback_reloads_the_last_save_and_trains_on_as_a_run_that_never_read_the_window(
    runs: dict[str, Any],
) -> None:
    run, reference = runs["rollback"], runs["reference"]
    spike, rolled = events(run)
    assert (spike["step"], spike["action"]) == (4, "rollback")
    assert rolled == {
        "step": 4,
        "rolled_back": [4, 4],
        "save": str(run.out_dir / "checkpoints" / "step_00000003"),
    }
    assert [r["step"] for r in reference.records] == [1, 2, 3, 5]
    after = {r["step"]: r["loss/train"] for r in run.records if r["step"] > 4}
    assert after == {r["step"]: r["loss/train"] for r in reference.records if r["step"] > 4}  # bitwise
    assert_equal(saved(run, 5), saved(reference, 5))


def test_rollback_without_saves_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    run = run_trainer(tmp_path / "run", *TINY, "stability.spike.action=rollback", "save=off", check=False)
    assert run.returncode == 2 and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert [line for line in run.stderr.splitlines() if line.strip()] == [
        "error: stability.spike.action=rollback reloads the last save: needs save.every >= 1 (save=default), "
        "got save.every=0"
    ]
