"""trainer/saves/dcp.py in one process, on CPU: the save schedule, what counts as a save, and real DCP
round trips on a single-rank gloo group. Multi-rank saves, kills and resharding are in
tests/integration/test_resume.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from tests.helpers import WORLD, fake_save, run_steps, tiny_config
from trainer.config import ConfigError
from trainer.data import build_batches
from trainer.rank.loop import build_trainee, train_step
from trainer.rank.nonfinite import NonFiniteGuard
from trainer.rank.trainee import Trainee, local_optimizer
from trainer.saves.dcp import (
    Progress,
    SaveSpec,
    check_global_batch,
    latest_save,
    list_saves,
    load_training_state,
    per_group,
    prune,
    read_progress,
    save_training_state,
    saved_keys,
    should_save,
)


def test_saves_every_n_steps_and_at_the_last() -> None:
    every_4, never = tiny_config(steps=10, save__every=4), tiny_config(steps=10, save__every=0)
    assert [s for s in range(1, 11) if should_save(every_4.save, every_4.steps, s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if should_save(never.save, never.steps, s)] == []


def test_only_renamed_saves_with_metadata_are_saves(tmp_path: Path) -> None:
    fake_save(tmp_path, 4)
    fake_save(tmp_path, 8, tmp=True)  # killed before the rename: all written, never published
    fake_save(tmp_path, 12, complete=False)  # a step_ directory without DCP's metadata
    assert [p.name for p in list_saves(tmp_path)] == ["step_00000004"]
    assert latest_save(tmp_path) == tmp_path / "checkpoints" / "step_00000004"


def test_prune_keeps_the_newest_saves_and_clears_leftovers(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8, 20):
        fake_save(tmp_path, step)
    fake_save(tmp_path, 10, tmp=True)
    prune(tmp_path / "checkpoints", keep=2, step=8)  # step 20: a replaced run's save in a reused directory
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]


def test_a_different_global_batch_is_refused_naming_the_keys() -> None:
    with pytest.raises(
        ConfigError,
        match=r"global batch of 8 sequences; this run has 4 \(micro_batch=2 x grad_accum=1 x 2 ranks\)",
    ):
        check_global_batch(8, SaveSpec.of(tiny_config()), 2, Path("save"))


def full_state(trainee: Trainee) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors by canonical name, as plain local tensors."""
    model = get_model_state_dict(trainee.model)
    optim = get_optimizer_state_dict(trainee.model, local_optimizer(trainee.optimizer))
    tensors = {f"model.{k}": v for k, v in model.items()}
    tensors |= {f"optim.{fqn}.{k}": v for fqn, state in optim["state"].items() for k, v in state.items()}
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in tensors.items()
    }


@pytest.mark.parametrize("stage", ["stage1", "stage3"])
def test_a_save_restores_every_tensor_and_the_next_loss_bitwise(
    process_group: None, tmp_path: Path, stage: str
) -> None:
    config = tiny_config(zero__stage=stage, save__every=2)
    torch.manual_seed(config.seed)
    trainee = build_trainee(config, WORLD)
    run_steps(trainee, config, 1, 2)
    save_training_state(trainee, SaveSpec.of(config), WORLD, tmp_path, Progress(step=2, nonfinite_skipped=1))
    saved, lr = full_state(trainee), trainee.scheduler.get_last_lr()
    expected = run_steps(trainee, config, 3, 4)

    torch.manual_seed(config.seed + 1)  # a different init: everything must come from the save
    fresh = build_trainee(config, WORLD)
    progress = load_training_state(
        fresh, SaveSpec.of(config), WORLD, tmp_path / "checkpoints" / "step_00000002"
    )
    assert (progress.step, progress.nonfinite_skipped) == (2, 1)
    restored = full_state(fresh)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert (
        fresh.scheduler.get_last_lr() == lr
        and local_optimizer(fresh.optimizer).param_groups[0]["lr"] == lr[0]
    )
    assert run_steps(fresh, config, 3, 4) == expected


def test_names_in_a_save_do_not_depend_on_the_stage(process_group: None, tmp_path: Path) -> None:
    keys = {}
    for stage in ("stage0", "stage1", "stage3"):
        config = tiny_config(zero__stage=stage)
        trainee = build_trainee(config, WORLD)
        run_steps(trainee, config, 1, 1)
        save_training_state(trainee, SaveSpec.of(config), WORLD, tmp_path / stage, Progress(step=1))
        keys[stage] = {
            k
            for k in saved_keys(tmp_path / stage / "checkpoints" / "step_00000001")
            if k.startswith(("model.", "optim."))
        }
        assert read_progress(tmp_path / stage / "checkpoints" / "step_00000001")["stage"] == stage
    assert keys["stage0"] == keys["stage1"] == keys["stage3"]
    assert "model.layers.0.attention.wq.weight" in keys["stage0"]  # no module., no wrapper prefixes


def test_fp16_scale_round_trips_and_the_configured_factors_stay(process_group: None, tmp_path: Path) -> None:
    fp16 = dict(precision__compute_dtype="float16", precision__loss_scale_init=1024.0)
    config = tiny_config(**fp16, fault__kind="inf_grad", fault__step=2)
    trainee = build_trainee(config, WORLD)
    run_steps(trainee, config, 1, 2)  # step 2 overflows: the scale backs off to 512
    save_training_state(trainee, SaveSpec.of(config), WORLD, tmp_path, Progress(step=2))
    other = tiny_config(**fp16, precision__backoff_factor=0.25)
    fresh = build_trainee(other, WORLD)
    load_training_state(fresh, SaveSpec.of(other), WORLD, tmp_path / "checkpoints" / "step_00000002")
    assert fresh.scaler.state_dict() == {**trainee.scaler.state_dict(), "backoff_factor": 0.25}
    assert fresh.scaler.get_scale() == 512.0


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage3"])
def test_the_running_optimizer_keeps_its_implementation_over_a_saves(
    process_group: None, tmp_path: Path, stage: str
) -> None:
    """A save of the per-tensor AdamW resumed with the fused one (issue 27, item 3): the loaded
    param groups must not switch the running AdamW back, or the deferred skip's found_inf reaches
    the per-tensor path, which asserts at the first step."""
    saved_config = tiny_config(zero__stage=stage, optim__fused=False)
    trainee = build_trainee(saved_config, WORLD)
    run_steps(trainee, saved_config, 1, 1)
    save_training_state(trainee, SaveSpec.of(saved_config), WORLD, tmp_path, Progress(step=1))
    config = tiny_config(zero__stage=stage, optim__fused=True)
    fresh = build_trainee(config, WORLD)
    load_training_state(fresh, SaveSpec.of(config), WORLD, tmp_path / "checkpoints" / "step_00000001")
    groups = [*local_optimizer(fresh.optimizer).param_groups, *fresh.optimizer.param_groups]
    assert [(g["fused"], g["foreach"], g["capturable"], g["differentiable"]) for g in groups] == [
        (True, None, False, False)
    ] * len(groups)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, WORLD, fp16=False, defer=True)
    batches = build_batches(config, 0, 1, start_step=1)
    losses = [train_step(fresh, batches, config, WORLD, step, guard).loss.item() for step in (2, 3)]
    guard.settle()
    assert guard.skipped == 0 and all(loss == loss for loss in losses)


# ----------------------------------------------------------------------------- RNG state follows the rank's device


def test_a_cpu_save_loads_with_cuda_state_absent_and_present(
    process_group: None, tmp_path: Path, monkeypatch
) -> None:
    import trainer.saves.dcp as save

    config = tiny_config()
    spec = SaveSpec.of(config)
    trainee = build_trainee(config, WORLD)
    run_steps(trainee, config, 1, 1)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host running CPU ranks
        assert sorted(save.rng_state(WORLD.device)) == [
            "numpy",
            "python",
            "torch",
        ]  # keyed on the rank's device
    save_training_state(trainee, spec, WORLD, tmp_path / "cpu", Progress(step=1))
    cpu_save = tmp_path / "cpu" / "checkpoints" / "step_00000001"
    assert not any(k.startswith("rng.rank0.cuda") for k in saved_keys(cpu_save))
    saved_torch = torch.get_rng_state()

    applied: list[dict] = []
    real_rng_state, real_set = save.rng_state, save.set_rng_state
    monkeypatch.setattr(
        save, "set_rng_state", lambda state, device: (applied.append(state), real_set(state, device))
    )
    load_training_state(
        build_trainee(config, WORLD), spec, WORLD, cpu_save
    )  # a CPU rank: no CUDA state asked for
    # A GPU rank asks for CUDA state the CPU save does not have: the load leaves it out.
    fake_cuda = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(
        save, "rng_state", lambda device: {**real_rng_state(device), "cuda": fake_cuda.clone()}
    )
    load_training_state(build_trainee(config, WORLD), spec, WORLD, cpu_save)
    assert [sorted(state) for state in applied] == [["numpy", "python", "torch"]] * 2
    assert all(torch.equal(state["torch"], saved_torch) for state in applied)

    # And a save made by a GPU rank (with CUDA state, still patched in) loads on a CPU rank.
    save_training_state(trainee, spec, WORLD, tmp_path / "gpu", Progress(step=1))
    gpu_save = tmp_path / "gpu" / "checkpoints" / "step_00000001"
    assert "rng.rank0.cuda" in saved_keys(gpu_save)
    monkeypatch.setattr(save, "rng_state", real_rng_state)
    assert load_training_state(build_trainee(config, WORLD), spec, WORLD, gpu_save).step == 1
    assert sorted(applied[-1]) == ["numpy", "python", "torch"]


def test_a_schedulers_state_resumes_across_one_and_two_param_groups() -> None:
    """A save from an optimizer of two param groups (DDP with parallel.ep: the experts and the rest) loads into
    a scheduler of one, and back: each per-group value repeated to the running count; differing values are kept."""
    from torch.optim.lr_scheduler import LambdaLR

    def schedule(groups: int) -> LambdaLR:
        params = [torch.nn.Parameter(torch.ones(2)) for _ in range(groups)]
        optimizer = torch.optim.AdamW([{"params": [p]} for p in params], lr=0.1)
        return LambdaLR(optimizer, lambda step: 1.0 / (step + 1))

    two = schedule(2)
    for _ in range(3):
        two.optimizer.step()
        two.step()
    one = schedule(1)
    one.load_state_dict(per_group(two.state_dict(), 1))
    assert one.get_last_lr() == [0.025] and one.base_lrs == [0.1] and one.last_epoch == 3
    back = schedule(2)
    back.load_state_dict(per_group(one.state_dict(), 2))
    assert back.get_last_lr() == [0.025, 0.025]
    differing = {"base_lrs": [0.1, 0.2], "last_epoch": 3}
    assert per_group(differing, 1) == differing
