"""The schema's range and cross-field rules name the key that is wrong."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.helpers import CONF, compose_config
from trainer.config import (
    TORCHTITAN_SAVE_OPS,
    CheckpointingConfig,
    Compression,
    ConfigError,
    DataConfig,
    DataKind,
    DataloaderConfig,
    ModelConfig,
    OffloadConfig,
    OffloadTarget,
    ReduceDType,
    ReduceEvery,
    Stage,
    TrainConfig,
    ZeroConfig,
    from_plain,
    to_plain,
)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"micro_batch": 0}, "micro_batch"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"steps": -1}, "steps"),
        ({"seq_len": 0}, "seq_len"),
        ({"seq_len": 4096}, "model.max_seq_len"),
        ({"nproc": "0"}, "nproc"),
        ({"nproc": "two"}, "nproc"),
        ({"device_memory_gib": -1.0}, "device_memory_gib"),
        ({"offload": OffloadConfig(target=OffloadTarget.cpu)}, "offload=cpu"),
    ],
)
def test_bad_top_level_values_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        TrainConfig(**kwargs)


@pytest.mark.parametrize(
    "build,key",
    [
        (lambda: ModelConfig(dim=130, n_heads=4), "model.dim"),
        (lambda: ModelConfig(n_heads=4, n_kv_heads=3), "model.n_heads"),
        (lambda: CheckpointingConfig(every_n_layers=0), "checkpointing.every_n_layers"),
        (lambda: DataloaderConfig(num_workers=0, prefetch_factor=2), "dataloader.prefetch_factor"),
        (lambda: DataloaderConfig(num_workers=0, persistent_workers=True), "dataloader.persistent_workers"),
        (lambda: DataConfig(kind=DataKind.tokens, path=None), "data.path"),
        (lambda: ZeroConfig(bucket_cap_mb=0.0), "zero.bucket_cap_mb must be > 0"),
        (lambda: ZeroConfig(stage=Stage.stage3, bucket_cap_mb=10.0), "zero.bucket_cap_mb applies to DDP"),
        (lambda: ZeroConfig(powersgd_rank=0), "zero.powersgd_rank must be >= 1"),
        (lambda: ZeroConfig(powersgd_start_step=1), "zero.powersgd_start_step must be >= 2"),
        (lambda: ZeroConfig(sync_every=0), "zero.sync_every must be >= 1"),
        (lambda: ZeroConfig(stage=Stage.stage2, sync_every=4), "zero.sync_every=4 hooks DDP"),
        (lambda: ZeroConfig(stage=Stage.stage1, sync_every=4), "needs zero=stage0: under stage1"),
        (
            lambda: ZeroConfig(sync_every=4, reduce_every=ReduceEvery.micro_batch),
            "zero.sync_every=4 needs zero.reduce_every=step",
        ),
        (
            lambda: ZeroConfig(compression=Compression.powersgd, reduce_dtype=ReduceDType.bf16),
            "zero.compression=powersgd and zero.reduce_dtype=bf16",
        ),
    ],
)
def test_bad_group_values_name_the_key(build, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build()


def test_offload_is_allowed_with_fsdp_stages_only() -> None:
    for stage in (Stage.stage2, Stage.stage3):
        config = TrainConfig(zero=ZeroConfig(stage=stage), offload=OffloadConfig(target=OffloadTarget.cpu))
        assert (config.zero.stage, config.offload.target) == (stage, OffloadTarget.cpu)
    for stage in (Stage.stage0, Stage.stage1):
        with pytest.raises(
            ConfigError, match=rf"^offload=cpu needs zero=stage2 or zero=stage3 .*got zero={stage.value}$"
        ):
            TrainConfig(zero=ZeroConfig(stage=stage), offload=OffloadConfig(target=OffloadTarget.cpu))


def test_global_batch_is_micro_batch_times_accum_times_world() -> None:
    assert TrainConfig(micro_batch=3, grad_accum=5).sequences_per_step(world_size=7) == 105


def test_plain_round_trip_keeps_every_value() -> None:
    config = TrainConfig(micro_batch=3, zero=ZeroConfig(stage=Stage.stage3), nproc="2")
    plain = to_plain(config)
    assert plain["zero"]["stage"] == "stage3" and plain["nonfinite"] == "raise"  # enums as plain strings
    assert OmegaConf.to_container(OmegaConf.create(plain)) == plain  # OmegaConf takes it as it is
    assert from_plain(plain) == config


def test_keeping_parameters_after_backward_needs_fsdp2_and_no_hpz() -> None:
    """zero.reshard_after_backward=false: FSDP2 stages only; not with hpZ (not planned together); with
    HSDP, offload=cpu and grad_accum=1 it is accepted (at grad_accum 1 the only backward reshards)."""
    for stage in (Stage.stage0, Stage.stage1):
        with pytest.raises(
            ConfigError, match=r"^zero\.reshard_after_backward=false .*needs zero=stage2 or stage3"
        ):
            ZeroConfig(stage=stage, reshard_after_backward=False)
    with pytest.raises(ConfigError, match=r"^zero\.reshard_after_backward=false with zero\.hpz_ranks"):
        ZeroConfig(stage=Stage.stage3, hpz_ranks=2, reshard_after_backward=False)
    for stage in (Stage.stage2, Stage.stage3):
        zero = ZeroConfig(stage=stage, shard_ranks=2, reshard_after_backward=False)
        config = TrainConfig(zero=zero, offload=OffloadConfig(target=OffloadTarget.cpu), grad_accum=1)
        assert config.zero.reshard_after_backward is False


# pytorch/torchtitan@1f029641b5caeb4df18ac094263e8bcc674b3686, torchtitan/models/llama3/parallelize.py
# lines 45-61, `_op_sac_save_list`, copied op by op (`torch.ops.` and `.default` dropped; the tests run
# without a network).
TORCHTITAN_1F02964 = {
    "aten.mm",
    "aten.linear",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_attention_math",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "_c10d_functional.reduce_scatter_tensor",
    "aten.max",
    "torch._higher_order_ops.flex_attention",
    "torch_attn._varlen_attn",
    "torch._higher_order_ops.inductor_compiled_code",
}
NEVER_RUN = {  # flex and varlen attention and inductor's code: zerolab's model runs none of them
    "torch._higher_order_ops.flex_attention",
    "torch_attn._varlen_attn",
    "torch._higher_order_ops.inductor_compiled_code",
}


def test_the_default_save_ops_are_torchtitans_list_and_defined_once() -> None:
    """checkpointing=op keeps torchtitan's ops (less those the model never runs, plus the SDPA op CPU
    runs), and conf/checkpointing/op.yaml names no list of its own: the schema's default is the one source."""
    assert sorted(TORCHTITAN_SAVE_OPS) == sorted(
        (TORCHTITAN_1F02964 - NEVER_RUN) | {"aten._scaled_dot_product_flash_attention_for_cpu"}
    )
    assert len(set(TORCHTITAN_SAVE_OPS)) == len(TORCHTITAN_SAVE_OPS)
    assert "save_ops" not in OmegaConf.load(CONF / "checkpointing" / "op.yaml")
    assert compose_config("checkpointing=op").checkpointing.save_ops == list(TORCHTITAN_SAVE_OPS)


# ----------------------------------------------------------------------------- issue 60: silent changes refused


def test_micro_batch_auto_with_global_batch_refuses_an_explicit_grad_accum() -> None:
    """auto with global_batch sets grad_accum from it: an explicit grad_accum=4 was silently replaced."""
    with pytest.raises(ConfigError) as err:
        compose_config("micro_batch=auto", "global_batch=16", "grad_accum=4")
    assert str(err.value) == (
        "grad_accum=4 with micro_batch=auto and global_batch=16: auto sets grad_accum to global_batch / "
        "(ranks x micro_batch); drop grad_accum, or drop global_batch to keep it"
    )
    assert compose_config("micro_batch=auto", "grad_accum=4").grad_accum == 4  # without global_batch: kept


def test_validation_files_with_validation_fraction_is_refused() -> None:
    """Both held the fraction out of training and evaluated only the files."""
    text = ("data=text", "data.files=[a.jsonl]", "data.tokenizer=t", "data.validation_files=[b.jsonl]")
    with pytest.raises(ConfigError) as err:
        compose_config(*text, "data.validation_fraction=0.1")
    assert str(err.value) == (
        "data.validation_files and data.validation_fraction=0.1: choose one (held-out files, or that fraction of "
        "data.files' documents); set data.validation_fraction=0 with validation_files"
    )
    assert compose_config(*text).data.validation_files == ["b.jsonl"]
