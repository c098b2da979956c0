"""hpZ (zero.hpz_ranks) under context parallelism: cp=2 x dp=2 on 4 CPU ranks, zero=stage3, fp32, 4 steps.

FSDP2 shards over dp_shard folded with cp (trainer/rank/mesh.py `dp_shard_cp`, 4 ranks) and keeps each block's
secondary shard over `mesh.view(-1, 2)` of that dim from forward to backward: the ranks of one dp index, both cp
ranks (trainer/layout.py `hpz_group`; tests/unit/test_layout.py). Against the same job without hpZ: losses within
1e-5, every rank's measured peak within 0.5% of its plan, and every collective's bytes in every group equal to the
plan's (step 1, whose window holds no metric gather; the loop's own all-reduces added on the shard group, the
default one here, as test_hsdp.py adds them). Two 4-rank jobs, 30 to 40 s together on this host's 2 shared cores.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import TINY, Run, layer_norms_bytes, run_trainer
from trainer.config import ModelConfig
from trainer.plan.states import model_shape

# The slow tier, and under every torch the project claims (FSDP2 views a flattened mesh dim: DeviceMesh._flatten)
pytestmark = [pytest.mark.slow, pytest.mark.torch_versions]

WORLD = 4
JOB = (
    *TINY,
    *("steps=4", "precision=fp32", "optim.warmup_steps=2", f"nproc={WORLD}", "save=off"),
    *("parallel.cp=2", "parallel.cp_impl=ulysses", "zero=stage3"),
)
HPZ = "zero.hpz_ranks=2"
PEAK_TOLERANCE = 0.005


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The job without hpZ and with it, one at a time."""
    out = tmp_path_factory.mktemp("cp_hpz")
    return {
        "without": run_trainer(out / "without", *JOB, timeout=600),
        "hpz": run_trainer(out / "hpz", *JOB, HPZ, timeout=600),
    }


def test_losses_equal_the_job_without_hpz(runs: dict[str, Run]) -> None:
    hpz, without = runs["hpz"].losses, runs["without"].losses
    assert len(hpz) == len(without) == 4
    assert max(abs(a - b) for a, b in zip(hpz, without)) < 1e-5, (hpz, without)


def test_every_ranks_peak_is_the_plans(runs: dict[str, Run]) -> None:
    """Step 2's window (the tracked one): each rank's measured peak against its planned one."""
    for name, run in runs.items():
        plan = json.loads((run.out_dir / "plan.json").read_text())
        (tracked,) = [r for r in run.records if "memory/prediction_error_pct" in r]
        for rank in plan["ranks"]:
            measured = tracked[f"memory/rank{rank['rank']}/peak_allocated_gib"]
            assert abs(rank["peak_gib"] - measured) / measured < PEAK_TOLERANCE, (
                name,
                rank["rank"],
                rank["peak_moment"],
                rank["peak_gib"],
                measured,
            )


def loop_bytes(group: str) -> int:
    """The loop's own all-reduces on step 1, on the shard group (every rank, the default group): the
    non-finite and stop agreement (world + 2 fp32 flags), the per-layer norms and clipping's fp32 norm per
    parameter tensor."""
    tensors = len(model_shape(ModelConfig()).order)
    return 4 * (WORLD + 2) + layer_norms_bytes() + 4 * tensors if group == "shard" else 0


def comm_groups(run: Run) -> dict[str, Any]:
    return json.loads((run.out_dir / "plan.json").read_text())["comm"]["groups"]


def test_bytes_per_collective_per_group_equal_the_plan(runs: dict[str, Run]) -> None:
    run = runs["hpz"]
    groups = comm_groups(run)
    assert set(groups) == {"shard", "hpz", "cp"}
    assert groups["hpz"]["ranks"] == 2 and groups["hpz"]["bytes_per_step"] > 0
    first = run.records[0]
    assert first["step"] == 1
    for rank in range(WORLD):
        for group, planned in groups.items():
            for kind, payload in planned["bytes_by_collective"].items():
                extra = loop_bytes(group) if kind == "all_reduce" else 0
                measured = first.get(f"comm/rank{rank}/{group}/{kind}_bytes_per_step", 0)
                assert measured == payload + extra, (rank, group, kind, measured, payload)
            assert first[f"comm/{group}/predicted_bytes_per_step"] == planned["bytes_per_step"]
        total = first[f"comm/rank{rank}/bytes_per_step"]
        named = sum(first.get(f"comm/rank{rank}/{g}/bytes_per_step", 0) for g in groups)
        assert total == named, (rank, total, named)


def test_hpz_moves_backwards_all_gathers_out_of_the_shard_group(runs: dict[str, Run]) -> None:
    """The same bytes in all: stage3 backward's all-gathers leave the 4-rank shard group for the 2-rank hpz
    groups (each gathers from secondary shards half the size of its block)."""
    hpz, without = comm_groups(runs["hpz"]), comm_groups(runs["without"])
    assert set(without) == {"shard", "cp"}
    moved = (
        without["shard"]["bytes_by_collective"]["all_gather"]
        - hpz["shard"]["bytes_by_collective"]["all_gather"]
    )
    assert moved > 0 and hpz["hpz"]["bytes_by_collective"]["all_gather"] > 0
    assert hpz["cp"] == without["cp"]
