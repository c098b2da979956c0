"""parallel.tp x precision=fp8 (torchao's emulated Float8Linear under the column- and row-wise layouts) on 2 CPU
ranks: every rank's measured peak within 0.5% of the plan where it used to miss by 8-13%, with checkpointing=full
and sequence parallelism (the plan's fp8 cast of w2's saved input beside the all-gathered output gradient,
trainer/plan/fp8_backward.py), at zero=stage0 (tensor-parallel walk, autocast) and zero=stage3 (FSDP2's walk, bf16).

One 2-rank process group trains both points in turn, as tests/integration/test_fp8_plan.py does: a fresh
trainee each, step 1 untracked, steps 2 and 3 each under the MemoryProbe a job's Meter uses; the lower of the
two is the rank's peak (tests/helpers.py assert_plan_holds_peaks says why). The same group then trains the
same 4 sequences a step at tp=2 (grad_accum=2) and at tp=1 (2 data-parallel ranks), fp8 both, for the losses.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import TINY, compose_config, free_port, freeze_imports, torchrun_env, tracked_peaks
from trainer.config import TrainConfig
from trainer.layout import Layout
from trainer.plan import build_plan

pytest.importorskip("torchao")
BOUND = 0.005
WORLD = 2
pytestmark = (
    pytest.mark.slow
)  # about 35 s of 2-rank runs (a clean-clone CI, 2026-12-06): .ci/run runs the slow tier
LOSS_BOUND = 5e-3
"""tp=2 against tp=1, fp8 both, relative, every step: fp8's documented bound (within 0.5% of bf16,
docs/memory_plan.md "fp8"; tests/integration/test_fp8.py LOSS_BOUND). Measured: 1.7e-5 at step 1, then up to
5.4e-4 by step 4 (where the layouts part is not traced here)."""
PARITY = {"tp2": ("parallel.tp=2", "grad_accum=2"), "tp1": ("parallel.tp=1", "grad_accum=1")}
POINTS = {
    "stage0 tensorwise": ("zero=stage0", "precision.fp8_recipe=tensorwise"),
    "stage3 rowwise": ("zero=stage3", "precision.fp8_recipe=rowwise"),
}


def point_config(name: str) -> TrainConfig:
    tiny = [arg for arg in TINY if not arg.startswith("seq_len")]
    return compose_config(
        *tiny, "seq_len=256", "save=off", "steps=3", "nproc=2", "parallel.tp=2", "precision=fp8",
        "precision.fp8_filter=all", "checkpointing=full", *POINTS[name],
    )  # fmt: skip


def step_losses(config: TrainConfig, world: Any, steps: int) -> list[float]:
    """The job's logged loss of each step: every rank's mean (tensor-parallel ranks hold the same loss)."""
    from trainer.data import build_batches
    from trainer.rank.loop import build_trainee, train_step
    from trainer.rank.nonfinite import NonFiniteGuard

    torch.manual_seed(config.seed)
    trainee = build_trainee(config, world)
    layout = Layout.from_config(config, world.world_size)
    batches = build_batches(config, layout.dp_index(world.rank), layout.dp, start_step=0)  # as the loop reads
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, world, fp16=False)
    losses = []
    for step in range(1, steps + 1):
        loss = train_step(trainee, batches, config, world, step, guard).loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world.world_size)
    del trainee
    gc.collect()
    return losses


def parity_config(name: str) -> TrainConfig:
    return compose_config(
        *TINY, "save=off", "steps=4", "nproc=2", "precision=fp8", "precision.fp8_filter=all", *PARITY[name]
    )


def worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(torchrun_env(rank, WORLD, port))
    from trainer.world import init_world, shutdown_world

    world = init_world("cpu")
    torch.set_num_threads(1)
    freeze_imports()
    peaks = {name: tracked_peaks(point_config(name), world) for name in POINTS}
    losses = {name: step_losses(parity_config(name), world, 4) for name in PARITY}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({**peaks, **losses}))
    shutdown_world()


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[float]]]:
    out = tmp_path_factory.mktemp("tp_fp8")
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=WORLD)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", sorted(POINTS))
def test_every_ranks_peak_is_the_plans_within_half_a_percent(
    measured: list[dict[str, list[float]]], name: str
) -> None:
    plan = build_plan(point_config(name), "cpu", WORLD)
    for rank in plan.ranks:
        got = min(measured[rank.rank][name])
        assert abs(rank.peak.total - got) / got < BOUND, (
            f"rank {rank.rank}: planned {rank.peak.total} at {rank.peak.name}, measured {got} "
            f"({(rank.peak.total - got) / got:+.2%})"
        )


def test_tensor_parallel_fp8_loses_what_data_parallel_fp8_loses(
    measured: list[dict[str, list[float]]],
) -> None:
    tp2, tp1 = measured[0]["tp2"], measured[0]["tp1"]
    assert len(tp2) == len(tp1) == 4 and tp2[-1] < tp2[0]
    for step, (got, want) in enumerate(zip(tp2, tp1), start=1):
        assert abs(got - want) <= LOSS_BOUND * abs(want), f"step {step}: {got} vs {want}"
