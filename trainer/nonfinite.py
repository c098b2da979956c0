"""The non-finite policy: before every optimizer step all ranks agree whether loss and gradients are finite.

`nonfinite=raise` stops the job at the first non-finite step with one line naming the step, the
rank(s) and whether the loss or the gradient was non-finite; `nonfinite=skip` leaves the weights
and the optimizer state untouched for that step, counts it, and stops once
`max_nonfinite_skips` steps in a row were non-finite.

Under fp16 a non-finite gradient with a finite loss is an overflow of the loss scale: the
GradScaler already skips that step on every rank and backs the scale off, so it is not handled
a second time here. A non-finite *loss* is never a scaling problem (the scale only touches the
backward pass) and goes through the policy in every precision.

torch has no such check to reuse (GradScaler's found_inf covers gradients only, and only fp16),
hence this module; it is one all-reduce per step, which is the cost of every rank agreeing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import NonFinitePolicy
from trainer.world import World

SKIPPED_KEY = "train/nonfinite_skipped"
"""Metric: cumulative count of optimizer steps skipped by nonfinite=skip."""


class NonFiniteError(RuntimeError):
    """Raised on every rank at once (they agreed): training cannot go on. The message is one line."""


@dataclass(frozen=True)
class NonFinite:
    """What was non-finite at one step, as every rank agreed."""

    step: int
    loss_ranks: tuple[int, ...]
    """Ranks whose loss (over this step's micro-batches) was NaN or inf."""
    gradient: bool
    """The global gradient norm was NaN or inf (one value for all ranks: it is all-reduced)."""

    def describe(self) -> str:
        if self.loss_ranks:
            ranks = ", ".join(str(r) for r in self.loss_ranks)
            return f"non-finite loss at step {self.step} on rank{'s' if len(self.loss_ranks) > 1 else ''} {ranks}"
        return f"non-finite gradient at step {self.step} (global gradient norm; the loss was finite on every rank)"


def find_nonfinite(loss: torch.Tensor, grad_norm: torch.Tensor, step: int, world: World, scaler_enabled: bool) -> NonFinite | None:
    """One all-reduce (MAX) of a flag per rank for the loss and one for the gradient norm.

    A host sync every step, deliberately: every rank must take the same branch (step or skip).
    Returns None when all is finite, or when only the gradient is non-finite under fp16 (an
    overflow, which the GradScaler handles on every rank).
    """
    flags = torch.zeros(world.world_size + 1, device=world.device)
    flags[world.rank] = (~torch.isfinite(loss.detach().float())).float()
    flags[-1] = (~torch.isfinite(grad_norm.detach().float())).float()
    if world.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    *loss_flags, grad_flag = flags.tolist()
    loss_ranks = tuple(rank for rank, flag in enumerate(loss_flags) if flag > 0)
    if not loss_ranks and (grad_flag == 0 or scaler_enabled):
        return None
    return NonFinite(step=step, loss_ranks=loss_ranks, gradient=grad_flag > 0)


class NonFiniteGuard:
    """Applies the policy: counts skipped steps, decides when to stop."""

    def __init__(self, policy: NonFinitePolicy, max_in_a_row: int, world: World, skipped: int = 0) -> None:  # type: ignore[valid-type]
        self.is_main = world.is_main
        self.skip = policy.value == "skip"
        self.max_in_a_row = max_in_a_row
        self.skipped = skipped
        """Cumulative skipped steps (carried across resumes by the save)."""
        self.in_a_row = 0

    def check(self, found: NonFinite | None) -> bool:
        """True when the optimizer may step; raises NonFiniteError when training must stop."""
        if found is None:
            self.in_a_row = 0
            return True
        if not self.skip:
            raise NonFiniteError(f"{found.describe()} (nonfinite=raise; nonfinite=skip skips such steps)")
        if self.in_a_row + 1 >= self.max_in_a_row:
            raise NonFiniteError(
                f"{found.describe()}: {self.in_a_row + 1} non-finite steps in a row "
                f"(nonfinite=skip stops at max_nonfinite_skips={self.max_in_a_row})"
            )
        self.skipped += 1
        self.in_a_row += 1
        if self.is_main:
            print(f"skipped: {found.describe()} ({self.skipped} skipped so far, nonfinite=skip)", flush=True)
        return False


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The skipped-step count for summary.json, from the last metrics record that has it."""
    for record in reversed(records):
        if SKIPPED_KEY in record:
            return {SKIPPED_KEY: record[SKIPPED_KEY]}
    return {}
