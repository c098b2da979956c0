"""The refusal of a plan that does not fit, and its way out: the first few single changes
(checkpointing, ZeRO stage, reducing every micro-batch, smaller micro-batches, offload, more GPUs)
whose plans fit."""

from __future__ import annotations

import copy
import functools
from typing import Any

from trainer.config import STAGE_REDUCE_EVERY, CheckpointMode, OffloadTarget, ReduceEvery, Stage, TrainConfig
from trainer.plan.build import Plan, build_plan, describe
from trainer.units import GIB


def refusal(plan: Plan) -> str | None:
    """None when every rank fits, else one line with the figures and a way out."""
    if plan.fits is not False:
        return None
    worst, c = plan.worst, plan.config
    parts = " + ".join(f"{name} {value / GIB:.2f}" for name, value in worst.peak.parts.items() if value)
    reserved = (
        f", {plan.required_bytes(worst) / GIB:.2f} GiB reserved with headroom"
        if plan.device_kind == "cuda"
        else ""
    )
    need = (
        f"{describe(c, plan.world_size, plan.device_kind)} ({plan.num_params / 1e9:.2f}B params) needs "
        f"{plan.peak_bytes / GIB:.2f} GiB on rank {worst.rank} at {worst.peak.name} ({parts}{reserved})"
    )
    assert plan.memory.per_rank_bytes is not None
    have = f"each rank has {plan.memory.per_rank_bytes / GIB:.2f} GiB ({plan.memory.source})"
    return f"does not fit: {need}, but {have}. {way_out(plan)}"


def _changed(config: TrainConfig, **changes: Any) -> TrainConfig:
    """A copy of the config with nested keys changed (`zero__stage` is zero.stage)."""
    new = copy.deepcopy(config)
    for key, value in changes.items():
        *path, leaf = key.split("__")
        target = functools.reduce(getattr, path, new)
        setattr(target, leaf, value)
    return new


def single_changes(
    c: TrainConfig, world_size: int, device_kind: str
) -> list[tuple[str, dict[str, Any], int]]:
    """Changes a user could make one at a time: (override text, changes, world size)."""
    options: list[tuple[str, dict[str, Any], int]] = []
    if c.checkpointing.mode != CheckpointMode.full:
        options.append(("checkpointing=full", {"checkpointing__mode": CheckpointMode.full}, world_size))
    # A stage's option file brings its own zero.reduce_every, so `zero=stage3` is planned with it.
    stage3 = {"zero__stage": Stage.stage3, "zero__reduce_every": STAGE_REDUCE_EVERY[Stage.stage3]}
    if c.zero.stage != Stage.stage3:
        options.append(("zero=stage3", stage3, world_size))
    if c.grad_accum > 1 and c.zero.reduce_every == ReduceEvery.step:  # no full gradient between micro-batches
        options.append(
            ("zero.reduce_every=micro_batch", {"zero__reduce_every": ReduceEvery.micro_batch}, world_size)
        )
    factor = 2
    while c.micro_batch // factor >= 1:  # the same global batch in more, smaller micro-batches
        mb, accum = c.micro_batch // factor, c.grad_accum * factor
        options.append(
            (f"micro_batch={mb} grad_accum={accum}", {"micro_batch": mb, "grad_accum": accum}, world_size)
        )
        factor *= 2
    if device_kind == "cuda":
        # GPUs each bring their own memory (CPU ranks share one host, so more of them never helps).
        if c.offload.target == OffloadTarget.none:  # FSDP2's CPUOffloadPolicy: stage2 or stage3
            stage = c.zero.stage if c.zero.uses_fsdp else Stage.stage2
            text = "offload=cpu" if c.zero.uses_fsdp else "zero=stage2 offload=cpu"
            every = c.zero.reduce_every if c.zero.uses_fsdp else STAGE_REDUCE_EVERY[stage]
            changes = {
                "offload__target": OffloadTarget.cpu,
                "zero__stage": stage,
                "zero__reduce_every": every,
            }
            options.append((text, changes, world_size))
        options += [
            (f"zero=stage3 nproc={n}", stage3 if c.zero.stage != Stage.stage3 else {}, n)
            for n in (2**k for k in range(13))
            if n > world_size
        ]
    return options


def way_out(plan: Plan) -> str:
    """The first few changes that fit (alone, else on top of checkpointing=full), with their peaks."""
    c, fitting, seen = plan.config, [], set()
    bases: list[tuple[str, dict[str, Any]]] = [("", {})]
    if c.checkpointing.mode != CheckpointMode.full:
        bases.append(("checkpointing=full ", {"checkpointing__mode": CheckpointMode.full}))
    for base_text, base in bases:
        for text, changes, world_size in single_changes(
            _changed(c, **base), plan.world_size, plan.device_kind
        ):
            kind = text.split("=")[0]  # the smallest micro-batch / world size that fits is enough
            if kind in seen:
                continue
            option = build_plan(_changed(c, **base, **changes), plan.device_kind, world_size)
            if option.fits:
                fitting.append(f"{base_text}{text} (peak {option.peak_bytes / GIB:.2f} GiB)")
                seen.add(kind)
            if len(fitting) == 3:
                break
        if fitting:
            break
    tried = (
        "Try " + ", or ".join(fitting) + ", or"
        if fitting
        else "Nothing simple fits: a smaller model or more memory per rank, or"
    )
    return f"{tried} plan.enforce=false to try anyway."
