"""One rank's memory probe on CPU, in this process: what MemTracker counts and when it runs."""

from __future__ import annotations

import mmap
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn

from trainer.telemetry.memory import (
    CPU_FIELDS,
    LOAD_FIELDS,
    TENSOR_CATEGORIES,
    MemoryProbe,
    cuda_outside_allocator_bytes,
    measure_load,
    peak_rss_bytes,
    reset_peak_rss,
    should_track_tensors,
)

pytestmark = pytest.mark.torch_versions  # MemTracker is a private torch tool

CPU = torch.device("cpu")


def resident_pages(mib: int) -> mmap.mmap:
    """`mib` MiB of private pages mapped fresh and written, so resident; close() returns them."""
    held = mmap.mmap(-1, mib * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for _ in range(mib):  # a MiB at a time: no `mib` MiB source besides
        held.write(b"\x01" * 2**20)
    return held


def test_tracking_runs_on_the_anchor_and_every_n_steps_after_it() -> None:
    assert [s for s in range(1, 13) if should_track_tensors(s, anchor=2, memory_every=5)] == [2, 7, 12]
    assert [s for s in range(1, 13) if should_track_tensors(s, anchor=2, memory_every=0)] == [2]
    assert [s for s in range(1, 5) if should_track_tensors(s, anchor=2, memory_every=1)] == [1, 2, 3, 4]


def adam_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(8, 256)).square().mean().backward()
    optimizer.step()


def test_what_a_rank_keeps_between_steps_counts_though_no_op_touches_it() -> None:
    """`held` (a pipeline's receive buffers): registered as the step begins, in the peak from its start."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    adam_step(model, optimizer)
    kept = torch.empty(3, 1000)  # allocated before the step, never used in it
    peaks = []
    for held in ([], [kept]):
        probe = MemoryProbe(CPU, memory_every=1, last_step=3)
        probe.held = lambda held=held: held
        with probe.measure(2, model, optimizer):
            adam_step(model, optimizer)
        peaks.append(dict(zip(CPU_FIELDS, probe.read()))["peak_allocated"])
    assert peaks[1] - peaks[0] == 3 * 1000 * 4


def test_tracked_step_counts_parameters_gradients_and_adam_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    adam_step(model, optimizer)  # Adam's state exists from here on, as in every step after the first
    probe = MemoryProbe(CPU, memory_every=1, last_step=3)
    with probe.measure(2, model, optimizer):
        adam_step(model, optimizer)
    figures = dict(zip(CPU_FIELDS, probe.read()))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert figures["peak_params"] == param_bytes
    assert figures["peak_grads"] == param_bytes
    # Two fp32 moments per parameter; the peak falls inside optimizer.step, whose temporaries
    # MemTracker files as optimizer state too (at most one moment's worth here, per-tensor Adam).
    assert 2 * param_bytes <= figures["peak_optimizer"] <= 3 * param_bytes + 4 * len(list(model.parameters()))
    categories = [figures[f"peak_{name}"] for name in TENSOR_CATEGORIES]
    assert figures["peak_allocated"] == sum(categories)
    # What the process held beyond its tensors: the window's peak RSS less the tensor peak.
    assert figures["outside_allocator"] == figures["peak_rss"] - figures["peak_allocated"]


def test_untracked_window_reports_no_tensor_peak_but_a_host_peak() -> None:
    model = nn.Linear(16, 16)
    optimizer = torch.optim.Adam(model.parameters())
    probe = MemoryProbe(CPU, memory_every=0, last_step=10)
    with probe.measure(1, model, optimizer):  # step 1: the anchor is step 2
        adam_step_small(model, optimizer)
    figures = dict(zip(CPU_FIELDS, probe.read()))
    assert np.isnan(figures["peak_allocated"])
    assert figures["peak_rss"] > 0
    assert np.isnan(figures["outside_allocator"])  # no tensor peak, so no split


def test_a_gpu_ranks_memory_outside_the_allocator_is_device_use_less_reserved(monkeypatch) -> None:
    """On CUDA: in use on the device (total - free) less the caching allocator's reserved bytes."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 39 * gib)
    assert cuda_outside_allocator_bytes(torch.device("cuda", 0)) == 2 * gib


def adam_step_small(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-window peak RSS needs /proc/self/clear_refs"
)
def test_peak_rss_resets_each_window() -> None:
    """64 MiB of fresh private pages, written and unmapped, raise the peak; a reset lowers it again.
    Fresh pages, not an array: a CI worker once got its 64 MiB np.ones from heap pages an earlier test
    had left resident, and the peak did not move."""
    assert reset_peak_rss()
    before = peak_rss_bytes()
    resident_pages(64).close()
    high = peak_rss_bytes()
    assert reset_peak_rss()
    assert high - before >= 60 * 2**20
    assert peak_rss_bytes() < high - 60 * 2**20


def test_a_load_counts_the_private_memory_it_held_at_its_peak_once() -> None:
    """What a load held at its peak and freed before it ended: 32 MiB of private pages, mapped fresh and
    written (so resident), held 0.2 s, some hundred samples. Fresh, not a tensor: a test worker's
    allocator may hand a tensor pages it kept resident from an earlier test, which no growth shows (a
    full run here once measured 28 KiB for a 32 MiB tensor held 1 s). The resident-set figure (VmHWM)
    sees them too. Within 1 MiB below (pages the process returned meanwhile: seen, some 40 KiB) and 2 MiB
    above (the runtime's own). The probe's next row carries both figures, the one after it neither."""
    mib = 2**20
    with measure_load():
        held = resident_pages(32)
        time.sleep(0.2)
        held.close()
    probe = MemoryProbe(CPU, memory_every=0, last_step=10)
    figures = dict(zip(CPU_FIELDS, probe.read()))
    assert 31 * mib < figures["load_host_peak"] < 34 * mib
    assert 31 * mib < figures["load_rss_peak"] < 34 * mib
    assert all(np.isnan(v) for f, v in zip(CPU_FIELDS, probe.read()) if f in LOAD_FIELDS)
