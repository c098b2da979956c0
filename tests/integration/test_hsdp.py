"""HSDP (zero.shard_ranks) and hpZ (zero.hpz_ranks) on four CPU ranks, as two "nodes" of two on one host.

One job per configuration (4 gloo ranks on this host's cores are slow: tiny model, 4 steps), each
compared with one 1-rank run of the same global batch (8 sequences): losses within 1e-5 (fp32), the
bytes of every collective in every process group equal to the plan's (step 1, whose window holds
no metric gather), and the measured peak next to the plan's. A save under HSDP then resumes under
1-D stage3 and under HSDP with another shard size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import TINY, Run, layer_norms_bytes, run_trainer
from trainer.config import ModelConfig
from trainer.plan.states import model_shape

STEPS = ("steps=4", "precision=fp32", "optim.warmup_steps=2")
WORLD = 4
CONFIGS = {
    "stage2 HSDP 2x2": ("zero=stage2", "zero.shard_ranks=2"),
    "stage3 HSDP 2x2": ("zero=stage3", "zero.shard_ranks=2", "save.every=2"),
    "stage3 hpZ 4/2": ("zero=stage3", "zero.hpz_ranks=2"),
}
PEAK_TOLERANCE_PCT = 0.5


def job(out_dir: Path, *overrides: str) -> Run:
    return run_trainer(out_dir, *TINY, *STEPS, *overrides, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return job(tmp_path_factory.mktemp("ref") / "run", "nproc=1", "micro_batch=8", "save=off")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One job per configuration, run when a test first asks for it and kept for the module."""
    done: dict[str, Run] = {}

    def run_of(name: str) -> Run:
        if name not in done:
            save = () if "save.every=2" in CONFIGS[name] else ("save=off",)
            out = tmp_path_factory.mktemp("hsdp") / "run"
            done[name] = job(out, f"nproc={WORLD}", *CONFIGS[name], *save)
        return done[name]

    return run_of


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hsdp_run(request: pytest.FixtureRequest, runs: Any) -> tuple[str, Run]:
    return request.param, runs(request.param)


def loop_bytes(group: str, default_group: str) -> dict[str, int]:
    """The loop's own collectives (docs/communication.md) by group: the non-finite and stop agreement
    (world + 2 fp32 flags) and the per-layer norms (a log step) on the default group, clipping's fp32 norm
    per tensor on the shard group."""
    tensors = len(model_shape(ModelConfig()).order)
    extra = 4 * tensors if group == "shard" else 0
    extra += 4 * (WORLD + 2) + layer_norms_bytes() if group == default_group else 0
    return {"all_reduce": extra}


def test_losses_equal_one_rank_of_the_same_global_batch(hsdp_run: tuple[str, Run], reference: Run) -> None:
    name, run = hsdp_run
    assert len(run.losses) == len(reference.losses) == 4
    assert max(abs(a - b) for a, b in zip(run.losses, reference.losses)) < 1e-5, (
        name,
        run.losses,
        reference.losses,
    )


def test_bytes_per_collective_per_group_equal_the_plan(hsdp_run: tuple[str, Run]) -> None:
    name, run = hsdp_run
    groups: dict[str, Any] = json.loads((run.out_dir / "plan.json").read_text())["comm"]["groups"]
    expected_groups = {"shard", "replicate"} if "HSDP" in name else {"shard", "hpz"}
    assert set(groups) == expected_groups
    default_group = "world" if "replicate" in groups else "shard"
    first = run.records[0]
    assert first["step"] == 1
    for rank in range(WORLD):
        for group, planned in groups.items():
            extra = loop_bytes(group, default_group)
            for kind, payload in planned["bytes_by_collective"].items():
                measured = first.get(f"comm/rank{rank}/{group}/{kind}_bytes_per_step", 0)
                assert measured == payload + extra.get(kind, 0), (name, rank, group, kind)
            assert first[f"comm/{group}/predicted_bytes_per_step"] == planned["bytes_per_step"]
    replicate_or_hpz = groups.get("replicate") or groups["hpz"]
    assert replicate_or_hpz["bytes_per_step"] > 0 and replicate_or_hpz["ranks"] == 2


def test_measured_peak_is_the_plans(hsdp_run: tuple[str, Run]) -> None:
    name, run = hsdp_run
    (tracked,) = [r for r in run.records if "memory/prediction_error_pct" in r]
    assert abs(tracked["memory/prediction_error_pct"]) < PEAK_TOLERANCE_PCT, (
        name,
        tracked["memory/prediction_error_pct"],
    )


# ----------------------------------------------------------------------------- resharding a save


@pytest.mark.parametrize(
    "target",
    [
        ("nproc=2", "micro_batch=4", "zero=stage3"),
        ("nproc=2", "micro_batch=4", "zero=stage3", "zero.shard_ranks=1"),
    ],
    ids=["1-D stage3 on 2 ranks", "HSDP 2x1 (shard_ranks=1)"],
)
def test_a_hsdp_save_resumes_under_1d_and_another_shard_size(
    tmp_path: Path, reference: Run, target: tuple[str, ...], runs: Any
) -> None:
    """The step-2 save of the 4-rank HSDP run (2 shard groups of 2) goes on elsewhere: steps 3-4 as the
    uninterrupted run's, within test_resume.py's reshard tolerance (rel 1e-5)."""
    save = runs("stage3 HSDP 2x2").out_dir / "checkpoints" / "step_00000002"
    resumed = job(tmp_path / "run", *target, "save=off", f"resume={save}")
    assert [r["step"] for r in resumed.records] == [3, 4]
    for record, expected in zip(resumed.records, reference.records[2:]):
        assert math.isclose(record["loss/train"], expected["loss/train"], rel_tol=1e-5), (
            record["step"],
            record["loss/train"],
            expected["loss/train"],
        )
