"""Expert parallelism under context parallelism: parallel.ep=2 with parallel.cp=2 on 2 CPU ranks (dp = 1, so the ep
group is the cp ranks, ZeRO's group too: trainer/layout.py), tiny-moe, fp32, each rank routing its 32 positions of
both rows (128 rows of 2 choices it sends).

With the routing set by a router bias (tests/integration/test_moe_plan.py says how), every rank's peak is the plan's
to within the cp positions' bytes, and in one step every rank's bytes are the plan's to the byte: the ep group's all-to-alls
(the dispatch's, which the flight recorder books to the group that is ZeRO's, cp's and ep's at once, told apart by
their tensors' dims: trainer/telemetry/comm.py `entry_group`), the cp group's (Ulysses', the same as at ep = 1) and
FSDP2's all-gathers, which leave the experts out. One 2-rank process group trains the points in turn. The losses
against ep = 1 are a whole job's, in tests/integration/test_moe_context_parallel.py.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing as mp

from tests.helpers import free_port
from tests.integration.test_moe_comm import measured
from tests.integration.test_moe_plan import EXACT, imbalance, point_config, tracked, worker
from trainer.config import TrainConfig
from trainer.plan import build_plan
from trainer.units import GIB

pytestmark = (
    pytest.mark.slow
)  # ~16 s of 2-rank runs; tests/unit/telemetry/test_comm.py holds the groups' names

WORLD = 2
POINTS = ("stage3 2 forced none", "stage3 2 balanced full", "stage0 2 forced none")
"""`zero ep routing checkpointing`, each at parallel.cp=2: the routers biased towards experts 0 and 1 (both rank 0's:
it computes every row, twice the mean) or 0 and 4 (one on each rank); at zero=stage0 DDP over the cp ranks."""
CP_POSITIONS = 1_280
"""The bound tests/integration/test_context_parallel_plan.py holds a cp rank's plan to above its measured peak."""
ROWS_SENT = 2 * 32 * 2
"""A rank's rows out: micro_batch 2 x its 64 / 2 positions x top 2."""


def track_both(config: TrainConfig, world: Any, biased: tuple[int, ...]) -> dict[str, Any]:
    """The peaks and loads of the tracked steps (test_moe_plan's), then one step's bytes (test_moe_comm's)."""
    return tracked(config, world, biased) | {"bytes": measured(config, world, biased)}


@pytest.fixture(scope="module")
def points(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("moe_ep_cp")
    tokens = out / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    configs = {}
    for name in POINTS:
        zero, ep, _, mode = name.split()
        configs[name] = point_config(tokens, zero, ep, mode, extra=("parallel.cp=2",))
    mp.spawn(worker, args=(free_port(), str(out), configs, WORLD, track_both), nprocs=WORLD)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    found = {}
    for name, config in configs.items():
        measured_imbalance = [
            imbalance(loads, 2) for r in range(WORLD) for loads in results[r][name]["loads"]
        ]
        config.moe.imbalance = max(measured_imbalance)
        found[name] = {
            "plan": build_plan(config, "cpu", WORLD).to_json(),
            "imbalance": measured_imbalance,
            "peaks": [results[r][name]["peaks"] for r in range(WORLD)],
            "bytes": [results[r][name]["bytes"] for r in range(WORLD)],
        }
    return found


@pytest.mark.parametrize("name", POINTS)
def test_each_ranks_peak_is_the_plans_to_the_cp_positions_bytes(
    points: dict[str, dict[str, Any]], name: str
) -> None:
    """At or above the measured peak by no more than the cp positions' bytes (the int64 indices the model only reads,
    which the tracker does not see: 752-756 B here, as test_context_parallel_plan.py holds the same bound; without
    cp the ep points are to EXACT bytes below)."""
    point = points[name]
    assert point["imbalance"] == [2.0 if "forced" in name else 1.0] * len(point["imbalance"])
    assert (point["plan"]["moe"]["ep"], point["plan"]["zero"]) == (2, name.split()[0])
    for rank in point["plan"]["ranks"]:
        planned, measured_peak = round(rank["peak_gib"] * GIB), min(point["peaks"][rank["rank"]])
        assert -EXACT <= planned - measured_peak <= CP_POSITIONS, (
            rank["rank"],
            rank["peak_moment"],
            planned,
            point["peaks"],
        )


@pytest.mark.parametrize("name", POINTS)
def test_each_ranks_all_to_alls_and_gathers_are_the_plans(
    points: dict[str, dict[str, Any]], name: str
) -> None:
    """Per layer and forward the counts (8 x E bytes) and two row exchanges, per backward two, each booked at
    max(A, R) x D x 4 bytes: A = 128 rows a rank sends, R = 256 its experts receive on rank 0 when forced, 0 on rank
    1, 128 each balanced; under checkpointing=full every forward twice. cp's all-to-alls are Ulysses' own."""
    point = points[name]
    groups = point["plan"]["comm"]["groups"]
    layers, counts, width = 4, 8 * 8, 128 * 4
    forwards = 2 * layers if "full" in name else layers
    received = [256, 0] if "forced" in name else [128, 128]
    for rank in range(WORLD):
        rows = max(ROWS_SENT, received[rank]) * width
        expected = forwards * (counts + 2 * rows) + layers * 2 * rows
        assert groups["ep"]["bytes_by_collective_per_rank"][rank]["all_to_all"] == expected
        got = point["bytes"][rank]
        assert got["ep:all_to_all"] == expected, (name, rank)
        assert got["cp:all_to_all"] == groups["cp"]["bytes_by_collective"]["all_to_all"], (name, rank)
        if "stage3" in name:
            assert got["shard:all_gather"] == groups["shard"]["bytes_by_collective"]["all_gather"], (
                name,
                rank,
            )
