"""trainer/model/compile.py on CPU: compile=true trains like eager, keeps parameter names, composes with checkpointing and FSDP2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import WORLD, run_steps, tiny_config
from trainer.model.decoder import build_model, init_weights
from trainer.plan import COMPILE_NOTE, build_plan
from trainer.rank.loop import build_trainee
from trainer.saves.dcp import Progress, SaveSpec, load_training_state, save_training_state, saved_keys


def losses(config, steps: int) -> tuple[list[float], object]:
    torch.manual_seed(config.seed)
    trainee = build_trainee(config, WORLD)
    return run_steps(trainee, config, 1, steps), trainee


@pytest.mark.parametrize(
    "overrides", [dict(zero__stage="stage0"), dict(zero__stage="stage3", checkpointing__mode="full")]
)
def test_compiled_blocks_train_like_eager_over_8_steps(process_group: None, overrides: dict) -> None:
    eager, _ = losses(tiny_config(steps=8, **overrides), 8)
    compiled, trainee = losses(
        tiny_config(steps=8, compile=True, compile_backend="aot_eager", **overrides), 8
    )
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= 1e-5
    model = getattr(trainee.model, "module", trainee.model)  # DDP keeps the model as .module
    block = model.layers[0]
    assert (
        block._compiled_call_impl is not None
    )  # compiled in place, under FSDP2's hooks and the checkpoint wrapper
    assert not any("_orig_mod" in name for name, _ in trainee.model.named_parameters())


def test_compiled_and_eager_saves_are_interchangeable(process_group: None, tmp_path: Path) -> None:
    compiled_config = tiny_config(compile=True, compile_backend="aot_eager")
    _, compiled = losses(compiled_config, 1)
    save_training_state(
        compiled, SaveSpec.of(compiled_config), WORLD, tmp_path / "compiled", Progress(step=1)
    )
    eager_config = tiny_config()
    _, eager = losses(eager_config, 1)
    save_training_state(eager, SaveSpec.of(eager_config), WORLD, tmp_path / "eager", Progress(step=1))
    keys = [saved_keys(tmp_path / run / "checkpoints" / "step_00000001") for run in ("compiled", "eager")]
    assert keys[0] == keys[1]
    fresh = build_trainee(eager_config, WORLD)
    load_training_state(
        fresh, SaveSpec.of(eager_config), WORLD, tmp_path / "compiled" / "checkpoints" / "step_00000001"
    )
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.model.state_dict().values(), compiled.model.state_dict().values())
    )


def test_the_plan_says_it_does_not_model_compile() -> None:
    assert build_plan(tiny_config(compile=True), "cpu", 1).to_json()["compile"] == COMPILE_NOTE
    assert "compile" not in build_plan(tiny_config(), "cpu", 1).to_json()


def test_inductor_compiles_a_block_on_cpu() -> None:
    """One real inductor build (g++), of the tiny model: forward and backward match eager."""
    config = tiny_config().model
    model = build_model(config, device="cpu")
    init_weights(model, seed=0)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    eager = model(tokens)
    eager.float().square().mean().backward()
    eager_grad = model.layers[0].attention.wq.weight.grad.clone()
    model.zero_grad()
    model.layers[0].compile(backend="inductor")
    compiled = model(tokens)
    compiled.float().square().mean().backward()
    assert torch.allclose(compiled, eager, atol=1e-5)
    assert torch.allclose(model.layers[0].attention.wq.weight.grad, eager_grad, atol=1e-6)
