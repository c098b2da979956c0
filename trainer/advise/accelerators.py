"""mode=advise across accelerators: which accelerator, at what cost (advise.accelerators, issue 65).

    python -m trainer mode=advise model=llama3-8b global_batch=256 seq_len=8192 precision=bf16 nodes=1 nproc=8 \
        advise.accelerators=[h100,a100-80gb,b200] advise.gpu_hour_cost={h100:2.5,a100-80gb:1.5,b200:4} advise.tokens=1e12

Each listed accelerator gets the advisor's own search, once (`advise_all` with plan.accelerator set to it, on
nodes x nproc of them): its best fitting configuration (the first row of its ranked table) is its row. A
configuration's plan is made once and given each accelerator's memory (advisor.shared_plans): only the fit and
the timing are the accelerator's. The
derived columns (tokens/s per GPU, days and GPU-hours to advise.tokens, cost per million tokens) are arithmetic
on that row's predicted tokens/s and the user's prices (trainer/report/cost.py); the table is ranked by cost,
by time (advise.rank_by=time), or without prices by tokens/s per GPU. advice.json's `accelerators` keeps the
table's rows and each accelerator's best few, which `python -m trainer.report` prints again.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from trainer.advise.advisor import (
    advise_all,
    command_line,
    nothing_fits_cause,
    shared_plans,
    unchecked_replace,
)
from trainer.advise.calibrate import advisor_accelerator, fit_error_cell
from trainer.config import ConfigError, TrainConfig
from trainer.report.cost import cost_figures, table_lines
from trainer.units import GIB

BEST_KEPT = 3
"""Each accelerator's best configurations kept in advice.json besides its row."""


def check_accelerators(config: TrainConfig) -> list[str]:
    """advise.accelerators before anything is planned: each one the advisor has rates for (one line naming the
    first it lacks), a node size given, and nothing that belongs to one accelerator (plan.accelerator,
    advise.verify on this host). The ACCELERATORS keys, in the order listed."""
    a = config.advise
    if config.plan.accelerator is not None:
        raise ConfigError(
            f"advise.accelerators=[{','.join(a.accelerators)}] plans for each of them: drop "
            f"plan.accelerator={config.plan.accelerator}"
        )
    if a.verify:
        raise ConfigError(
            "advise.verify runs jobs on this host: with advise.accelerators set advise.verify=0"
        )
    if config.nproc == "auto":
        raise ConfigError(
            "advise.accelerators needs nproc=N, the GPUs of a node (and nodes=M): the cluster to price"
        )
    names = [advisor_accelerator(name) for name in a.accelerators]
    if len(set(names)) < len(names):
        raise ConfigError(
            f"advise.accelerators=[{','.join(a.accelerators)}] names one accelerator twice (h100-sxm is h100)"
        )
    return names


def accelerator_row(
    config: TrainConfig, name: str, world_size: int, base: list[str], price: float | None = None
) -> dict[str, Any]:
    """One accelerator's search (`name`: an ACCELERATORS key), its best fitting configuration and the row's figures
    at `price` per GPU-hour (the user's, None: none given)."""
    on = unchecked_replace(config, plan=dataclasses.replace(config.plan, accelerator=name))
    advice = advise_all(on, "cuda", world_size)
    fitting = [c for c in advice.candidates if c.fits is not False]
    best = fitting[0] if fitting else None
    tokens_per_s = None if best is None else best.tokens_per_s
    return {
        "accelerator": name,
        "world_size": world_size,
        "configuration": None if best is None else best.label(),
        "command": None if best is None else command_line(base, best),
        "tokens_per_s": tokens_per_s,
        "mfu_pct": None if best is None else best.mfu_pct,
        "reserved_gib": None if best is None else best.reserved_bytes / GIB,
        "fitting": len(fitting),
        "planned": len(advice.candidates),
        "why": None if best is not None or not advice.candidates else nothing_fits_cause(advice.candidates),
        "fit_error": fit_error_cell(name, config.model),
        "rates": advice.rates.source,
        "gpu_hour_cost": price,
        **cost_figures(tokens_per_s, world_size, price, config.advise.tokens),
        "best": [
            {
                "configuration": c.label(),
                "tokens_per_s": c.tokens_per_s,
                "reserved_gib": c.reserved_bytes / GIB,
                "tie": c.tie,
            }
            for c in fitting[:BEST_KEPT]
        ],
    }


def across_accelerators(config: TrainConfig, world_size: int, base: list[str]) -> dict[str, Any]:
    """advice.json's `accelerators` record: the table's settings and one row per accelerator (unranked; the
    table ranks them, trainer/report/cost.py)."""
    names = check_accelerators(config)
    with shared_plans():  # each choice planned once, for the first accelerator that plans it
        prices = config.advise.gpu_hour_cost or {}  # by the name as listed (h100-sxm is the h100 row)
        rows = [
            accelerator_row(config, name, world_size, base, prices.get(listed))
            for listed, name in zip(config.advise.accelerators, names)
        ]
    return {
        "model": config.model.name,
        "global_batch": config.global_batch,
        "seq_len": config.seq_len,
        "precision": config.precision.name,
        "nodes": config.nodes,
        "nproc": world_size // config.nodes,
        "tokens": config.advise.tokens,
        "rank_by": config.advise.rank_by,
        "rows": rows,
    }


def run_across_accelerators(
    config: TrainConfig, out_dir: Path, world_size: int, base: list[str]
) -> dict[str, Any]:
    """Print the table, write advice.json (its `accelerators` record)."""
    record = across_accelerators(config, world_size, base)
    print("\n".join(table_lines(record)), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "advice.json"
    path.write_text(json.dumps({"accelerators": record}, indent=2) + "\n")
    print(f"advice.json: {path}", flush=True)
    return record
