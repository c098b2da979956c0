"""The plan's bytes of gradient compression and local SGD (trainer/plan/comm.py), against the rules of
torch's powerSGD_hook and our TopK hook worked by hand on the tiny model."""

from __future__ import annotations

import dataclasses
import math

import pytest

from trainer.config import Compression, DeviceKind, ReduceEvery, TrainConfig, ZeroConfig
from trainer.plan.activations import activations
from trainer.plan.comm import plan_comm, powersgd_elements, topk_count
from trainer.plan.ddp_walk import hook_state
from trainer.plan.schedule import StepSchedule
from trainer.plan.states import model_shape


def config(**zero: object) -> TrainConfig:
    return TrainConfig(zero=ZeroConfig(**zero), device=DeviceKind.cpu, nproc="2")


def test_powersgd_compresses_a_matrix_only_where_it_pays_twice() -> None:
    rank1 = ZeroConfig(compression=Compression.powersgd, powersgd_rank=1)
    assert powersgd_elements((512, 128), rank1) == 512 + 128  # P (512 x 1) and Q (128 x 1)
    assert powersgd_elements((128,), rank1) == 128  # 1-D: n x 1, (n + 1) * 2 > n: sent whole
    at_par = ZeroConfig(compression=Compression.powersgd, powersgd_rank=32)
    assert (
        powersgd_elements((128, 128), at_par) == 128 * 128
    )  # 256 * 32 * 2 = 128 * 128: not below, sent whole
    assert powersgd_elements((128, 128), ZeroConfig(powersgd_rank=31)) == 256 * 31


def test_topk_sends_at_least_one_element_of_each_gradient() -> None:
    assert (topk_count(128, 0.01), topk_count(65536, 0.01), topk_count(10, 1.0)) == (2, 656, 10)


def test_topk_gathers_values_and_indices_from_every_rank() -> None:
    shapes = model_shape(config().model).order
    sent = sum(math.ceil(0.01 * math.prod(s)) for s in shapes)
    planned = plan_comm(config(compression=Compression.topk), 2, backend="gloo").bytes_by_collective
    assert planned == {
        "all_reduce": 0,
        "all_gather": 2 * 8 * sent,
        "reduce_scatter": 0,
        "broadcast": 0,
        "all_to_all": 0,
    }


def test_local_sgd_plans_the_parameter_average_spread_over_its_period() -> None:
    exact = plan_comm(config(), 2, backend="gloo").bytes_by_collective["all_reduce"]
    local = plan_comm(config(sync_every=4), 2, backend="gloo").bytes_by_collective["all_reduce"]
    assert 4 * local == exact == 4 * model_shape(config().model).num_params


def test_the_memory_each_method_holds_by_hand() -> None:
    """The tiny model (dim 128, 4 blocks, 2 of 4 heads for k and v, ffn 384, vocab 512; 918,656
    parameters): TopK keeps a fp32 residual of every gradient, and its hook's dense result until the next
    backward; PowerSGD at rank 2 keeps its error feedback of every gradient plus P and Q of every matrix
    (per block wq, wo 128x128, wk, wv 64x128, w1, w3 384x128, w2 128x384; the embedding and head 512x128:
    (n + m) * 2 each; the norms are not compressed); local SGD averages a flat fp32 copy of the parameters."""
    from trainer.plan import build_plan

    numel = 918_656
    per_block = (256 + 192 + 192 + 256 + 512 + 512 + 512) * 2
    p_and_q = 4 * (4 * per_block + 2 * 640 * 2)
    assert p_and_q == 88_064
    shape = model_shape(config().model)
    assert shape.num_params == numel
    assert (
        hook_state(ZeroConfig(compression=Compression.powersgd, powersgd_rank=2), shape)
        == 4 * numel + p_and_q
    )
    assert hook_state(ZeroConfig(compression=Compression.topk), shape) == 4 * numel
    assert hook_state(ZeroConfig(sync_every=4), shape) == hook_state(ZeroConfig(), shape) == 0

    def moments(**zero: object) -> dict[str, int]:
        return {m.name: m.total for m in build_plan(config(**zero), "cpu", 2).ranks[0].moments}

    none, topk = moments(), moments(compression=Compression.topk)
    assert topk["forward: last block"] - none["forward: last block"] == 4 * numel
    assert topk["optimizer step"] - none["optimizer step"] == 8 * numel
    average = {m.name: m for m in build_plan(config(sync_every=4), "cpu", 2).ranks[0].moments}
    parts = average["local SGD: parameter average"].parts
    # at rest: fp32 parameters, gradients and Adam's two moments (16 bytes a parameter), and the flat copy
    assert (parts["params"] + parts["grads"] + parts["optimizer"], parts["temporary"]) == (
        16 * numel,
        4 * numel,
    )


def test_powersgds_hook_holds_a_copy_of_its_bucket_and_the_new_error_by_hand() -> None:
    """The tiny model's gradients, ready in reverse order, fill DDP's 1 MiB first bucket with the head
    (65,536), the final norm and the last block (262,528 elements, 3 norms uncompressed), the other
    with the rest (656,128, 6 norms). While its hook works on a bucket of B with U uncompressed,
    PowerSGD holds 4 * (2B + U) bytes more: the last bucket's at the end of backward, the first's at the
    end of the last block's backward, its wq gradient being the bucket's last: then the blocks below keep
    their saved sets, the last one its attention norm's (8·D + 4 per token) and the norm's output (4·D),
    beside two B·T·D fp32 gradients. (DDP's own first bucket, measured, leaves out the last block's
    attention norm: 262,400 and 656,256 elements, 4 * (2B + U) = 2,100,224 and 5,253,632 bytes at its two hooks.)"""
    from trainer.plan import build_plan

    compressed = config(compression=Compression.powersgd, powersgd_rank=2)
    moments = {m.name: m for m in build_plan(compressed, "cpu", 2).ranks[0].moments}
    last = moments["backward: embedding + PowerSGD hook"].total - moments["backward: embedding"].total
    assert last == 4 * (2 * 656_128 + 768) == 5_252_096
    end = moments["backward: end of block 3 + PowerSGD hook"].parts
    tokens, dim = compressed.micro_batch * compressed.seq_len, compressed.model.dim
    assert end["temporary"] - 2 * 4 * tokens * dim == 4 * (2 * 262_528 + 384) == 2_101_760
    acts = activations(compressed, "cpu")
    assert end["activations"] == sum(acts.blocks[:3]) + acts.batch + (12 * dim + 4) * tokens


def test_the_steps_before_powersgd_starts_are_planned_as_exact_all_reduces() -> None:
    """trainer/plan/schedule.py: zero.powersgd_start_step=2 reductions exact (steps 1-2; with grad_accum=2
    reducing every micro-batch, step 1's two), then compressed; the plan's peak from the step after the first
    compressed one (the error feedback exists when it starts)."""
    exact = plan_comm(config(), 2, backend="gloo").total
    compressed = config(compression=Compression.powersgd, powersgd_start_step=2)
    schedule = StepSchedule.of(compressed, 2, backend="gloo")
    assert schedule.steady == plan_comm(compressed, 2, backend="gloo").total < exact / 10
    assert [schedule.bytes_at(n) for n in (1, 2, 3, 9)] == [exact, exact, schedule.steady, schedule.steady]
    assert [schedule.holds_peak(n) for n in (1, 2, 3, 4, 9)] == [False, False, False, True, True]
    assert schedule.mean_bytes(2, 5) == (exact + 3 * schedule.steady) / 4
    accumulating = dataclasses.replace(
        compressed,
        grad_accum=2,
        zero=dataclasses.replace(compressed.zero, reduce_every=ReduceEvery.micro_batch),
    )
    twice = StepSchedule.of(accumulating, 2, backend="gloo")
    assert twice.bytes_at(1) == 2 * exact and twice.bytes_at(2) == twice.steady
    assert StepSchedule.of(config(), 2, backend="gloo").uniform


def test_local_sgd_plans_its_warmup_and_each_average_on_its_own_step() -> None:
    """zero.sync_every=4 after zero.sync_warmup_steps=2: steps 1-2 all-reduce the gradients, steps 3 and 7 average
    the fp32 parameters (PeriodicModelAverager), the others move nothing: four steps from 3 average the plan's
    per-step figure, and only the averaging steps hold the plan's peak."""
    local = config(sync_every=4, sync_warmup_steps=2)
    schedule = StepSchedule.of(local, 2, backend="gloo")
    params = 4 * model_shape(local.model).num_params
    exact = plan_comm(config(), 2, backend="gloo").total
    assert [schedule.bytes_at(n) for n in range(1, 9)] == [exact, exact, params, 0, 0, 0, params, 0]
    assert schedule.mean_bytes(3, 6) == pytest.approx(plan_comm(local, 2, backend="gloo").total, abs=1)
    assert [n for n in range(1, 12) if schedule.holds_peak(n)] == [3, 7, 11]
