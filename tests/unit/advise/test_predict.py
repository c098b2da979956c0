"""The advisor's arithmetic (trainer/advise/predict.py, docs/advisor.md) on fixed calibration figures."""

from __future__ import annotations

import dataclasses

import pytest

from trainer.advise.calibrate import ACCELERATORS, Rates, accelerator_rates
from trainer.advise.predict import predict_step, recompute_flops_per_token
from trainer.advise.throughput import FAMILY_EFFICIENCY, shape_factor
from trainer.config import (
    CheckpointingConfig,
    CheckpointMode,
    ConfigError,
    DType,
    ModelConfig,
    OffloadConfig,
    OffloadTarget,
    ReduceDType,
    ReduceEvery,
    Stage,
    TrainConfig,
    ZeroConfig,
)

# Fixed figures: 1 TFLOP/s, all-reduce 100 GB/s, all-gather 50 GB/s bus bandwidth, 1e9 Adam params/s.
RATES = Rates(
    source="test",
    peak_flops=2e12,
    compute_flops={0: 1e12},
    bus_bytes_per_s={"all_reduce": 1e11, "all_gather": 5e10},
    adam_params_per_s=1e9,
    overlap=False,
)
F = 1e6  # model FLOPs per token, fixed


def recompute_of(c: TrainConfig) -> float:
    return recompute_flops_per_token(c.model, c.checkpointing, c.seq_len)


def config(
    stage: Stage = Stage.stage0, checkpointing: CheckpointMode = CheckpointMode.none, **top: int
) -> TrainConfig:
    return TrainConfig(
        zero=ZeroConfig(stage=stage), checkpointing=CheckpointingConfig(mode=checkpointing), **top
    )


def test_recompute_is_the_checkpointed_blocks_forward_without_w2() -> None:
    # tiny: D=128, 4 layers, 4 heads (Q=32), 2 KV heads, M=384, T=128
    block_params = (
        128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384 + 2 * 128
    )  # wq, wk+wv, wo, w1-3, 2 norms
    per_block = 2 * (block_params - 128 * 384) + 4 * 4 * 32 * 128
    assert per_block == 360_960
    assert recompute_of(config(checkpointing=CheckpointMode.full, seq_len=128)) == 4 * per_block
    assert (
        recompute_of(config(checkpointing=CheckpointMode.selective, seq_len=128)) == 2 * per_block
    )  # blocks 0, 2
    assert recompute_of(config(seq_len=128)) == 0


def test_op_recomputes_wk_wo_w3_and_attention_only_when_its_op_is_not_saved() -> None:
    # tiny: D=128, KQ=64, M=384, 4 layers, T=128. torchtitan's policy keeps wq, wv, w1, w2 and
    # the SDPA op's output: wk, wo and w3 are rerun, w2 never (early stop).
    matmuls = 2 * (128 * 64 + 128 * 128 + 128 * 384)
    op = config(checkpointing=CheckpointMode.op, seq_len=128)
    cpu_flash = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert recompute_flops_per_token(op.model, op.checkpointing, 128, attention_op=cpu_flash) == 4 * matmuls
    # attention=math: its composite op decomposes before the policy sees it, so attention is rerun
    assert recompute_flops_per_token(op.model, op.checkpointing, 128, attention_op=None) == 4 * (
        matmuls + 4 * 4 * 32 * 128
    )
    assert matmuls < 360_960  # less than full checkpointing's rerun of the block
    no_mm = dataclasses.replace(op.checkpointing, save_ops=[cpu_flash])  # every matmul but w2 rerun
    assert recompute_flops_per_token(op.model, no_mm, 128, attention_op=cpu_flash) == 4 * 2 * (
        128 * 128 + 2 * 128 * 64 + 128 * 128 + 2 * 128 * 384
    )


def test_step_without_overlap_adds_compute_wire_and_optimizer() -> None:
    c = config(micro_batch=2, grad_accum=2, seq_len=128)
    step = predict_step(c, 4, {"all_reduce": 4_000_000, "broadcast": 0}, 1_000_000, F, RATES)
    tokens = 2 * 2 * 128
    assert step.compute_s == pytest.approx(tokens * F / 1e12)
    assert step.wire_s == {
        "all_reduce": pytest.approx(4e6 * 2 * 3 / 4 / 1e11)
    }  # ring: 2(n-1)/n of the payload
    assert step.exposed_comm_s == pytest.approx(4e6 * 1.5 / 1e11)  # CPU: nothing hides it
    assert step.optimizer_s == pytest.approx(1e6 / 1e9)
    assert step.step_s == pytest.approx(tokens * F / 1e12 + 6e-5 + 1e-3)
    assert step.limiter == "optimizer"


def test_all_gather_and_reduce_scatter_move_n_minus_1_over_n_of_their_payload() -> None:
    wire = predict_step(
        config(Stage.stage2, seq_len=128), 2, {"reduce_scatter": 10**8, "all_gather": 10**8}, 0, F, RATES
    ).wire_s
    assert wire == {
        "reduce_scatter": pytest.approx(1e8 * 0.5 / 5e10),
        "all_gather": pytest.approx(1e8 * 0.5 / 5e10),
    }


def test_bf16_reduction_runs_at_the_bandwidth_measured_in_bf16() -> None:
    rates = dataclasses.replace(RATES, bus_bytes_per_s={**RATES.bus_bytes_per_s, "all_reduce_bf16": 1e10})
    fp32 = config(Stage.stage2, seq_len=128)
    bf16 = dataclasses.replace(fp32, zero=ZeroConfig(stage=Stage.stage2, reduce_dtype=ReduceDType.bf16))
    assert predict_step(fp32, 2, {"all_reduce": 10**8}, 0, F, rates).wire_s["all_reduce"] == pytest.approx(
        1e8 / 1e11
    )
    assert predict_step(bf16, 2, {"all_reduce": 10**8}, 0, F, rates).wire_s["all_reduce"] == pytest.approx(
        1e8 / 1e10
    )
    assert predict_step(bf16, 2, {"all_reduce": 10**8}, 0, F, RATES).wire_s["all_reduce"] == pytest.approx(
        1e8 / 1e11
    )  # not measured: fp32's


def test_overlap_hides_what_fits_behind_its_compute_window() -> None:
    overlapping = dataclasses.replace(RATES, overlap=True)
    c = config(Stage.stage3, micro_batch=4, grad_accum=2, seq_len=128)  # tiny: 4 layers
    tokens = 4 * 2 * 128
    forward, compute = tokens * F / 3 / 1e12, tokens * F / 1e12
    backward = compute - forward
    gather, scatter = 8 * 10**6, 4 * 10**8
    step = predict_step(c, 8, {"all_gather": gather, "reduce_scatter": scatter}, 0, F, overlapping)
    gather_s, scatter_s = gather * 7 / 8 / 5e10, scatter * 7 / 8 / 5e10
    # all-gather (stage3) hides behind forward + backward: only one block's share shows;
    # reduce-scatter behind the last micro-batch's backward only.
    expected = max(gather_s / 4, gather_s - (forward + backward)) + max(
        scatter_s / 4, scatter_s - backward / 2
    )
    assert gather_s < forward + backward and scatter_s > backward / 2  # one of each case
    assert step.exposed_comm_s == pytest.approx(expected)
    assert step.limiter == "communication"


def test_reducing_every_micro_batch_hides_behind_every_backward() -> None:
    """zero.reduce_every=micro_batch: the plan's reduce-scatter bytes are grad_accum times step's, and
    they overlap every micro-batch's backward instead of the last one's."""
    overlapping = dataclasses.replace(RATES, overlap=True)
    c = config(Stage.stage3, micro_batch=4, grad_accum=2, seq_len=128)
    c = dataclasses.replace(c, zero=dataclasses.replace(c.zero, reduce_every=ReduceEvery.micro_batch))
    tokens = 4 * 2 * 128
    backward = tokens * F / 1e12 * 2 / 3
    scatter = 2 * 4 * 10**8  # two reductions
    step = predict_step(c, 8, {"reduce_scatter": scatter}, 0, F, overlapping)
    scatter_s = scatter * 7 / 8 / 5e10
    assert step.exposed_comm_s == pytest.approx(max(scatter_s / 4, scatter_s - backward))
    assert scatter_s > backward  # exposed: the window is the whole backward, not half of it


def test_offload_moves_shards_over_the_host_link_and_steps_adam_on_the_host() -> None:
    gpu = dataclasses.replace(RATES, offload_bytes_per_s=5e10, host_adam_params_per_s=1e8)
    c = dataclasses.replace(
        config(Stage.stage3, seq_len=128), offload=OffloadConfig(target=OffloadTarget.cpu)
    )
    step = predict_step(c, 4, {"all_gather": 8 * 10**8, "reduce_scatter": 4 * 10**8}, 10**7, F, gpu)
    assert step.offload_s == pytest.approx(12e8 / 4 / 5e10)
    assert step.optimizer_s == pytest.approx(1e7 / 1e8)


def test_accelerator_table_uses_nvlink_inside_a_node_and_the_nodes_nics_beyond() -> None:
    spec = ACCELERATORS["h100"]
    inside, across = (
        accelerator_rates("h100", DType.bfloat16, 8),
        accelerator_rates("h100", DType.bfloat16, 64),
    )
    assert inside.peak_flops == 989.4e12  # trainer/devices.py, H100 SXM5 dense bf16
    assert inside.compute_flops == {0: pytest.approx(989.4e12 * FAMILY_EFFICIENCY[spec.family])}
    assert inside.bus_bytes_per_s["all_reduce"] == pytest.approx(360e9)
    # 8 NDR NICs x 47 GB/s = 376 GB/s across nodes, capped by the 360 GB/s the rings cross inside
    assert across.bus_bytes_per_s["all_gather"] == pytest.approx(360e9)
    a100 = accelerator_rates("a100-80gb", DType.bfloat16, 64)
    assert a100.bus_bytes_per_s["all_gather"] == pytest.approx(192e9)  # NVIDIA/nccl#812: 8 x 200 Gb/s
    assert accelerator_rates("a100-80gb", DType.float32, 8, tf32=False).peak_flops == 19.5e12
    assert accelerator_rates("a100-80gb", DType.float32, 8).peak_flops == 156e12  # precision.tf32 (default)
    assert "published fit" in inside.source and "expected error" in inside.source


def test_accelerator_rates_follow_the_model_gemm_shapes() -> None:
    model = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336)
    rates = accelerator_rates(
        "h100-hbm2e", DType.bfloat16, 8, model=model, seq_len=8192, micro_batches=[1, 2]
    )
    expected = 989.4e12 * FAMILY_EFFICIENCY["h100-hbm2e"] * shape_factor(model, 8192, 8192)
    assert rates.compute_flops[8192] == pytest.approx(expected)
    assert rates.compute_flops[8192] < rates.compute_flops[16384] < 989.4e12 * FAMILY_EFFICIENCY["h100-hbm2e"]


def test_advise_refuses_an_accelerator_without_rates_in_one_line_naming_them() -> None:
    with pytest.raises(
        ConfigError, match=r"no rates for plan.accelerator=l40s: missing its matmul efficiency"
    ) as info:
        accelerator_rates("l40s", DType.bfloat16, 8)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("preset", ["7b", "llama3-8b", "mistral-7b", "qwen3-0.6b", "qwen3-8b", "qwen3-32b"])
def test_the_shape_factors_gemms_are_the_models_flops(preset: str) -> None:
    """The GEMMs the efficiency is weighted over carry the FLOPs MFU counts (a head width apart from
    dim / n_heads, Qwen3's, included); only the norms' few parameters are not matmuls."""
    from tests.helpers import load_preset
    from trainer.advise.throughput import gemms
    from trainer.model.decoder import flops_per_token

    model = load_preset(preset)
    total = sum(flops for flops, _ in gemms(model, rows=4096, seq_len=4096))
    assert total == pytest.approx(flops_per_token(model, 4096), rel=1e-4)


@pytest.mark.parametrize("preset", ["7b", "qwen3-0.6b", "qwen3-32b"])
def test_full_checkpointing_recomputes_each_blocks_forward_but_w2(preset: str) -> None:
    """checkpointing=full reruns every block's forward less w2: a third of the blocks' training FLOPs
    (head width included, Qwen3's apart from dim / n_heads), less 2·D·M per block."""
    from tests.helpers import load_preset
    from trainer.advise.throughput import gemms

    model, seq_len = load_preset(preset), 4096
    blocks = sum(flops for flops, (m, n, k) in gemms(model, seq_len, seq_len) if n != model.vocab_size)
    expected = blocks / 3 - 2.0 * model.n_layers * model.dim * model.ffn_dim
    full = CheckpointingConfig(mode=CheckpointMode.full)
    assert recompute_flops_per_token(model, full, seq_len) == pytest.approx(expected, rel=1e-3)


def test_a_tp_and_pipeline_rank_reruns_only_its_own_share_under_checkpointing() -> None:
    """Issue 57: the busiest rank of tp=8 x pp=8 (16 of llama3-405b's 126 blocks, on 1/8 of each GEMM) runs 1/8 of
    its stage's FLOPs and reruns 1/8 of its stage's blocks, so recompute over compute is the whole model's (about
    0.25 under full checkpointing), not eight times it."""
    from tests.helpers import compose_config
    from trainer.advise.predict import block_flops_per_token, rank_flops
    from trainer.model.decoder import flops_per_token

    common = ("mode=plan", "model=llama3-405b", "nodes=64", "nproc=8", "seq_len=8192", "checkpointing=full")
    whole = compose_config(*common)
    split = compose_config(
        *common, "parallel.tp=8", "parallel.pp=8", "zero=stage3", "zero.reduce_every=step", "grad_accum=8"
    )
    F = flops_per_token(whole.model, 8192)
    share, recompute = rank_flops(split, None)
    assert rank_flops(whole, None) == (
        pytest.approx(1.0),
        recompute_flops_per_token(whole.model, whole.checkpointing, 8192),
    )
    assert share == pytest.approx(16 * block_flops_per_token(whole.model, 8192) / F / 8, rel=1e-6)
    whole_ratio = recompute_flops_per_token(whole.model, whole.checkpointing, 8192) / F
    assert 0.24 < whole_ratio < 0.26
    assert recompute / (share * F) == pytest.approx(whole_ratio, rel=0.01)  # the head's share aside


def test_compile_and_fp8_change_the_rate_where_published_points_measured_them() -> None:
    """compile=true: torchtitan's measured gain on the H100s (Tables 1 and 3), none on an A100 (no published pair);
    precision=fp8: bf16's rate over fp8.py's compute factor, on a TP rank's local GEMMs."""
    from tests.helpers import compose_config
    from trainer.advise.advisor import rates_for, unchecked_replace
    from trainer.advise.fp8 import fp8_compute_factor
    from trainer.advise.predict import rank_rate, tp_local_model
    from trainer.advise.throughput import COMPILE_SPEEDUP
    from trainer.config import Fp8Recipe

    for accelerator, gain in (("h100", COMPILE_SPEEDUP["h100-hbm2e"]), ("a100-80gb", 1.0)):
        config = compose_config(
            "mode=plan", "model=llama3-70b", "nodes=4", "nproc=8", f"plan.accelerator={accelerator}",
            "precision=bf16", "seq_len=8192", "parallel.tp=8", "zero=stage3", "micro_batch=1",
        )  # fmt: skip
        rates = rates_for(config, 32, [1])
        eager = rank_rate(config, rates)
        assert rank_rate(unchecked_replace(config, compile=True), rates) == pytest.approx(eager * gain)
    assert COMPILE_SPEEDUP["h100-hbm2e"] == pytest.approx(1.1596, abs=1e-4)
    fp8 = unchecked_replace(config, plan=unchecked_replace(config.plan, accelerator="h100"))
    fp8 = unchecked_replace(fp8, precision=unchecked_replace(fp8.precision, fp8_recipe=Fp8Recipe.tensorwise))
    rates = rates_for(fp8, 32, [1])
    factor = fp8_compute_factor(tp_local_model(fp8.model, 8), 8192, 1, "h100", "tensorwise")
    assert factor is not None and 0.5 < factor < 1.0
    bf16 = unchecked_replace(fp8, precision=unchecked_replace(fp8.precision, fp8_recipe=Fp8Recipe.none))
    assert rank_rate(fp8, rates) == pytest.approx(rank_rate(bf16, rates) / factor)


def test_a_tp_ranks_narrower_gemms_run_at_their_own_shape_factor() -> None:
    from tests.helpers import compose_config
    from trainer.advise.advisor import rates_for
    from trainer.advise.predict import rank_rate, tp_local_model

    config = compose_config(
        "mode=plan", "model=llama3-70b", "nodes=4", "nproc=8", "plan.accelerator=h100", "precision=bf16",
        "seq_len=8192", "parallel.tp=8", "zero=stage3", "micro_batch=1",
    )  # fmt: skip
    rates = rates_for(config, 32, [1])
    local = shape_factor(tp_local_model(config.model, 8), 8192, 8192)
    assert rank_rate(config, rates) == pytest.approx(
        rates.flops_at(8192) * local / shape_factor(config.model, 8192, 8192)
    )
    ratio = local / shape_factor(config.model, 8192, 8192)
    assert 0.95 < ratio < 0.97  # wk and wv are 128 columns wide at tp=8


def cp_job(*overrides: str) -> TrainConfig:
    from tests.helpers import compose_config

    return compose_config(
        "mode=plan", "model=llama3-8b", "nproc=8", "plan.accelerator=h100", "precision=bf16", "micro_batch=1",
        "seq_len=131072", "checkpointing=full", "zero=stage3", *overrides,
    )  # fmt: skip


@pytest.mark.parametrize("impl", ["ulysses", "allgather"])
def test_a_cp_rank_computes_its_share_of_each_sequence_at_its_own_gemm_shapes(impl: str) -> None:
    """parallel.cp=4: a rank's tokens are 1/4 of a row's, at the same FLOPs per token (head-tail balance: 1/cp of
    the causal pairs), its GEMMs micro_batch x seq_len / cp rows; Ulysses' attention is T x T on H/cp heads, the
    all-gather's T/cp queries against T keys."""
    from trainer.advise.advisor import rates_for
    from trainer.advise.predict import compute_seconds, rank_rate

    plain, cp = cp_job(), cp_job("parallel.cp=4", f"parallel.cp_impl={impl}")
    rates = rates_for(plain, 8, [1])
    queries = 131072 if impl == "ulysses" else 32768
    expected = shape_factor(cp.model, 32768, 131072, queries=queries) / shape_factor(cp.model, 131072, 131072)
    assert rank_rate(cp, rates) == pytest.approx(rank_rate(plain, rates) * expected)
    # the same FLOPs per token over a quarter of the tokens, at the cp rank's rate
    ratio = compute_seconds(cp, F, rates, "cuda")[0] / compute_seconds(plain, F, rates, "cuda")[0]
    assert ratio == pytest.approx(rank_rate(plain, rates) / rank_rate(cp, rates) / 4)


def test_the_cp_exchanges_are_exposed_whole_on_their_link() -> None:
    """The cp group's collectives feed or drain attention: no window hides them (as TP's); an all-to-all moves
    (n-1)/n of its payload at the all-gather's bus bandwidth."""
    from trainer.advise.advisor import rates_for
    from trainer.advise.predict import predict_step_tiers
    from trainer.plan import plan_comm

    config = cp_job("parallel.cp=4", "parallel.cp_impl=ulysses")
    comm, rates = plan_comm(config, 8), rates_for(config, 8, [1])
    step = predict_step_tiers(config, 8, comm, 10**9, F, rates, "cuda")
    payload = comm.groups["cp"].bytes_by_collective["all_to_all"]
    wire = payload * 3 / 4 / rates.group_bus_bytes_per_s("intra-node", 4)
    assert step.wire_s["cp/all_to_all"] == pytest.approx(wire)
    hidden = {k: v for k, v in step.wire_s.items() if not k.startswith("cp/")}
    assert step.links["intra-node"].exposed_s >= wire
    assert step.links["intra-node"].wire_s == pytest.approx(wire + sum(hidden.values()))
