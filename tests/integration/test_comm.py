"""Measured communication equals the plan's, for every stage, precision, grad_accum and reduce_every (2 gloo ranks).

One 2-rank process group runs every configuration in turn (a fresh trainee each, one warm-up
step, then one measured step read back from c10d's flight recorder exactly as the Meter reads
it), so 20 configurations cost one process group. Rank 0 writes what it measured to a JSON file
the tests below read.
"""

from __future__ import annotations

import gc
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import free_port, freeze_imports, torchrun_env
from trainer.config import (
    DeviceKind,
    DType,
    PrecisionConfig,
    ReduceDType,
    ReduceEvery,
    Stage,
    TrainConfig,
    ZeroConfig,
)
from trainer.plan.comm import plan_comm
from trainer.plan.states import model_shape
from trainer.telemetry.comm import WindowReader, window_figures

STAGES = ("stage0", "stage1", "stage2", "stage3")
WORLD = 2
LOSS_STEPS = 20
DEBUG_CASE = ("stage1", "fp32", 1, "fp32", "step")


def make_config(
    stage: str,
    precision: str,
    grad_accum: int,
    reduce_dtype: str = "fp32",
    reduce_every: str = "step",
    reshard_after_backward: bool = True,
    steps: int = 3,
) -> TrainConfig:
    dtype = {"fp32": DType.float32, "bf16": DType.bfloat16}[precision]
    zero = ZeroConfig(
        stage=Stage(stage),
        reduce_dtype=ReduceDType(reduce_dtype),
        reduce_every=ReduceEvery(reduce_every),
        reshard_after_backward=reshard_after_backward,
    )
    return TrainConfig(
        precision=PrecisionConfig(name=precision, compute_dtype=dtype),
        zero=zero,
        micro_batch=2,
        seq_len=16,
        grad_accum=grad_accum,
        steps=steps,
        device=DeviceKind.cpu,
        nproc=str(WORLD),
        log_every=1,  # the flight recorder is sized for one log window of this many steps (trainer/telemetry/comm.py)
    )


CASES = [(s, p, a, "fp32", "step") for s in STAGES for p in ("fp32", "bf16") for a in (1, 2)]
CASES += [(s, p, 1, "bf16", "step") for s in ("stage2", "stage3") for p in ("fp32", "bf16")]
# zero.reduce_every=micro_batch: every micro-batch's backward reduces (DDP all-reduce, FSDP2 reduce-scatter)
CASES += [(s, "fp32", 2, "fp32", "micro_batch") for s in STAGES] + [
    ("stage3", "bf16", 2, "bf16", "micro_batch")
]
# zero.reshard_after_backward=false: the second micro-batch's forward gathers nothing
KEPT = [(s, "fp32", 2, "fp32", "micro_batch", False) for s in ("stage2", "stage3")]
KEPT += [("stage3", "bf16", 2, "bf16", "micro_batch", False), ("stage2", "bf16", 2, "fp32", "step", False)]
CASES += KEPT
Case = tuple  # stage, precision, grad_accum, reduce_dtype, reduce_every[, reshard_after_backward]


def key(case: Case) -> str:
    kept = " reshard_after_backward=false" if case[5:] == (False,) else ""
    return "{} precision={} grad_accum={} reduce_dtype={} reduce_every={}".format(*case[:5]) + kept


def run_case(
    config: TrainConfig, world: Any, measure_steps: int, count_collectives: bool = False
) -> dict[str, Any]:
    """`measure_steps` recorded steps; under DDP after two warm-up steps (the second rebuilds the
    buckets in the order gradients arrived, broadcasting their int32 indices once)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from trainer.data import build_batches
    from trainer.rank.loop import build_trainee, train_step
    from trainer.rank.nonfinite import NonFiniteGuard

    torch.manual_seed(config.seed)
    trainee = build_trainee(config, world)
    batches = build_batches(config, world.rank, world.world_size, start_step=0)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, world, fp16=config.precision.is_fp16)
    first = 1 if config.zero.uses_fsdp else 3
    for step in range(1, first):
        train_step(trainee, batches, config, world, step, guard)
    reader = WindowReader()  # from here on, as the Meter does after building the trainee
    losses, counted = [], None
    for step in range(first, first + measure_steps):
        if count_collectives and step == first:
            with CommDebugMode() as mode:
                losses.append(train_step(trainee, batches, config, world, step, guard).loss.item())
            counted = mode.get_total_counts()
        else:
            losses.append(train_step(trainee, batches, config, world, step, guard).loss.item())
    entries = reader.take()
    result = {
        "figures": window_figures(entries),
        "calls": len(entries or []),
        "losses": losses,
        "debug_counts": counted,
    }
    del trainee
    gc.collect()
    return result


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(torchrun_env(rank, WORLD, port))
    from trainer.telemetry.comm import enable_recording
    from trainer.world import init_world, shutdown_world

    # the most collectives per step: every parameter broadcast, and the all-reduces of both micro-batches
    enable_recording(make_config("stage1", "fp32", 2, reduce_every="micro_batch"), WORLD, "cpu")
    world = init_world("cpu")
    freeze_imports()
    results: dict[str, Any] = {}
    for case in CASES:
        results[key(case)] = run_case(
            make_config(*case), world, measure_steps=1, count_collectives=case == DEBUG_CASE
        )
    for reduce_dtype in ("fp32", "bf16"):
        config = make_config("stage3", "bf16", 1, reduce_dtype, steps=LOSS_STEPS)
        results[f"losses reduce_dtype={reduce_dtype}"] = run_case(config, world, measure_steps=LOSS_STEPS)[
            "losses"
        ]
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    shutdown_world()


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("comm") / "measured.json"
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=WORLD)
    return json.loads(out.read_text())


def loop_bytes(config: TrainConfig) -> int:
    """The loop's own collectives in a step without a log (docs/communication.md): the non-finite and
    stop agreement (N + 2 fp32 flags) and, on FSDP2's DTensors, clipping's all-reduce of one fp32 norm per tensor."""
    tensors = len(model_shape(config.model).order)
    return 4 * (WORLD + 2) + (4 * tensors if config.zero.uses_fsdp else 0)


@pytest.mark.parametrize("case", CASES, ids=key)
def test_measured_bytes_are_the_plans(measured: dict[str, Any], case: Case) -> None:
    """Acceptance 1: every kind of collective as planned; all-reduce over by the loop's scalars only."""
    config = make_config(*case)
    planned = plan_comm(config, WORLD, backend="gloo").bytes_by_collective
    got = measured[key(case)]["figures"]
    for kind in ("all_gather", "reduce_scatter", "broadcast"):
        assert got[kind] == planned[kind], kind
    assert got["all_reduce"] - planned["all_reduce"] == loop_bytes(config)
    assert got["other"] == 0


def test_bf16_reduction_halves_the_gradient_bytes(measured: dict[str, Any]) -> None:
    """Acceptance 3: stage2/3 with zero.reduce_dtype=bf16 reduce half the bytes of fp32 (on gloo:
    the all-reduce FSDP2's reduce-scatter becomes, less the loop's fp32 scalars)."""
    for stage in ("stage2", "stage3"):
        for precision in ("fp32", "bf16"):
            scalars = loop_bytes(make_config(stage, precision, 1))
            fp32, bf16 = (
                measured[key((stage, precision, 1, r, "step"))]["figures"]["all_reduce"] - scalars
                for r in ("fp32", "bf16")
            )
            assert bf16 * 2 == fp32 > 0, (stage, precision)


@pytest.mark.parametrize("stage", STAGES)
def test_reducing_every_micro_batch_moves_the_gradient_once_per_micro_batch(
    measured: dict[str, Any], stage: str
) -> None:
    """Acceptance 5: with grad_accum=2, zero.reduce_every=micro_batch moves twice step's gradient
    bytes (on gloo: all-reduce, less the loop's scalars) and the same of everything else."""
    scalars = loop_bytes(make_config(stage, "fp32", 2))
    step, every = (measured[key((stage, "fp32", 2, "fp32", e))]["figures"] for e in ("step", "micro_batch"))
    assert every["all_reduce"] - scalars == 2 * (step["all_reduce"] - scalars) > 0
    assert (every["all_gather"], every["broadcast"]) == (step["all_gather"], step["broadcast"])


@pytest.mark.parametrize("case", KEPT, ids=key)
def test_keeping_parameters_gathers_one_forward_per_step(measured: dict[str, Any], case: Case) -> None:
    """zero.reshard_after_backward=false with grad_accum=2: stage2 gathers half the bytes (one forward's
    instead of two); stage3 one forward's less of four passes' (two forwards, two backwards), the root
    included; the reductions are the same."""
    kept, default = (measured[key((*case[:5], r))]["figures"] for r in (False, True))
    if case[0] == "stage2":
        assert 2 * kept["all_gather"] == default["all_gather"] > 0
    else:
        config = make_config(*case)
        root = sum(math.prod(s) for s in model_shape(config.model).root)
        block = sum(math.prod(s) for s in model_shape(config.model).block)
        width = 4 if case[1] == "fp32" else 2
        saved = width * (
            root + config.model.n_layers * block
        )  # the tiny model's dims divide by 2: no padding
        assert default["all_gather"] - kept["all_gather"] == saved > 0
    assert kept["all_reduce"] == default["all_reduce"]


def test_bf16_reduction_keeps_the_losses_within_2_percent(measured: dict[str, Any]) -> None:
    """Acceptance 3: over 20 steps of stage3 bf16 the losses with bf16 reduction stay within 2% of fp32's."""
    fp32, bf16 = measured["losses reduce_dtype=fp32"], measured["losses reduce_dtype=bf16"]
    assert len(fp32) == len(bf16) == LOSS_STEPS
    assert fp32[-1] < fp32[0]  # it learns
    assert max(abs(b - f) / f for f, b in zip(fp32, bf16)) < 0.02


def test_the_flight_recorder_sees_every_collective_commdebugmode_counts(measured: dict[str, Any]) -> None:
    """Cross-check with torch's CommDebugMode (too slow for training, fine for one step): the
    recorder holds one entry per collective it counted."""
    result = measured[key(DEBUG_CASE)]
    assert result["debug_counts"] == result["calls"] > 0
