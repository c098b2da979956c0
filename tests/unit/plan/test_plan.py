"""The memory plan's arithmetic, pinned against torch itself and against hand-counted ledgers.

- model states: against ZeroRedundancyOptimizer's own partition and FSDP2's own shards, built
  for 3 ranks on torch's fake process group (uneven shards on purpose);
- activations: against the tensors autograd really saves for the tiny model;
- whole moments: a ledger of named tensors for the tiny model under every stage and precision.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tests.helpers import CONF, compose_config, saved_storage_bytes
from trainer.config import ModelConfig, TrainConfig
from trainer.model.decoder import build_model, init_weights
from trainer.plan import build_plan, format_plan, refusal, summary_fields
from trainer.plan.activations import activations
from trainer.plan.states import model_shape, padded_numel, rank_states, shard_rows, zero1_partition
from trainer.units import GIB

pytestmark = pytest.mark.torch_versions  # the plan's moments against what torch really holds

# Parameter counts published with Llama 2 (Touvron et al. 2023; the Hugging Face model cards).
LLAMA2 = {"7b": 6_738_415_616, "13b": 13_015_864_320, "70b": 68_976_648_192}


def moment(plan, name: str, rank: int = 0) -> int:
    (found,) = [m for m in plan.ranks[rank].moments if m.name == name]
    return found.total


# ----------------------------------------------------------------------------- model states


@pytest.mark.parametrize("name", sorted(LLAMA2))
def test_llama2_presets_have_the_published_parameter_counts(name: str) -> None:
    model = ModelConfig(**OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml")))
    assert model_shape(model).num_params == LLAMA2[name]


def test_shapes_are_the_full_models_in_parameter_order() -> None:
    config = ModelConfig(n_layers=5)
    full = build_model(config, device="meta")
    assert model_shape(config).order == tuple(tuple(p.shape) for p in full.parameters())


@pytest.mark.parametrize("name", sorted(LLAMA2))
def test_stage3_on_8_ranks_holds_the_zero_arithmetic(name: str) -> None:
    """ZeRO-3: 16 bytes per parameter over N ranks (4 fp32 weights + 4 fp32 grads + 8 Adam here)."""
    config = compose_config(f"model={name}", "zero=stage3", "precision=bf16")
    plan = build_plan(config, "cuda", 8)
    P = LLAMA2[name]
    for rank in plan.ranks:
        assert (rank.states.params, rank.states.grads, rank.states.optimizer) == (
            4 * P // 8,
            4 * P // 8,
            8 * P // 8,
        )
        assert rank.states.params + rank.states.grads + rank.states.optimizer == 16 * P // 8


@pytest.fixture
def fake_group():
    """A 3-rank world on torch's fake process group (collectives are no-ops): rank 2, the last."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=2, world_size=3, store=FakeStore())
    yield 3, 2
    dist.destroy_process_group()


def test_zero1_partition_is_zero_redundancy_optimizers(fake_group) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    world_size, _ = fake_group
    model = build_model(ModelConfig(), device="cpu")
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    partition = optimizer._partition_parameters()  # per rank, its param groups
    theirs = [sorted(index[id(p)] for group in groups for p in group["params"]) for groups in partition]
    assert [sorted(mine) for mine in zero1_partition([p.numel() for p in params], world_size)] == theirs
    states = rank_states(model_shape(ModelConfig()), compose_config("zero=stage1").zero.stage, world_size)
    assert [s.optimizer for s in states] == [8 * sum(params[i].numel() for i in part) for part in theirs]


def test_fsdp2_shards_are_the_plans(fake_group) -> None:
    """Uneven dims on 3 ranks: the plan's padded storage and unpadded shard are fully_shard's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world_size, rank = fake_group
    config = ModelConfig()
    model = build_model(config, device="meta")
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    modules = [*model.layers, model]
    fsdp_params = [p for module in modules for p in module._get_fsdp_state()._fsdp_param_group.fsdp_params]
    assert len(fsdp_params) == len(list(model.parameters()))
    for fp in fsdp_params:
        shape = tuple(fp._orig_size)
        assert fp._sharded_param_data.numel() == padded_numel(shape, world_size) // world_size
        assert fp.sharded_param.to_local().numel() == shard_rows(shape[0], world_size, rank) * math.prod(
            shape[1:]
        )
    states = rank_states(model_shape(config), compose_config("zero=stage3").zero.stage, world_size)[rank]
    assert states.params == 4 * sum(fp._sharded_param_data.numel() for fp in fsdp_params)
    assert states.optimizer == 8 * sum(fp.sharded_param.to_local().numel() for fp in fsdp_params)


# ----------------------------------------------------------------------------- activations


def saved_bytes(regime: str, micro_batch: int, seq_len: int, config: ModelConfig | None = None) -> int:
    """Bytes of the distinct storages autograd saves in one forward + loss of the model (the tiny one
    unless given), parameters and rotary tables excluded (they are model states and `other`)."""
    config = config or ModelConfig()
    model = build_model(config, device="cpu")
    init_weights(model, seed=0)
    inputs, targets = (torch.randint(0, config.vocab_size, (micro_batch, seq_len)) for _ in range(2))
    return saved_storage_bytes(model, inputs, targets, regime)


@pytest.mark.parametrize(
    ("regime", "overrides"),
    [
        ("fp32", ["precision=fp32"]),
        ("autocast", ["precision=bf16", "zero=stage1"]),
        ("fsdp_mp", ["precision=bf16", "zero=stage3"]),
        # q/k RMSNorm with head_dim apart from dim / n_heads: its width and its rstd per head (the
        # other regimes' q/k terms: tests/unit/plan/test_fsdp_terms.py, by hand)
        ("fsdp_mp", ["precision=bf16", "zero=stage2", "model.qk_norm=true", "model.head_dim=48"]),
    ],
)
def test_planned_activations_are_what_autograd_saves(regime: str, overrides: list[str]) -> None:
    config = compose_config("model=tiny", "micro_batch=3", "seq_len=40", *overrides)
    acts = activations(config)
    expected = acts.total
    if (
        regime == "autocast"
    ):  # autocast's cached bf16 weights are saved too; the plan counts them as temporary
        shape = model_shape(config.model)
        expected += 2 * (
            shape.block_linear_numel * config.model.n_layers + config.model.vocab_size * config.model.dim
        )
    assert saved_bytes(regime, micro_batch=3, seq_len=40, config=config.model) == expected


def test_full_checkpointing_keeps_each_blocks_input_only() -> None:
    plain = activations(compose_config("model=tiny", "checkpointing=none", "precision=bf16", "zero=stage3"))
    ckpt = activations(compose_config("model=tiny", "checkpointing=full", "precision=bf16", "zero=stage3"))
    config = compose_config("model=tiny")
    tokens = config.micro_batch * config.seq_len
    assert ckpt.blocks == (2 * config.model.dim * tokens,) * config.model.n_layers  # bf16 residual stream
    assert ckpt.full_block == plain.full_block and ckpt.head == plain.head
    selective = activations(
        compose_config("model=tiny", "checkpointing=selective", "checkpointing.every_n_layers=2")
    )
    fp32_plain = activations(compose_config("model=tiny"))
    assert (
        selective.blocks[1] == fp32_plain.full_block and selective.blocks[0] == 4 * config.model.dim * tokens
    )


# ----------------------------------------------------------------------------- whole moments, by ledger


def tiny_ledger(stage: str, precision: str) -> dict[str, int]:
    """The tiny model (micro_batch=2, seq_len=64) on 2 CPU ranks, tensor by tensor."""
    D, L, H, KQ, V, M, S = 128, 4, 4, 64, 512, 384, 2  # conf/model/tiny.yaml; 2 kv heads of width 32
    N = 2 * 64
    block_params = 2 * D * D + 2 * KQ * D + 3 * M * D + 2 * D
    P = 2 * V * D + D + L * block_params
    other = (
        2 * 512 * (D // H // 2) * 4 + (16 * V * 4 + 8 * V) + 4 * (3 + 9 * L)
    )  # rope, data tables, Adam steps
    half = precision != "fp32"
    fsdp = stage in ("stage2", "stage3")
    if not half:
        block = N * 4 * (5 * D + 2 * KQ + 3 * D + 4 * M) + N * (4 * H + 8)
        head = N * (4 * D * 3 + 4)
    elif not fsdp:  # autocast: residual, norms fp32; norm output cast per projection
        block = N * (
            4 * D * 2 + 2 * D * 3 + 2 * D * 2 + 2 * 2 * KQ + 4 * D * 2 + 2 * D * 2 + 2 * 4 * M
        ) + N * (4 * H + 8)
        head = N * (4 * D * 2 + 2 * D + 4)
    else:  # FSDP2 bf16: RMSNorm saves its fp32 upcast input
        block = N * (4 * D * 2 + 2 * D * 3 + 2 * 2 * KQ + 4 * D * 2 + 2 * D + 2 * 4 * M) + N * (4 * H + 8)
        head = N * (4 * D * 2 + 2 * D + 4)
    acts = L * block + head + N * 4 * V + 16 * N + 4  # + log_softmax, inputs and targets, nll's total weight
    # At the loss's backward FSDP2 holds no gradients yet (zero_grad freed them); DDP its buckets.
    states = {"stage0": 16 * P, "stage2": 12 * P // S, "stage3": 12 * P // S}
    if stage == "stage1":  # ZeRO-1 splits whole tensors: rank 0's part by the partition rule (tested above)
        numels = (
            [V * D]
            + [n for _ in range(L) for n in (D * D, KQ * D, KQ * D, D * D, M * D, M * D, M * D, D, D)]
            + [D, V * D]
        )
        mine = zero1_partition(numels, S)[0]
        states["stage1"] = 8 * P + 8 * sum(numels[i] for i in mine)
        other += 4 * (len(mine) - len(numels))  # Adam's step counters of rank 0's tensors only
    unsharded = {"stage2": (2 if half else 4) * P, "stage3": (2 if half else 4) * (2 * V * D + D)}.get(
        stage, 0
    )
    cache = 2 * (L * (block_params - 2 * D) + V * D) if half and not fsdp else 0
    loss_backward = states[stage] + other + acts + unsharded + cache + 8 * N * V
    ledger = {"backward: loss": loss_backward}
    if fsdp:  # the output head's matmul: the logits being written, next to the last block's all-gather output
        width = 2 if half else 4
        ledger["forward: output head"] = (
            states[stage] + other + acts - N * 4 * V - 4 + unsharded + width * block_params + width * N * V
        )
    if (
        fsdp
    ):  # gradients: every shard, the root's reduce-scatter input twice (gloo), the kept output-head gradient
        ledger["backward: root reduce-scatter"] = (
            16 * P // S + other + 16 * N + 2 * 4 * (2 * V * D + D) + (2 if half else 4) * (V * D + D)
        )
    return ledger


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage2", "stage3"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_tiny_moments_match_the_ledger(stage: str, precision: str) -> None:
    config = compose_config(
        "model=tiny", f"zero={stage}", f"precision={precision}", "micro_batch=2", "seq_len=64"
    )
    plan = build_plan(config, "cpu", 2)
    for name, expected in tiny_ledger(stage, precision).items():
        assert moment(plan, name) == expected, name


# ----------------------------------------------------------------------------- what stages and options change


def test_stage2_keeps_every_block_unsharded_and_stage3_none() -> None:
    stage2 = build_plan(compose_config("model=tiny", "zero=stage2"), "cpu", 2)
    stage3 = build_plan(compose_config("model=tiny", "zero=stage3"), "cpu", 2)
    shape = model_shape(compose_config("model=tiny").model)
    all_blocks = 4 * shape.config.n_layers * sum(padded_numel(s, 2) for s in shape.block)
    assert moment(stage2, "forward: loss") - moment(stage3, "forward: loss") == all_blocks


def test_offload_moves_model_states_off_the_gpu() -> None:
    on = build_plan(compose_config("model=1b", "zero=stage3", "offload=cpu"), "cuda", 4)
    off = build_plan(compose_config("model=1b", "zero=stage3"), "cuda", 4)
    states = off.ranks[0].states
    held = states.params + states.grads + states.optimizer
    assert on.ranks[0].offloaded == held
    assert (
        moment(off, "forward: loss") - moment(on, "forward: loss") == states.params + states.optimizer
    )  # no grads yet
    # On a CPU device offload moves nothing.
    assert (
        build_plan(compose_config("model=tiny", "zero=stage3", "offload=cpu"), "cpu", 2).peak_bytes
        == build_plan(compose_config("model=tiny", "zero=stage3"), "cpu", 2).peak_bytes
    )


@pytest.mark.parametrize(
    "stage,precision,reduce_dtype,width",
    [
        ("stage0", "fp32", "fp32", 4),  # DDP no_sync: the fp32 parameters' gradient, outside the buckets
        ("stage0", "bf16", "fp32", 4),
        ("stage3", "fp32", "fp32", 4),  # FSDP2: unsharded_accumulated_grad in the reduce dtype
        ("stage3", "bf16", "fp32", 4),
        ("stage3", "bf16", "bf16", 2),  # reduce dtype = param dtype: the bf16 unsharded gradient itself
        ("stage2", "fp32", "bf16", 2),
    ],
)
def test_reducing_once_per_step_holds_a_full_gradient_in_the_reduce_dtype(
    stage: str, precision: str, reduce_dtype: str, width: int
) -> None:
    base = ("model=tiny", f"zero={stage}", f"precision={precision}", f"zero.reduce_dtype={reduce_dtype}")
    one = build_plan(compose_config(*base), "cpu", 2)
    two = build_plan(compose_config(*base, "grad_accum=2", "zero.reduce_every=step"), "cpu", 2)
    assert moment(two, "forward: loss") - moment(one, "forward: loss") == width * one.num_params


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage2", "stage3"])
def test_reducing_every_micro_batch_holds_only_the_gradient_at_rest(stage: str) -> None:
    """ZeRO's promise: DDP accumulates in its buckets (nothing more), FSDP2 in the gradient shard,
    which from the second micro-batch on is held from the forward on: the at-rest `grads`."""
    one = build_plan(compose_config("model=tiny", f"zero={stage}"), "cpu", 2)
    four = build_plan(compose_config("model=tiny", f"zero={stage}", "grad_accum=4"), "cpu", 2)
    assert four.config.zero.reduce_every.value == ("micro_batch" if stage in ("stage2", "stage3") else "step")
    four = build_plan(
        compose_config("model=tiny", f"zero={stage}", "grad_accum=4", "zero.reduce_every=micro_batch"),
        "cpu",
        2,
    )
    held = four.ranks[0].states.grads if stage in ("stage2", "stage3") else 0
    assert moment(four, "forward: loss") - moment(one, "forward: loss") == held
    assert moment(four, "optimizer step") == moment(one, "optimizer step")


def test_13b_accumulation_costs_the_gradient_shard_not_the_gradient() -> None:
    """The issue's case: 13b, stage3, bf16, 8 H100s, micro_batch 4 x 16. Reducing every micro-batch
    adds the fp32 gradient shard (4P / 8) to grad_accum=1's peak; reducing once per step does not fit."""
    base = (
        "model=13b",
        "zero=stage3",
        "precision=bf16",
        "checkpointing=full",
        "micro_batch=4",
        "seq_len=4096",
    )
    base += ("plan.accelerator=h100",)
    one = build_plan(compose_config(*base), "cuda", 8)
    sixteen = build_plan(compose_config(*base, "grad_accum=16"), "cuda", 8)
    step = build_plan(compose_config(*base, "grad_accum=16", "zero.reduce_every=step"), "cuda", 8)
    shard = one.ranks[0].states.grads
    assert one.peak_bytes < sixteen.peak_bytes <= one.peak_bytes + shard
    assert sixteen.fits and not step.fits
    assert "Try zero.reduce_every=micro_batch (" in (refusal(step) or "")


def test_adam_temporaries_follow_the_optimizer_implementation() -> None:
    config = compose_config("model=tiny")
    states = build_plan(config, "cpu", 2).ranks[0].states
    cpu = moment(build_plan(config, "cpu", 2), "optimizer step")
    cuda = moment(build_plan(config, "cuda", 2), "optimizer step")
    fused_cpu = moment(
        build_plan(compose_config("model=tiny", "optim.fused=true"), "cpu", 2), "optimizer step"
    )
    loop_cuda = moment(
        build_plan(compose_config("model=tiny", "optim.fused=false"), "cuda", 2), "optimizer step"
    )
    # the fused kernel (CUDA's default) updates in place; the loop (CPU's default): 2 of a tensor and 1 of the one before it
    assert cpu - cuda == cpu - fused_cpu == 4 * states.loop_temporary
    assert loop_cuda == cpu
    shape = model_shape(config.model)
    numels = [math.prod(s) for s in shape.order]
    assert states.loop_temporary == max(2 * n + (numels[i - 1] if i else 0) for i, n in enumerate(numels))


# ----------------------------------------------------------------------------- refusal and the job's figure


def test_refusal_names_the_figures_and_a_way_out_that_fits() -> None:
    config = compose_config(
        "model=7b", "zero=stage0", "precision=bf16", "micro_batch=4", "seq_len=4096", "plan.accelerator=h100"
    )
    plan = build_plan(config, "cuda", 8)
    message = refusal(plan)
    assert message is not None and "\n" not in message
    assert (
        f"{plan.peak_bytes / GIB:.2f} GiB" in message
        and "78.23 GiB (h100-sxm, 79.6 GiB less 1.4 GiB for the CUDA context and 1 NCCL communicator)"
        in message
    )
    assert "plan.enforce=false" in message
    suggestion = message.split("Try ", 1)[1].split(" (")[0]  # e.g. "checkpointing=full zero=stage3"
    fixed = compose_config(*[o for o in config_overrides(config)], *suggestion.split())
    assert build_plan(fixed, "cuda", 8).fits


def config_overrides(config: TrainConfig) -> list[str]:
    return [
        f"model={config.model.name}",
        f"zero={config.zero.stage.value}",
        f"precision={config.precision.name}",
        f"micro_batch={config.micro_batch}",
        f"seq_len={config.seq_len}",
        "plan.accelerator=h100",
    ]


def test_a_fitting_plan_is_not_refused_and_its_peak_is_the_jobs_prediction() -> None:
    config = compose_config("model=tiny", "zero=stage2", "device=cpu")
    plan = build_plan(config, "cpu", 2)
    assert plan.fits and refusal(plan) is None
    # The job hands this figure to the ranks (trainer/job.py), which write it beside the measured peak.
    assert (
        summary_fields(plan)["memory/predicted_peak_gib"] * GIB
        == plan.peak_bytes
        == max(r.peak.total for r in plan.ranks)
    )


# ----------------------------------------------------------------------------- what the data adds


def test_the_70b_fine_tune_recipe_plans_with_its_document_mask_and_evaluation() -> None:
    """Issue 58's recipe, planned for another machine: data=text needs no files to be planned (the job that
    trains reads them); attention=auto takes CUDA's efficient kernel, which takes the document mask; the plan
    prints the mask's bytes and the evaluation's held-out ids."""
    recipe = compose_config(
        "mode=plan", "model=llama3-70b", "nodes=4", "nproc=8", "plan.accelerator=h100", "parallel.tp=8",
        "zero=stage3", "compile=true", "precision=fp8", "checkpointing=op", "data=text", "data.packing=document",
        "eval.every=100", "save.async_mode=thread",
    )  # fmt: skip
    text = format_plan(build_plan(recipe, "cuda", 32))
    b, t = recipe.micro_batch, recipe.seq_len
    assert f"document mask (data.packing=document): {b * t * t / 1024:.2f} KiB of booleans" in text
    assert f"{2 * b * t * t / 1024:.2f} KiB of its additive form" in text  # bf16 compute: 2 B a value
    assert "attention kernel efficient_attention" in text
    sequences = recipe.eval.batches * b * recipe.grad_accum
    assert f"evaluation every 100 steps: 4 global batches, {sequences} sequences" in text
    assert f"({sequences * t * 24 / 1024:.2f} KiB of ids held for the run)" in text
    assert "fits: peak" in text
