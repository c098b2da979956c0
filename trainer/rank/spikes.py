"""Loss spikes (`stability.spike`): a finite loss far above its running median, agreed by every rank.

Each rank keeps the last `window` losses it saw (its own, over the step's micro-batches) on the
device and flags a step whose loss exceeds `factor` x their median (Megatron-LM's check_for_spiky_loss
compares with SPIKY_LOSS_FACTOR = 10 the same way, against its running value); optionally a global
gradient norm above `stability.spike.grad_norm` is a spike too. The flag of every rank travels in the
one all-reduce that already carries the non-finite and stop decisions (trainer/rank/nonfinite.py
`agree`), so a spike that only rank 1 saw is acted on by every rank at the same step: deciding on one
rank alone would leave the others in a collective it never joins (WeatherGenerator#2724).

Actions: `log` says it and counts it (spikes.jsonl in the run directory, `stability/loss_spikes` in
metrics.jsonl and summary.json); `skip` does not take the optimizer step (as nonfinite=skip: weights
and optimizer state untouched); `rollback` reloads the newest save and reads past the data from it up
to the spike (`stability.skip_steps`' mechanism), recording the window in spikes.jsonl. After
`max_in_a_row` spikes in a row the run stops, status diverged, in one line.

A spike's loss never enters the history, so a run of spikes cannot raise the median that judges
them; a non-finite loss is the non-finite policy's and does not enter it either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import SpikeAction, SpikeConfig, TrainConfig
from trainer.jsonl import read_jsonl
from trainer.rank.nonfinite import NonFiniteError
from trainer.rank.trainee import Trainee
from trainer.saves.background import Saves
from trainer.saves.dcp import Progress, SaveSpec, list_saves, load_training_state, save_step
from trainer.saves.integrity import newest_whole_save
from trainer.telemetry import keys
from trainer.world import World

SPIKES_FILE = "spikes.jsonl"
"""In the run directory: one line per spike every rank agreed on (rank 0 writes it), and one per rollback."""
ROLLED_BACK = "rolled_back"
"""A rollback's line: [first, last], the steps left untrained, and the save it reloaded."""


class SpikeError(NonFiniteError):
    """Raised on every rank at once: `max_in_a_row` spikes in a row, or nothing to roll back to.
    A NonFiniteError, so the loop saves the last good state and the job ends `diverged` alike."""


class SpikeDetector:
    """One rank's running window of losses and its flag, on the device (no host sync)."""

    def __init__(self, spike: SpikeConfig, device: torch.device) -> None:
        self.factor, self.window, self.bound = spike.factor, spike.window, spike.grad_norm
        self.history = torch.zeros(spike.window, device=device)
        self.at = torch.zeros(1, dtype=torch.long, device=device)
        """Where the next kept loss goes (a ring)."""
        self.held = torch.zeros((), device=device)
        """Losses in the history, up to `window`: nothing is flagged before it is full."""

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's (loss ratio, gradient norm) flags, 0 where not a spike: the loss over the median of
        the history when above `factor`, the gradient norm when above its bound. Keeps a loss that is
        neither a spike nor non-finite."""
        loss = loss.detach().float().reshape(())
        finite = torch.isfinite(loss)
        ratio = loss / torch.quantile(self.history, 0.5)  # the median (mean of the middle two when even)
        spike = finite & (self.held >= self.window) & (ratio > self.factor)
        keep = finite & ~spike
        kept = torch.where(keep, loss, self.history.index_select(0, self.at))
        self.history.index_copy_(0, self.at, kept.reshape(1))
        self.at = (self.at + keep.long()) % self.window
        self.held = torch.clamp(self.held + keep.float(), max=self.window)
        grad = torch.zeros((), device=loss.device)
        if self.bound is not None:
            norm = grad_norm.detach().float().reshape(())
            grad = torch.where(torch.isfinite(norm) & (norm > self.bound), norm, grad)
        return torch.where(spike, ratio, torch.zeros_like(ratio)), grad


@dataclass(frozen=True)
class Spike:
    """A spike every rank agreed on: each flagging rank's loss ratio, and the gradient norm over its bound."""

    step: int
    ratios: dict[int, float]
    grad_norm: float

    def describe(self, spike: SpikeConfig) -> str:
        if self.ratios:
            ranks = ", ".join(str(rank) for rank in self.ratios)
            worst = max(self.ratios.values())
            return (
                f"loss spike at step {self.step} on rank{'s' if len(self.ratios) > 1 else ''} {ranks} "
                f"({worst:.1f} x the median of its last {spike.window} losses; "
                f"stability.spike.factor={spike.factor:g})"
            )
        return (
            f"gradient norm spike at step {self.step} ({self.grad_norm:.4g} > "
            f"stability.spike.grad_norm={spike.grad_norm:g})"
        )

    def event(self, action: SpikeAction) -> dict[str, Any]:
        """Its line in spikes.jsonl."""
        return {
            "step": self.step,
            "action": action.value,
            "ratios": {str(rank): ratio for rank, ratio in self.ratios.items()},
            "grad_norm": self.grad_norm or None,
        }


def decode_spike(ratios: list[float], grad_norm: float, step: int) -> Spike | None:
    """What the agreed spike slots say (read on the host): None when no rank flagged a spike."""
    flagged = {rank: ratio for rank, ratio in enumerate(ratios) if ratio > 0}
    if not flagged and grad_norm == 0:
        return None
    return Spike(step=step, ratios=flagged, grad_norm=grad_norm)


@dataclass
class SpikeGuard:
    """Applies `stability.spike.action` to the agreed spikes: counts, records, decides when to stop."""

    spike: SpikeConfig
    world: World
    run_dir: Path
    count: int = 0
    """Spikes so far in this run (metrics.jsonl `stability/loss_spikes`)."""
    in_a_row: int = 0
    rollback_at: int | None = None
    """The step whose spike asks for a rollback, until the loop has done it."""
    detector: SpikeDetector = field(init=False)

    def __post_init__(self) -> None:
        self.detector = SpikeDetector(self.spike, self.world.device)

    @classmethod
    def of(cls, config: TrainConfig, world: World, run_dir: Path, start_step: int) -> SpikeGuard | None:
        """None when stability.spike.action=none: nothing is computed, the agreement keeps its size.
        The count goes on from the spikes spikes.jsonl records up to `start_step` (a resumed run)."""
        if not config.stability.spike.enabled:
            return None
        return cls(config.stability.spike, world, run_dir, count=len(past_spikes(run_dir, start_step)))

    def check_flags(self, ratios: list[float], grad_norm: float, step: int) -> bool:
        """The agreed spike slots of `step` (trainer/rank/nonfinite.py `Slots`) through `check`."""
        return self.check(decode_spike(ratios, grad_norm, step))

    def check(self, found: Spike | None) -> bool:
        """True when the optimizer may step; raises SpikeError once `max_in_a_row` steps in a row spiked."""
        if found is None:
            self.in_a_row = 0
            return True
        action = self.spike.action
        self.in_a_row += 1
        if self.in_a_row >= self.spike.max_in_a_row:
            raise SpikeError(
                f"{found.describe(self.spike)}: {self.in_a_row} spike{'s' if self.in_a_row > 1 else ''} in a row "
                f"(stability.spike.action={action.value} stops at stability.spike.max_in_a_row="
                f"{self.spike.max_in_a_row})",
                found.step,
            )
        self.count += 1
        if action == SpikeAction.rollback:
            self.rollback_at = found.step
        if self.world.is_main:
            done = {"log": "step taken", "skip": "step skipped", "rollback": "rolling back to the last save"}
            print(
                f"{found.describe(self.spike)}: {done[action.value]} "
                f"({self.count} so far, stability.spike.action={action.value})",
                flush=True,
            )
            self.write(found.event(action))
        return action == SpikeAction.log

    def write(self, event: dict[str, Any]) -> None:
        with (self.run_dir / SPIKES_FILE).open("a") as f:
            f.write(json.dumps(event) + "\n")

    def fields(self) -> dict[str, Any]:
        """The log record's figures (metrics.jsonl, W&B)."""
        return {keys.LOSS_SPIKES: self.count}


def roll_back(guard: SpikeGuard, trainee: Trainee, spec: SaveSpec, step: int, saves: Saves) -> Progress:
    """Reload the newest whole save before `step` (every rank: a collective); rank 0 records the steps
    from it to `step`, left untrained, in spikes.jsonl. The caller reads the data on from `step`.
    Raises SpikeError when there is no save yet."""
    world = guard.world
    saves.drain()  # a save in flight is of an earlier step: listed (by rank 0) before the choice
    dist.barrier()
    saves = [path for path in list_saves(guard.run_dir) if save_step(path) < step]
    save = newest_whole_save(saves, say=False)
    if save is None:
        raise SpikeError(
            f"loss spike at step {step}: no save to roll back to yet (save.every={spec.save.every}); "
            "stability.spike.action=skip skips the step instead",
            step,
        )
    progress = load_training_state(trainee, spec, world, save)
    guard.rollback_at = None
    if world.is_main:
        print(
            f"rolled back to {save} (step {progress.step}); steps {progress.step + 1}-{step} left untrained",
            flush=True,
        )
        guard.write({"step": step, ROLLED_BACK: [progress.step + 1, step], "save": str(save)})
    return progress


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """spikes.jsonl's lines ([] when there is none: no spike yet)."""
    return read_jsonl(run_dir / SPIKES_FILE)


def past_spikes(run_dir: Path, up_to: int) -> list[dict[str, Any]]:
    """The spikes spikes.jsonl records at steps up to `up_to` (not the rollbacks' own lines)."""
    return [event for event in read_events(run_dir) if "action" in event and event["step"] <= up_to]


def untrained_steps(config: TrainConfig, run_dir: Path, start_step: int) -> set[int]:
    """Steps whose batches are read past untrained: stability.skip_steps, and the windows of this run's
    rollbacks (spikes.jsonl) after `start_step`, so that a run resumed from a save before a rollback
    does not train on the window it left out."""
    steps = set(config.stability.skip_steps)
    for event in read_events(run_dir):
        if ROLLED_BACK in event:
            first, last = event[ROLLED_BACK]
            steps.update(range(max(first, start_step + 1), last + 1))
    return steps


def skip_batches(batches: Iterator[Any], grad_accum: int) -> None:
    """Read one step's micro-batches past (every rank reads its own: the data position stays global)."""
    for _ in range(grad_accum):
        next(batches)
