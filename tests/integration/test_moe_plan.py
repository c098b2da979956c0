"""A mixture of experts in the memory plan (trainer/plan/moe.py): every rank's measured peak against the plan's,
within 0.5%, for model=tiny-moe (8 experts of width 96, top 2) on 2 CPU ranks, fp32, zero=stage0 (DDP) and
zero=stage3 (FSDP2), parallel.ep=1, at the routing the run had and at a routing a router bias forces.

The plan takes the routing as its input (moe.imbalance: the busiest expert's rows over the mean). A test-only
forcing of the router, or a config key for it, would test a router no run has; instead every point is planned
with the routing its ranks measured (the loads the model's RouterLog holds for each tracked step, per rank and
micro-batch, as the loop hands them to the Meter), and the forced point sets each router's `expert_bias` buffer in
the test so that its routing is exactly known: a bias of 1 on expert 0 (softmax scores differ by less than 1) puts
it first for every token, so it takes every token, 4 x the mean (E / K), the most one expert can take; a bias can
force no share in between (it is the same for every token). Dropless, the saved set is the same whatever the
split; the split shows only in the experts' backward (docs/memory_plan.md, "Mixture of experts").

The points run as tests/integration/test_fp8_plan.py runs its grid: one 2-rank process group trains them in turn
as a job's ranks would (plan_sweep's overrides on a token file, a fresh trainee each, step 1 untracked, steps 2
and 3 each under the MemoryProbe a job's Meter uses), and each is planned with build_plan as its job would.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import (
    assert_plan_holds_peaks,
    compose_config,
    free_port,
    freeze_imports,
    torchrun_env,
)
from trainer.config import TrainConfig
from trainer.plan import build_plan
from trainer.units import GIB

PLAN_BOUND = 0.005
WORLD = 2
TRACKED = (2, 3)
"""plan_sweep's: Adam's state exists from step 2, and the lower of two identical steps is held."""
POINTS = [(zero, routing) for zero in ("stage0", "stage3") for routing in ("routed", "forced")]
FORCED_EXPERT = 0
MOE_TINY = ("model=tiny-moe", "device=cpu", "logger=none", "seq_len=64", "micro_batch=2", "log_every=1")


def point_config(tokens: Path, zero: str) -> TrainConfig:
    """plan_sweep's point (tests/helpers.py plan_sweep_point) on tiny-moe: 3 steps on a token file, fp32."""
    return compose_config(
        *MOE_TINY,
        "save=off",
        "steps=3",
        "telemetry.memory_every=0",
        "data=tokens",
        f"data.path={tokens}",
        "nproc=2",
        "precision=fp32",
        "checkpointing=none",
        f"zero={zero}",
    )


def tracked(config: TrainConfig, world: Any, forced: bool) -> dict[str, Any]:
    """This rank's peak tensor bytes and its routers' loads in each tracked step, trained as a job's rank trains
    (tests/helpers.py tracked_peaks), with every router's bias on FORCED_EXPERT where `forced`."""
    from trainer.data import build_batches
    from trainer.layout import Layout
    from trainer.model.moe import moe_layers
    from trainer.rank.loop import build_trainee, train_step
    from trainer.rank.nonfinite import NonFiniteGuard
    from trainer.telemetry.memory import MemoryProbe

    torch.manual_seed(config.seed)
    trainee = build_trainee(config, world)
    if forced:
        for layer in moe_layers(trainee.model):
            layer.router.expert_bias[FORCED_EXPERT] = 1.0
    layout = Layout.from_config(config, world.world_size)
    batches = build_batches(config, layout.dp_index(world.rank), layout.dp, start_step=0)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, world, fp16=False)
    train_step(trainee, batches, config, world, 1, guard)
    peaks, loads = [], []
    for step in TRACKED:
        probe = MemoryProbe(world.device, memory_every=0, last_step=step)
        with probe.measure(step, trainee.model, trainee.optimizer):
            stats = train_step(trainee, batches, config, world, step, guard)
        peaks.append(probe.read()[probe.fields.index("peak_allocated")])
        loads.append(stats.routing.loads.tolist())
    del trainee
    gc.collect()
    return {"peaks": peaks, "loads": loads}


def worker(rank: int, port: int, out_dir: str, configs: dict[str, TrainConfig]) -> None:
    os.environ.update(torchrun_env(rank, WORLD, port))
    from trainer.world import init_world, shutdown_world

    world = init_world("cpu")
    torch.set_num_threads(1)
    freeze_imports()
    results = {name: tracked(config, world, "forced" in name) for name, config in configs.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown_world()


def imbalance(loads_LE: list[list[int]]) -> float:
    """The busiest expert's rows over the mean, in the worst layer: what the plan takes as moe.imbalance."""
    return max(max(layer) * len(layer) / sum(layer) for layer in loads_LE)


@pytest.fixture(scope="module")
def points(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """(zero, routing) -> the plan.json its job writes at the imbalance its ranks measured, the records of
    steps 2 and 3 (each rank's `memory/rank{r}/peak_allocated_gib`), and the imbalance of each rank and step."""
    out = tmp_path_factory.mktemp("moe_plan")
    tokens = out / "tokens.npy"  # plan_sweep's token file
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    configs = {" ".join(point): point_config(tokens, point[0]) for point in POINTS}
    mp.spawn(worker, args=(free_port(), str(out), configs), nprocs=WORLD)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    found = {}
    for point in POINTS:
        name = " ".join(point)
        measured = [[imbalance(loads) for loads in results[r][name]["loads"]] for r in range(WORLD)]
        config = configs[name]
        config.moe.imbalance = max(max(ranks) for ranks in measured)
        found[point] = {
            "plan": build_plan(config, "cpu", WORLD).to_json(),
            "imbalance": measured,
            "records": [
                {"step": step}
                | {
                    f"memory/rank{r}/peak_allocated_gib": results[r][name]["peaks"][i] / GIB
                    for r in range(WORLD)
                }
                for i, step in enumerate(TRACKED)
            ],
        }
    return found


@pytest.mark.parametrize(("zero", "routing"), POINTS)
def test_each_ranks_peak_is_the_plans_within_half_a_percent(
    points: dict[tuple[str, str], dict[str, Any]], zero: str, routing: str
) -> None:
    point = points[(zero, routing)]
    assert (point["plan"]["zero"], point["plan"]["model"], len(point["plan"]["ranks"])) == (
        zero,
        "tiny-moe",
        WORLD,
    )
    assert_plan_holds_peaks(point, PLAN_BOUND)


@pytest.mark.parametrize("zero", ["stage0", "stage3"])
def test_the_bias_forces_every_token_onto_one_expert(
    points: dict[tuple[str, str], dict[str, Any]], zero: str
) -> None:
    """The forced point's routing is known exactly: every layer of every rank and step sent expert 0 all 128
    tokens of its micro-batch, 4 x the mean of 32 (256 rows over 8 experts), and the plan took that imbalance;
    the run's own routing is uneven (the busiest expert above the mean), and planned as it was."""
    forced = points[(zero, "forced")]
    assert forced["imbalance"] == [[4.0, 4.0]] * WORLD
    assert forced["plan"]["moe"]["imbalance"] == 4.0
    assert forced["plan"]["moe"]["rows_per_expert"] == [128, 19, 19, 18, 18, 18, 18, 18]
    routed = points[(zero, "routed")]
    assert all(1.0 < r <= 4.0 for ranks in routed["imbalance"] for r in ranks), routed["imbalance"]
