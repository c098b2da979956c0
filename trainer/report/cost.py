"""The table across accelerators: arithmetic from predicted tokens/s and the user's prices, and its text.

Nothing here knows a price: every cost is the user's `advise.gpu_hour_cost` (per GPU-hour, in whatever
currency the user gave) times GPU-hours, and GPU-hours are world size x tokens / (tokens/s x 3600).
The table is built from plain records (advice.json's `accelerators`), so the console and
`python -m trainer.report` print the same lines; this module imports no torch.

    tokens/s per GPU            T / n                    (T: the cluster's predicted tokens/s, n GPUs)
    GPU-hours per 1M tokens     n x 1e6 / (T x 3600)
    cost per 1M tokens          price x GPU-hours per 1M tokens
    with advise.tokens = B:     hours = B / T / 3600, days = hours / 24, GPU-hours = n x hours, cost = price x GPU-hours
"""

from __future__ import annotations

import math
from typing import Any

SECONDS_PER_HOUR = 3600.0
MILLION = 1e6


def cost_figures(
    tokens_per_s: float | None, world_size: int, price: float | None, tokens: float | None
) -> dict[str, float | None]:
    """A row's derived columns (None where an input is missing: no fitting configuration, no price, no budget)."""
    out: dict[str, float | None] = dict.fromkeys(
        (
            "tokens_per_s_per_gpu",
            "gpu_hours_per_million_tokens",
            "cost_per_million_tokens",
            "days",
            "gpu_hours",
            "cost",
        )
    )
    if not tokens_per_s:
        return out
    out["tokens_per_s_per_gpu"] = tokens_per_s / world_size
    out["gpu_hours_per_million_tokens"] = world_size * MILLION / (tokens_per_s * SECONDS_PER_HOUR)
    if price is not None:
        out["cost_per_million_tokens"] = price * out["gpu_hours_per_million_tokens"]
    if tokens is not None:
        hours = tokens / tokens_per_s / SECONDS_PER_HOUR
        out["days"] = hours / 24.0
        out["gpu_hours"] = world_size * hours
        out["cost"] = None if price is None else price * out["gpu_hours"]
    return out


def rank_rows(rows: list[dict[str, Any]], rank_by: str) -> tuple[list[dict[str, Any]], str]:
    """Rows best first, and the line saying by what: cost per million tokens where every row has a price
    (rank_by=cost), the cluster's time to the tokens (its tokens/s, rank_by=time), else tokens/s per GPU.
    Accelerators where nothing fits come last."""
    priced = bool(rows) and all(r.get("gpu_hour_cost") is not None for r in rows)
    if rank_by == "cost" and priced:
        key, how = (
            "cost_per_million_tokens",
            "ranked by cost per million tokens (advise.gpu_hour_cost, the user's prices)",
        )
        order = 1.0
    elif rank_by == "time":
        key, how = (
            "tokens_per_s",
            "ranked by time to the tokens (the cluster's tokens/s; advise.rank_by=time)",
        )
        order = -1.0
    else:
        key, how = (
            "tokens_per_s_per_gpu",
            "no prices given (advise.gpu_hour_cost): ranked by tokens/s per GPU, no cost columns",
        )
        order = -1.0

    def sort_key(r: dict[str, Any]) -> tuple[bool, float]:
        value = r.get(key)
        return (value is None, math.inf if value is None else order * value)

    return sorted(rows, key=sort_key), how


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_lines(record: dict[str, Any]) -> list[str]:
    """The table of an advice.json's `accelerators` record (advisor and report alike)."""
    rows, how = rank_rows(record["rows"], record["rank_by"])
    budget = record.get("tokens")
    priced = any(r.get("gpu_hour_cost") is not None for r in rows)
    lines = [
        f"across accelerators: model={record['model']} global_batch={record['global_batch']} seq_len={record['seq_len']} "
        f"precision={record['precision']}, {record['nodes']} x {record['nproc']} GPUs of each; "
        + (f"token budget {budget:.3g}; " if budget is not None else "no token budget (advise.tokens); ")
        + how,
        f"{'#':>3} {'accelerator':<11} {'tokens/s/GPU':>12} {'tokens/s':>12} {'MFU %':>6} {'days':>8} "
        f"{'GPU-hours':>11} {'cost/GPU-h':>10} {'cost/1M tok':>11} {'cost':>13} {'fit error':>11}  best configuration",
    ]
    for i, r in enumerate(rows, 1):
        best = r.get("configuration") or f"nothing fits ({r.get('why') or 'every candidate over memory'})"
        lines.append(
            f"{i:>3} {r['accelerator']:<11} {_cell(r.get('tokens_per_s_per_gpu'), ',.0f'):>12} "
            f"{_cell(r.get('tokens_per_s'), ',.0f'):>12} {_cell(r.get('mfu_pct'), '.1f'):>6} {_cell(r.get('days'), ',.1f'):>8} "
            f"{_cell(r.get('gpu_hours'), ',.0f'):>11} {_cell(r.get('gpu_hour_cost'), ',.2f'):>10} "
            f"{_cell(r.get('cost_per_million_tokens'), ',.4g'):>11} {_cell(r.get('cost'), ',.0f'):>13} "
            f"{r['fit_error']:>11}  {best}"
        )
    lines.append(
        "    predicted per accelerator by mode=advise's own search (its best fitting configuration, ties to fewer "
        "moving parts); fit error: the advisor's tokens/s error on published runs of that accelerator's family"
        + (
            "; unvalidated: no published run of the part or of a model this size to hold it to"
            if any(r["fit_error"] == "unvalidated" for r in rows)
            else ""
        )
    )
    if priced:
        lines.append(
            "    cost: the user's advise.gpu_hour_cost x GPU-hours (GPU-hours = GPUs x tokens / tokens/s / 3600), "
            "in the prices' own currency; zerolab ships no prices"
        )
    lines += [f"{i:>3}: {r['command']}" for i, r in enumerate(rows, 1) if r.get("command")]
    return lines
