"""hpZ (zero.hpz_ranks) under context parallelism: cp=2 x dp=2 on 4 CPU ranks, zero=stage3, fp32, 3 steps.

FSDP2 shards over dp_shard folded with cp (trainer/rank/mesh.py `dp_shard_cp`, 4 ranks) and keeps each block's
secondary shard over `mesh.view(-1, 2)` of that dim from forward to backward: the ranks of one dp index, both cp
ranks (trainer/layout.py `hpz_group`; tests/unit/test_layout.py). Against the same job without hpZ, each run as
plan_sweep runs a point (a token file, steps 2 and 3 tracked): losses within 1e-5; every rank's measured peak
within 0.5% of its plan and to within the cp positions' bytes, hpZ's share of it to the byte; every collective's
bytes in every group equal to the plan's (step 1, whose window holds no metric gather; the loop's own all-reduces
added on the shard group, the default one here, as test_hsdp.py adds them). Two 4-rank jobs, 30 to 40 s together
on this host's 2 shared cores.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tests.helpers import Run, layer_norms_bytes, plan_sweep_point, run_trainer
from trainer.config import ModelConfig
from trainer.plan.states import model_shape
from trainer.units import GIB

# The slow tier, and under every torch the project claims (FSDP2 views a flattened mesh dim: DeviceMesh._flatten)
pytestmark = [pytest.mark.slow, pytest.mark.torch_versions]

WORLD = 4
JOB = (
    *("precision=fp32", "optim.warmup_steps=2", f"nproc={WORLD}"),
    *("parallel.cp=2", "parallel.cp_impl=ulysses", "zero=stage3"),
)
HPZ = "zero.hpz_ranks=2"
PEAK_TOLERANCE = 0.005


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The job without hpZ and with it, one at a time, as plan_sweep runs a point (tests/helpers.py: a token
    file, steps 2 and 3 tracked)."""
    out = tmp_path_factory.mktemp("cp_hpz")
    tokens = out / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    point = plan_sweep_point(tokens)
    return {
        "without": run_trainer(out / "without", *point, *JOB, timeout=600),
        "hpz": run_trainer(out / "hpz", *point, *JOB, HPZ, timeout=600),
    }


def test_losses_equal_the_job_without_hpz(runs: dict[str, Run]) -> None:
    hpz, without = runs["hpz"].losses, runs["without"].losses
    assert len(hpz) == len(without) == 3
    assert max(abs(a - b) for a, b in zip(hpz, without)) < 1e-5, (hpz, without)


def peaks(run: Run) -> list[tuple[int, int]]:
    """Each rank's (planned, measured) peak in bytes, the measured the lower of steps 2 and 3 (plan_sweep's)."""
    ranks = json.loads((run.out_dir / "plan.json").read_text())["ranks"]
    tracked = run.records[1:]
    assert [r["step"] for r in tracked] == [2, 3]
    return [
        (
            round(rank["peak_gib"] * GIB),
            min(round(r[f"memory/rank{rank['rank']}/peak_allocated_gib"] * GIB) for r in tracked),
        )
        for rank in ranks
    ]


def test_every_ranks_peak_is_the_plans(runs: dict[str, Run]) -> None:
    """Within 0.5%, and to within the cp positions' bytes (the int64 indices the model only reads, 752 under
    Ulysses here: test_context_parallel_plan.py holds the same bound)."""
    for name, run in runs.items():
        for rank, (planned, measured) in enumerate(peaks(run)):
            assert abs(planned - measured) / measured < PEAK_TOLERANCE, (name, rank, planned, measured)
            assert -16 <= planned - measured <= 1_280, (name, rank, planned, measured)


def test_the_secondary_shards_share_of_the_peak_is_the_plans(runs: dict[str, Run]) -> None:
    """What hpZ adds to each rank's peak (its blocks' secondary shards held through backward), planned to the byte."""
    for (planned, measured), (planned_without, measured_without) in zip(
        peaks(runs["hpz"]), peaks(runs["without"])
    ):
        assert planned - planned_without == measured - measured_without > 0


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
