"""The refusal of a plan that does not fit, and its way out: the first few single changes
(checkpointing, ZeRO stage, reducing every micro-batch, smaller micro-batches, offload, more GPUs;
under a pipeline, more stages or tensor parallelism, of sizes the config check allows) whose plans fit."""

from __future__ import annotations

import copy
import functools
from typing import Any

from trainer.config import (
    STAGE_REDUCE_EVERY,
    CheckpointMode,
    ConfigError,
    OffloadTarget,
    ReduceEvery,
    SaveAsync,
    Stage,
    TrainConfig,
)
from trainer.config.composition import check_composition
from trainer.layout import check_world, divisors, tp_sizes
from trainer.plan.build import Plan, build_plan, describe
from trainer.units import GIB


def refusal(plan: Plan) -> str | None:
    """None when every rank fits, else one line with the figures and a way out."""
    if plan.fits is not False:
        return None
    worst, c = plan.worst, plan.config
    parts = " + ".join(f"{name} {value / GIB:.2f}" for name, value in worst.peak.parts.items() if value)
    # On a GPU the verdict is on the allocator's reserved memory: that figure leads.
    figure = (
        f"{plan.required_bytes(worst) / GIB:.2f} GiB reserved on rank {worst.rank} (tensors {plan.peak_bytes / GIB:.2f} "
        f"GiB at {worst.peak.name}: {parts})"
        if plan.device_kind == "cuda"
        else f"{plan.peak_bytes / GIB:.2f} GiB on rank {worst.rank} at {worst.peak.name} ({parts})"
    )
    need = f"{describe(c, plan.world_size, plan.device_kind)} ({plan.num_params / 1e9:.2f}B params) needs {figure}"
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
    if c.parallel.pp > 1:  # the stage's unsharded parameters and gradient: split the stage
        options += stage_splits(c, world_size)
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
        more = stage3 if c.zero.stage != Stage.stage3 else {}
        if c.nodes > 1:  # whole nodes of the same ranks each: more of them
            per_node = world_size // c.nodes
            options += [
                (f"zero=stage3 nodes={m}", {**more, "nodes": m}, m * per_node)
                for m in (c.nodes * 2**k for k in range(1, 8))
            ]
        else:
            options += [
                (f"zero=stage3 nproc={n}", more, n) for n in (2**k for k in range(13)) if n > world_size
            ]
    return options


def stage_splits(c: TrainConfig, world_size: int) -> list[tuple[str, dict[str, Any], int]]:
    """A pipeline's smaller stages on the same ranks: more stages (parallel.pp), or the stage's tensors
    split over more ranks (parallel.tp); only sizes the config check allows (`allowed`)."""
    nproc = world_size // c.nodes
    pps = [n for n in divisors(world_size // c.parallel.tp) if n > c.parallel.pp]
    tps = [t for t in tp_sizes(c.model, nproc) if t > c.parallel.tp]
    options = [(f"parallel.pp={n}", {"parallel__pp": n}, world_size) for n in pps]
    options += [(f"parallel.tp={t}", {"parallel__tp": t}, world_size) for t in tps]
    return [option for option in options if allowed(_changed(c, **option[1]), world_size)]


def allowed(config: TrainConfig, world_size: int) -> bool:
    """Whether the config check and the job's world check accept `config` (a way out must be valid)."""
    try:
        config.parallel.check_model(config.model, config.seq_len)
        check_composition(config)
        config.parallel.check_pipeline(config.model, config.grad_accum)
        check_world(config, world_size // config.nodes, config.nodes)
    except ConfigError:
        return False
    return True


def fits_text(plan: Plan) -> str:
    """The figure an option is judged by: reserved memory on a GPU, the tensor peak on CPU."""
    if plan.device_kind == "cuda":
        return f"{plan.required_bytes(plan.worst) / GIB:.2f} GiB reserved"
    return f"peak {plan.peak_bytes / GIB:.2f} GiB"


def way_out(plan: Plan) -> str:
    """The first few single changes that fit, else pairs of them; else what binds (`binding_cause`)."""
    fitting = fitting_changes(plan, [("", {})])
    if not fitting:  # pairs: each memory saver under every other change
        savers = [
            (f"{text} ", changes)
            for text, changes, world in single_changes(plan.config, plan.world_size, plan.device_kind)
            if world == plan.world_size and not text.startswith("micro_batch")
        ]
        fitting = fitting_changes(plan, savers)
    if fitting:
        return f"Try {', or '.join(fitting)}, or plan.enforce=false to try anyway."
    return f"Nothing simple fits ({binding_cause(plan)}): {larger_ways(plan)}, or plan.enforce=false to try anyway."


def larger_ways(plan: Plan) -> str:
    """What is left when no change fits: under a pipeline, its stages split over more ranks (naming the
    valid sizes, which alone do not fit on these ranks), else more memory."""
    if plan.pipeline is None:
        return "a smaller model or more memory per rank"
    splits = [text for text, _, _ in stage_splits(plan.config, plan.world_size)]
    alone = f" ({' or '.join(splits)} on these ranks do not fit alone)" if splits else ""
    return f"a smaller model, more ranks for more pipeline stages or tensor parallelism{alone}, or more memory per rank"


def fitting_changes(plan: Plan, bases: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Up to three changes, each on top of one of `bases`, whose plans fit (the first micro-batch and
    world size that fit are enough)."""
    c, fitting, seen = plan.config, [], set()
    for base_text, base in bases:
        for text, changes, world_size in single_changes(
            _changed(c, **base), plan.world_size, plan.device_kind
        ):
            # The first micro-batch or world size that fits is enough, and a pair is one either way round.
            kind = frozenset(word.split("=")[0] for word in f"{base_text}{text}".split())
            if kind in seen or text in base_text:
                continue
            option = build_plan(_changed(c, **{**base, **changes}), plan.device_kind, world_size)
            if option.fits and option.host_fits is not False:
                fitting.append(f"{base_text}{text} ({fits_text(option)})")
                seen.add(kind)
            if len(fitting) == 3:
                return fitting
    return fitting


def binding_cause(plan: Plan) -> str:
    """What stops every change: planned with every memory saver at once (stage3, full checkpointing,
    micro_batch 1, offload=cpu on a GPU), the largest part of the peak, or the node's host."""
    c = plan.config
    least = {"zero__stage": Stage.stage3, "checkpointing__mode": CheckpointMode.full}
    least |= {"micro_batch": 1, "grad_accum": c.grad_accum * c.micro_batch}
    if plan.device_kind == "cuda" and not c.offload.on_host:  # offload=nvme's device plan is offload=cpu's
        least["offload__target"] = OffloadTarget.cpu
    floor = build_plan(_changed(c, **least), plan.device_kind, plan.world_size)
    stage = (
        sum(floor.pipeline.within_step[floor.worst_stage])
        if floor.pipeline and floor.pipeline.within_step
        else 0
    )
    return cause_of(floor.worst.peak.parts, floor.fits, floor.host_fits, floor.host.need_bytes, stage)


def cause_of(
    parts: dict[str, int],
    device_fits: bool | None,
    host_fits: bool | None,
    host_need: int,
    stage_unsharded: int = 0,
) -> str:
    """One clause naming what binds a configuration that does not fit (mode=plan's refusal and mode=advise).
    `stage_unsharded`: under a pipeline, the bytes of the worst stage's parameters and gradient that
    PipelineStage holds unsharded within the step (part of `temporary`), which then names that part."""
    if device_fits is not False and host_fits is False:
        return (
            f"what binds: host memory (a node needs {host_need / GIB:.0f} GiB of it, plan.host_memory_gib: more "
            "nodes share the offloaded states)"
        )
    states = parts.get("params", 0) + parts.get("grads", 0) + parts.get("optimizer", 0)
    activations, temporary = parts.get("activations", 0), parts.get("temporary", 0)
    clauses = [
        (
            states,
            f"model states ({states / GIB:.1f} GiB a rank at the least: more ranks or nodes shard them)",
        ),
        (
            activations,
            f"activations ({activations / GIB:.1f} GiB at micro_batch 1 with full checkpointing: a shorter seq_len, "
            "or a larger parallel.cp: a rank holds seq_len / cp positions)",
        ),
        (temporary, temporary_clause(temporary, stage_unsharded)),
    ]
    clauses.sort(key=lambda clause: -clause[0])
    # The largest part binds; a second one at least half its size binds too (removing one is not enough).
    binding = [text for size, text in clauses[:2] if size >= clauses[0][0] / 2]
    return "what binds: " + ", and ".join(binding)


def temporary_clause(temporary: int, stage_unsharded: int) -> str:
    """What the plan's `temporary` part holds, and what shrinks it."""
    if stage_unsharded * 2 >= temporary:  # a pipeline whose stage's unsharded tensors are most of it
        return (
            f"the stage's unsharded parameters and gradient ({stage_unsharded / GIB:.1f} of {temporary / GIB:.1f} "
            "GiB of buffers: PipelineStage gathers the stage's parameters and accumulates its whole gradient "
            "unsharded within the step, which more data-parallel ranks do not shrink: more pipeline stages or "
            "tensor parallelism split the stage)"
        )
    return (
        f"per-block buffers ({temporary / GIB:.1f} GiB: FSDP2's gathered blocks, a block's unsharded gradient "
        "and the loss's temporaries, which more data-parallel ranks do not shrink: a device with more memory, or "
        "smaller blocks; a larger parallel.cp shrinks the loss's, per position)"
    )


# ----------------------------------------------------------------------------- the host


def host_refusal(plan: Plan, way_out: bool = True) -> str | None:
    """None when a node's ranks fit its host's memory (or it is unknown), else one line with the
    figures and (`way_out`) the changes that fit."""
    host = plan.host
    if host.fits is not False:
        return None
    assert host.available_bytes is not None
    worst, n = host.worst, len(host.ranks)
    if plan.device_kind == "cpu":
        held = (
            f"{n} CPU ranks each hold {worst.runtime / GIB:.2f} GiB of process runtime (plan.cpu_rank_runtime_gib) "
            f"+ {worst.tensors / GIB:.3f} GiB of tensors"
        )
    else:
        buffer = f", {worst.buffer / GIB:.2f} GiB offload=nvme buffer" if worst.buffer else ""
        held = (
            f"{n} ranks per node each hold {worst.runtime / GIB:.2f} GiB of process runtime (plan.cuda_rank_runtime_gib) "
            f"+ {(worst.pinned + worst.pageable + worst.buffer) / GIB:.2f} GiB of offloaded states ({worst.pinned / GIB:.2f} "
            f"GiB pinned, rounded up to powers of two{buffer})"
        )
    if worst.staging:
        held += f" + {(worst.staging + worst.writer) / GIB:.2f} GiB to save in the background (save.async_mode={plan.config.save.async_mode.value})"
    line = (
        f"does not fit this host: {held} = {host.need_bytes / GIB:.1f} GiB per node, but the host has "
        f"{host.available_bytes / GIB:.1f} GiB ({host.source})."
    )
    return f"{line} {host_way_out(plan)}" if way_out else line


def host_changes(plan: Plan) -> list[tuple[str, TrainConfig, int]]:
    """Changes that lower a node's host memory: fewer CPU ranks; more nodes, no offload, no pinning, Adam's
    moments on disk (offload=nvme, its directory named by the user)."""
    c, ranks = plan.config, len(plan.host.ranks)
    options = []
    if plan.host.worst.staging:  # saving in place needs no staging copy
        options.append(("save.async_mode=off", _changed(c, save__async_mode=SaveAsync.off), plan.world_size))
    if plan.device_kind == "cpu":  # every CPU rank holds about the same: the most that fit here
        most = min(ranks - 1, plan.host.available_bytes // plan.host.worst.total)  # type: ignore[operator]
        return options + ([(f"nproc={most}", c, most * c.nodes)] if most >= 1 else [])
    if c.offload.on_host:
        no_offload = {"offload__target": OffloadTarget.none}
        options.append(("offload=none", _changed(c, **no_offload), plan.world_size))
        full = {**no_offload, "checkpointing__mode": CheckpointMode.full}
        options.append(("offload=none checkpointing=full", _changed(c, **full), plan.world_size))
        if c.offload.pin_memory:
            options.append(
                ("offload.pin_memory=false", _changed(c, offload__pin_memory=False), plan.world_size)
            )
    if c.zero.stage != Stage.stage3:
        options.append(("zero=stage3", _changed(c, zero__stage=Stage.stage3), plan.world_size))
    for nodes in (c.nodes * 2**k for k in range(1, 8)):
        options.append((f"nodes={nodes}", _changed(c, nodes=nodes), nodes * ranks))
    if c.offload.target == OffloadTarget.cpu:  # last: the moments leave host memory for a disk's stall
        path = c.offload.path or "DIR"  # DIR: a directory on the node's local NVMe, for the user to name
        nvme = {"offload__target": OffloadTarget.nvme, "offload__path": path}
        options.append((f"offload=nvme offload.path={path}", _changed(c, **nvme), plan.world_size))
    return options


def host_way_out(plan: Plan) -> str:
    """The first few changes whose plans fit both each rank's device and the node's host."""
    fitting, seen = [], set()
    for text, config, world_size in host_changes(plan):
        kind = text.split("=")[0]
        if kind in seen:
            continue
        option = build_plan(config, plan.device_kind, world_size)
        if option.host_fits and option.fits is not False:
            fitting.append(f"{text} ({option.host.need_bytes / GIB:.1f} GiB per node)")
            seen.add(kind)
        if len(fitting) == 3:
            break
    tried = "Try " + ", or ".join(fitting) + ", or" if fitting else "Free host memory, or"
    return f"{tried} plan.enforce=false to try anyway."
