"""What the user reads of a plan: the console report.

format_plan is what mode=plan prints (and every job before it launches, where a refusal comes
as the job's error line). A sweep's fit table, read back from its points' plan.json, is a
report: trainer/report/fit_table.py.
"""

from __future__ import annotations

from trainer.config import TrainConfig
from trainer.devices import accelerator_names
from trainer.model.attention import config_choice
from trainer.plan.activations import cp_gathers, document_mask_per_token, precisions
from trainer.plan.build import COMPILE_NOTE, Plan, RankPlan, describe, fp8_fields
from trainer.plan.context_parallel import cp_local
from trainer.plan.refusal import host_refusal, refusal
from trainer.units import GIB, KIB, MIB

COLUMNS = ("params", "grads", "optimizer", "activations", "temporary", "other", "peak")


def format_table(plan: Plan) -> str:
    """Per-rank table (GiB, or MiB for small jobs); ranks with the same figures share a row."""
    columns = COLUMNS
    unit, scale = ("GiB", 1.0) if plan.peak_bytes >= GIB else ("MiB", 1024.0)
    pipelined = plan.pipeline is not None
    header = (
        f"{'stage' if pipelined else 'rank':>9} "
        + " ".join(f"{name:>11}" for name in columns)
        + f"  fits   ({unit})"
    )
    rows: list[tuple[list[int], tuple[str, ...], str]] = []
    if pipelined:  # one row per stage: its ranks (every pp-th) plan alike but for zero's shards
        ranks = [
            max((r for r in plan.ranks if plan.pipeline_stage(r.rank) == i), key=lambda r: r.peak_total)
            for i in range(plan.config.parallel.pp)
        ]
        return "\n".join([header, *(stage_row(plan, i, r, scale) for i, r in enumerate(ranks))])
    for rank in plan.ranks:
        figures = rank.figures()
        cells = tuple(f"{figures[name + '_gib'] * scale:11.2f}" for name in columns)
        fits = {True: "yes", False: "NO", None: "?"}[plan.rank_fits(rank)]
        if rows and rows[-1][1] == cells and rows[-1][2] == fits:
            rows[-1][0].append(rank.rank)
        else:
            rows.append(([rank.rank], cells, fits))
    lines = [header]
    for ranks, cells, fits in rows:
        label = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        lines.append(f"{label:>9} " + " ".join(cells) + f"  {fits}")
    return "\n".join(lines)


def stage_row(plan: Plan, stage: int, rank: RankPlan, scale: float) -> str:
    """A pipeline stage's row: its worst rank's figures."""
    columns = COLUMNS
    figures = rank.figures()
    fits = {True: "yes", False: "NO", None: "?"}[plan.rank_fits(rank)]
    return (
        f"{stage:>9} " + " ".join(f"{figures[name + '_gib'] * scale:11.2f}" for name in columns) + f"  {fits}"
    )


def format_plan(plan: Plan, way_out: bool = True) -> str:
    """The console report of mode=plan (and of every job before it launches: there a refusal
    comes as the job's error line, so the table ends with the short verdict)."""
    worst = plan.worst
    offloaded = (
        f"; {worst.offloaded / GIB:.2f} GiB of model states per rank in host memory"
        if worst.offloaded
        else ""
    )
    if worst.on_disk:  # offload=nvme: the optimizer column is its buffer
        offloaded += (
            f"; Adam's moments on disk, the optimizer column their {worst.buffer / MIB:.0f} MiB buffer"
        )
    lines = [
        f"memory plan: {describe(plan.config, plan.world_size, plan.device_kind)}, {plan.num_params:,} parameters",
        format_table(plan),
        f"peak on rank {worst.rank} at {worst.peak.name}; model states at rest, activations at the end "
        f"of forward, temporary and other at the peak{offloaded}",
        *pipeline_lines(plan),
        comm_line(plan),
        plan.host.describe(),
        *disk_lines(plan),
        *data_lines(plan),
        verdict(plan, way_out),
    ]
    host_verdict = host_refusal(plan, way_out)
    if host_verdict is not None:  # the device may fit while the node's host does not
        lines.append(host_verdict)
    if plan.config.compile:
        lines.append(f"note: {COMPILE_NOTE}")
    if plan.config.precision.is_fp8:
        lines.append(fp8_line(plan))
    return "\n".join(lines)


def pipeline_lines(plan: Plan) -> list[str]:
    """parallel.pp > 1: the split, each stage's micro-batches in flight and peak, the bubble, the sends."""
    pipe, p2p = plan.pipeline, plan.comm.p2p
    if pipe is None or p2p is None:
        return []
    p = plan.config.parallel
    record = plan.pipeline_json()
    interleaved = f" x {p.pp_virtual_stages} virtual" if p.pp_schedule == "interleaved_1f1b" else ""
    lines = [
        f"pipeline: {p.pp} stages{interleaved}, {p.pp_schedule} over {pipe.micro_batches} micro-batches; bubble "
        f"{pipe.bubble:.1%} of the step; worst stage {record['worst_stage']}"
    ]
    for stage in record["stages"]:
        blocks = ", ".join(f"{a}-{b - 1}" for a, b in stage["blocks"])
        ends = " + embedding" * stage["embedding"] + " + norm, head, loss" * stage["head"]
        lines.append(
            f"  stage {stage['rank']}: blocks {blocks}{ends}; {stage['in_flight_micro_batches']} micro-batches in flight, "
            f"buffers {format_bytes(stage['buffers_bytes'])}, sends {format_bytes(p2p.sent[stage['rank']])} per step, "
            f"peak {format_bytes(stage['peak_bytes'])}"
        )
    worst = record["stages"][record["worst_stage"]]
    if "within_step_unsharded_grads_bytes" in worst:
        params, grads = (
            worst["within_step_unsharded_params_bytes"],
            worst["within_step_unsharded_grads_bytes"],
        )
        unsharded = f"its parameters unsharded ({format_bytes(params)}) and " if params else ""
        lines.append(
            f"  within the step (PipelineStage reduces once, after the last backward) stage {worst['rank']} holds "
            f"{unsharded}its gradient unsharded ({format_bytes(grads)}) beside its states at rest"
        )
    if "all_gather_bytes_per_step_by_zero_stage" in record:
        lines.append(gathers_line(plan, record))
    return lines


def gathers_line(plan: Plan, record: dict) -> str:
    """FSDP2's all-gathers over dp of the worst stage, at zero=stage3 and at stage2 (torchtitan's default under PP:
    reshard_after_forward=False), per micro-batch: what keeping the stage unsharded after forward saves."""
    by, m = record["all_gather_bytes_per_step_by_zero_stage"], plan.config.grad_accum
    stage3, stage2 = by["stage3"], by["stage2"]
    return (
        f"  all-gathers over dp of stage {record['worst_stage']}, a micro-batch on average: zero=stage3 "
        f"{format_bytes(stage3 / m)} ({format_bytes(stage3)} a step: every block again in each backward, as each "
        f"forward reshards it); zero=stage2 {format_bytes(stage2 / m)} ({format_bytes(stage2)} a step, each block "
        "once: reshard_after_forward=False, torchtitan's default under PP, every block unsharded from its first forward)"
    )


def disk_lines(plan: Plan) -> list[str]:
    """offload=nvme (trainer/plan/disk.py): the moments' files, what a step reads and writes, the stall."""
    disk = plan.disk
    if disk is None:
        return []
    rate = disk.rate.bytes_per_s
    stall = (
        f"stall {disk.stall_s:.3g} s per step at {rate / 1e9:.3g} GB/s ({disk.rate.source})"
        if disk.stall_s is not None and rate is not None
        else f"stall {disk.rate.source}"
    )
    return [
        f"disk (offload=nvme, offload.path={disk.path}): Adam's moments in files of {format_bytes(disk.file_bytes_per_rank)} "
        f"per rank, {format_bytes(disk.file_bytes_per_node)} per node ({len(disk.file_bytes)} ranks); each step reads "
        f"{format_bytes(disk.read_bytes_per_rank)} and writes {format_bytes(disk.written_bytes_per_rank)} per rank "
        f"({format_bytes(disk.traffic_bytes_per_node)} per node) through a {format_bytes(disk.buffer_bytes)} buffer "
        f"per rank; {stall}"
    ]


def document_mask_bytes(c: TrainConfig, device_kind: str) -> tuple[int, int, str]:
    """data.packing=document's boolean mask per micro-batch, the additive form each block's attention saves, and
    the mask's shape: the whole rows' (B·T·T; a cp rank's T/cp queries at parallel.cp_impl=allgather, B·T/cp·T)."""
    local = cp_local(c)  # the rank's T / cp positions under parallel.cp (trainer/plan/context_parallel.py)
    if cp_gathers(local):
        mask = c.micro_batch * local.seq_len * c.seq_len
        saved = 0 if config_choice(c, device_kind).saves_scores else precisions(c.precision, c.zero).compute
        return mask, saved * mask, "B·T/cp·T"
    per_block = document_mask_per_token(local, device_kind) * c.micro_batch * local.seq_len
    return c.micro_batch * c.seq_len * c.seq_len, per_block, "B·T·T"


def data_lines(plan: Plan) -> list[str]:
    """What the data adds that the table folds into its columns: data.packing=document's mask (in activations),
    and eval.every's evaluations (held-out batches kept for the run; a forward under no_grad, not walked)."""
    c, lines = plan.config, []
    if c.data.masks_documents:
        mask, per_block, shape = document_mask_bytes(c, plan.device_kind)
        lines.append(
            f"document mask (data.packing=document): {format_bytes(mask)} of booleans ({shape}) per micro-batch, "
            f"{format_bytes(per_block)} of its additive form saved by each block's attention, and the documents' "
            f"ids (8 B a token), in the activations column; attention kernel {sdpa_name(c, plan.device_kind)}"
        )
    if c.eval.every > 0:
        sequences = c.eval.batches * c.micro_batch * c.grad_accum
        held = sequences * c.seq_len * (16 + (8 if c.data.masks_documents else 0))
        lines.append(
            f"evaluation every {c.eval.every} steps: {c.eval.batches} global batches, {sequences} sequences a "
            f"data-parallel rank ({format_bytes(held)} of ids held for the run), each a forward under no_grad "
            "beside the gradients; not walked: it saves no activations, and measured below the step's peak "
            '(39-87% of it on 2 CPU ranks; docs/memory_plan.md, "Evaluation")'
        )
    return lines


def sdpa_name(config: TrainConfig, device_kind: str) -> str:
    choice = config_choice(config, device_kind)
    return "SDPA's own" if choice.backend is None else choice.backend.name.lower()


def fp8_line(plan: Plan) -> str:
    """precision=fp8: what runs in fp8, what stays bf16 and why, and whether the emulated path runs."""
    f = fp8_fields(plan.config, plan.device_kind)
    kept = "; ".join(f"{name} ({why})" for name, why in f["left_in_bf16"].items())
    emulated = (
        f"emulated on {plan.device_kind} (torchao's emulate=True: real float8 casts and scales, matmuls in fp32)"
        if f["emulated"]
        else "torch._scaled_mm on CUDA"
    )
    note = f"; {f['note']}" if "note" in f else ""
    per_block = ", ".join(f["converted_per_block"]) or "none"
    gathered = (
        "their weights all-gathered and held unsharded in fp8, 1 byte each (precision.fp8_all_gather); "
        if f["all_gather"] == "fp8"
        else ""
    )
    return (
        f"fp8: {f['recipe']} scaling in {f['converted']} block linears (fp8_filter={f['filter']}; per block: "
        f"{per_block}), {emulated}; left in bf16: {kept}; {gathered}"
        f"memory as bf16: backward keeps {f['saved_for_backward']}{note}"
    )


def comm_line(plan: Plan) -> str:
    """What each rank's collectives move per optimizer step (trainer/plan/comm.py): total and by kind."""
    comm = plan.comm
    parts = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in comm.bytes_by_collective.items() if n)
    line = (
        f"communication: {format_bytes(comm.total)} ({comm.total:,} bytes) per rank per optimizer step"
        f"{f' ({parts})' if parts else ''}; payloads on {comm.backend}, see docs/communication.md"
    )
    return "\n".join([line, *group_lines(plan)])


def group_lines(plan: Plan) -> list[str]:
    """Per process group (trainer/plan/groups.py), where a job has more than one: its ranks, its link, its bytes."""
    groups = plan.comm.groups
    if len(groups) < 2:
        return []
    lines = []
    for name, group in groups.items():
        parts = ", ".join(f"{kind} {format_bytes(n)}" for kind, n in group.bytes_by_collective.items() if n)
        lines.append(
            f"  {name} group ({group.ranks} ranks, {group.link}): {format_bytes(group.total)} per rank per step ({parts})"
        )
    return lines


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def verdict(plan: Plan, way_out: bool = True) -> str:
    if plan.fits is None:
        return (
            f"fits: unknown ({plan.memory.source}); set plan.accelerator="
            f"{'|'.join(accelerator_names())} or device_memory_gib=N to compare"
        )
    reserved = (
        f" ({plan.required_bytes(plan.worst) / GIB:.3g} GiB reserved with headroom)"
        if plan.device_kind == "cuda"
        else ""
    )
    figures = f"peak {plan.peak_bytes / GIB:.3g} GiB{reserved} of {plan.memory.per_rank_bytes / GIB:.3g} GiB per rank ({plan.memory.source})"
    if plan.fits:
        return f"fits: {figures}"
    return (refusal(plan) or "") if way_out else f"does not fit: {figures}"
