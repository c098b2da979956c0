"""The communication plan is the arithmetic of docs/communication.md, for every stage."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainer.config import (
    DType,
    ModelConfig,
    PrecisionConfig,
    ReduceDType,
    ReduceEvery,
    Stage,
    TrainConfig,
    ZeroConfig,
)
from trainer.plan import build_plan, format_plan, plan_comm

# Llama-2 70b (docs/communication.md, "70b at stage3 on 64 ranks"): every dim 0 divides by 64,
# so FSDP2 pads nothing. P parameters, of which the root (embeddings, final norm, output) holds R.
P_70B = 68_976_648_192
ROOT_70B = 2 * 32_000 * 8_192 + 8_192


def config(
    stage: str,
    precision: str = "fp32",
    reduce_dtype: str = "fp32",
    grad_accum: int = 1,
    model: ModelConfig | None = None,
) -> TrainConfig:
    dtype = {"fp32": DType.float32, "bf16": DType.bfloat16}[precision]
    return TrainConfig(
        model=model or ModelConfig(),
        precision=PrecisionConfig(name=precision, compute_dtype=dtype),
        zero=ZeroConfig(stage=Stage(stage), reduce_dtype=ReduceDType(reduce_dtype)),
        grad_accum=grad_accum,
    )


def llama70b() -> ModelConfig:
    return ModelConfig(
        name="70b",
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_dim=28672,
        max_seq_len=4096,
    )


def test_70b_stage3_bf16_on_64_ranks_is_the_documented_arithmetic() -> None:
    """bf16 all-gathers of every block twice (forward, backward) and the root once: 2·(2P − R);
    the fp32 reduce-scatter of everything once: 4P. On gloo the reduce-scatter is an all-reduce."""
    cfg = config("stage3", "bf16", model=llama70b())
    nccl, gloo = plan_comm(cfg, 64, backend="nccl"), plan_comm(cfg, 64, backend="gloo")
    assert nccl.bytes_by_collective == {
        "all_reduce": 0,
        "all_gather": 2 * (2 * P_70B - ROOT_70B),
        "reduce_scatter": 4 * P_70B,
        "broadcast": 0,
        "all_to_all": 0,
    }
    assert nccl.total == gloo.total == 550_764_593_152
    assert (
        gloo.bytes_by_collective["all_reduce"] == 4 * P_70B
        and gloo.bytes_by_collective["reduce_scatter"] == 0
    )
    # zero.reduce_dtype=bf16 halves the gradient reduction: 2P instead of 4P.
    halved = plan_comm(config("stage3", "bf16", "bf16", model=llama70b()), 64, backend="nccl")
    assert halved.bytes_by_collective["reduce_scatter"] == 2 * P_70B


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_every_stage_moves_what_torch_issues(precision: str, grad_accum: int) -> None:
    """The tiny model (P parameters, every dim 0 even): DDP all-reduces P fp32 gradients once per
    step, ZeRO-1 also broadcasts P fp32 weights, FSDP2 gathers P in the compute dtype per
    micro-batch (stage3: blocks twice) and reduce-scatters P in fp32 once."""
    model = ModelConfig()
    P = build_plan(config("stage0"), "cpu", 2).num_params
    root = 2 * model.vocab_size * model.dim + model.dim
    width = 4 if precision == "fp32" else 2
    got = {
        stage: plan_comm(
            config(stage, precision, grad_accum=grad_accum), 2, backend="nccl"
        ).bytes_by_collective
        for stage in ("stage0", "stage1", "stage2", "stage3")
    }
    assert got["stage0"] == {
        "all_reduce": 4 * P,
        "all_gather": 0,
        "reduce_scatter": 0,
        "broadcast": 0,
        "all_to_all": 0,
    }
    assert got["stage1"] == {
        "all_reduce": 4 * P,
        "all_gather": 0,
        "reduce_scatter": 0,
        "broadcast": 4 * P,
        "all_to_all": 0,
    }
    assert got["stage2"] == {
        "all_reduce": 0,
        "all_gather": grad_accum * width * P,
        "reduce_scatter": 4 * P,
        "broadcast": 0,
        "all_to_all": 0,
    }
    assert got["stage3"] == {
        "all_reduce": 0,
        "all_gather": grad_accum * width * (2 * P - root),
        "reduce_scatter": 4 * P,
        "broadcast": 0,
        "all_to_all": 0,
    }


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage2", "stage3"])
@pytest.mark.parametrize("grad_accum", [1, 4])
def test_reducing_every_micro_batch_multiplies_only_the_gradient_reduction(
    stage: str, grad_accum: int
) -> None:
    """zero.reduce_every=micro_batch: grad_accum reductions per step (bytes and calls), every other
    collective as under step; at grad_accum 1 the two choices are the same step."""
    step = config(stage, grad_accum=grad_accum)
    every = dataclasses.replace(
        step, zero=dataclasses.replace(step.zero, reduce_every=ReduceEvery.micro_batch)
    )
    once, each = (plan_comm(c, 2, backend="nccl") for c in (step, every))
    reduction = "reduce_scatter" if step.zero.uses_fsdp else "all_reduce"
    for kind in once.bytes_by_collective:
        factor = grad_accum if kind == reduction else 1
        assert each.bytes_by_collective[kind] == factor * once.bytes_by_collective[kind], kind
        assert each.calls_by_collective[kind] == factor * once.calls_by_collective[kind], kind
    assert once.bytes_by_collective[reduction] == 4 * 918_656  # tiny's fp32 gradient, once: not 0 == 0


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage2", "stage3"])
def test_bf16_reduction_halves_the_gradient_bytes(stage: str) -> None:
    fp32, bf16 = (
        plan_comm(config(stage, reduce_dtype=r), 2, backend="gloo").bytes_by_collective
        for r in ("fp32", "bf16")
    )
    assert bf16["all_reduce"] * 2 == fp32["all_reduce"] > 0  # gloo: the reduce-scatter is an all-reduce
    assert bf16["all_gather"] == fp32["all_gather"] and bf16["broadcast"] == fp32["broadcast"]


def test_fsdp_payloads_are_padded_to_the_world_size() -> None:
    """3 ranks: FSDP2 pads each parameter's dim 0 to a multiple of 3, so a 4-layer tiny model's
    512-row embedding gathers 513 rows."""
    model = ModelConfig(n_layers=1)
    padded = plan_comm(config("stage2", model=model), 3, backend="nccl").bytes_by_collective["all_gather"]
    unpadded = plan_comm(config("stage2", model=model), 2, backend="nccl").bytes_by_collective["all_gather"]
    # Rows added (dim 0 to a multiple of 3): tok_embeddings and output 512 -> 513, wq and wo
    # 128 -> 129, wk and wv 64 -> 66 (each row 128 wide); w2 128 -> 129 (rows 384 wide); the three
    # 128-element norms 128 -> 129; w1 and w3 (384 rows) need none.
    extra_elements = 128 * (1 + 1 + 1 + 1 + 2 + 2) + 384 * 1 + 3 * 1
    assert padded - unpadded == 4 * extra_elements


def test_the_plan_carries_the_comm_section_and_prints_it() -> None:
    plan = build_plan(config("stage1"), "cpu", 2)
    comm = json.loads(json.dumps(plan.to_json()))["comm"]
    assert comm["backend"] == "gloo" and comm["bytes_per_step"] == 8 * plan.num_params
    assert comm["bytes_by_collective"]["broadcast"] == 4 * plan.num_params
    assert (
        f"communication: 7.01 MiB ({8 * plan.num_params:,} bytes) per rank per optimizer step"
        in format_plan(plan)
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_keeping_parameters_after_backward_gathers_one_forward_per_step(precision: str) -> None:
    """zero.reshard_after_backward=false, 70b on 64 ranks (no padding), grad_accum 4: stage2 gathers the
    whole model once per step instead of 4 times, (A-1)·p·P less; stage3 one forward (P) and every
    backward's blocks (A·(P − R)) instead of A·(2P − R); the reductions do not change; at grad_accum 1
    nothing changes."""
    p = 4 if precision == "fp32" else 2
    for stage, default, kept in (
        ("stage2", 4 * p * P_70B, p * P_70B),
        ("stage3", 4 * p * (2 * P_70B - ROOT_70B), p * P_70B + 4 * p * (P_70B - ROOT_70B)),
    ):
        cfg = config(stage, precision, grad_accum=4, model=llama70b())
        keep = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, reshard_after_backward=False))
        plans = plan_comm(cfg, 64, backend="nccl"), plan_comm(keep, 64, backend="nccl")
        assert [plan.bytes_by_collective["all_gather"] for plan in plans] == [default, kept]
        assert (
            plans[0].bytes_by_collective["reduce_scatter"] == plans[1].bytes_by_collective["reduce_scatter"]
        )
        once = dataclasses.replace(keep, grad_accum=1)
        assert plan_comm(once, 64) == plan_comm(dataclasses.replace(cfg, grad_accum=1), 64)


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_keeping_parameters_costs_memory_only_with_accumulation(stage: str) -> None:
    """The plan: grad_accum 1 is the default's to the byte; with grad_accum 2 on the tiny model's 2 ranks
    the kept unsharded parameters raise the peak (measured in tests/integration/test_accumulation.py)."""
    base = dataclasses.replace(
        config(stage, grad_accum=1),
        micro_batch=1,
        seq_len=32,
        zero=ZeroConfig(stage=Stage(stage), reduce_every=ReduceEvery.micro_batch),
    )
    keep = dataclasses.replace(base, zero=dataclasses.replace(base.zero, reshard_after_backward=False))
    assert build_plan(keep, "cpu", 2).peak_bytes == build_plan(base, "cpu", 2).peak_bytes
    twice, twice_kept = (dataclasses.replace(c, grad_accum=2) for c in (base, keep))
    kept_plan = build_plan(twice_kept, "cpu", 2)
    assert "micro-batch" in kept_plan.ranks[0].peak.name
    if stage == "stage3":
        assert kept_plan.peak_bytes > build_plan(twice, "cpu", 2).peak_bytes


# ----------------------------------------------------------------------------- context parallelism


def cp_config(*overrides: str) -> TrainConfig:
    from tests.helpers import compose_config

    return compose_config(
        "model=llama3-8b", "nproc=8", "seq_len=131072", "micro_batch=1", "precision=bf16", *overrides
    )


@pytest.mark.parametrize("impl", ["ulysses", "allgather"])
def test_llama3_8b_at_128k_on_cp4_exchanges_the_documented_bytes(impl: str) -> None:
    """Llama 3 8B (H = 32, K = 8 heads of Q = 128), b = 1 row of s = 131,072, cp = 4, bf16, full checkpointing:
    Ulysses moves q and the output, b·(s/cp)·H·Q·2 = 268,435,456 bytes each, and k and v, 67,108,864 each, per
    block each way: 96 block passes (32 forwards, 32 recomputes, 32 backwards) x 671,088,640 = 60 GiB. The
    all-gather: b·s·2·K·Q·2 = 536,870,912 bytes out per block forward (64 with recomputes), its reduce-scatter
    per backward (32)."""
    comm = plan_comm(cp_config(f"parallel.cp_impl={impl}", "parallel.cp=4", "checkpointing=full"), 8, "nccl")
    cp = comm.groups["cp"]
    assert (cp.ranks, cp.link) == (4, "intra-node")
    blocks = cp.exchange["forward"]["bytes_per_block"]
    if impl == "ulysses":
        assert blocks == {"q": 268_435_456, "k": 67_108_864, "v": 67_108_864, "output": 268_435_456}
        assert cp.bytes_by_collective["all_to_all"] == 96 * 671_088_640 == 60 * 2**30
        assert cp.calls_by_collective["all_to_all"] == 96 * 4
    else:
        assert blocks == {"kv": 536_870_912}
        assert cp.bytes_by_collective["all_gather"] == 64 * 536_870_912
        assert cp.bytes_by_collective["reduce_scatter"] == 32 * 536_870_912
    assert cp.exchange["wire_share"] == 0.75
    assert json.loads(json.dumps(comm.to_json()))["groups"]["cp"]["exchange"] == cp.exchange


def test_zero_works_over_dp_times_cp() -> None:
    """FSDP2's shard group is dp_shard x cp: 8 ranks at cp 4 on 8 (the same bytes as cp 1, padded to 8);
    DDP's world is dp_replicate x cp, and at dp 1 DDP still all-reduces over the cp ranks."""
    sharded = plan_comm(cp_config("parallel.cp=4", "zero=stage3"), 8, "nccl")
    plain = plan_comm(cp_config("zero=stage3"), 8, "nccl")
    assert sharded.groups["shard"].ranks == 8
    assert sharded.groups["shard"].bytes_by_collective == plain.groups["shard"].bytes_by_collective
    ddp = plan_comm(cp_config("parallel.cp=8", "zero=stage0", "nproc=8"), 8, "nccl")
    assert ddp.groups["world"].ranks == 8
    # every fp32 gradient once: 4P, what FSDP2 reduce-scatters in fp32 (8B's dims 0 divide by 8: no padding)
    reduced = plain.groups["shard"].bytes_by_collective["reduce_scatter"]
    assert ddp.groups["world"].bytes_by_collective["all_reduce"] == reduced == 4 * 8_030_261_248
