"""Tensor parallelism in the plan and the step-time model (trainer/plan/tensor_parallel.py, trainer/advise/predict.py):
the worked example of docs/communication.md, llama3-70b at tp=8 on 4 nodes of 8 H100s."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.advise.advisor import choices, tp_options
from trainer.advise.calibrate import accelerator_rates
from trainer.advise.predict import predict_step_tiers
from trainer.config import DType
from trainer.plan import INTRA_NODE, NETWORK, build_plan

WORLD = 32
EXAMPLE = (
    "mode=plan",
    "model=llama3-70b",
    "nodes=4",
    "nproc=8",
    "parallel.tp=8",
    "zero=stage3",
    "precision=bf16",
    "seq_len=8192",
    "micro_batch=1",
    "checkpointing=full",
    "plan.accelerator=h100",
)
D, T = 8192, 8192  # llama3-70b's width, the sequence


def test_tp_bytes_per_block_are_the_activations_gathered_and_scattered() -> None:
    """SP with full checkpointing, per micro-batch: each block's forward (twice: once recomputed) gathers two
    B·T·D inputs and scatters two outputs; its backward the adjoints; the root one of each both ways. Under
    FSDP2's bf16 policy the residual stream is bf16 too (measured at tp=2 pp=2 stage3 bf16, test_3d.py)."""
    plan = build_plan(compose_config(*EXAMPLE), "cuda", WORLD)
    tp = plan.comm.groups["tp"]
    blocks, layers = 160, 80  # forwards run (80 + 80 recomputed), backwards
    bf16 = T * D * 2
    assert tp.ranks == 8 and tp.link == INTRA_NODE
    assert tp.bytes_by_collective["all_gather"] == 2 * blocks * bf16 + 2 * layers * bf16 + 2 * bf16
    assert tp.bytes_by_collective["reduce_scatter"] == 2 * blocks * bf16 + 2 * layers * bf16 + 2 * bf16
    # loss_parallel's three fp32 values per token; SP's norm weight gradients (2 per block and the final norm)
    assert tp.bytes_by_collective["all_reduce"] == 3 * 4 * T + 4 * D * (2 * layers + 1)
    assert plan.comm.groups["shard"].ranks == 4  # zero shards over dp = 32 / 8


def test_states_per_rank_are_the_tp_shard_of_the_model_with_norms_whole() -> None:
    tp8 = build_plan(compose_config(*EXAMPLE), "cuda", WORLD)
    norms = 8192 * (2 * 80 + 1)  # attention_norm and ffn_norm per block, the final norm: replicated
    sharded = tp8.num_params - norms
    expected_params = 4 * (sharded // 8 + norms) // 4  # fp32, then FSDP2 over 4 dp ranks (rows divide evenly)
    assert tp8.worst.states.params == expected_params


def test_tp_exposed_time_is_its_nvlink_wire_time() -> None:
    """Acceptance 7: TP's collectives are on the critical path, so the intra-node link (which carries only the tp
    group here: the shard group of 4 replicas spans 4 nodes) exposes their whole wire time."""
    config = compose_config(*EXAMPLE)
    plan = build_plan(config, "cuda", WORLD)
    rates = accelerator_rates("h100", DType.bfloat16, WORLD, model=config.model, seq_len=T, micro_batches=[1])
    step = predict_step_tiers(config, WORLD, plan.comm, 1, 1e9, rates, "cuda")
    tp = plan.comm.groups["tp"]
    nvlink = rates.link_bus_bytes_per_s[INTRA_NODE]
    ring = {
        "all_reduce": 2 * 7 / 8,
        "all_gather": 7 / 8,
        "reduce_scatter": 7 / 8,
    }  # bytes sent per payload byte
    wire = sum(payload * ring[kind] / nvlink for kind, payload in tp.bytes_by_collective.items() if payload)
    assert plan.comm.groups["shard"].link != INTRA_NODE
    assert step.links[INTRA_NODE].exposed_s == pytest.approx(wire, rel=1e-12)
    assert step.links[INTRA_NODE].wire_s == pytest.approx(wire, rel=1e-12)


def test_advisor_considers_tp_that_divides_nproc_and_the_heads() -> None:
    """Acceptance 5's candidate space: tp inside one node (a divisor of nproc) that splits heads evenly."""
    llama405 = compose_config("mode=advise", "global_batch=1024", "model=llama3-405b", "nodes=64", "nproc=8")
    assert tp_options(llama405, 512) == [None, 2, 4, 8]
    one_node = compose_config("mode=advise", "global_batch=64", "model=tiny", "nproc=8")
    assert tp_options(one_node, 8) == [None]  # ZeRO's collectives stay on NVLink there already
    tiny = compose_config(
        "mode=advise", "global_batch=64", "model=tiny", "nproc=4", "nodes=2"
    )  # 4 heads, 2 kv
    assert tp_options(tiny, 8) == [None, 2]
    rows = choices(tiny, 8, "cuda")
    tp_rows = [row for row in rows if row["parallel.tp"] == 2 and row["parallel.pp"] is None]
    assert {row["zero"] for row in tp_rows} == {
        "stage2",
        "stage3",
    }  # DDP's stages refuse TP on several replicas
    assert {row["offload"] for row in tp_rows} == {
        "none",
        "cpu",
    }  # CPUOffloadPolicy on (dp, tp) shards composes
    assert {row["micro_batch"] * row["grad_accum"] for row in tp_rows} == {16}  # 64 sequences over dp = 4


def test_a_dp_group_beside_tp8_holds_one_rank_a_node_and_one_nics_share() -> None:
    """Under tp=8 the shard group's 4 ranks sit on 4 nodes, one each (trainer/layout.py: dp outside tp), and the
    node's 8 TP ranks run their 8 shard groups at once: each group gets 1/8 of the node's NICs."""
    config = compose_config(*EXAMPLE)
    plan = build_plan(config, "cuda", WORLD)
    rates = accelerator_rates("h100", DType.bfloat16, WORLD, model=config.model, seq_len=T, micro_batches=[1])
    step = predict_step_tiers(config, WORLD, plan.comm, 1, 1e9, rates, "cuda")
    shard = plan.comm.groups["shard"]
    assert shard.ranks == 4 and shard.link == NETWORK
    one_nic = rates.link_bus_bytes_per_s[NETWORK] / 8
    assert step.wire_s["shard/all_gather"] == pytest.approx(
        shard.bytes_by_collective["all_gather"] * 3 / 4 / one_nic
    )
