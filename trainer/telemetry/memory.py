"""One rank's peak memory over a log window, measured with what PyTorch and the OS already keep.

GPU: the CUDA caching allocator's own counters (peak allocated, reserved and active bytes,
allocation retries, OOMs), reset at the start of every window; reading them costs nothing.

CPU: there is no allocator counter, so two figures stand in:
- peak tensor memory from torch's MemTracker (torch.distributed._tools.mem_tracker), a
  TorchDispatchMode that sees every tensor storage an op creates and attributes it to
  parameters, buffers, gradients, activations, temporaries (backward) or optimizer state.
  It counts tensor bytes only: not the allocator's slack, the Python runtime, gloo's buffers
  or anything outside torch tensors. It intercepts every op in Python, which makes a step
  several times slower, so it runs only on chosen steps (`telemetry.memory_every`);
- the process's peak resident set (host memory, VmHWM), reset per window through
  /proc/self/clear_refs. It shows what the process really held, but at small scale the
  runtime dominates it and ZeRO's savings do not show (docs/design.md, pitfalls).

Memory outside the allocator (`outside_allocator`), on every device: on a GPU, what the device
holds beyond the caching allocator's reserved memory at the window's end (the CUDA context and
kernel images, NCCL's buffers, cuBLAS handles: what trainer/plan/headroom.py assumes), from
`torch.cuda.mem_get_info`, which counts every process on the device (a rank has its GPU to
itself); on a CPU, the window's peak resident set less its tensor peak where tensors were
tracked (the runtime, gloo's buffers, the allocator's slack; the two peaks may fall at
different moments, so it is an estimate of the runtime's share, not an exact split).

Loading model.weights (`measure_load`, around each rank's load): the growth of the process's
private resident memory to its peak, sampled, and of its resident set (VmHWM), which also counts
the checkpoint's pages the readers map; the first window's row carries them.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn

from trainer.model.decoder import rope_cache
from trainer.model.hf_weights import import_readers
from trainer.private_apis.of_torch import comm_hook_states, new_mem_tracker
from trainer.rank.trainee import local_optimizer

# Our names for MemTracker's categories (the values of its _MemRefType enum).
TENSOR_CATEGORIES = {
    "params": "Parameter",
    "buffers": "Buffer",
    "grads": "Gradient",
    "activations": "Activation",
    "temp": "Temp",
    "optimizer": "Optstate",
}
LOAD_FIELDS = ("load_host_peak", "load_rss_peak")
"""model.weights: what loading took of the host (`measure_load`), in the first window's row only."""
CPU_FIELDS = (
    "peak_allocated",
    "peak_rss",
    *(f"peak_{name}" for name in TENSOR_CATEGORIES),
    "outside_allocator",
    *LOAD_FIELDS,
)
CUDA_FIELDS = (
    "peak_allocated",
    "peak_reserved",
    "peak_active",
    "alloc_retries",
    "num_ooms",
    "peak_rss",
    "outside_allocator",
    *LOAD_FIELDS,
)
COUNT_FIELDS = ("alloc_retries", "num_ooms")  # counts, not bytes
NAN = float("nan")


def should_track_tensors(step: int, anchor: int, memory_every: int) -> bool:
    """Tensor tracking on `anchor` and every `memory_every` steps from it (0: the anchor only).

    The anchor is the run's second step: the first one that starts with Adam's state (step 1
    creates it, so its peak is lower than every later step's), and one that the warm-up, left
    out of steady throughput, still covers in a run that logs less often than every step.
    """
    if memory_every == 0:
        return step == anchor
    return (step - anchor) % memory_every == 0


_ACTIVE_TRACKER: list = []  # the MemTracker of the step being tracked, if any (one per rank process)
_PENDING_START: list[Callable[[], None]] = []
"""A pipeline's first tracked step: how to start its tracker, at the step's first stage forward."""
AT_FAILURE: dict[str, float] = {}
"""Bytes by category (`held`, then `params`, `grads`, ... of TENSOR_CATEGORIES) that this rank's tensors
held when a tracked step raised; empty when the failing step was not tracked."""


def category_bytes(snapshot: dict, total_name: str, prefix: str = "") -> dict[str, float]:
    """A MemTracker snapshot (per device, bytes by its _MemRefType) as our categories (`prefix`ed),
    summed over devices."""
    out = {total_name: 0.0, **{f"{prefix}{name}": 0.0 for name in TENSOR_CATEGORIES}}
    for per_kind in snapshot.values():
        by_name = {getattr(kind, "value", kind): nbytes for kind, nbytes in per_kind.items()}
        out[total_name] += by_name.get("Total", 0)
        for name, kind in TENSOR_CATEGORIES.items():
            out[f"{prefix}{name}"] += by_name.get(kind, 0)
    return out


def next_micro_batch() -> None:
    """Tell an active MemTracker that another forward of the same modules begins (grad_accum > 1).

    MemTracker refuses a second forward of a module within one tracking context unless its
    per-module stats are cleared first; clearing them keeps the step's global peak.
    """
    for tracker in _ACTIVE_TRACKER:
        tracker.reset_mod_stats()


def next_stage_forward(stage_module: nn.Module) -> None:
    """Tell an active MemTracker that a pipeline schedule calls a stage's module again (parallel.pp > 1),
    before the backward of its earlier micro-batches; on the run's first step, start the tracker.

    MemTracker refuses a second forward of a top-level module (one whose only parent is its `Global`);
    a stage's blocks have the stage as parent, so only the stage's own stats are forgotten: the blocks'
    stay for their backwards still to come, and the step's global peak is kept.
    """
    for start in _PENDING_START:  # the first step's tracker, once the stages know their shapes
        start()
    _PENDING_START.clear()
    for tracker in _ACTIVE_TRACKER:
        tracker.memory_tracking.pop(stage_module, None)


class MemoryProbe:
    """Peak memory of this rank since the last `reset`, as a fixed-order row of floats.

    Every rank builds the same fields for a device type, so rank 0 can gather the rows into
    one tensor; a figure not measured in the window is NaN.
    """

    def __init__(
        self,
        device: torch.device,
        memory_every: int,
        last_step: int,
        track_first: bool = False,
        also: frozenset[int] = frozenset(),
        pipelined: bool = False,
    ) -> None:
        self.device = device
        # parallel.pp > 1: on the run's first step torch's PipelineStage infers its shapes with a forward and
        # an autograd.grad that MemTracker's module hooks cannot run under; that step is tracked from the
        # first stage forward (`next_stage_forward`), after the inference.
        self.pipelined = pipelined
        self.also = also  # steps tracked besides (memory.snapshot=steps on CPU)
        self.step_peak: dict[str, float] | None = None  # the last tracked step's peak by category
        # Under a memory cap the first step is tracked too: that is where an activation-bound OOM
        # happens, and its failure record then has the split of what the rank held.
        self.track_first = track_first
        self.memory_every = memory_every
        self.last_step = last_step
        self.fields = CUDA_FIELDS if device.type == "cuda" else CPU_FIELDS
        self._ooms_before = self._retries_before = 0
        self._anchor: int | None = None  # the second step of this run (of this attempt, after a resume)
        self._first: int | None = None  # the first step of this run (of this attempt)
        # Tensors a rank keeps from step to step outside its model and optimizer (a pipeline's receive buffers)
        self.held: Callable[[], list[torch.Tensor]] = list
        self.reset()

    def reset(self) -> None:
        """Open a new window: peak counters start again from what is held now."""
        self._tensor_peak: dict[str, float] = {}
        reset_peak_rss()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            stats = torch.cuda.memory_stats(self.device)
            # Cumulative counters: the window's figure is the difference.
            self._retries_before, self._ooms_before = (
                stats.get("num_alloc_retries", 0),
                stats.get("num_ooms", 0),
            )

    def measure(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> AbstractContextManager:
        """Wrap one training step: tensor-level tracking on chosen CPU steps, nothing otherwise."""
        if self._anchor is None:
            self._anchor = min(step + 1, self.last_step)
            self._first = step
        if not self.tracks(step):
            return contextlib.nullcontext()
        return self._track_tensors(model, optimizer, deferred=self.pipelined and step == self._first)

    def tracks(self, step: int) -> bool:
        """Whether `step`, once `measure` has wrapped the run's first, runs under the tensor tracker."""
        assert self._anchor is not None, "measure() wraps the run's first step before tracks() is asked"
        chosen = (
            should_track_tensors(step, self._anchor, self.memory_every)
            or (step == self._first and self.track_first)
            or step in self.also
        )
        return self.device.type == "cpu" and chosen

    @contextlib.contextmanager
    def _track_tensors(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, deferred: bool = False
    ) -> Iterator[None]:
        """The step under a fresh MemTracker, entered now or (`deferred`) at its first stage forward."""
        # A fresh tracker per step: its peak starts at what exists when it is entered, and a
        # module seen in an earlier step would otherwise need reset_mod_stats().
        tracker = new_mem_tracker()
        with contextlib.ExitStack() as entered:

            def start() -> None:
                # What exists before (parameters, their gradients, optimizer moments, a compression hook's
                # error feedback, a pipeline stage's receive buffers, the rotary table: under parallel.cp
                # only index_select reads them, and no op makes a view) is invisible to a dispatch mode
                # until an op creates it anew; register it as the tracker starts.
                tracker.track_external(
                    model,
                    *optimizer_memory(optimizer),
                    *hook_tensors(model),
                    *rope_cache(model),
                    *self.held(),
                )
                entered.enter_context(tracker)
                _ACTIVE_TRACKER.append(tracker)

            if deferred:
                _PENDING_START.append(start)
            else:
                start()
            try:
                yield
            except BaseException:
                # What the rank held when the step failed (an allocation that did not fit is not in
                # it): the failure record's measured split (trainer/faults/failures.py).
                AT_FAILURE.clear()
                if _ACTIVE_TRACKER:
                    AT_FAILURE.update(category_bytes(tracker.get_tracker_snapshot("current"), "held"))
                raise
            finally:
                started = bool(_ACTIVE_TRACKER)
                _ACTIVE_TRACKER.clear()
                _PENDING_START.clear()
        if not started:  # a deferred start whose step ran no stage forward: nothing measured
            return
        peak = category_bytes(tracker.get_tracker_snapshot("peak"), "peak_allocated", "peak_")
        self.step_peak = peak
        if peak["peak_allocated"] > self._tensor_peak.get("peak_allocated", -1.0):
            self._tensor_peak = peak  # several tracked steps in a window: keep the worst one

    def read(self) -> list[float]:
        """This window's figures in `self.fields` order (bytes, or counts for COUNT_FIELDS)."""
        values = {"peak_rss": float(peak_rss_bytes()), **LOADED}
        LOADED.clear()  # the first window's row carries the load's figures, once
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            values.update(
                peak_allocated=float(stats.get("allocated_bytes.all.peak", 0)),
                peak_reserved=float(stats.get("reserved_bytes.all.peak", 0)),
                peak_active=float(stats.get("active_bytes.all.peak", 0)),
                alloc_retries=float(stats.get("num_alloc_retries", 0) - self._retries_before),
                num_ooms=float(stats.get("num_ooms", 0) - self._ooms_before),
                outside_allocator=float(cuda_outside_allocator_bytes(self.device)),
            )
        else:
            values.update(self._tensor_peak)
            if "peak_allocated" in self._tensor_peak:
                values["outside_allocator"] = values["peak_rss"] - self._tensor_peak["peak_allocated"]
        return [values.get(field, NAN) for field in self.fields]


def optimizer_memory(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer | torch.Tensor]:
    """What the optimizer holds in memory, to register: itself (its state), or, where its state lives in a
    file (offload=nvme, trainer/rank/nvme.py, which says so with `in_memory()`), its buffer and counters."""
    tracked = local_optimizer(optimizer)
    return tracked.in_memory() if hasattr(tracked, "in_memory") else [tracked]


def hook_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors a DDP communication hook keeps from step to step (PowerSGD's error feedback and
    its P and Q, TopK's residuals: trainer/rank/compression.py), found in the hooks' states."""
    held = []
    for state in comm_hook_states(model):
        names = getattr(state, "__slots__", None) or list(vars(state))  # PowerSGDState has __slots__
        for value in (getattr(state, name, None) for name in names):  # a tensor, or a dict of them
            values = value.values() if isinstance(value, dict) else [value]
            held += [v for v in values if isinstance(v, torch.Tensor)]
    return held


def cuda_outside_allocator_bytes(device: torch.device) -> int:
    """Device memory in use that the caching allocator has not reserved: the CUDA context, NCCL's
    buffers and the like (every process on the device counts: one rank per GPU)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0); whether it could.

    Where /proc/self/clear_refs is missing or not writable the peak stays the process's
    lifetime peak; peak_rss_bytes still answers, just not per window.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def status_bytes(*names: str) -> list[int]:
    """Fields of /proc/self/status in bytes (VmRSS, RssAnon, VmHWM: reported in kB); -1 where absent."""
    with contextlib.suppress(OSError):
        found = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return [int(found[name].split()[0]) * 1024 if name in found else -1 for name in names]
    return [-1] * len(names)


LOADED: dict[str, float] = {}
"""The last `measure_load`'s figures (LOAD_FIELDS), until the memory probe's first row takes them."""
SAMPLE_EVERY_S = 0.001


@contextlib.contextmanager
def measure_load() -> Iterator[None]:
    """What loading model.weights takes of this rank's host memory, into LOADED:

    - load_host_peak: the growth of the process's anonymous resident memory (RssAnon: its private
      pages, tensors and all) from the load's start to its peak. The kernel keeps no peak of it,
      and torch keeps no CPU allocator statistics (torch 2.13: only CUDA, XPU, MPS and MTIA have
      them), so a thread samples it every SAMPLE_EVERY_S while the load runs (a peak shorter than
      that can be missed: the figure is a lower bound of the true peak, to the sampling);
    - load_rss_peak: the growth of the resident set to its peak (VmHWM, reset at the start through
      /proc/self/clear_refs; NaN where that is not allowed). Exact, but it also counts the file's
      pages the safetensors readers map (safetensors 0.8 hands out views of an mmap of the file,
      whole tensors or slices; they stay mapped until the file is closed): page cache that every
      rank on the node shares and the kernel can drop, not memory the rank holds.
    """
    (anon_start,) = status_bytes("RssAnon")
    reset = reset_peak_rss()
    (rss_start,) = status_bytes("VmRSS")
    peak = [anon_start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_EVERY_S):
            peak[0] = max(peak[0], *status_bytes("RssAnon"))

    sampler = threading.Thread(target=sample, name="load memory", daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        anon_end, hwm = status_bytes("RssAnon", "VmHWM")
        LOADED["load_host_peak"] = float(max(peak[0], anon_end) - anon_start) if anon_start >= 0 else NAN
        LOADED["load_rss_peak"] = float(hwm - rss_start) if reset and hwm >= 0 else NAN


def measured_load(load: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """`load` (trainer/model/hf_weights.py load_weights) under `measure_load`, its readers imported first."""

    def measured(model: nn.Module) -> None:
        import_readers()
        with measure_load():
            load(model)

    return measured


def peak_rss_bytes() -> int:
    """Peak resident set of this process since the last reset (VmHWM), else its lifetime peak."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, kB elsewhere
