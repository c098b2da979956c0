"""Issue 39, A3-A5: network rates by group, ties within the model's error, reserved memory, numerics,
and one rank planned without collectives."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from trainer.advise.advisor import Candidate, advise, rank
from trainer.advise.calibrate import accelerator_rates
from trainer.advise.predict import StepTime, predict_step
from trainer.cli import register_configs
from trainer.config import ConfigError, DType, PlanConfig, TrainConfig, validate
from trainer.plan import INTRA_NODE, NETWORK, device_memory, plan_comm
from trainer.plan.headroom import HEADROOM

CONF = Path(__file__).resolve().parents[3] / "conf"


def composed(*overrides: str) -> TrainConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return validate(compose("train", overrides=["logger=none", *overrides]))


def test_a_groups_network_share_is_its_ranks_of_the_nodes_nics() -> None:
    rates = accelerator_rates("a100-80gb", DType.bfloat16, 64)
    assert rates.group_bus_bytes_per_s(NETWORK, 8) == pytest.approx(192e9)  # 8 HDR NICs x 24 GB/s
    assert rates.group_bus_bytes_per_s(NETWORK, 1) == pytest.approx(24e9)  # one rank a node: one rail
    assert rates.group_bus_bytes_per_s(NETWORK, 4) == pytest.approx(96e9)
    assert rates.group_bus_bytes_per_s(INTRA_NODE, 8) == pytest.approx(232e9)  # NVIDIA/nccl-tests#175
    h100 = accelerator_rates("h100", DType.bfloat16, 64)
    assert h100.group_bus_bytes_per_s(NETWORK, 8) == pytest.approx(
        360e9
    )  # 8 x 47 = 376, NVLink's 360 caps it


def test_a_clusters_own_figures_replace_the_table() -> None:
    rates = accelerator_rates("h100", DType.bfloat16, 64, network_bus_gbps=100, nvlink_bus_gbps=300)
    assert rates.link_bus_bytes_per_s == {INTRA_NODE: 300e9, NETWORK: 100e9}
    assert "plan.network_bus_gbps=100" in rates.source and "plan.nvlink_bus_gbps=300" in rates.source
    config = composed("mode=plan", "plan.accelerator=h100", "plan.network_bus_gbps=100", "nodes=2", "nproc=8")
    assert config.plan.network_bus_gbps == 100
    with pytest.raises(ConfigError, match=r"plan.network_bus_gbps must be > 0 \(GB/s\) or null, got 0"):
        PlanConfig(network_bus_gbps=0)


def candidate(tokens: float, reserved_gib: float, **choice) -> Candidate:
    base = {
        "zero": "stage3", "checkpointing": "none", "offload": "none", "zero.reduce_dtype": "fp32",
        "zero.reduce_every": "micro_batch", "zero.reshard_after_backward": True, "micro_batch": 1,
        "grad_accum": 1, "loss": "full", "zero.shard_ranks": None, "zero.hpz_ranks": None,
    }  # fmt: skip
    step = StepTime(1.0, 0.0, {}, 0.0, 0.0, 0.0)
    gib = int(reserved_gib * 2**30)
    return Candidate({**base, **choice}, gib, True, step, tokens, None, "compute", reserved_bytes=gib)


def test_ties_go_to_fewer_moving_parts_then_less_reserved_memory_then_speed() -> None:
    offload = candidate(1030, 20, offload="cpu")
    bf16 = candidate(1040, 50, **{"zero.reduce_dtype": "bf16"})
    big = candidate(1020, 60)
    small = candidate(1000, 40)
    slow = candidate(900, 10)
    refused = dataclasses.replace(candidate(2000, 90), fits=False)
    ranked = rank([offload, bf16, big, small, slow, refused], tolerance=0.05)
    assert ranked == [
        dataclasses.replace(
            small, tie=True
        ),  # 3.8% slower than the fastest: a tie, and the smallest plain one
        dataclasses.replace(big, tie=True),
        dataclasses.replace(offload, tie=True),
        dataclasses.replace(bf16, tie=True),
        slow,  # 13% slower: not a tie
        refused,
    ]
    assert "changes numerics: bf16 gradient reduction" in bf16.numerics_note() and not small.numerics_note()
    assert rank([small, slow], tolerance=0.05) == [small, slow]  # alone within its error: no tie to mark


def test_the_headroom_is_taken_off_reserved_memory(tmp_path: Path) -> None:
    config = composed(
        "mode=advise", "model=13b", "nproc=8", "plan.accelerator=h100", "seq_len=4096", "precision=bf16",
        "global_batch=64", "advise.stages=[stage3]", "advise.offload=[none]", "advise.reduce_dtypes=[fp32]",
        "advise.checkpointing=[none,full]",
    )  # fmt: skip
    ranked, _ = advise(config, "cuda", 8)
    memory = device_memory(config.plan, config.device_memory_gib, "cuda", 8, config.nodes)
    budget = memory.per_rank_bytes * (1 - config.advise.headroom)
    for c in ranked:
        assert c.reserved_bytes == HEADROOM.reserved(c.peak_bytes)
        assert c.device_fits == (c.reserved_bytes <= budget)
    assert any(c.peak_bytes <= budget < c.reserved_bytes for c in ranked)  # allocated alone would have passed


def test_an_fp32_jobs_top_row_reduces_in_fp32() -> None:
    config = composed(
        "mode=advise", "model=7b", "nproc=8", "plan.accelerator=h100", "seq_len=2048", "precision=fp32",
        "global_batch=16", "advise.stages=[stage3]", "advise.offload=[none]", "advise.checkpointing=[op,full]",
    )  # fmt: skip
    ranked, _ = advise(config, "cuda", 8)
    fitting = [c for c in ranked if c.fits]
    bf16 = [c for c in fitting if c.choice["zero.reduce_dtype"] == "bf16"]
    assert bf16 and max(c.tokens_per_s for c in bf16) >= max(c.tokens_per_s for c in fitting if c not in bf16)
    assert fitting[0].choice["zero.reduce_dtype"] == "fp32"


def test_one_rank_plans_no_collectives() -> None:
    for stage in ("stage2", "stage3"):
        config = composed("mode=plan", f"zero={stage}", "nproc=1")
        assert plan_comm(config, 1).total == 0
    assert plan_comm(composed("mode=plan", "zero=stage3", "nproc=2"), 2).total > 0


def test_offload_moves_fp32_shards_and_adds_every_accumulated_reduction_on_the_host() -> None:
    """bf16 compute, bf16 reduction, 4 micro-batches each reducing: the fp32 shards move both ways (twice
    the bf16 payloads), and 3 of the 4 reductions are added to the held gradient on the CPU."""
    config = composed(
        "mode=plan", "zero=stage3", "precision=bf16", "zero.reduce_dtype=bf16", "offload=cpu", "grad_accum=4",
        "zero.reduce_every=micro_batch", "nproc=4",
    )  # fmt: skip
    rates = dataclasses.replace(
        accelerator_rates("h100", DType.bfloat16, 4), offload_bytes_per_s=5e10, host_memory_bytes_per_s=1e10
    )
    comm = {"all_gather": 8 * 10**8, "reduce_scatter": 4 * 10**8}
    step = predict_step(config, 4, comm, 10**7, 1e6, rates, "cuda")
    assert step.offload_s == pytest.approx((2 * 8e8 + 2 * 4e8) / 4 / 5e10 + 3 * 12 * 1e7 / 1e10)
