"""What a job's W&B run says about itself, so that W&B can sort, group and compare runs.

- tags: the option of each group that changes what a run measures (`zero=stage3`,
  `precision=bf16`, `checkpointing=full`, `offload=cpu`, `model=125m`) and `sweep` for a
  multirun point;
- `swept` in the run's config: the keys the sweep varies (a single run: the keys its command
  line set), each with the value the job used, typed (`micro_batch: 4`, not `"4"`), so that the
  runs table, group-by and parallel coordinates work on numbers;
- metric definitions: `step` (the optimizer step, as in metrics.jsonl) is the x-axis of every
  metric; the summary keeps the lowest and the last training loss and the highest memory figures;
- steady figures: summary.json's steady-state throughput and MFU (warm-up left out) under keys
  of their own, which no logged record ever overwrites.

Hydra's view of the job (its choices, overrides, sweep) is read in `describe_job`; everything
else here works on plain values, so tests and the report builder use it without Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from trainer.overrides import split_override
from trainer.telemetry import keys

TAGGED_GROUPS = ("model", "precision", "zero", "checkpointing", "offload")
SWEEP_TAG = "sweep"
STEP_KEY = "step"  # metrics.jsonl's optimizer step, logged with every record
# summary.json key -> the W&B summary key that holds it for good (a key no record is logged under).
STEADY_KEYS = {
    keys.TOKENS_PER_S: keys.STEADY_TOKENS_PER_S,
    keys.MFU_PCT: keys.STEADY_MFU_PCT,
}
# The field of a group's resolved config that names the chosen option, so that a comparison can
# address a group choice through the whole config every run carries (`config.zero.stage`).
GROUP_FIELDS = {
    "model": "model.name",
    "precision": "precision.name",
    "zero": "zero.stage",
    "checkpointing": "checkpointing.mode",
    "offload": "offload.target",
    "data": "data.kind",
    "optim": "optim.name",
    "logger": "logger.backend",
}
UNNAMED_GROUPS = ("dataloader", "save")  # their options set several fields, none naming the option


@dataclass(frozen=True)
class JobLabels:
    """The tags and the typed swept values of one job's W&B run."""

    tags: list[str] = field(default_factory=list)
    swept: dict[str, Any] = field(default_factory=dict)


def config_path(key: str) -> str:
    """Where an override key's value sits in a run's W&B config: a group choice at the group's naming
    field (`zero` -> `zero.stage`), a key at its own dotted path, a group without one under `swept`."""
    if key in GROUP_FIELDS:
        return GROUP_FIELDS[key]
    if key in UNNAMED_GROUPS:
        return f"swept.{swept_name(key)}"
    return key


def swept_name(key: str) -> str:
    """A key inside `swept`: W&B reads a dot in a config key as nesting, so dotted keys use `/`."""
    return key.replace(".", "/")


def build_labels(
    plain_config: dict[str, Any],
    choices: dict[str, str],
    swept_keys: list[str],
    overrides: list[str],
    multirun: bool,
) -> JobLabels:
    """Tags from the group choices; `swept` from the job's own overrides of the keys in `swept_keys`."""
    tags = [f"{group}={choices[group]}" for group in TAGGED_GROUPS if choices.get(group)]
    if multirun:
        tags.append(SWEEP_TAG)
    given = dict(split_override(o) for o in overrides)
    swept = {swept_name(key): typed_value(key, given.get(key), plain_config, choices) for key in swept_keys}
    return JobLabels(tags=tags, swept=swept)


def typed_value(key: str, given: str | None, plain_config: dict[str, Any], choices: dict[str, str]) -> Any:
    """The value the job used for `key`: a group's option name, or the resolved config's typed value."""
    if key in choices:
        return choices[key]
    value = OmegaConf.select(OmegaConf.create(plain_config), key, default=given)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def sweep_keys(sweep_overrides: list[str], sweeper_params: dict[str, Any]) -> list[str]:
    """The keys a multirun varies: sweep overrides on its command line (`micro_batch=1,2`, `range(...)`)
    and the named sweep's `hydra.sweeper.params`, in the order given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(sweep_overrides)
    keys = [o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()]
    return list(dict.fromkeys([*keys, *sweeper_params]))


def describe_job(plain_config: dict[str, Any]) -> JobLabels:
    """The labels of the Hydra job running in this process."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_config = HydraConfig.get()
    choices = {
        k: v for k, v in hydra_config.runtime.choices.items() if v is not None and not k.startswith("hydra/")
    }
    excluded = set(hydra_config.job.config.override_dirname.exclude_keys)
    overrides = [o for o in hydra_config.overrides.task if split_override(o)[0] not in excluded]
    multirun = hydra_config.mode == RunMode.MULTIRUN
    if multirun:
        recorded = Path(hydra_config.sweep.dir) / "multirun.yaml"  # written by the launcher before any job
        sweep_overrides = (
            list(OmegaConf.load(recorded).hydra.overrides.task) if recorded.exists() else overrides
        )
        keys = [
            k
            for k in sweep_keys(sweep_overrides, dict(hydra_config.sweeper.get("params") or {}))
            if k not in excluded
        ]
    else:
        keys = [split_override(o)[0] for o in overrides]
    return build_labels(plain_config, choices, keys, overrides, multirun)


SUMMARIZED_BY_WANDB = (keys.LOSS_VAL, keys.PERPLEXITY_VAL)
"""History keys whose W&B summary is define_metrics' min and last rather than summary.json's value."""


def define_metrics(run: Any) -> None:
    """The x-axis of every chart is the optimizer step; the summaries W&B keeps while records arrive."""
    run.define_metric(STEP_KEY, hidden=True)
    run.define_metric("*", step_metric=STEP_KEY)
    run.define_metric(keys.LOSS, summary="min,last")
    for key in SUMMARIZED_BY_WANDB:
        run.define_metric(key, summary="min,last")
    run.define_metric(keys.EVERY_MEMORY_KEY, summary="max")


def steady_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """summary.json's steady-state figures under the W&B summary keys of their own."""
    return {wandb_key: summary[key] for key, wandb_key in STEADY_KEYS.items() if summary.get(key) is not None}
