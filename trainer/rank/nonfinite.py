"""The non-finite policy: before every optimizer step all ranks agree whether loss and gradients are finite.

`nonfinite=raise` stops the job at the first non-finite step with one line naming the step, the
rank(s) and whether the loss or the gradient was non-finite; `nonfinite=skip` leaves the weights
and the optimizer state untouched for that step, counts it, and stops once
`max_nonfinite_skips` steps in a row were non-finite.

Under fp16 a non-finite gradient with a finite loss is an overflow of the loss scale: the
GradScaler already skips that step on every rank and backs the scale off, so it is not handled
a second time here. A non-finite *loss* is never a scaling problem (the scale only touches the
backward pass) and goes through the policy in every precision.

Where the ranks agree, and when the host learns of it. The agreement is one all-reduce (MAX)
of a small flags tensor per step: a loss flag per rank, the gradient flag, and the ranks' stop
requests (trainer/faults/stop.py: a signal number per rank, MAX-reduced) and, with stability.spike
on, each rank's loss-spike flag (trainer/rank/spikes.py), so one collective carries every per-step
decision. Spikes are read on the host every step (no deferred read: a rollback is the host's act).
A stop is agreed where the flags are read: at once on the per-step path, at the next log step or
save on the deferred one. The result stays on
the device. With a fused AdamW (trainer/rank/optim.py; the default on CUDA) the optimizer skips a
non-finite step on the device through its `found_inf` input, the mechanism GradScaler uses
for fused optimizers, so the host reads the flags only where it synchronises anyway: at log
steps, saves and the last step (`NonFiniteGuard.settle`). It then replays the steps of the
window through the policy, so messages and counts are those of a per-step check. Until the
read, a device-side `halted` flag skips every later step too, so a run that must stop is
stopped with the weights of the last good step. Without found_inf (the per-tensor AdamW on
CPU, where a host read costs nothing: there is no device queue to drain) the flags are read at
once.

torch has no such check to reuse (GradScaler's found_inf covers gradients only, and only fp16),
hence this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.config import NonFinitePolicy
from trainer.telemetry import keys
from trainer.world import World

if TYPE_CHECKING:
    from trainer.faults.stop import RankStop
    from trainer.rank.spikes import SpikeGuard


class NonFiniteError(RuntimeError):
    """Raised on every rank at once (they agreed): training cannot go on. The message is one line."""

    def __init__(self, message: str, step: int = 0) -> None:
        super().__init__(message)
        self.step = step
        """The non-finite step that stopped the run: the state saved is that of the step before."""


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


@dataclass(frozen=True)
class Slots:
    """Where each decision sits in the agreed flags: `world_size` loss flags (one per rank), the
    gradient flag, the stop request (the largest signal number any rank noted: trainer/faults/stop.py);
    with `spikes` (stability.spike on, trainer/rank/spikes.py) `world_size` loss-spike ratios and the
    gradient norm over its bound after them (absent when off: the agreement is as small as before)."""

    world_size: int
    spikes: bool = False

    @property
    def losses(self) -> slice:
        return slice(0, self.world_size)

    @property
    def gradient(self) -> int:
        return self.world_size

    @property
    def stop(self) -> int:
        return self.world_size + 1

    @property
    def spike_losses(self) -> slice:
        return slice(self.world_size + 2, 2 * self.world_size + 2)

    @property
    def spike_grad(self) -> int:
        return 2 * self.world_size + 2

    @property
    def size(self) -> int:
        return 2 * self.world_size + 3 if self.spikes else self.world_size + 2


def agree(
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    world: World,
    stop: torch.Tensor | float = 0.0,
    spike: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The flags every rank agrees on for this step (laid out as `Slots` says), after one
    all-reduce (MAX), left on the device. `stop`: this rank's stop request (`stop_request`);
    `spike`: this rank's loss-spike ratio and the gradient norm over its bound (SpikeDetector.observe)."""
    slots = Slots(world.world_size, spikes=spike is not None)
    flags = torch.zeros(slots.size, device=world.device)
    if spike is not None:
        flags[slots.spike_losses][world.rank] = spike[0]
        flags[slots.spike_grad] = spike[1]
    flags[world.rank] = (~torch.isfinite(loss.detach().float())).float()
    flags[slots.gradient] = (~torch.isfinite(grad_norm.detach().float())).float()
    # fill_ takes the number as a kernel argument; `flags[i] = number` copies it from pageable host
    # memory, a synchronizing copy on CUDA (tests/gpu's sync-debug steps caught it).
    flags[slots.stop].fill_(stop)
    if world.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags


def decode(flags: list[float], step: int, world_size: int, scaler_enabled: bool) -> NonFinite | None:
    """What the agreed flags say (read on the host). None when all is finite, or when only the
    gradient is non-finite under fp16 (an overflow, which the GradScaler handles on every rank)."""
    slots = Slots(world_size)
    loss_ranks = tuple(rank for rank, flag in enumerate(flags[slots.losses]) if flag > 0)
    grad_flag = flags[slots.gradient]
    if not loss_ranks and (grad_flag == 0 or scaler_enabled):
        return None
    return NonFinite(step=step, loss_ranks=loss_ranks, gradient=grad_flag > 0)


def stop_request(stop: RankStop | None) -> float:
    """This rank's stop request for the agreement's stop slot (0: none)."""
    return float(stop.local_request()) if stop is not None else 0.0


class NonFiniteGuard:
    """Applies the policy: counts skipped steps, decides when to stop.

    `defer`: the optimizer takes the skip on the device (`record` gives it), and the host reads
    the window's flags in `settle`; otherwise each step's flags are read in `check_now`.
    """

    def __init__(
        self,
        policy: NonFinitePolicy,
        max_in_a_row: int,
        world: World,
        fp16: bool,
        skipped: int = 0,
        defer: bool = False,  # type: ignore[valid-type]
        spikes: SpikeGuard | None = None,
    ) -> None:
        self.is_main = world.is_main
        self.world_size = world.world_size
        self.slots = Slots(world.world_size, spikes=spikes is not None)
        self.spikes = spikes
        """stability.spike on: a finite step's agreed spike slots go through it (read per step: no defer)."""
        assert not (defer and spikes is not None), "spikes are read on the host every step"
        self.skip = policy.value == "skip"
        self.max_in_a_row = max_in_a_row
        self.scaler_enabled = fp16  # a gradient overflow alone is then the GradScaler's to skip
        self.defer = defer
        self.skipped = skipped
        """Cumulative skipped steps (carried across resumes by the save)."""
        self.in_a_row = 0
        self.window: list[tuple[int, torch.Tensor]] = []
        # Device-side twins of in_a_row and of "must stop", for the deferred path.
        self.in_a_row_t = torch.zeros((), device=world.device)
        self.halted_t = torch.zeros((), device=world.device)

    def check_now(self, step: int, flags: torch.Tensor, stop: RankStop | None = None) -> bool:
        """Read this step's flags now (a host sync): True when the optimizer may step."""
        rows = flags.tolist()
        if stop is not None:
            stop.agree(rows[self.slots.stop])
        if not self.check(decode(rows, step, self.world_size, self.scaler_enabled)):
            return False  # non-finite: the non-finite policy's step, not a spike
        if self.spikes is None:
            return True
        return self.spikes.check_flags(rows[self.slots.spike_losses], rows[self.slots.spike_grad], step)

    def record(self, step: int, flags: torch.Tensor) -> torch.Tensor:
        """Keep this step's flags for `settle`; the optimizer's found_inf (1.0: skip), on the device.

        A step is skipped when it is non-finite, or once the run must stop (nonfinite=raise: any
        non-finite step; skip: max_nonfinite_skips in a row), so that the weights stay those of
        the last good step until the host reads the flags and stops the run.
        """
        self.window.append((step, flags))
        bad = flags[self.slots.losses].amax()
        if not self.scaler_enabled:  # under fp16 a gradient overflow alone is the scaler's to skip
            bad = torch.maximum(bad, flags[self.slots.gradient])
        self.in_a_row_t = (self.in_a_row_t + 1) * bad
        must_stop = bad if not self.skip else (self.in_a_row_t >= self.max_in_a_row).float()
        self.halted_t = torch.maximum(self.halted_t, must_stop)
        return torch.maximum(bad, self.halted_t)

    def settle(self, stop: RankStop | None = None) -> None:
        """Read the window's flags (one host sync, where the loop synchronises anyway) and replay
        them through the policy: counts skips, raises NonFiniteError naming the first step that
        stops the run; hands the window's stop requests to `stop`."""
        if not self.window:
            return
        rows = torch.stack([flags for _, flags in self.window]).tolist()
        steps = [step for step, _ in self.window]
        self.window = []
        if stop is not None:
            stop.agree(max(row[self.slots.stop] for row in rows))
        for step, flags in zip(steps, rows):
            self.check(decode(flags, step, self.world_size, self.scaler_enabled))

    def check(self, found: NonFinite | None) -> bool:
        """True when the optimizer may step; raises NonFiniteError when training must stop."""
        if found is None:
            self.in_a_row = 0
            return True
        if not self.skip:
            raise NonFiniteError(
                f"{found.describe()} (nonfinite=raise; nonfinite=skip skips such steps)", found.step
            )
        if self.in_a_row + 1 >= self.max_in_a_row:
            raise NonFiniteError(
                f"{found.describe()}: {self.in_a_row + 1} non-finite steps in a row "
                f"(nonfinite=skip stops at max_nonfinite_skips={self.max_in_a_row})",
                found.step,
            )
        self.skipped += 1
        self.in_a_row += 1
        if self.is_main:
            print(f"skipped: {found.describe()} ({self.skipped} skipped so far, nonfinite=skip)", flush=True)
        return False


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The skipped-step count for summary.json, and the loss-spike count where stability.spike was
    on (trainer/rank/spikes.py), each from the last metrics record that has it."""
    found: dict[str, Any] = {}
    for key in (keys.NONFINITE_SKIPPED, keys.LOSS_SPIKES):
        for record in reversed(records):
            if key in record:
                found[key] = record[key]
                break
    return found
