"""Every option of every config group composes and validates against the typed schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.helpers import CONF, compose_config
from trainer.config import STAGE_REDUCE_EVERY, TrainConfig, to_plain

GROUPS = [
    "model",
    "loss",
    "precision",
    "zero",
    "checkpointing",
    "offload",
    "dataloader",
    "data",
    "optim",
    "save",
    "logger",
]
REQUIRED_OPTIONS = {
    "model": {
        "tiny",
        "125m",
        "350m",
        "1b",
        "7b",
        "13b",
        "70b",
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "llama3.2-1b",
        "llama3.2-3b",
        "qwen3-0.6b",
        "qwen3-8b",
        "qwen3-32b",
        "mistral-7b",
        "hf",
    },
    "loss": {"full", "chunked"},
    "precision": {"fp32", "bf16", "fp16", "fp8"},
    "zero": {"stage0", "stage1", "stage2", "stage3"},
    "checkpointing": {"none", "full", "selective"},
    "offload": {"none", "cpu"},
    "dataloader": {"default"},
    "data": {"synthetic", "tokens"},
    "optim": {"adamw"},
    "save": {"default", "off"},
    "logger": {"wandb", "none"},
}
# What an option file's first line must name: the mechanism (a torch/numpy API, a class, FSDP2,
# W&B, the published model family it copies: Llama, Qwen, Mistral), or for an option that turns one off, that it is off.
MECHANISM = re.compile(
    r"\b(torch|numpy)\.\w+|\b[A-Z][a-z]+[A-Z]\w+|\bFSDP2\b|Weights & Biases|\b(Llama|Qwen\d*|Mistral|Mixtral)\b|^# (No|Only) "
)
# Options that need a partner to be valid on their own.
PARTNERS = {
    ("offload", "cpu"): ["zero=stage3"],
    ("offload", "nvme"): ["zero=stage3", "offload.path=/tmp"],
    ("data", "tokens"): ["data.path=tokens.npy"],
    ("data", "text"): ["data.files=[corpus.jsonl]", "data.tokenizer=tokenizer.json"],
    # A Llama config.json (LlamaConfig's defaults fill the rest); skipped without transformers.
    ("model", "hf"): [f"model.config={Path(__file__).parent / 'llama_config.json'}"],
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_group_has_the_required_options(group: str) -> None:
    assert REQUIRED_OPTIONS[group] <= set(options(group))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group: str, option: str) -> None:
    """The validated config's group is the schema's defaults with the option file's values on top."""
    if (group, option) == ("model", "hf"):
        pytest.importorskip("transformers")
    partners = PARTNERS.get((group, option), [])
    config = compose_config(f"{group}={option}", *partners)
    if (group, option) == ("model", "hf"):  # the shapes come from the config.json, not the option file
        assert (config.model.dim, config.model.n_layers, config.model.vocab_size) == (64, 2, 256)
        return
    # the file's values as the job resolves them (conf/zero's `${zerolab.reduce_every:...,${parallel.pp}}`)
    context = OmegaConf.create(
        {"parallel": {"pp": config.parallel.pp}, group: OmegaConf.load(CONF / group / f"{option}.yaml")}
    )
    chosen = OmegaConf.to_container(context, resolve=True)[group] or {}
    by_partner = {
        o.split("=")[0].removeprefix(f"{group}."): yaml.safe_load(o.split("=")[1])  # `[a]` is a list
        for o in partners
        if o.startswith(f"{group}.")
    }
    expected = {**to_plain(TrainConfig())[group], **chosen, **by_partner}
    assert to_plain(config)[group] == expected


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_file_opens_with_a_comment_naming_its_mechanism(group: str, option: str) -> None:
    first = (CONF / group / f"{option}.yaml").read_text().splitlines()[0]
    assert first.startswith("# ") and MECHANISM.search(first), first
    others = [(CONF / group / f"{o}.yaml").read_text().splitlines()[0] for o in options(group) if o != option]
    assert first not in others  # each option says what it does, not its group's boilerplate


def test_the_option_selects_its_values() -> None:
    config = compose_config("model=70b", "zero=stage3", "precision=fp16", "checkpointing=selective")
    assert (config.model.dim, config.model.n_layers, config.model.n_kv_heads) == (8192, 80, 8)
    assert config.zero.stage.value == "stage3"
    assert config.precision.compute_dtype.value == "float16"
    assert config.checkpointing.every_n_layers == 2


def test_defaults_are_the_documented_ones() -> None:
    config = compose_config()
    assert (config.model.name, config.zero.stage.value, config.precision.name) == ("tiny", "stage0", "fp32")
    assert config.nproc == "auto" and config.device.value == "auto" and config.mode.value == "train"


def test_composed_defaults_are_the_schemas() -> None:
    """Each default lives in one place, the schema: conf/train.yaml only picks the groups' options
    (and Hydra's settings), and each group's default option leaves the schema's values alone."""
    train_yaml = OmegaConf.load(CONF / "train.yaml")
    assert set(train_yaml.keys()) == {"defaults", "hydra"}
    assert to_plain(compose_config()) == to_plain(TrainConfig())


@pytest.mark.parametrize("stage", options("zero"))
def test_each_stage_sets_when_gradients_are_reduced(stage: str) -> None:
    """conf/zero: micro_batch at stage2/3 (ZeRO's sharded accumulation), step at stage0/1; the
    mapping suggestions use (trainer/config/zero.py STAGE_REDUCE_EVERY) is what the files say."""
    config = compose_config(f"zero={stage}")
    assert config.zero.reduce_every == STAGE_REDUCE_EVERY[config.zero.stage]
    assert config.zero.reduce_every.value == ("micro_batch" if stage in ("stage2", "stage3") else "step")
    other = "step" if config.zero.reduce_every.value == "micro_batch" else "micro_batch"
    assert compose_config(f"zero={stage}", f"zero.reduce_every={other}").zero.reduce_every.value == other
    # under a pipeline the stage's file says step: PipelineStage reduces once, after the step's last backward
    if stage != "stage1":  # which the pipeline refuses (the composition table)
        pipelined = compose_config(f"zero={stage}", "parallel.pp=2", "grad_accum=2")
        assert pipelined.zero.reduce_every.value == "step"
