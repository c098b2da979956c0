"""Expert parallelism's communication (parallel.ep=2 on 2 CPU ranks, tiny-moe, fp32, zero=stage3): every rank's
all-to-all bytes per step, read from c10d's flight recorder as telemetry reads them (trainer/telemetry/comm.py:
the window's entries, their group by `group_names`), equal the plan's for that rank (plan.json's
`comm.groups.ep.bytes_by_collective_per_rank`), to the byte; and FSDP2's shard group moves what the plan says
with the expert weights left out (trainer/rank/experts.py).

A rank's all-to-all bytes depend on the rows its experts receive, so each point's routing is set by a router bias
in the test, as tests/integration/test_moe_plan.py sets it, and planned at the imbalance that routing is: experts
0 and 4 take every token (one on each rank: each rank's experts receive the mean group's rows, moe.imbalance=1),
or experts 0 and 1 (both on rank 0: it receives every row, twice the mean, moe.imbalance=2), the latter also
under checkpointing=full (every block's recompute dispatches again). One 2-rank process group trains the points
in turn (a fresh trainee each, step 1 to settle, step 2 read), as a job's ranks would.
"""

from __future__ import annotations

import gc
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import biased_trainee, compose_config, free_port, freeze_imports, torchrun_env
from trainer.config import TrainConfig
from trainer.plan import build_plan, model_shape
from trainer.plan.moe import expert_shapes

WORLD = 2
POINTS = {
    "balanced": ((0, 4), 1.0, "none"),
    "forced": ((0, 1), 2.0, "none"),
    "forced full": ((0, 1), 2.0, "full"),
}
"""name -> (the experts the routers are biased towards, the imbalance that routing is, checkpointing)."""
DDP_POINTS = {
    "stage0 balanced": ((0, 4), 1.0, "none"),
    "stage0 forced": ((0, 1), 2.0, "none"),
}
"""The same routings at zero=stage0: DDP, which leaves the experts out of its buckets (trainer/rank/experts.py)."""


def point_config(tokens: Path, imbalance: float, checkpointing: str, zero: str = "stage3") -> TrainConfig:
    return compose_config(
        "model=tiny-moe",
        "device=cpu",
        "logger=none",
        "seq_len=64",
        "micro_batch=2",
        "save=off",
        "steps=3",
        "data=tokens",
        f"data.path={tokens}",
        "nproc=2",
        "precision=fp32",
        f"zero={zero}",
        "parallel.ep=2",
        f"moe.imbalance={imbalance}",
        f"checkpointing={checkpointing}",
    )


def measured(config: TrainConfig, world: Any, biased: tuple[int, ...]) -> dict[str, float]:
    """This rank's bytes by group and collective in step 2 (the window after step 1), as telemetry books them."""
    from trainer.rank.loop import train_step
    from trainer.telemetry.comm import WindowReader, group_names, window_figures

    trainee, batches, guard = biased_trainee(config, world, biased)
    reader = WindowReader()  # from here on
    train_step(trainee, batches, config, world, 2, guard)
    default, descriptions = group_names(config, world.world_size)
    figures = window_figures(reader.take(), default, None, descriptions)
    del trainee
    gc.collect()
    return {key: value for key, value in figures.items() if ":" in key and value}


def worker(
    rank: int, port: int, out_dir: str, configs: dict[str, TrainConfig], biased: dict[str, tuple[int, ...]]
) -> None:
    os.environ.update(torchrun_env(rank, WORLD, port))
    os.environ["TORCH_FR_BUFFER_SIZE"] = "4096"  # every collective of a step (trainer/telemetry/comm.py)
    from trainer.world import init_world, shutdown_world

    world = init_world("cpu")
    torch.set_num_threads(1)
    freeze_imports()
    results = {name: measured(config, world, biased[name]) for name, config in configs.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown_world()


def run_points(
    out: Path, points: dict[str, tuple[tuple[int, ...], float, str]], zero: str
) -> dict[str, dict[str, Any]]:
    """name -> the plan.json its job writes (comm) and each rank's measured bytes by `group:collective`."""
    tokens = out / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    configs = {
        name: point_config(tokens, imbalance, mode, zero) for name, (_, imbalance, mode) in points.items()
    }
    biased = {name: point[0] for name, point in points.items()}
    mp.spawn(worker, args=(free_port(), str(out), configs, biased), nprocs=WORLD)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {
        name: {
            "config": configs[name],
            "plan": build_plan(configs[name], "cpu", WORLD).to_json(),
            "measured": [results[r][name] for r in range(WORLD)],
        }
        for name in points
    }


@pytest.fixture(scope="module")
def points(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_points(tmp_path_factory.mktemp("moe_comm"), POINTS, "stage3")


@pytest.fixture(scope="module")
def ddp_points(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_points(tmp_path_factory.mktemp("moe_comm_ddp"), DDP_POINTS, "stage0")


@pytest.mark.parametrize("name", sorted(POINTS))
def test_each_ranks_all_to_all_bytes_are_the_plans(points: dict[str, dict[str, Any]], name: str) -> None:
    """Per layer and forward the counts (8 x E bytes each way) and two row exchanges, per backward two, each
    booked at max(A, R) x D x 4 bytes (A = 256 rows a rank sends, R its experts receive): balanced 2,097,408
    bytes on each rank; forced 4,194,560 on rank 0 (R = 512) and 2,097,408 on rank 1 (R = 0: it sends its 256);
    under checkpointing=full every block's forward twice."""
    point = points[name]
    ep = point["plan"]["comm"]["groups"]["ep"]
    assert ep["ranks"] == WORLD and ep["link"] == "intra-node"
    per_rank = ep["bytes_by_collective_per_rank"]
    for rank in range(WORLD):
        assert point["measured"][rank].get("ep:all_to_all") == per_rank[rank]["all_to_all"], (name, rank)
        assert {k for k in point["measured"][rank] if k.startswith("ep:")} == {"ep:all_to_all"}
    layers, rows_bytes, counts = 4, 256 * 128 * 4, 8 * 8
    forwards = 2 * layers if "full" in name else layers
    idle = forwards * (counts + 2 * rows_bytes) + layers * 2 * rows_bytes
    busy = forwards * (counts + 4 * rows_bytes) + layers * 4 * rows_bytes
    expected = [idle, idle] if name == "balanced" else [busy, idle]
    assert [r["all_to_all"] for r in per_rank] == expected


@pytest.mark.parametrize("name", sorted(POINTS))
def test_fsdp2_gathers_and_reduces_no_expert_weight(points: dict[str, dict[str, Any]], name: str) -> None:
    """The shard group's all-gathers are the plan's to the byte (the blocks' and the root's parameters without the
    experts': forward, and stage3's backward, whose gather a checkpointed block's recompute reads too); its
    all-reduces (gloo's reduce-scatter) the plan's plus the loop's own: the non-finite agreement (world + 2 fp32
    flags) and clipping's fp32 norm per parameter tensor; no all-to-all is left in it."""
    point = points[name]
    shard = point["plan"]["comm"]["groups"]["shard"]["bytes_by_collective"]
    loop = 4 * (WORLD + 2) + 4 * len(model_shape(point["config"].model).order)
    for rank in range(WORLD):
        got = point["measured"][rank]
        assert got["shard:all_gather"] == shard["all_gather"], (name, rank)
        assert got["shard:all_reduce"] == shard["all_reduce"] + loop, (name, rank)
        assert not any(key.startswith("shard:all_to_all") for key in got)


@pytest.mark.slow  # ~13 s of 2-rank runs (measured): the default tier is at its budget
@pytest.mark.parametrize("name", sorted(DDP_POINTS))
def test_under_ddp_the_ep_groups_all_to_all_and_the_buckets_all_reduce_are_the_plans(
    ddp_points: dict[str, dict[str, Any]], name: str
) -> None:
    """zero=stage0: the ep group is DDP's (every rank), and its all-to-alls are the plan's to the byte, as under
    FSDP2 (the same rows move); DDP's all-reduce is the plan's, the buckets of every parameter but the experts',
    plus the loop's own: the non-finite agreement (world + 2 fp32 flags) and the gradient norm's all-reduce over
    the experts' DTensor gradients, one fp32 norm per expert tensor (trainer/rank/optim.py `mixed_norm`). (DDP's
    broadcast of the routers' buffers before each forward, which the plan leaves out at ep = 1 too, is not held
    here.)"""
    point = ddp_points[name]
    groups = point["plan"]["comm"]["groups"]
    per_rank = groups["ep"]["bytes_by_collective_per_rank"]
    assert groups["ep"]["ranks"] == WORLD and "shard" not in groups
    layers, rows_bytes, counts = 4, 256 * 128 * 4, 8 * 8
    idle = layers * (counts + 2 * rows_bytes) + layers * 2 * rows_bytes
    busy = layers * (counts + 4 * rows_bytes) + layers * 4 * rows_bytes
    assert [r["all_to_all"] for r in per_rank] == ([idle, idle] if "balanced" in name else [busy, idle])
    shape = model_shape(point["config"].model)
    experts = 4 * layers * sum(math.prod(s) for s in expert_shapes(point["config"].model))
    assert groups["world"]["bytes_by_collective"]["all_reduce"] == 4 * shape.num_params - experts
    for rank in range(WORLD):
        got = point["measured"][rank]
        assert got.get("ep:all_to_all") == per_rank[rank]["all_to_all"], (name, rank)
        loop = 4 * (WORLD + 2) + 4 * layers * len(expert_shapes(point["config"].model))
        assert got["world:all_reduce"] == groups["world"]["bytes_by_collective"]["all_reduce"] + loop, (
            name,
            rank,
        )
