"""trainer/telemetry/layer_norms.py on one rank: the layers are the decoder's own modules, a wrapped parameter's
name finds its layer, and a step's norms equal those of the gradients and parameters it left (2 ranks, every
layout: tests/integration/test_layer_norms.py)."""

from __future__ import annotations

import math

import pytest

from tests.helpers import WORLD, tiny_config
from trainer.data import build_batches
from trainer.rank.loop import build_trainee, train_step
from trainer.rank.nonfinite import NonFiniteGuard
from trainer.telemetry import keys
from trainer.telemetry.layer_norms import LayerNorms, layer_names, layer_of


def test_the_layers_are_the_decoders_modules() -> None:
    model = tiny_config().model
    assert layer_names(model) == ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    tied = tiny_config(model__tie_embeddings=True).model
    assert layer_names(tied) == [
        "tok_embeddings",
        "layers.0",
        "layers.1",
        "norm",
    ]  # one weight: the embedding's


def test_a_wrapped_parameter_finds_its_layer() -> None:
    assert layer_of("module.layers.3._checkpoint_wrapped_module.attention.wq.weight") == "layers.3"
    assert layer_of("_orig_mod.tok_embeddings.weight") == "tok_embeddings"
    assert layer_of("norm.weight") == "norm"
    assert layer_of("output.weight") == "output"


def test_one_rank_norms_are_the_tensors_own(process_group: None) -> None:
    """A step that clips (the tiny model's first gradient norm is above optim.grad_clip=1): the logged
    gradient norms are those before clipping, the parameter norms those after the step."""
    config = tiny_config()
    trainee = build_trainee(config, WORLD)
    batches = build_batches(config, 0, 1, start_step=0)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, WORLD, fp16=False)
    norms = LayerNorms(config.model, world_size=1, pp=1, device=WORLD.device)
    stats = train_step(trainee, batches, config, WORLD, 1, guard, norms=norms)
    assert stats.layer_norms is not None
    logged = norms.fields(stats.layer_norms)
    grad_norm = float(stats.grad_norm)
    coef = min(1.0, config.optim.grad_clip / (grad_norm + 1e-6))
    assert coef < 1
    squares: dict[str, float] = {}
    for name, param in trainee.model.named_parameters():
        grad_key, param_key = (
            keys.layer_grad_norm_key(layer_of(name)),
            keys.layer_param_norm_key(layer_of(name)),
        )
        squares[grad_key] = squares.get(grad_key, 0.0) + float((param.grad.double() / coef).square().sum())
        squares[param_key] = squares.get(param_key, 0.0) + float(param.detach().double().square().sum())
    assert list(logged) == [keys.layer_grad_norm_key(n) for n in norms.layers] + [
        keys.layer_param_norm_key(n) for n in norms.layers
    ]
    for key, value in logged.items():
        assert abs(value - math.sqrt(squares[key])) <= 1e-6, key
    grads = [logged[keys.layer_grad_norm_key(n)] for n in norms.layers]
    assert sum(g * g for g in grads) == pytest.approx(grad_norm**2, rel=1e-6)


class DTensor:
    """Just what LayerNorms.local_piece reads of a DTensor (named so, as it tells one by its type's name): a
    2 x 2 mesh of 4 ranks, as FSDP2 over 2 data-parallel ranks lays out a tensor-parallel model's weights."""

    def __init__(self, *placements: object) -> None:
        self.placements = placements
        self.device_mesh = type("Mesh", (), {"size": lambda self, dim: 2})()

    def to_local(self) -> str:
        return "the local piece"


def test_every_placement_but_replicate_cuts_the_tensor() -> None:
    """The weight of a piece in the ranks' sum: (product of the cutting dims' sizes) / the stage's ranks. FSDP2's
    _StridedShard (dp over a TP-sharded dim) says is_shard() False; counted as not cutting, a tp=2 x dp=2
    stage3 job's norms came out 1/sqrt(2) of the whole's."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    norms = LayerNorms(tiny_config().model, world_size=4, pp=1, device=WORLD.device)
    strided = _StridedShard(0, split_factor=2)
    assert norms.local_piece(DTensor(strided, Shard(0))) == (
        "the local piece",
        1.0,
    )  # a column-parallel weight
    assert norms.local_piece(DTensor(Shard(0), Replicate())) == (
        "the local piece",
        0.5,
    )  # a norm's, without SP
    assert norms.local_piece(DTensor(Shard(0), Shard(1))) == ("the local piece", 1.0)  # a row-parallel weight
