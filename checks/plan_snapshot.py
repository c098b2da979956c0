"""Every moment of every plan over a fixed grid of jobs, as canonical JSON, and its sha256.

A refactor of trainer/plan/ that moves code and changes no figure leaves the checksum as it was:
run this before and after and compare the last line. Nothing is trained or allocated (plans are
arithmetic on the meta model's shapes); about 40 s of CPU time, most of it Hydra composing.

    python checks/plan_snapshot.py                         # writes /tmp/plan_snapshot.json
    python checks/plan_snapshot.py --out snapshot.json     # elsewhere, to diff two runs

The grid (each axis as a Hydra override of conf/): ZeRO stages 0-3 x precision x checkpointing x
grad_accum x loss x device kind for the tiny model; FSDP2's accumulation choices (zero.reduce_every,
zero.reshard_after_backward) on 3 ranks; offload, HSDP (zero.shard_ranks) and hpZ (zero.hpz_ranks)
on 4 ranks; and the 125m and qwen3-0.6b presets under every stage: 1,344 plans.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from trainer.cli import register_configs
from trainer.config import TrainConfig, validate
from trainer.layout import Layout
from trainer.plan import Plan, build_plan

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {path.name for path in CONF.iterdir() if path.is_dir()}  # model, zero, precision, ...

STAGES = ["zero=stage0", "zero=stage1", "zero=stage2", "zero=stage3"]
PRECISIONS = ["precision=fp32", "precision=bf16", "precision=fp16"]
CHECKPOINTING = ["checkpointing=none", "checkpointing=full", "checkpointing=selective", "checkpointing=op"]
GRAD_ACCUM = ["grad_accum=1", "grad_accum=2", "grad_accum=4"]
# chunk_tokens=192 of 8 x 128 tokens: 6 chunks, the last one short (the chunked walk's every branch)
LOSSES = ["loss=full", "loss=chunked loss.chunk_tokens=192"]
DEVICES = ["cpu", "cuda"]
TP_PP_PRECISIONS = ["precision=fp32", "precision=bf16"]

# Each grid is the product of its axes (world=N: the world sizes planned, not a config key), times DEVICES.
GRIDS: list[list[list[str]]] = [
    # every stage, precision, checkpointing mode, accumulation and loss on the tiny model
    [STAGES, PRECISIONS, CHECKPOINTING, GRAD_ACCUM, LOSSES, ["world=2"]],
    # FSDP2's accumulation choices, uneven shards on 3 ranks
    [
        ["zero=stage2", "zero=stage3"],
        ["precision=fp32", "precision=bf16", "precision=bf16 zero.reduce_dtype=bf16"],
        ["grad_accum=2", "grad_accum=4"],
        ["zero.reduce_every=step", "zero.reduce_every=micro_batch"],
        ["zero.reshard_after_backward=true", "zero.reshard_after_backward=false"],
        ["checkpointing=none", "checkpointing=full"],
        LOSSES,
        ["world=3"],
    ],
    # offload, HSDP (2 shard groups of 2) and hpZ (secondary shards over 2 ranks) on 4 ranks
    [
        ["model=tiny", "model=qwen3-0.6b"],
        [
            "zero=stage3 offload=cpu",
            "zero=stage2 offload=cpu",
            "zero=stage3 zero.shard_ranks=2",
            "zero=stage2 zero.shard_ranks=2",
            "zero=stage3 zero.hpz_ranks=2",
            "zero=stage3 zero.shard_ranks=2 offload=cpu",
        ],
        ["precision=fp32", "precision=bf16"],
        ["checkpointing=none", "checkpointing=full"],
        ["grad_accum=1", "grad_accum=2 zero.reduce_every=step"],
        ["world=4"],
    ],
    # the presets, every stage, at a realistic sequence length
    [
        ["model=125m", "model=qwen3-0.6b"],
        STAGES,
        ["precision=fp32", "precision=bf16"],
        ["checkpointing=none", "checkpointing=full", "checkpointing=op"],
        ["micro_batch=2 seq_len=1024"],
        ["world=2 world=3"],
    ],
    # tensor parallelism: tp 2 on the tiny model, 4 and 8 on 1b; one replica (stage0 takes no more) ...
    [
        [
            "model=tiny parallel.tp=2 world=2",
            "model=1b seq_len=256 parallel.tp=4 world=4",
            "model=1b seq_len=256 parallel.tp=8 world=8",
        ],
        ["zero=stage0", "zero=stage2", "zero=stage3"],
        TP_PP_PRECISIONS,
        ["checkpointing=none", "checkpointing=full"],
    ],
    # ... and two, sharded over dp
    [
        [
            "model=tiny parallel.tp=2 world=4",
            "model=1b seq_len=256 parallel.tp=4 world=8",
            "model=1b seq_len=256 parallel.tp=8 world=16",
        ],
        ["zero=stage2", "zero=stage3"],
        TP_PP_PRECISIONS,
        ["checkpointing=none", "checkpointing=full"],
    ],
    # pipeline parallelism: pp 2 on the tiny model, 4 on 1b, each schedule, one replica and two
    [
        ["model=tiny parallel.pp=2 world=2 world=4", "model=1b seq_len=256 parallel.pp=4 world=4 world=8"],
        [f"parallel.pp_schedule={schedule}" for schedule in ("gpipe", "1f1b", "interleaved_1f1b")],
        ["zero=stage0", "zero=stage2 zero.reduce_every=step", "zero=stage3 zero.reduce_every=step"],
        TP_PP_PRECISIONS,
        ["grad_accum=4"],
    ],
]


def jobs() -> Iterator[list[str]]:
    """Every combination of overrides of the grid, in a fixed order."""
    for axes in GRIDS:
        for choice in itertools.product(*axes):
            yield [word for option in choice for word in option.split()]


def rank_coords(plan: Plan, rank: int) -> list[int]:
    """A rank's (pp, dp, tp) coordinates (trainer/layout.py): the record names a rank by where it stands,
    so that a change of rank order (which global rank holds which stage) is not read as a change of any
    rank's plan. Before the layout (its first checksum, 5495a9f3...) the same three were the plan's own
    formulas: stage rank // tp % pp, replica rank // (tp * pp), tp rank % tp."""
    layout = Layout.from_config(plan.config, plan.world_size)
    coords = layout.coords(rank)
    return [coords["pp"], layout.dp_index(rank), coords["tp"]]


def plan_record(plan: Plan) -> list[dict[str, Any]]:
    """Every rank's states, activations, offloaded bytes and every moment's parts, in (pp, dp, tp) order."""
    ranks = sorted(plan.ranks, key=lambda rank: rank_coords(plan, rank.rank))
    return [
        {
            "coords": rank_coords(plan, rank.rank),
            "states": [rank.states.params, rank.states.grads, rank.states.optimizer],
            "activations": rank.activations,
            "offloaded": rank.offloaded,
            "moments": [[moment.name, moment.parts] for moment in rank.moments],
        }
        for rank in ranks
    ]


def compose_job(overrides: list[str], composed: dict[tuple[str, ...], DictConfig]) -> TrainConfig:
    """The validated config of `overrides`. Hydra composes each choice of config groups once (most of
    the run's time); plain keys are then set on a copy, as the command line would set them."""
    groups = tuple(word for word in overrides if word.split("=")[0] in GROUPS)
    if groups not in composed:
        composed[groups] = compose("train", overrides=["logger=none", "save=off", *groups])
    cfg = copy.deepcopy(composed[groups])
    for word in overrides:
        key, value = word.split("=", 1)
        if key not in GROUPS:
            OmegaConf.update(cfg, key, yaml.safe_load(value))
    return validate(cfg)


def snapshot() -> dict[str, Any]:
    """The plans of the whole grid, keyed by overrides, device kind and world size. Every combination
    is valid: one the config or the plan refused would stop the run (a grid to correct)."""
    plans: dict[str, Any] = {}
    composed: dict[tuple[str, ...], DictConfig] = {}
    for overrides in jobs():
        world_sizes = [int(word.split("=")[1]) for word in overrides if word.startswith("world=")]
        overrides = [word for word in overrides if not word.startswith("world=")]
        config = compose_job(overrides, composed)
        for world_size, device_kind in itertools.product(world_sizes, DEVICES):
            plan = build_plan(config, device_kind, world_size)
            plans[f"{' '.join(overrides)} | {device_kind} x {world_size}"] = plan_record(plan)
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/plan_snapshot.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        plans = snapshot()
    text = json.dumps(plans, sort_keys=True, indent=0, separators=(",", ":")) + "\n"
    args.out.write_text(text)
    moments = sum(len(rank["moments"]) for ranks in plans.values() for rank in ranks)
    print(f"{len(plans)} plans, {moments} rank moments, {time.perf_counter() - start:.0f} s: {args.out}")
    print(f"sha256 {hashlib.sha256(text.encode()).hexdigest()}")


if __name__ == "__main__":
    main()
