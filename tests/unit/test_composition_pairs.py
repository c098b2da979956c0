"""Every pair of the config groups' options and the techniques' switches, generated: each pair is accepted and
planned, or refused by the composition table (trainer/config/composition.py), or is one of the few pairs a
setting's own meaning excludes (PRECONDITION_PAIRS below, each with the key that says why). A refusal from
anywhere else, a listed pair that now composes, or a plan that raises fails the test (issue 58, acceptance 1).

Each option is what it needs to mean something alone: hpZ, HSDP, offload and keeping parameters between
micro-batches come with their ZeRO stage. Two options that set one key to different values are not a pair of
techniques (zero=stage1 with an option that needs stage3) and are skipped; the count of pairs checked is held.

Hydra composes each option once (about 0.1-0.4 s a compose on CI's cores); a pair is the base with both options'
changed leaves applied, then validated and planned as `python -m trainer` would: milliseconds a pair.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from tests.helpers import compose
from trainer.config import ConfigError, TrainConfig
from trainer.config.composition import REFUSALS
from trainer.config.train import validate
from trainer.plan.build import build_plan

BASE = ("model=tiny", "device=cpu", "nproc=8", "micro_batch=2", "grad_accum=4", "mode=plan", "save=off")
WORLD = 8
OPTIONS: dict[str, tuple[str, ...]] = {
    # the config groups' options (conf/<group>/*.yaml) other than the defaults and the models
    "checkpointing=full": ("checkpointing=full",),
    "checkpointing=op": ("checkpointing=op",),
    "checkpointing=selective": ("checkpointing=selective",),
    "loss=chunked": ("loss=chunked",),
    "offload=cpu": ("offload=cpu", "zero=stage3"),
    "offload=nvme": ("offload=nvme", "offload.path=/tmp", "zero=stage3"),
    "precision=bf16": ("precision=bf16",),
    "precision=fp16": ("precision=fp16",),
    "precision=fp8": ("precision=fp8",),
    "zero=stage1": ("zero=stage1",),
    "zero=stage2": ("zero=stage2",),
    "zero=stage3": ("zero=stage3",),
    "dataloader=workers": ("dataloader=workers",),
    # the techniques' switches
    "parallel.tp=2": ("parallel.tp=2",),
    "parallel.tp=2 sp=false": ("parallel.tp=2", "parallel.sp=false"),
    "parallel.pp=2": ("parallel.pp=2",),
    "parallel.pp=2 interleaved": ("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"),
    "parallel.pp=2 gpipe": ("parallel.pp=2", "parallel.pp_schedule=gpipe"),
    "parallel.cp=2": ("parallel.cp=2",),
    "parallel.cp=2 allgather": ("parallel.cp=2", "parallel.cp_impl=allgather"),
    "compile=true": ("compile=true",),
    "attention=math": ("attention=math",),
    "zero.compression=powersgd": ("zero.compression=powersgd", "zero=stage0"),  # DDP's communication hooks
    "zero.compression=topk": ("zero.compression=topk", "zero=stage0"),
    "zero.sync_every=2": ("zero.sync_every=2", "zero=stage0"),
    "zero.shard_ranks=2": ("zero.shard_ranks=2", "zero=stage3"),
    "zero.hpz_ranks=2": ("zero.hpz_ranks=2", "zero=stage3"),
    "zero.reshard_after_backward=false": ("zero.reshard_after_backward=false", "zero=stage3"),
    "zero.reduce_every=step": ("zero.reduce_every=step", "zero=stage3"),
    "model.tie_embeddings=true": ("model.tie_embeddings=true",),
    "eval.every=2": ("eval.every=2",),
    "fault.kind=nan_loss": ("fault.kind=nan_loss", "fault.step=2"),
}

# Pairs refused by a setting's own validation, not by the composition table: the start of each message.
PRECONDITION_PAIRS: dict[frozenset[str], str] = {
    # DDP takes one communication hook (trainer/config/zero.py)
    frozenset(
        {"zero.compression=powersgd", "zero.sync_every=2"}
    ): "zero.compression=powersgd and zero.sync_every=2",
    frozenset({"zero.compression=topk", "zero.sync_every=2"}): "zero.compression=topk and zero.sync_every=2",
    # hpZ's secondary group must divide a shard group larger than itself (trainer/layout.py)
    frozenset({"zero.hpz_ranks=2", "zero.shard_ranks=2"}): "zero.hpz_ranks=2 must divide the shard group",
    # a real limit outside the table: hpZ's secondary shards with blocks kept between micro-batches, not planned
    frozenset(
        {"zero.hpz_ranks=2", "zero.reshard_after_backward=false"}
    ): "zero.reshard_after_backward=false with zero.hpz_ranks is not planned",
    # Ulysses gives each rank whole heads: the tiny model's 2 kv heads over tp x cp = 4 ranks (trainer/config/parallel.py)
    frozenset(
        {"parallel.cp=2", "parallel.tp=2"}
    ): "model.n_kv_heads=2 of model=tiny must divide by parallel.tp=2",
    frozenset(
        {"parallel.cp=2", "parallel.tp=2 sp=false"}
    ): "model.n_kv_heads=2 of model=tiny must divide by parallel.tp=2",
}
TABLE = re.compile(r"^parallel\.(tp|pp|cp)=\d+ with (.+?) (is not supported|\(|is refused|:)")


def leaves(cfg: DictConfig) -> dict[str, Any]:
    """Every leaf of an unresolved config by its dotted key (interpolations kept as written)."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key in node:
            value = node._get_node(key)
            path = f"{prefix}{key}"
            if isinstance(value, DictConfig):
                walk(value, path + ".")
            else:
                flat[path] = value._value()

    walk(cfg, "")
    return flat


@pytest.fixture(scope="module")
def found(changes: tuple[DictConfig, dict[str, dict[str, Any]]]) -> dict[frozenset[str], str]:
    return outcomes(*changes)


@pytest.fixture(scope="module")
def changes() -> tuple[DictConfig, dict[str, dict[str, Any]]]:
    """The base, and each option's changed leaves against it (Hydra composes each once)."""
    base = compose(*BASE)
    flat = leaves(base)
    changed = {}
    for name, overrides in OPTIONS.items():
        alone = leaves(compose(*BASE, *overrides))
        changed[name] = {key: value for key, value in alone.items() if flat.get(key, object()) != value}
    return base, changed


def pair_config(base: DictConfig, *changed: dict[str, Any]) -> TrainConfig:
    cfg = base.copy()
    for change in changed:
        for key, value in change.items():
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return validate(cfg)


def conflict(first: tuple[str, ...], second: tuple[str, ...]) -> bool:
    """Whether two options set one key to different values (`zero=stage1` and hpZ's `zero=stage3`)."""
    a, b = (dict(override.split("=", 1) for override in options) for options in (first, second))
    return any(a[key] != b[key] for key in a.keys() & b.keys())


def outcomes(base: DictConfig, changed: dict[str, dict[str, Any]]) -> dict[frozenset[str], str]:
    """Each pair whose options do not set one key differently -> "planned", "table: <second>" or the error."""
    result = {}
    for a, b in itertools.combinations(OPTIONS, 2):
        if conflict(OPTIONS[a], OPTIONS[b]):
            continue
        try:  # the layout's checks over the world (trainer/layout.py) run as the plan is made
            build_plan(pair_config(base, changed[a], changed[b]), "cpu", WORLD)
        except ConfigError as err:
            match = TABLE.match(str(err))
            result[frozenset({a, b})] = f"table: {match.group(2)}" if match else str(err)
            continue
        result[frozenset({a, b})] = "planned"
    return result


def test_every_pair_is_planned_or_refused_by_the_table_or_by_a_listed_precondition(
    found: dict[frozenset[str], str],
) -> None:
    assert len(found) == 445  # of 496 pairs, 51 set one key differently (mostly the ZeRO stage)
    seconds = {row.second for row in REFUSALS}
    others = {
        pair: what for pair, what in found.items() if what != "planned" and not what.startswith("table: ")
    }
    assert set(others) == set(PRECONDITION_PAIRS), {tuple(sorted(p)): w for p, w in others.items()}
    for pair, what in others.items():
        assert what.startswith(PRECONDITION_PAIRS[pair]), (sorted(pair), what)
    table = {pair: what.removeprefix("table: ") for pair, what in found.items() if what.startswith("table: ")}
    assert set(table.values()) <= seconds
    assert sum(what == "planned" for what in found.values()) == len(found) - len(table) - len(others)


def test_every_pipeline_tensor_and_context_parallel_row_refuses_one_generated_pair(
    found: dict[frozenset[str], str],
) -> None:
    """The table's rows that a generated option reaches each refuse it (a row that no longer refuses fails)."""
    refused = {what.removeprefix("table: ") for what in found.values() if what.startswith("table: ")}
    reachable = {
        "zero=stage1",
        "zero.hpz_ranks",
        "zero.compression",
        "zero.sync_every",
        "model.tie_embeddings=true",
        "zero.reshard_after_backward=false",
    }  # parallel.cp with parallel.pp composes (tests/integration/test_pipeline_context_parallel.py): planned
    assert reachable <= {row.second for row in REFUSALS}
    assert reachable <= refused, reachable - refused
