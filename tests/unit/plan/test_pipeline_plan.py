"""Pipeline parallelism in the plan (trainer/plan/pipeline.py, pipeline_walk.py): the split, the bubble, what
each schedule holds in flight, the buffers and the bytes between stages, plan.json's `pipeline` section."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import compose_config
from trainer.config import OffloadTarget, ParallelConfig, TrainConfig
from trainer.plan import build_plan, format_plan, pipeline_bubble, stage_blocks
from trainer.plan.activations import activations
from trainer.plan.disk import file_bytes, node_file_bytes
from trainer.plan.host import offload_shard_bytes
from trainer.plan.pipeline import (
    InFlight,
    Sends,
    schedule_order,
    stage_model_shape,
    walk_in_flight,
    worst_of,
)
from trainer.plan.states import model_shape

TINY_PP = (
    "model=tiny",
    "device=cpu",
    "seq_len=64",
    "micro_batch=2",
    "grad_accum=4",
    "nproc=2",
    "parallel.pp=2",
)


def test_blocks_split_evenly_the_earlier_stages_taking_the_extra_one() -> None:
    assert [len(r) for r in stage_blocks(126, 8)] == [16, 16, 16, 16, 16, 16, 15, 15]
    assert stage_blocks(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v", "expected"),
    [
        ("gpipe", 4, 8, 2, 3 / 11),  # (pp - 1) / (m + pp - 1): v plays no part
        ("1f1b", 4, 8, 2, 3 / 11),
        ("interleaved_1f1b", 4, 8, 2, 3 / 19),  # (pp - 1) / (v·m + pp - 1)
        ("interleaved_1f1b", 8, 16, 4, 7 / 71),
        ("1f1b", 1, 4, 2, 0.0),
    ],
)
def test_bubble_formulas(schedule: str, pp: int, m: int, v: int, expected: float) -> None:
    parallel = ParallelConfig(pp=pp, pp_schedule=schedule, pp_virtual_stages=v)
    assert math.isclose(pipeline_bubble(parallel, m), expected, rel_tol=1e-12)


@pytest.mark.parametrize("rank", range(4))
def test_in_flight_micro_batches_per_schedule(rank: int) -> None:
    """GPipe holds every micro-batch; 1F1B min(m, pp - i) on stage i (Schedule1F1B's warm-up); interleaved its
    `_get_warmup_ops` forwards ((v - 1)·m_round + 2·(pp - 1 - i), at most v·m) and the forward before its first backward."""
    pp, m, v = 4, 8, 2
    equal = {stage: 1 for stage in range(pp * v)}

    def count(schedule: str) -> int:
        parallel = ParallelConfig(pp=pp, pp_schedule=schedule, pp_virtual_stages=v)
        return worst_of(walk_in_flight(schedule_order(parallel, m, rank), equal, {}), equal).count

    assert count("gpipe") == m
    assert count("1f1b") == pp - rank
    assert count("interleaved_1f1b") == min((v - 1) * pp + 2 * (pp - 1 - rank) + 1, v * m)


@pytest.mark.parametrize(("schedule", "unsharded", "kept"), [("gpipe", True, 10), ("1f1b", False, 0)])
def test_a_backward_after_a_backward_finds_every_block_of_its_stage_unsharded(
    schedule: str, unsharded: bool, kept: int
) -> None:
    """PipelineStage runs every backward but the step's last with FSDP2's set_reshard_after_backward(False)
    (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`): a backward that follows the stage's
    previous one with no forward between (GPipe's second) finds all of the stage's blocks still unsharded
    (`regathered`, 10 here), not only the one it runs; under 1F1B the last stage's forward before each backward has
    resharded them block by block."""
    parallel = ParallelConfig(pp=2, pp_schedule=schedule)
    order = schedule_order(parallel, 4, 1)
    # the accumulated gradient (100) makes a later backward the worst, as on tiny under FSDP2
    sizes = {0: 100, 1: 100}
    peak = worst_of(walk_in_flight(order, sizes, {}, regathered={0: 10, 1: 10}), sizes, growth=100)
    assert (peak.done, peak.unsharded, peak.kept) == (1, unsharded, kept)


def test_a_forward_after_backwards_holds_the_other_stages_unsharded_parameters() -> None:
    """Under interleaving a rank's forward can follow backwards of its other stage: at that forward's end the
    rank holds the activations in flight, the accumulated gradient and the other stage's parameters left
    unsharded by its backward (`regathered`), its own resharded block by block. At pp=2, v=2, m=4, rank 0
    (stages 0 and 2): the worst forward end is stage 2's last forward, after three backwards, four other
    stage activations held and stage 0's parameters (10) unsharded; the first forwards hold less."""
    parallel = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    order = schedule_order(parallel, 4, 0)
    sizes, regathered = {0: 100, 2: 100}, {0: 10, 2: 1}
    forwards = [m for m in walk_in_flight(order, sizes, {}, regathered=regathered) if m.forward]
    assert [m.held for m in forwards] == [
        0,
        100,
        200,
        300,
        400,
        400,
        400,
        400,
    ]  # every forward of both stages
    worst = worst_of(
        walk_in_flight(order, sizes, {}, regathered=regathered), sizes, growth=1000, forward=True
    )
    assert worst == InFlight(stage=2, held=400, count=5, kept=10, done=3, forward=True, gathered=True)
    # stage 2's forwards after its own backwards: the first finds it unsharded, the second gathers it again
    assert [m.gathered for m in forwards] == [True, True, True, True, True, True, False, True]


@pytest.mark.parametrize(
    ("schedule", "kept", "sent"),
    [("1f1b", [0, 7, 7, 0], [True, False, False, False]), ("gpipe", [0, 7, 14, 21], [True] * 4)],
)
def test_a_sent_output_outlives_its_backward_while_its_send_is_kept(
    schedule: str, kept: list[int], sent: list[bool]
) -> None:
    """A stage's output, sent on, stays alive past its backward while the schedule keeps the send's Work: GPipe
    every one to the step's end; Schedule1F1B its second-to-last warm-up forward's (stage 0 at pp=2: micro-batch
    0) until the second backward after the last forward, where the cool-down replaces its `send_work`."""
    order = schedule_order(ParallelConfig(pp=2, pp_schedule=schedule), 4, 0)
    sends = Sends(outputs={0: 7}, keeps_all=schedule == "gpipe")
    backwards = [m for m in walk_in_flight(order, {0: 100}, {}, sends) if not m.forward]
    assert [m.kept for m in backwards] == kept
    assert [m.output_sent for m in backwards] == sent


@pytest.fixture(scope="module")
def plans() -> dict[str, object]:
    return {
        schedule: build_plan(compose_config(*TINY_PP, f"parallel.pp_schedule={schedule}"), "cpu", 2)
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    }


def test_each_stage_holds_the_micro_batches_its_schedule_keeps(plans: dict) -> None:
    """tiny's 4 blocks on 2 stages: every stage's activations at its peak are its in-flight micro-batches' (the
    stage's table; the same micro-batch split over 2 stages adds to the model's one-micro-batch activations: each
    stage but the last keeps its output, B·T·D fp32, which the next stage's first block saves as its input, the
    receive buffer, counted with the buffers)."""
    config = compose_config(*TINY_PP)
    model_acts = activations(config, "cpu")
    for schedule, plan in plans.items():
        record = plan.pipeline_json()
        stages = record["stages"]
        assert [s["blocks"] for s in stages] == (
            [[[0, 1], [2, 3]], [[1, 2], [3, 4]]] if schedule == "interleaved_1f1b" else [[[0, 2]], [[2, 4]]]
        )
        assert (
            sum(s["activations_per_micro_batch_bytes"] for s in stages) == model_acts.total - model_acts.batch
        )
        counts = [s["in_flight_micro_batches"] for s in stages]
        assert counts == {"gpipe": [4, 4], "1f1b": [2, 1], "interleaved_1f1b": [5, 3]}[schedule]


def test_worst_stage_sets_the_peak_and_plan_json_names_it(plans: dict) -> None:
    for plan in plans.values():
        record = plan.to_json()
        peaks = [s["peak_bytes"] for s in record["pipeline"]["stages"]]
        assert record["pipeline"]["worst_stage"] == peaks.index(max(peaks)) == plan.worst_stage
        assert plan.peak_bytes == max(peaks)
    assert plans["1f1b"].to_json()["pipeline"]["bubble"] == 1 / 5
    assert plans["interleaved_1f1b"].to_json()["pipeline"]["bubble"] == 1 / 9
    assert "bubble 20.0% of the step" in format_plan(plans["1f1b"])


def test_1f1b_holds_less_than_gpipe_on_the_first_stage(plans: dict) -> None:
    gpipe, one = (plans[s].pipeline_json()["stages"][0]["peak_bytes"] for s in ("gpipe", "1f1b"))
    assert gpipe > one


def test_buffers_and_bytes_between_stages(plans: dict) -> None:
    """Per step, each micro-batch's activation forward and its gradient back, B·T·D fp32 (the residual stream
    in fp32 and under autocast); each stage receives into one buffer per micro-batch per boundary it has."""
    tensor = 2 * 64 * 128 * 4  # micro_batch · seq_len · dim · 4
    for schedule, plan in plans.items():
        p2p = plan.comm.p2p
        per_rank = (
            4 * tensor * (3 if schedule == "interleaved_1f1b" else 1)
        )  # 4 micro-batches; 3 boundaries each
        assert p2p.boundary == tensor
        assert p2p.sent == (per_rank, per_rank)
        assert [s["buffers_bytes"] for s in plan.pipeline_json()["stages"]] == [per_rank, per_rank]


def test_bf16_under_fsdp_sends_half_precision() -> None:
    plan = build_plan(
        compose_config(*TINY_PP, "zero=stage3", "zero.reduce_every=step", "precision=bf16"), "cpu", 2
    )
    assert plan.comm.p2p.boundary == 2 * 64 * 128 * 2


# tiny at zero=stage3 fp32, micro_batch 1, Schedule1F1B: each rank's MemTracker peak of step 2, measured
# 2026-12-05 (docs/memory_plan.md, "Pipeline parallelism"), and the moment it falls at
MICRO_BATCH_1 = (
    "model=tiny",
    "device=cpu",
    "seq_len=64",
    "micro_batch=1",
    "grad_accum=4",
    "parallel.pp=2",
    "zero=stage3",
    "zero.reduce_every=step",
    "precision=fp32",
)
SYNTHETIC_TABLES = 36_864  # synthetic data's transition tables: planned, never seen by a tracked step


@pytest.mark.parametrize(
    ("nproc", "measured", "moment"),
    [
        (4, [9_784_428, 8_472_452], "backward: last block"),
        (2, [11_883_116, 10_539_140], "backward: first block"),
    ],
)
def test_stage3_micro_batch_1_plans_the_measured_peak(nproc: int, measured: list[int], moment: str) -> None:
    """At dp 2 the worst moment is the second backward's start on each stage (two micro-batches in flight, the
    gradient accumulated, its blocks resharded by the forward before): beside the block it runs FSDP2 holds the
    all-gather output of the block below, prefetched (`prefetched`). At dp 1 (no all-gather) it is a later
    backward at its stage's first block, both blocks unsharded beside the whole gradient and, on the first
    stage, the stage's output, which stage_backward holds through the backward. Each is measured to the byte
    (the last stage's to the loss's 20 bytes of scalars, which the plan leaves out), the loaded micro-batches included: of one sample each
    the inputs and targets are row views of the stacked tokens."""
    plan = build_plan(compose_config(*MICRO_BATCH_1, f"nproc={nproc}"), "cpu", nproc)
    stage_peaks = [plan.ranks[0].peak, plan.ranks[nproc - 1].peak]
    assert [p.name for p in stage_peaks] == [moment, moment]
    for planned, peak in zip(stage_peaks, measured, strict=True):
        assert 0 <= peak - (planned.total - SYNTHETIC_TABLES) <= 20


@pytest.mark.parametrize(("precision", "measured"), [("fp32", 9_471_564), ("bf16", 7_094_860)])
def test_interleaved_stage3_tp_forward_peaks_at_w2s_reduce_scatter(precision: str, measured: int) -> None:
    """tp 2 x pp 2, interleaved_1f1b, zero=stage3: the first stage's rank peaks in the forward of its later stage
    after three backwards, at w2's reduce-scatter under sequence parallelism (w2's partial output over all T, its
    chunk-concatenated copy, the output being made and the feed-forward's input: `w2_scattered`), not at the
    residual add. Measured 2026-12-05 with MemTracker: the plan less the TP rank's synthetic tables (18,432
    bytes) is the peak to the byte (bf16 re-measured with the complex rotary table, which FSDP2 does not cast:
    20,480 bytes less, five blocks' bf16 cos and sin)."""
    overrides = (*TINY_PP, "nproc=4", "parallel.tp=2", "parallel.pp_schedule=interleaved_1f1b", "zero=stage3")
    config = compose_config(*overrides, "zero.reduce_every=step", f"precision={precision}")
    peak = build_plan(config, "cpu", 4).ranks[0].peak
    assert (peak.name, peak.total - 18_432) == ("forward: last block", measured)


INTERLEAVED_TWO_NODES = (("intra-node",) * 3 + ("network",)) * 3 + ("intra-node",) * 3


@pytest.mark.parametrize(
    ("schedule", "nodes", "nproc", "links"),
    [
        ("1f1b", 1, 8, ("intra-node",) * 7),
        ("1f1b", 2, 8, ("intra-node",) * 3 + ("network",) + ("intra-node",) * 3),
        ("1f1b", 128, 4, ("network",) * 7),
        ("interleaved_1f1b", 1, 8, ("intra-node",) * 15),
        ("interleaved_1f1b", 2, 8, INTERLEAVED_TWO_NODES),
        ("interleaved_1f1b", 128, 4, ("network",) * 15),
    ],
)
def test_boundary_links_follow_the_layout(
    schedule: str, nodes: int, nproc: int, links: tuple[str, ...]
) -> None:
    """pp outermost (trainer/layout.py): stage s of the first replica is rank s·dp, so 8 stages of one replica
    stay in a node of 8; over 2 nodes (dp 2) they cross the network once, between stages 3 and 4; over 128
    nodes of 4 (dp 64) every boundary crosses it. Interleaved (16 stages, stage s on pipeline rank s mod 8):
    over 2 nodes at 3->4 and 11->12 (node 0 to 1) and at 7->8 (pipeline rank 7 back to 0: node 1 to 0).
    B·T·D bf16 under FSDP2's mixed precision."""
    config = compose_config(
        "mode=plan", "model=llama3-405b", f"nodes={nodes}", f"nproc={nproc}", "parallel.pp=8", "zero=stage3",
        "zero.reduce_every=step", "precision=bf16", "seq_len=8192", "micro_batch=1", "grad_accum=16",
        "plan.accelerator=h100", f"parallel.pp_schedule={schedule}",
    )  # fmt: skip
    plan = build_plan(config, "cuda", nodes * nproc)
    assert plan.comm.p2p.links == links
    assert plan.comm.groups["pp"].link == ("intra-node" if nodes == 1 else "network")
    assert plan.comm.p2p.boundary == 8192 * 16384 * 2


# offload=cpu on a GPU: tiny at zero=stage3 over pp 2 (dp 1 and 2), 1F1B over 4 micro-batches


@pytest.fixture(scope="module")
def offloading() -> Callable[..., TrainConfig]:
    """MICRO_BATCH_1 with offload=cpu, composed once (Hydra takes a third of a second a config); each variant
    a replace of it (the checks of __post_init__ run again)."""
    base = compose_config(
        *MICRO_BATCH_1, "nproc=2", "offload=cpu", "plan.disk_gbps=1"
    )  # nvme: no disk measured

    def variant(nproc: int, pp: int = 2, **offload: Any) -> TrainConfig:
        parallel = dataclasses.replace(base.parallel, pp=pp)
        fields = dataclasses.replace(base.offload, **offload)
        return dataclasses.replace(base, nproc=str(nproc), parallel=parallel, offload=fields)

    return variant


@pytest.mark.parametrize("nproc", [2, 4])
def test_offloaded_stages_leave_their_states_at_rest_off_the_gpu(
    nproc: int, offloading: Callable[..., TrainConfig]
) -> None:
    """Every moment of every rank is the offload=none plan's less its stage's states at rest (FSDP2's
    CPUOffloadPolicy keeps the sharded parameters, their gradients and Adam's moments in host memory;
    StepContext.moment), which the rank offloads: what PipelineStage's accumulation keeps (the unsharded
    parameters and gradient) stays on the device, and the fused AdamW steps in place on the host or on the GPU."""
    on = build_plan(offloading(nproc), "cuda", nproc)
    off = build_plan(offloading(nproc, target=OffloadTarget.none), "cuda", nproc)
    for offloaded, resident in zip(on.ranks, off.ranks, strict=True):
        states = resident.states
        assert offloaded.offloaded == states.params + states.grads + states.optimizer > 0
        assert [m.name for m in offloaded.moments] == [m.name for m in resident.moments]
        for moment, before in zip(offloaded.moments, resident.moments, strict=True):
            at_rest = before.parts["params"] + before.parts["grads"] + before.parts["optimizer"]
            assert moment.total == before.total - at_rest, (offloaded.rank, moment.name)
    # On a CPU device nothing moves: the plan is offload=none's (tests/integration/test_pipeline_offload.py).
    cpu = build_plan(offloading(nproc), "cpu", nproc)
    assert cpu.peak_bytes == build_plan(offloading(nproc, target=OffloadTarget.none), "cpu", nproc).peak_bytes


@pytest.mark.parametrize("nproc", [2, 4])
def test_offloading_stages_hold_their_own_parameters_in_host_memory(
    nproc: int, offloading: Callable[..., TrainConfig]
) -> None:
    """The host plan sizes each rank's offloaded shards from its stages' parameters, not the whole model's: at
    pp 2 the two stages' pageable states (fp32 parameters and gradients, Adam's moments and steps: the fused
    AdamW makes no temporaries) add up to a one-rank job's per dp shard, and pinned, each rank's tensors are
    rounded up on their own."""
    dp = nproc // 2
    pp = build_plan(offloading(nproc, pin_memory=False), "cuda", nproc).host.ranks
    whole = build_plan(offloading(dp, pp=1, pin_memory=False), "cuda", dp).host.ranks
    assert [r.pinned for r in pp] == [0] * nproc
    # pp outermost: ranks 0..dp-1 hold stage 0, dp..2dp-1 stage 1, at the same places in their shard groups
    assert [pp[i].pageable + pp[i + dp].pageable for i in range(dp)] == [r.pageable for r in whole]
    config = offloading(nproc)
    full = model_shape(config.model)
    for rank, host in enumerate(build_plan(config, "cuda", nproc).host.ranks):
        stage = stage_model_shape(full, 2, first=rank < dp, last=rank >= dp)
        assert host.pinned == offload_shard_bytes(stage.order, dp, rank % dp, True)


@pytest.mark.parametrize("nproc", [2, 4])
def test_nvme_files_hold_each_ranks_stages_moments(
    nproc: int, offloading: Callable[..., TrainConfig]
) -> None:
    """offload=nvme: each rank's file and traffic are its stages' moments (the two stages' add up to a pp = 1 job's
    per dp shard), and offload.path's free-space check (`node_file_bytes`) asks for the files the plan sizes."""
    path = {"target": OffloadTarget.nvme, "path": "/tmp"}
    dp = nproc // 2
    plan = build_plan(offloading(nproc, **path), "cuda", nproc)
    whole = build_plan(offloading(dp, pp=1, **path), "cuda", dp)
    assert plan.disk is not None and whole.disk is not None
    moments = plan.disk.moment_bytes
    assert [moments[i] + moments[i + dp] for i in range(dp)] == list(whole.disk.moment_bytes)
    assert plan.disk.traffic_bytes_per_node == whole.disk.traffic_bytes_per_node
    full = model_shape(plan.config.model)
    expected = [
        file_bytes(stage_model_shape(full, 2, first=r < dp, last=r >= dp), dp, r % dp) for r in range(nproc)
    ]
    assert list(plan.disk.file_bytes) == expected
    assert list(node_file_bytes(offloading(nproc, **path), nproc, 0).values()) == expected


# zero=stage3 against stage2 under a pipeline: what keeping the blocks unsharded after forward saves (issue 57)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_each_zero_stages_all_gathers_side_by_side(schedule: str) -> None:
    """plan.json's `all_gather_bytes_per_step_by_zero_stage` (the worst pipeline rank's): each figure is the shard
    group's all-gather bytes of that rank in the job planned at that stage (test_pipeline.py measures stage3's);
    stage3 gathers every block of the rank once more in each micro-batch's backward, stage2 each block once."""
    base = (
        "mode=plan",
        "model=tiny",
        "nproc=4",
        "parallel.pp=2",
        "grad_accum=4",
        f"parallel.pp_schedule={schedule}",
    )
    plans = {
        zero: build_plan(compose_config(*base, f"zero={zero}"), "cpu", 4) for zero in ("stage2", "stage3")
    }
    records = {zero: plan.pipeline_json() for zero, plan in plans.items()}
    worst = records["stage3"]["worst_stage"]
    by = records["stage3"]["all_gather_bytes_per_step_by_zero_stage"]
    for zero, plan in plans.items():
        assert by[zero] == plan.comm.groups["shard"].per_stage[worst]["all_gather"], zero
    blocks = sum(len(r) for r in plans["stage3"].pipeline.stage_range(worst))
    # fp32; tiny's dims pad nothing at 2 ranks
    block = 4 * model_shape(plans["stage3"].config.model).block_numel
    assert by["stage3"] - by["stage2"] == 4 * blocks * block
    assert "zero=stage2" in format_plan(plans["stage3"])
