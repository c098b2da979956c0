"""An out-of-memory failure explained (trainer/faults/oom.py, trainer/faults/failures.py watch_blocks) and
the remedies the plan says fit (trainer/advise/fit.py): plan arithmetic and a three-block toy, no job."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tests.helpers import CPU_OOM, compose_config
from trainer.advise.fit import remedies
from trainer.faults.failures import POSITION, mark_phase, watch_blocks, where
from trainer.faults.oom import (
    CATEGORIES,
    explain_oom,
    explanation_lines,
    failed_allocation_bytes,
    plan_moment,
)
from trainer.plan import build_plan
from trainer.units import GIB

CAPPED = ("model=tiny", "device=cpu", "seq_len=256", "device_memory_gib=0.5", "micro_batch=62")


def test_the_block_of_a_forward_and_of_a_backward_is_noted() -> None:
    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    watch_blocks(blocks)
    seen: dict[str, int | None] = {}

    class Probe(nn.Module):  # inside block 1's forward: where a failing allocation would be
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["forward"] = POSITION.block
            return x

    blocks[1].register_forward_hook(lambda module, args, out: Probe()(out))

    def backward_of_block_1(grad: torch.Tensor) -> None:
        seen["backward"] = POSITION.block

    blocks[1].weight.register_hook(backward_of_block_1)
    mark_phase(1, "forward", micro_batch=2)
    x = torch.ones(2, 4, requires_grad=True)
    for block in blocks:
        x = block(x)
    assert (seen["forward"], POSITION.block, POSITION.micro_batch) == (1, None, 2)  # the head follows
    mark_phase(1, "backward")
    x.sum().backward()
    assert seen["backward"] == 1
    assert where({"step": 1, "phase": "backward", "block": 1, "micro_batch": 2}) == (
        "step 1 (backward, block 1, micro-batch 2)"
    )


def test_the_allocators_messages_give_the_failed_allocation() -> None:
    assert failed_allocation_bytes(CPU_OOM) == 8388608
    assert failed_allocation_bytes("CUDA out of memory. Tried to allocate 2.00 GiB") == 2 * GIB
    assert failed_allocation_bytes("injected fault") is None


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("1.50 GiB", 1_610_612_736),
        ("20.00 MiB", 20_971_520),
        ("512.00 KiB", 524_288),
        ("2.25 MiB", 2_359_296),
    ],
)
def test_a_cuda_message_in_gib_mib_or_kib_gives_its_bytes(size: str, expected: int) -> None:
    """The caching allocator's message states the size with c10's format_size (GiB, MiB or KiB, two
    decimals): each unit's bytes, the literal figure (1.5 x 2**30, 20 x 2**20, 512 x 2**10, 2.25 x 2**20)."""
    message = (
        f"CUDA out of memory. Tried to allocate {size}. GPU 0 has a total capacity of 79.19 GiB of which "
        "3.06 MiB is free. Of the allocated memory 77.50 GiB is allocated by PyTorch"
    )
    assert failed_allocation_bytes(message) == expected


@pytest.fixture(scope="module")
def plan():
    return build_plan(compose_config(*CAPPED), "cpu", 2)


def test_a_position_is_compared_with_the_plans_nearest_moment(plan) -> None:
    rank = plan.ranks[0]
    assert plan_moment(rank, "forward", 2) == "forward: last block"
    assert plan_moment(rank, "forward", None) == "forward: loss"
    assert plan_moment(rank, "optimizer", None) == "optimizer step"
    assert plan_moment(rank, "setup", None) == rank.peak.name


def test_the_category_most_over_its_plan_is_named(plan) -> None:
    parts = next(m for m in plan.ranks[1].moments if m.name == "forward: loss").parts
    held = {tracked: float(parts[part]) for part, (_, tracked) in CATEGORIES.items()}
    held["activations"] += 3 * 2**20  # 3 MiB more than planned
    held["held"] = sum(held.values())
    record = {"rank": 1, "step": 5, "phase": "forward", "block": None, "micro_batch": 0, "message": CPU_OOM}
    explained = explain_oom(plan, {**record, "measured_bytes": held})
    assert explained["plan_moment"] == "forward: loss"
    assert explained["plan_gib"] == {part: parts[part] / GIB for part in CATEGORIES}
    assert (explained["most_over"], explained["most_over_gib"]) == ("activations", 3 * 2**20 / GIB)
    assert explained["failed_allocation_gib"] == 8388608 / GIB
    assert "cap_gib" not in explained  # no CPU cap in this record


def test_the_cpu_caps_record_is_told_against_the_cap(plan) -> None:
    """Under device_memory_gib on CPU the record carries the capped quantity (tensor bytes) and the cap,
    and the console's account sets one against the other."""
    record = {"rank": 0, "step": 4, "phase": "backward", "block": 1, "micro_batch": 0}
    message = (
        f"CPU out of memory under device_memory_gib: tried to allocate {2**26} bytes while tensors held ..."
    )
    held = {"held": 0.46 * GIB, "cap": 0.5 * GIB, "refused": float(2**26)}
    explained = explain_oom(plan, {**record, "message": message, "measured_bytes": held})
    assert (explained["held_gib"], explained["cap_gib"], explained["failed_allocation_gib"]) == (
        0.46,
        0.5,
        2**26 / GIB,
    )
    last = explanation_lines(explained)[-1]
    assert "0.4600 GiB held + the allocation > the cap's 0.5000 GiB" in last


def test_remedies_are_the_advisors_fitting_candidates_nearest_first() -> None:
    config = compose_config(*CAPPED)
    found = remedies(config, "cpu", 2, ["micro_batch=62", "device_memory_gib=0.5"])
    first = found[0]
    assert (first.changes, first.distance) == ("micro_batch=2 grad_accum=31", 1)
    fixed = dataclasses.replace(config, micro_batch=2, grad_accum=31)
    assert first.peak_gib == build_plan(fixed, "cpu", 2).peak_bytes / GIB
    assert first.command.startswith("python -m trainer device_memory_gib=0.5 zero=stage0 ")
    assert "micro_batch=2 grad_accum=31" in first.command and "micro_batch=62" not in first.command
    assert [r.distance for r in found] == sorted(r.distance for r in found)


def test_no_remedy_plans_as_much_as_what_ran_out() -> None:
    """A job that ran out although its plan fit: no candidate planned at its peak or above is offered."""
    config = compose_config(*CAPPED)
    found = remedies(config, "cpu", 2, ["micro_batch=62", "device_memory_gib=0.5"])
    bound = int(max(r.peak_gib for r in found) * GIB)  # the largest remedy's peak: it would be offered
    kept = remedies(config, "cpu", 2, ["micro_batch=62", "device_memory_gib=0.5"], ran_out_bytes=bound)
    assert kept and all(r.peak_gib * GIB < bound for r in kept)
    largest = max(found, key=lambda r: r.peak_gib)
    assert largest.changes not in {r.changes for r in kept}
