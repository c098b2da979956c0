"""Communication one rank measured, from what torch.distributed itself recorded.

Bytes: c10d's flight recorder keeps an entry for every collective a process group runs (gloo
and NCCL alike): its kind, and the sizes and dtypes of its inputs and outputs. Each log step a
rank reads the entries recorded since the last one and adds up their payloads by kind of
collective (the payload as trainer/plan/comm.py defines it: the larger of the input and output
bytes, i.e. the full tensor). Nothing is re-implemented or patched. There are two recorders,
each with its own dump (private torch APIs, called through trainer/private_apis/, so every use is
guarded): NCCL's collectives go to ProcessGroupNCCL's own (`torch._C._distributed_c10d._dump_nccl_trace_json`,
ProcessGroupNCCL.hpp `dump_nccl_trace_json`; absent from CPU wheels), gloo's to the generic one
(`_dump_fr_trace_json`, FlightRecorder.hpp). A rank reads both (a `cuda:nccl,cpu:gloo` group writes
to both), each with its own record ids. The figures are absent, not guessed, where a dump is
missing, its buffer overflowed, or the recorders recorded nothing at all in a window: a zero is
never reported as a measurement.

Time per collective: NCCL entries carry a duration when `TORCH_NCCL_ENABLE_TIMING=1` (set here
on GPU), but only once NCCL's watchdog has retired them, which is often after the window that ran
them was read. An entry still without one is carried: its duration counts in the first window
that reads it, and each window states the share of the collectives it accounts for whose time is
in its figure (`time_covered_pct`). gloo's entries carry none, so on gloo that figure is absent.

Exposed communication: on the step after each step the memory tracker measures (MemTracker's
dispatch mode slows compute several times, which would hide more communication than a real
step does), torch.profiler records the step; the time some collective was running while this
rank computed nothing (CPU: no aten op on a computing thread; GPU: no non-NCCL kernel) over the
step's wall time is the exposed share.

Pipeline parallelism's point-to-point sends (parallel.pp > 1) are not in gloo's recorder (a pp=2 job's
windows hold its collectives only); the stages count what they send themselves (trainer/rank/pipeline.py,
`comm/pp/...`).

The loop's own collectives (LOOP_COLLECTIVES) are recorded too: they are part of what a rank
moves, and the plan leaves them out (docs/communication.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.layout import Layout
from trainer.plan import COLLECTIVES, GROUPS, plan_comm
from trainer.private_apis.of_torch import flight_recorder_dumps, flight_recorder_json
from trainer.telemetry import keys
from trainer.telemetry.memory import should_track_tensors
from trainer.telemetry.traces import profiled_step

KINDS = (*COLLECTIVES, "other")
"""Columns of a rank's row: payload bytes by kind (`other`: barriers, point-to-point, ...)."""
GROUP_FIELDS = tuple(f"{group}:{kind}" for group in GROUPS for kind in KINDS)
"""The same bytes by the process group the recorder names for each entry (trainer/plan/groups.py)."""
FIELDS = (*KINDS, "time_s", "time_covered_pct", "exposed_pct", "profiled_step_s", *GROUP_FIELDS)
# The recorder's `process_group` is (name, description); DeviceMesh describes the groups of a dim
# `mesh_<dim name>` (torch/distributed/device_mesh.py). The job's one mesh (trainer/rank/mesh.py) names its
# dims after the layout's axes: FSDP2 shards over dp_shard and HSDP replicates over dp_replicate; the
# post-forward mesh FSDP2 builds for reshard_after_forward=<int> has no names (its second dim:
# `mesh_dim_1`, _fsdp_init.py); the layers' collectives run in tp, the pipeline's loss and norm in pp, the
# context-parallel exchanges in cp. Under parallel.cp ZeRO's dim is dp folded with cp into one flattened dim
# (`mesh_dp_shard_cp`, DDP's `mesh_dp_replicate_cp`), or cp itself at dp = 1 (`group_names`).
# A dim spanning every rank reuses the default group (`default_pg`): `group_names` names it.
GROUP_DESCRIPTIONS = {
    "mesh_dp_shard": "shard",
    "mesh_dp_shard_cp": "shard",
    "mesh_dp_replicate": "replicate",
    "mesh_dp_replicate_cp": "world",
    "mesh_dim_1": "hpz",
    "mesh_hpz": "hpz",  # hpZ's secondary mesh under a pipeline (trainer/rank/mesh.py `secondary_mesh`)
    "mesh_tp": "tp",
    "mesh_cp": "cp",
    "mesh_pp": "pp",
    "mesh_ep": "ep",  # an ep group inside FSDP2's shard group (trainer/rank/mesh.py `expert_mesh`)
    "mesh_expert_shard": "expert_shard",
}
SHARED_WITH_EP = "+ep"
"""Suffix of a name `group_names` gives FSDP2's shard group under parallel.ep, which is the ep group too
(trainer/rank/experts.py), or of DDP's group, `world+ep`: `entry_group` gives its all-to-alls (the MoE dispatch's;
FSDP2 and DDP issue none) to `ep`. At dp = 1 under parallel.cp one group is ZeRO's, cp's and ep's: `shard+cp+ep`."""
SHARED_WITH_CP = "+cp"
"""Suffix of a name `group_names` gives ZeRO's group where it is also the cp group (dp = 1): `entry_group`
splits its entries by what they move (`moves_activations`)."""
ACTIVATION_DIMS = 4
"""The cp exchanges' tensors are (rows, positions, heads, head_dim) or more dims (trainer/model/
context_parallel.py); ZeRO's buckets and flat parameter buffers, and the loop's flags and norms, have 1 or 2."""


def group_names(config: TrainConfig, world_size: int) -> tuple[str, dict[str, str]]:
    """The plan's name (trainer/plan/groups.py) for the default group, and for each mesh dim's description.

    The default group is the one a mesh dim spanning every rank reuses: tp's or pp's when either is the
    whole world, FSDP2's shard group when it shards over every rank, else `world`. DDP (zero=stage0/1)
    replicates over dp_replicate, which the plan calls `world` (the data-parallel world, every rank unless
    tp or pp takes some): under a pipeline that dim is a group of its own, named alike here. At dp = 1 under
    parallel.cp, or under HSDP with zero.shard_ranks=1 (its shard dim), ZeRO works over the cp dim itself: that process group is ZeRO's and cp's, `shard+cp` or
    `world+cp` (SHARED_WITH_CP). Under parallel.ep ZeRO's group is the ep group too, `shard+ep` or `world+ep`
    (SHARED_WITH_EP), both at once at dp = 1 under cp (`shard+cp+ep`).
    """
    layout = Layout.from_config(config, world_size)
    descriptions = dict(GROUP_DESCRIPTIONS)
    zero = "shard" if config.zero.uses_fsdp else "world"
    if not config.zero.uses_fsdp:
        descriptions["mesh_dp_replicate"] = "world"
    # cp is ZeRO's whole dim where the data-parallel axis it folds into has one rank: dp = 1, or under HSDP
    # zero.shard_ranks=1 (FSDP2's mesh `(dp_replicate, cp)`, trainer/rank/mesh.py)
    alone = layout.dp_shard if config.zero.uses_fsdp else layout.dp
    shared = layout.cp > 1 and alone == 1
    if shared:
        descriptions["mesh_cp"] = zero + SHARED_WITH_CP
    zero_ranks = layout.dp * layout.cp
    ep_is_zero = config.parallel.ep > 1 and not (config.zero.uses_fsdp and config.parallel.ep < zero_ranks)
    if ep_is_zero:  # the ep group is ZeRO's group (trainer/rank/experts.py), under cp at dp = 1 cp's too
        descriptions["mesh_dp_shard"] = "shard" + SHARED_WITH_EP
        descriptions["mesh_dp_shard_cp"] = "shard" + SHARED_WITH_EP
        if not config.zero.uses_fsdp:
            descriptions["mesh_dp_replicate"] = "world" + SHARED_WITH_EP
            descriptions["mesh_dp_replicate_cp"] = "world" + SHARED_WITH_EP
        if shared:
            descriptions["mesh_cp"] += SHARED_WITH_EP
    spanning = [axis for axis in ("tp", "pp") if 1 < layout.degree(axis) == world_size]
    if spanning:
        return spanning[0], descriptions
    if layout.cp == world_size:
        return descriptions["mesh_cp"], descriptions
    sharded_over_all = config.zero.uses_fsdp and layout.shard_size() == world_size
    zero = "shard" if sharded_over_all else "world"
    if ep_is_zero and (sharded_over_all or not config.zero.uses_fsdp):
        return zero + SHARED_WITH_EP, descriptions  # DDP's replicas are every rank: ep = dp x cp
    return zero, descriptions


LOOP_COLLECTIVES = {
    "non-finite and stop agreement": "all_reduce of world_size + 2 fp32 flags (2 x world_size + 3 with stability.spike), every step (trainer/rank/nonfinite.py)",
    "gradient-norm clipping": "all_reduce of one fp32 norm per parameter tensor, every step, stages 2-3 (DTensor)",
    "fp16 overflow agreement": "all_reduce of one fp32 flag, every step, stages 2-3 under fp16 (ShardedGradScaler)",
    "metric gather": "all_gather of one float64 row per rank, on log steps, none at one rank (trainer/telemetry/metrics.py)",
    "per-layer norms": "all_reduce of 2 x layers float64, on log steps (telemetry.layer_norms, trainer/telemetry/layer_norms.py)",
}
"""The collectives the training loop issues besides ZeRO's, which the plan leaves out (the pipeline's loss and
norm all-reduces over its pp group it plans: trainer/plan/comm.py `PIPELINE_MOVES`)."""

# c10d ScalarType names as the flight recorder writes them -> bytes per element.
ELEMENT_BYTES = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Int": 4,
    "Long": 8,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
}
# Substrings of the recorder's `profiling_name` (`gloo:all_reduce`, `nccl:_allgather_base`, ...) -> kind.
NAME_KINDS = (
    ("reduce_scatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("broadcast", "broadcast"),
    ("all_to_all", "all_to_all"),
    ("alltoall", "all_to_all"),
)
NAN = float("nan")


LOOP_CALLS_PER_STEP = 3  # the non-finite agreement, clipping's norms, the fp16 scaler's flag
WINDOW_SLACK = 64  # the metric gather, a save's DCP collectives, DDP's first-steps broadcasts


def enable_recording(config: TrainConfig, world_size: int, device_kind: str) -> None:
    """Before init_process_group: size the flight recorder to one log window, time NCCL collectives.

    Each read dumps the whole ring buffer (about 0.05-0.3 ms per entry here), so it holds one
    window's collectives and some slack, no more; a window it cannot hold is reported absent.
    A user's own setting of either variable wins. Telemetry off: nothing is recorded.
    """
    if not config.telemetry.enabled:
        return
    per_step = plan_comm(config, world_size).calls + LOOP_CALLS_PER_STEP
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(per_step * config.log_every + WINDOW_SLACK))
    if device_kind == "cuda":
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")


def collective_kind(profiling_name: str) -> str:
    name = profiling_name.lower()
    return next((kind for pattern, kind in NAME_KINDS if pattern in name), "other")


def tensor_bytes(sizes: list[list[int]], dtypes: list[str]) -> int | None:
    """Bytes of a list of tensors as the recorder lists them; None for a dtype it names unknown here."""
    total = 0
    for shape, dtype in zip(sizes, dtypes):
        if dtype not in ELEMENT_BYTES:
            return None
        total += math.prod(shape) * ELEMENT_BYTES[dtype]
    return total


def payload_bytes(entry: dict[str, Any]) -> int | None:
    """The full tensor a collective reads or writes: all-gather output, reduce-scatter input, ..."""
    sizes = [
        tensor_bytes(entry.get(f"{side}_sizes") or [], entry.get(f"{side}_dtypes") or [])
        for side in ("input", "output")
    ]
    return None if None in sizes else max(sizes)  # type: ignore[type-var]


def dump_entries(name: str = "_dump_fr_trace_json") -> list[dict[str, Any]] | None:
    """Every entry one flight recorder holds, or None where this torch has no (working) dump."""
    try:
        dumped = flight_recorder_json(name)
        return None if dumped is None else json.loads(dumped).get("entries", [])
    except (RuntimeError, ValueError):
        return None


TIMED_RECORDERS = ("_dump_nccl_trace_json",)
"""The recorders whose entries get a duration once retired (NCCL's, with TORCH_NCCL_ENABLE_TIMING=1)."""


@dataclass
class Timing:
    """Time in collectives that a window can account for: durations known at its read."""

    seconds: float = 0.0
    timed: int = 0
    """Entries whose duration is in `seconds`: this window's, and earlier ones retired since."""
    untimed: int = 0
    """Entries of a timing recorder still without a duration (carried on), or overwritten before they had one."""

    @property
    def covered_pct(self) -> float:
        return 100.0 * self.timed / (self.timed + self.untimed) if self.timed + self.untimed else NAN


class WindowReader:
    """The flight-recorder entries of this process since the last read (ids increase by one per recorder).

    `alone`: this is a one-rank job. With peers every step moves something, so a window its recorders left
    empty says they record nothing (nothing is not a zero). A lone rank's loop issues no collective (no DDP,
    no agreement, no metric gather), and one that did would be recorded: there, an empty window read whole
    is a zero."""

    def __init__(self, alone: bool = False) -> None:
        self.alone = alone
        self.last_ids = dict.fromkeys(flight_recorder_dumps(), -1)
        self.pending: dict[str, set[int]] = {name: set() for name in self.last_ids}
        """Per recorder: ids read before they had a duration, looked up again at the next read."""
        self.timing: Timing | None = None
        """What the last `take` could time; None where no recorder times its entries (gloo)."""
        self.skip_past()

    def skip_past(self) -> None:
        """Leave out what was recorded so far (process-group setup, the model's first broadcast, a resume)."""
        for name in self.last_ids:
            entries = dump_entries(name) or []
            self.last_ids[name] = max((e["record_id"] for e in entries), default=self.last_ids[name])
            self.pending[name].clear()

    def take(self) -> list[dict[str, Any]] | None:
        """New entries of every recorder, or None when they cannot be known whole (no dump; a ring
        buffer overwrote some) or when no recorder recorded anything, except on a rank `alone`."""
        new_entries: list[dict[str, Any]] = []
        complete = bool(self.last_ids)
        timing = Timing()
        timed_any = False
        for name, last_id in self.last_ids.items():
            entries = dump_entries(name)
            if entries is None:
                complete = False
                continue
            new = sorted((e for e in entries if e["record_id"] > last_id), key=lambda e: e["record_id"])
            complete = complete and (not new or new[0]["record_id"] == last_id + 1)
            if new:
                self.last_ids[name] = new[-1]["record_id"]
            new_entries += new
            timed_any |= self._time(name, entries, new, timing)
        self.timing = timing if timed_any else None
        return new_entries if complete and (new_entries or self.alone) else None

    def _time(
        self, name: str, entries: list[dict[str, Any]], new: list[dict[str, Any]], timing: Timing
    ) -> bool:
        """Add to `timing` the durations known now of `new` and of this recorder's carried entries;
        carry the rest. Whether this recorder times its entries at all."""
        if name not in TIMED_RECORDERS and not any(e.get("duration_ms") is not None for e in entries):
            return False
        by_id = {e["record_id"]: e for e in entries}
        carried = self.pending[name]
        timing.untimed += len(carried - by_id.keys())  # overwritten before NCCL retired them
        self.pending[name] = set()
        for entry in [by_id[i] for i in sorted(carried & by_id.keys())] + new:
            if entry.get("duration_ms") is None:
                self.pending[name].add(entry["record_id"])
                timing.untimed += 1
            else:
                timing.seconds += entry["duration_ms"] / 1000.0
                timing.timed += 1
        return True


def entry_group(
    entry: dict[str, Any], default_group: str, descriptions: dict[str, str] = GROUP_DESCRIPTIONS
) -> str:
    """The group an entry ran in: by DeviceMesh's description of it (`group_names`); the default group is
    `default_group`. In a process group that is both ZeRO's and cp's (dp = 1), the cp exchanges'
    entries are cp's, the rest ZeRO's."""
    description = (entry.get("process_group") or ["", ""])[-1]
    name = descriptions.get(description, default_group)
    zero, *shared = name.split("+")
    all_to_all = collective_kind(entry.get("profiling_name", "")) == "all_to_all"
    if "ep" in shared and all_to_all and not activation_shaped(entry):
        return "ep"  # the MoE dispatch's counts (1-D) and rows (2-D); cp's all-to-alls move 5-D tensors
    if "cp" in shared and moves_activations(entry):
        return "cp"
    return zero


def moves_activations(entry: dict[str, Any]) -> bool:
    """A cp exchange: an all-to-all (beside the MoE dispatch's, which `entry_group` takes first, nothing else
    issues one), or a collective of (rows, positions, heads, head_dim) tensors (the K/V all-gather and its
    reduce-scatter)."""
    return collective_kind(entry.get("profiling_name", "")) == "all_to_all" or activation_shaped(entry)


def activation_shaped(entry: dict[str, Any]) -> bool:
    """A collective of tensors of ACTIVATION_DIMS dims or more: the cp exchanges' (rows, positions, heads, ...)."""
    return any(len(shape) >= ACTIVATION_DIMS for shape in entry.get("input_sizes") or [])


def window_figures(
    entries: list[dict[str, Any]] | None,
    default_group: str = "world",
    timing: Timing | None = None,
    descriptions: dict[str, str] = GROUP_DESCRIPTIONS,
) -> dict[str, float]:
    """Payload bytes by kind (and by group and kind) over a window's entries, and the time in
    collectives its read could account for (NaN: not measured)."""
    figures = dict.fromkeys(KINDS + GROUP_FIELDS, NAN) | {"time_s": NAN, "time_covered_pct": NAN}
    if timing is not None and timing.timed:
        figures.update(time_s=timing.seconds, time_covered_pct=timing.covered_pct)
    if entries is None:
        return figures
    totals = dict.fromkeys(KINDS + GROUP_FIELDS, 0.0)
    for entry in entries:
        payload = payload_bytes(entry)
        if payload is None:
            return figures
        kind = collective_kind(entry.get("profiling_name", ""))
        totals[kind] += payload
        totals[f"{entry_group(entry, default_group, descriptions)}:{kind}"] += payload
    figures.update(totals)
    return figures


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def exposed_seconds(events: list[Any], device_kind: str) -> float:
    """Time some collective ran while no computation did, from a profiled step's events.

    CPU: gloo runs collectives on its own threads (events `gloo:*`); computation is every
    `aten::` op on the other threads. GPU: NCCL kernels against every other kernel.
    """
    if device_kind == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        comm = [e for e in kernels if "nccl" in e.name.lower()]
        compute = [e for e in kernels if "nccl" not in e.name.lower()]
    else:
        comm = [e for e in events if e.name.startswith(("gloo:", "nccl:"))]
        comm_threads = {e.thread for e in comm}
        compute = [e for e in events if e.name.startswith("aten::") and e.thread not in comm_threads]
    spans = [(e.time_range.start, e.time_range.end) for e in comm]
    busy = [(e.time_range.start, e.time_range.end) for e in compute]
    # |comm \ compute| = |comm ∪ compute| − |compute|
    return (union_length(spans + busy) - union_length(busy)) / 1e6  # profiler times are in µs


class CommProbe:
    """This rank's communication over a log window, as a fixed-order row of floats (FIELDS)."""

    def __init__(
        self,
        device: torch.device,
        memory_every: int,
        last_step: int,
        default_group: str = "world",
        descriptions: dict[str, str] = GROUP_DESCRIPTIONS,
        alone: bool = False,
    ) -> None:
        self.device = device
        self.default_group, self.descriptions = default_group, descriptions
        self.memory_every = memory_every
        self.last_step = last_step
        self.reader = WindowReader(alone)
        self._anchor: int | None = None
        self._exposed_pct = self._profiled_step_s = NAN

    def measure(self, step: int, tracked: bool) -> AbstractContextManager:
        """Wrap a training step: torch.profiler on the step after each memory-tracked step, unless the
        tensor tracker runs on this step too (`tracked`: every CPU step at `telemetry.memory_every=1`),
        whose dispatch mode slows computation several times and would hide communication that a plain
        step exposes; such a run reports no exposed share rather than a wrong one."""
        if self._anchor is None:
            self._anchor = min(
                step + 1, self.last_step
            )  # the memory tracker's anchor (trainer/telemetry/memory.py)
        if (
            tracked
            or step - 1 < self._anchor
            or not should_track_tensors(step - 1, self._anchor, self.memory_every)
        ):
            return contextlib.nullcontext()
        return self._profile()

    @contextlib.contextmanager
    def _profile(self) -> Iterator[None]:
        # The step's one profiler session: a traced step (telemetry.trace_steps) has it open already.
        with profiled_step(self.device) as session:
            start = time.perf_counter()
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step_s = time.perf_counter() - start
            session.after.append(lambda prof: self._read_profile(prof, step_s))

    def _read_profile(self, prof: Any, step_s: float) -> None:
        self._profiled_step_s = step_s
        self._exposed_pct = 100.0 * exposed_seconds(list(prof.events()), self.device.type) / step_s

    def read(self) -> list[float]:
        """This window's figures in FIELDS order (bytes and seconds in total, not yet per step)."""
        entries = self.reader.take()
        figures = window_figures(entries, self.default_group, self.reader.timing, self.descriptions)
        figures.update(exposed_pct=self._exposed_pct, profiled_step_s=self._profiled_step_s)
        self._exposed_pct = self._profiled_step_s = NAN
        return [figures[name] for name in FIELDS]


def comm_fields(
    per_rank: torch.Tensor,
    steps: int,
    predicted_bytes: int | None,
    predicted_groups: dict[str, float] | None = None,
) -> dict[str, float]:
    """Every rank's bytes per optimizer step (total, by kind, and by process group where it used
    the group), time where timed, the plan next to the worst rank, and the exposed share of the profiled
    step (worst rank). Unmeasured figures are left out."""
    record: dict[str, float] = {}
    totals = []
    for rank, row in enumerate(per_rank.tolist()):
        figures = dict(zip(FIELDS, row))
        if not math.isnan(figures["all_reduce"]):
            total = sum(figures[kind] for kind in KINDS)
            totals.append(total / steps)
            record[keys.comm_key(rank, "bytes_per_step")] = total / steps
            for kind in COLLECTIVES:
                record[keys.comm_key(rank, f"{kind}_bytes_per_step")] = figures[kind] / steps
            record.update(group_fields(rank, figures, steps))
        if not math.isnan(figures["time_s"]):
            record[keys.comm_key(rank, "time_s_per_step")] = figures["time_s"] / steps
            record[keys.comm_key(rank, "time_covered_pct")] = figures["time_covered_pct"]
    exposed = per_rank[:, FIELDS.index("exposed_pct")]
    if not torch.isnan(exposed).all():
        record[keys.COMM_EXPOSED_PCT] = float(exposed[~torch.isnan(exposed)].max())
    for group, predicted in (predicted_groups or {}).items():
        record[keys.comm_group_predicted_key(group)] = predicted
    if predicted_bytes is not None:
        record[keys.COMM_PREDICTED_BYTES] = predicted_bytes
        if totals and len(totals) == per_rank.shape[0] and max(totals) > 0:
            # Positive: the plan over-predicts; relative to the worst rank's measurement.
            record[keys.COMM_PREDICTION_ERROR_PCT] = 100.0 * (predicted_bytes - max(totals)) / max(totals)
    return record


def group_fields(rank: int, figures: dict[str, float], steps: int) -> dict[str, float]:
    """`comm/rank{r}/{group}/bytes_per_step` and `.../{collective}_bytes_per_step` of each group this rank used."""
    record: dict[str, float] = {}
    for group in GROUPS:
        total = sum(figures[f"{group}:{kind}"] for kind in KINDS)
        if total == 0:
            continue
        record[keys.comm_key(rank, f"{group}/bytes_per_step")] = total / steps
        for kind in COLLECTIVES:
            record[keys.comm_key(rank, f"{group}/{kind}_bytes_per_step")] = figures[f"{group}:{kind}"] / steps
    return record
