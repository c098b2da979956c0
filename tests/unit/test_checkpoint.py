"""trainer/save.py and trainer/resume.py (and the non-finite policy of trainer/nonfinite.py) in one process, on CPU.

The DCP round trips run a real single-rank gloo process group; multi-rank saves, kills and
resharding are in tests/integration/test_resume.py.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from trainer.config import ConfigError, TrainConfig, from_plain, to_plain
from trainer.data import build_batches
from trainer.loop import build_trainee, train_step
from trainer.nonfinite import NonFinite, NonFiniteError, NonFiniteGuard, find_nonfinite
from trainer.optim import local_optimizer
from trainer.resume import resolve_resume, rewind_metrics
from trainer.save import (
    Progress,
    SaveSpec,
    check_global_batch,
    latest_save,
    list_saves,
    load_training_state,
    prune,
    read_progress,
    save_training_state,
    saved_keys,
    should_save,
)
from trainer.trainee import Trainee
from trainer.world import World

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def tiny_config(**overrides: object) -> TrainConfig:
    plain = to_plain(TrainConfig())
    plain.update(seq_len=32, micro_batch=2, steps=6, nproc="1", device="cpu", log_every=1)
    plain["model"].update(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=64, max_seq_len=64)
    plain["optim"].update(warmup_steps=2)
    plain["logger"]["backend"] = "none"
    for dotted, value in overrides.items():
        *path, key = dotted.split("__")
        node = plain
        for part in path:
            node = node[part]
        node[key] = value
    return from_plain(plain)


# ----------------------------------------------------------------------------- the schedule and the directory


def test_saves_every_n_steps_and_at_the_last() -> None:
    every_4, never = tiny_config(steps=10, save__every=4), tiny_config(steps=10, save__every=0)
    assert [s for s in range(1, 11) if should_save(every_4.save, every_4.steps, s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if should_save(never.save, never.steps, s)] == []


def fake_save(run_dir: Path, step: int, complete: bool = True, tmp: bool = False) -> Path:
    name = f"{'.tmp_' if tmp else ''}step_{step:08d}"
    path = run_dir / "checkpoints" / name
    path.mkdir(parents=True)
    if complete:
        (path / ".metadata").write_bytes(b"x")
    return path


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


def test_rewinding_metrics_keeps_records_up_to_the_save_in_a_new_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss/train": 1.0 / s}) + "\n" for s in range(1, 7)))
    inode = path.stat().st_ino
    rewind_metrics(tmp_path, 6)  # nothing to drop: the file is left alone
    assert path.stat().st_ino == inode
    rewind_metrics(tmp_path, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert path.stat().st_ino != inode  # the W&B feeder notices a replaced file and rereads it


# ----------------------------------------------------------------------------- resume resolution


def fake_run(run_dir: Path, config: TrainConfig, steps: tuple[int, ...]) -> None:
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(to_plain(config)))
    for step in steps:
        fake_save(run_dir, step)


def test_resume_true_continues_the_newest_save_of_the_same_config(tmp_path: Path) -> None:
    day = tmp_path / "runs" / "2026-01-01"
    config = tiny_config()
    fake_run(day / "10-00-00", config, (4,))
    fake_run(day / "11-00-00", tiny_config(seed=1), (8,))  # another config: never resumed
    fake_run(day / "12-00-00", tiny_config(fault__kind="kill", fault__step=7), (4, 8))  # fault.* aside, the same run
    os.utime(day / "10-00-00" / "checkpoints" / "step_00000004" / ".metadata", (1, 1))  # older
    new_dir = day / "13-00-00"
    new_dir.mkdir()
    resume, run_dir = resolve_resume(tiny_config(resume="true"), new_dir)
    assert (resume, run_dir) == (str(day / "12-00-00" / "checkpoints" / "step_00000008"), day / "12-00-00")


def test_resume_true_without_a_save_starts_at_step_0(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs" / "day" / "t0"
    out_dir.mkdir(parents=True)
    assert resolve_resume(tiny_config(resume="true"), out_dir) == ("false", out_dir)


def test_resume_a_path_to_a_run_or_to_a_save(tmp_path: Path) -> None:
    run = tmp_path / "old"
    fake_run(run, tiny_config(), (4, 8))
    here = tmp_path / "new"
    assert resolve_resume(tiny_config(resume=str(run)), here) == (str(run / "checkpoints" / "step_00000008"), run)
    save = run / "checkpoints" / "step_00000004"
    assert resolve_resume(tiny_config(resume=str(save)), here) == (str(save), here)  # e.g. other ranks or stage
    with pytest.raises(ConfigError, match=r"^resume=.*allowed: false, true, a run directory"):
        resolve_resume(tiny_config(resume=str(tmp_path / "nothing")), here)


def test_a_different_global_batch_is_refused_naming_the_keys() -> None:
    with pytest.raises(ConfigError, match=r"global batch of 8 sequences; this run has 4 \(micro_batch=2 x grad_accum=1 x 2 ranks\)"):
        check_global_batch(8, SaveSpec.of(tiny_config()), 2, Path("save"))


# ----------------------------------------------------------------------------- real DCP round trips, one rank


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A one-rank gloo group in this process (DCP and FSDP2 collectives need one)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def run_steps(trainee: Trainee, config: TrainConfig, first: int, last: int) -> list[float]:
    batches = build_batches(config, 0, 1, start_step=first - 1)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, WORLD)
    return [train_step(trainee, batches, config, WORLD, step, guard).loss.item() for step in range(first, last + 1)]


def full_state(trainee: Trainee) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors by canonical name, as plain local tensors."""
    model = get_model_state_dict(trainee.model)
    optim = get_optimizer_state_dict(trainee.model, local_optimizer(trainee.optimizer))
    tensors = {f"model.{k}": v for k, v in model.items()}
    tensors |= {f"optim.{fqn}.{k}": v for fqn, state in optim["state"].items() for k, v in state.items()}
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in tensors.items()}


@pytest.mark.parametrize("stage", ["stage1", "stage3"])
def test_a_save_restores_every_tensor_and_the_next_loss_bitwise(process_group: None, tmp_path: Path, stage: str) -> None:
    config = tiny_config(zero__stage=stage, save__every=2)
    torch.manual_seed(config.seed)
    trainee = build_trainee(config, WORLD)
    run_steps(trainee, config, 1, 2)
    save_training_state(trainee, SaveSpec.of(config), WORLD, tmp_path, Progress(step=2, nonfinite_skipped=1))
    saved, lr = full_state(trainee), trainee.scheduler.get_last_lr()
    expected = run_steps(trainee, config, 3, 4)

    torch.manual_seed(config.seed + 1)  # a different init: everything must come from the save
    fresh = build_trainee(config, WORLD)
    progress = load_training_state(fresh, SaveSpec.of(config), WORLD, tmp_path / "checkpoints" / "step_00000002")
    assert (progress.step, progress.nonfinite_skipped) == (2, 1)
    restored = full_state(fresh)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert fresh.scheduler.get_last_lr() == lr and local_optimizer(fresh.optimizer).param_groups[0]["lr"] == lr[0]
    assert run_steps(fresh, config, 3, 4) == expected


def test_names_in_a_save_do_not_depend_on_the_stage(process_group: None, tmp_path: Path) -> None:
    keys = {}
    for stage in ("stage0", "stage1", "stage3"):
        config = tiny_config(zero__stage=stage)
        trainee = build_trainee(config, WORLD)
        run_steps(trainee, config, 1, 1)
        save_training_state(trainee, SaveSpec.of(config), WORLD, tmp_path / stage, Progress(step=1))
        keys[stage] = {k for k in saved_keys(tmp_path / stage / "checkpoints" / "step_00000001") if k.startswith(("model.", "optim."))}
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


# ----------------------------------------------------------------------------- the non-finite policy


def test_raise_names_step_rank_and_loss() -> None:
    config = tiny_config()
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, WORLD)
    with pytest.raises(NonFiniteError, match=r"^non-finite loss at step 3 on rank 1 \(nonfinite=raise"):
        guard.check(NonFinite(step=3, loss_ranks=(1,), gradient=True))


def test_skip_counts_and_stops_after_max_in_a_row() -> None:
    config = tiny_config(nonfinite="skip", max_nonfinite_skips=3)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, WORLD)
    bad = NonFinite(step=5, loss_ranks=(), gradient=True)
    assert [guard.check(bad), guard.check(None), guard.check(bad), guard.check(bad)] == [False, True, False, False]
    assert guard.skipped == 3
    with pytest.raises(NonFiniteError, match=r"non-finite gradient at step 5 .*: 3 non-finite steps in a row"):
        guard.check(bad)


def test_find_nonfinite_tells_loss_from_gradient_and_leaves_fp16_overflow_to_the_scaler() -> None:
    nan, inf, one = torch.tensor(math.nan), torch.tensor(math.inf), torch.tensor(1.0)
    assert find_nonfinite(nan, inf, 3, WORLD, scaler_enabled=False) == NonFinite(3, (0,), True)
    assert find_nonfinite(one, inf, 3, WORLD, scaler_enabled=False) == NonFinite(3, (), True)
    assert find_nonfinite(one, inf, 3, WORLD, scaler_enabled=True) is None  # an overflow: GradScaler skips it
    assert find_nonfinite(nan, inf, 3, WORLD, scaler_enabled=True) == NonFinite(3, (0,), True)
    assert find_nonfinite(one, one, 3, WORLD, scaler_enabled=False) is None
