"""trainer/model/pipeline_split.py: the split of the blocks over the stages, and the stages themselves."""

from __future__ import annotations

import torch

from trainer.config import ModelConfig
from trainer.model.decoder import build_model, materialize
from trainer.model.pipeline_split import build_stage, split_line, stage_blocks


def test_blocks_split_as_evenly_as_they_divide_earlier_stages_taking_the_extra() -> None:
    assert stage_blocks(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_blocks(126, 8)[0] == range(0, 16) and stage_blocks(126, 8)[-1] == range(111, 126)
    assert [len(r) for r in stage_blocks(7, 7)] == [1] * 7


def test_the_printed_split_names_each_stages_blocks_and_extras() -> None:
    assert split_line(4, 4, 2) == (
        "pipeline: 4 stages over parallel.pp=2 ranks; stage 0 (rank 0): blocks 0-0 + embedding; "
        "stage 1 (rank 1): blocks 1-1; stage 2 (rank 0): blocks 2-2; stage 3 (rank 1): blocks 3-3 + norm, head, loss"
    )


def test_stages_hold_the_models_parameters_under_its_own_names_once() -> None:
    config = ModelConfig(n_layers=5)
    whole = {name: p.shape for name, p in build_model(config).named_parameters()}
    held: dict[str, torch.Size] = {}
    for stage in range(3):
        for name, param in build_stage(config, stage, 3).named_parameters():
            assert name not in held, name
            held[name] = param.shape
    assert held == whole
    assert [n for n, _ in build_stage(config, 1, 3).named_parameters()][0] == "layers.2.attention.wq.weight"


def test_stages_chained_compute_the_models_logits() -> None:
    """Each stage initialised by name as the whole model is: stage 1 of stage 0's output is the model's output."""
    config = ModelConfig()
    model = build_model(config)
    materialize(model, "cpu", seed=3)
    stages = [build_stage(config, stage, 2) for stage in range(2)]
    for stage in stages:
        materialize(stage, "cpu", seed=3)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](tokens)), model(tokens), rtol=0, atol=0)
