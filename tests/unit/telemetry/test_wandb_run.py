"""What a job's W&B run says about itself (trainer/telemetry/wandb_run.py): tags, typed swept values, steady keys."""

from __future__ import annotations

from trainer.config import TrainConfig, to_plain
from trainer.telemetry.wandb_run import build_labels, config_path, steady_figures, sweep_keys

CHOICES = {
    "model": "tiny",
    "precision": "bf16",
    "zero": "stage3",
    "checkpointing": "full",
    "offload": "none",
    "data": "synthetic",
    "logger": "wandb",
}


def plain(**changes: object) -> dict:
    config = to_plain(TrainConfig())
    config.update(changes)
    return config


def test_a_sweep_points_tags_name_its_choices_and_the_sweep() -> None:
    labels = build_labels(plain(), CHOICES, ["zero"], ["zero=stage3"], multirun=True)
    assert labels.tags == [
        "model=tiny",
        "precision=bf16",
        "zero=stage3",
        "checkpointing=full",
        "offload=none",
        "sweep",
    ]
    assert "sweep" not in build_labels(plain(), CHOICES, [], [], multirun=False).tags


def test_swept_values_are_typed_as_the_config_has_them() -> None:
    config = plain(micro_batch=4)
    config["precision"]["loss_scale_init"] = 1024.0
    overrides = ["micro_batch=4", "zero=stage3", "precision.loss_scale_init=1024", "nproc=2"]
    labels = build_labels(
        config, CHOICES, ["micro_batch", "zero", "precision.loss_scale_init"], overrides, multirun=True
    )
    assert labels.swept == {"micro_batch": 4, "zero": "stage3", "precision/loss_scale_init": 1024.0}
    assert [type(v) for v in labels.swept.values()] == [int, str, float]


def test_the_swept_keys_are_the_sweep_overrides_and_the_named_sweeps_params() -> None:
    overrides = [
        "micro_batch=1,2",
        "nproc=2",
        "zero=stage2,stage3",
        "steps=range(1,3)",
        "+sweeps=micro_batch_x_stage",
    ]
    assert sweep_keys(overrides, {"seq_len": "64,128", "zero": "stage0,stage1"}) == [
        "micro_batch",
        "zero",
        "steps",
        "seq_len",
    ]


def test_a_group_choice_is_addressed_through_the_field_that_names_it() -> None:
    assert [config_path(k) for k in ("zero", "model", "precision", "micro_batch", "zero.reduce_dtype", "dataloader")] == [
        "zero.stage", "model.name", "precision.name", "micro_batch", "zero.reduce_dtype", "swept.dataloader",
    ]  # fmt: skip


def test_steady_figures_go_under_keys_no_record_is_logged_under() -> None:
    summary = {"throughput/tokens_per_s": 1234.5, "throughput/mfu_pct": None, "loss/final": 2.0}
    assert steady_figures(summary) == {"throughput/steady_tokens_per_s": 1234.5}


def test_a_rank_importing_the_job_and_its_logger_does_not_import_wandb() -> None:
    """Under torchrun every rank runs trainer.job; only rank 0's process may start W&B."""
    import subprocess
    import sys

    code = "import sys, trainer.job, trainer.telemetry.wandb_logger, trainer.telemetry.wandb_run, trainer.launch; print('wandb' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"
