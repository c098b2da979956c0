"""`stability:` (StabilityConfig): what the loop does about a finite loss spike (SpikeConfig,
trainer/rank/spikes.py, docs/stability.md "Loss spikes") and the steps whose data it never trains on."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config.enums import SpikeAction
from trainer.config.errors import _require


@dataclass
class SpikeConfig:
    """`stability.spike.*`: a loss above `factor` x the running median, agreed by every rank."""

    action: SpikeAction = SpikeAction.none
    """none (not checked: nothing is computed), log (said and counted, the step taken), skip (the optimizer
    step not taken, as nonfinite=skip does) or rollback (the last save reloaded, the steps since it and the
    spike's own left untrained)."""
    factor: float = 10.0
    """A step is a spike when a rank's loss exceeds factor x the median of its last `window` losses
    (Megatron-LM's SPIKY_LOSS_FACTOR is 10)."""
    window: int = 100
    """Losses the median is taken over; nothing is flagged before this many steps were seen."""
    grad_norm: float | None = None
    """A bound on the global gradient norm (before clipping): a step above it is a spike too; null: none."""
    max_in_a_row: int = 3
    """The run stops (status diverged) once this many steps in a row were spikes."""

    def __post_init__(self) -> None:
        _require(self.factor > 1, f"stability.spike.factor must be > 1, got {self.factor}")
        _require(self.window >= 1, f"stability.spike.window must be >= 1, got {self.window}")
        _require(
            self.grad_norm is None or self.grad_norm > 0,
            f"stability.spike.grad_norm must be > 0 or null, got {self.grad_norm}",
        )
        _require(
            self.max_in_a_row >= 1, f"stability.spike.max_in_a_row must be >= 1, got {self.max_in_a_row}"
        )

    @property
    def enabled(self) -> bool:
        return self.action != SpikeAction.none


@dataclass
class StabilityConfig:
    """`stability.*`: loss spikes, and data never trained on."""

    spike: SpikeConfig = field(default_factory=SpikeConfig)
    skip_steps: list[int] = field(default_factory=list)
    """Steps (1-based) whose batches are read past untrained: no forward, no optimizer step, the LR schedule
    not advanced (Megatron-LM's --iterations-to-skip). A rollback skips its window the same way; listing
    that window replays a run that never saw it."""

    def __post_init__(self) -> None:
        _require(
            all(type(step) is int and step >= 1 for step in self.skip_steps),
            f"stability.skip_steps must be steps >= 1, got {self.skip_steps}",
        )
