"""trainer/rank/parallelize.py: one sequence of transforms for a whole model and for a pipeline stage, so a
stage's DDP carries the settings the whole model's does (before, a stage's plain DDP dropped
zero.reduce_dtype's hook, zero.bucket_cap_mb and the bucket view)."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from tests.helpers import WORLD, compose_config
from trainer.layout import Layout
from trainer.model.decoder import build_model
from trainer.model.pipeline_split import build_stage
from trainer.rank import sharding
from trainer.rank.parallelize import parallelize

GROUP = object()
"""The data-parallel process group the fake mesh hands out."""


class FakeMesh:
    """A mesh whose every dim is the one fake group: DDP's arguments are what the test reads."""

    def __getitem__(self, _axes: Any) -> FakeMesh:
        return self

    def get_group(self) -> object:
        return GROUP


class RecordedDDP(nn.Module):
    """Stands in for DistributedDataParallel (no process group here): what it was built with."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module, self.kwargs, self.hooks = module, kwargs, []

    def register_comm_hook(self, state: object, hook: Any) -> None:
        self.hooks.append(hook)


def test_a_stage_ddp_has_the_whole_models_hook_buckets_and_view(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharding, "DistributedDataParallel", RecordedDDP)
    keys = ("zero.reduce_dtype=bf16", "zero.bucket_cap_mb=1", "grad_accum=2")
    whole_config, stage_config = compose_config(*keys), compose_config(*keys, "parallel.pp=2")
    whole = parallelize(
        build_model(whole_config.model),
        config=whole_config,
        layout=Layout(dp_replicate=2),
        mesh=FakeMesh(),
        world=WORLD,
    )
    stage = parallelize(
        build_stage(stage_config.model, 0, 2),
        config=stage_config,
        layout=Layout(pp=2, dp_replicate=2),
        mesh=FakeMesh(),
        world=WORLD,
    )
    expected = {
        "device_ids": None,
        "process_group": GROUP,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 1,
    }
    assert isinstance(whole, RecordedDDP) and isinstance(stage, RecordedDDP)
    assert whole.kwargs == stage.kwargs == expected
    assert whole.hooks == stage.hooks == [bf16_compress_hook]


def test_one_replica_of_a_stage_is_not_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """One data-parallel replica, a pipeline stage's or a whole one-rank model's: nothing to replicate, no DDP
    (trainer/plan/replica_walk.py plans the step without its buckets); two are wrapped (the test above)."""
    monkeypatch.setattr(sharding, "DistributedDataParallel", RecordedDDP)
    config = compose_config("parallel.pp=2", "grad_accum=2")
    stage = parallelize(
        build_stage(config.model, 1, 2), config=config, layout=Layout(pp=2), mesh=FakeMesh(), world=WORLD
    )
    whole_config = compose_config()
    whole = parallelize(
        build_model(whole_config.model), config=whole_config, layout=Layout(), mesh=FakeMesh(), world=WORLD
    )
    assert not isinstance(stage, RecordedDDP) and not isinstance(whole, RecordedDDP)
