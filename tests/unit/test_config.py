"""The schema's range and cross-field rules name the key that is wrong."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from trainer.config import (
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
