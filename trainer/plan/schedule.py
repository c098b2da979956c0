"""The plan step by step: what one optimizer step moves and whether the memory plan's peak describes it.

The communication plan (trainer/plan/comm.py) and the memory plan give the figures of a steady step.
Two methods of zero= run steps that are planned otherwise (trainer/rank/compression.py):

- zero.compression=powersgd all-reduces the first zero.powersgd_start_step gradient reductions exactly
  (PowerSGDState.start_powerSGD_iter): those steps move what zero.compression=none moves, and until
  the first compressed reduction has made the error feedback a step does not hold what the plan's
  peak holds;
- zero.sync_every > 1 (local SGD) all-reduces the first zero.sync_warmup_steps reductions as
  synchronous DDP does; after them a step moves nothing but the parameters' fp32 average every
  zero.sync_every steps (PeriodicModelAverager: the steps n with n - 1 >= warm-up and
  (n - 1 - warm-up) % sync_every == 0), the step whose peak (the average's flat copy) the plan holds.

Both count from the process's first step: neither the hook's state nor the averager's count is saved
(trainer/saves/dcp.py saves the wrapped optimizer's state), so a resumed job starts them afresh.
telemetry (trainer/telemetry/metrics.py) compares each log window with the plan of its own steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.config import Compression, TrainConfig
from trainer.plan.comm import plan_comm, reductions
from trainer.plan.states import model_shape


@dataclass(frozen=True)
class StepSchedule:
    """The plan of the n-th step of a process (n from 1)."""

    steady: int
    """Bytes per rank of a steady step: plan.json's `comm.bytes_per_step`."""
    exact: int = 0
    """Bytes per rank of a step whose every reduction is exact (zero.compression=none, zero.sync_every=1)."""
    reductions: int = 1
    """Gradient reductions per optimizer step (trainer/plan/comm.py `reductions`)."""
    exact_reductions: int = 0
    """Reductions all-reduced exactly before the method starts: zero.powersgd_start_step or zero.sync_warmup_steps."""
    sync_every: int = 1
    """zero.sync_every: > 1 is local SGD."""
    sync_warmup_steps: int = 0
    average_bytes: int = 0
    """Local SGD: the bytes of one average of the parameters (fp32), 0 where DDP is not applied."""

    @classmethod
    def of(
        cls, config: TrainConfig, world_size: int, backend: str | None = None, steady: int | None = None
    ) -> StepSchedule:
        """`steady`: the plan's figure where the caller has it (the job's plan), else planned here."""
        if steady is None:
            steady = plan_comm(config, world_size, backend).total
        zero = config.zero
        if zero.compression != Compression.powersgd and zero.sync_every == 1:
            return cls(steady)
        plain = dataclasses.replace(
            config, zero=dataclasses.replace(zero, compression=Compression.none, sync_every=1)
        )
        exact = plan_comm(plain, world_size, backend).total
        if zero.compression == Compression.powersgd:
            return cls(steady, exact, reductions(config), zero.powersgd_start_step)
        average = 4 * model_shape(config.model).num_params if exact > 0 else 0
        return cls(
            steady,
            exact,
            reductions(config),
            zero.sync_warmup_steps,
            zero.sync_every,
            zero.sync_warmup_steps,
            average,
        )

    @property
    def uniform(self) -> bool:
        """Every step is planned alike (no compression warm-up, no local SGD)."""
        return self.exact_reductions == 0 and self.sync_every == 1

    def exact_in(self, n: int) -> int:
        """How many of step n's reductions are exact."""
        return min(max(self.exact_reductions - (n - 1) * self.reductions, 0), self.reductions)

    def averages(self, n: int) -> bool:
        """Local SGD: whether step n ends with the parameters' average (PeriodicModelAverager)."""
        warmup = self.sync_warmup_steps
        return self.sync_every > 1 and n - 1 >= warmup and (n - 1 - warmup) % self.sync_every == 0

    def bytes_at(self, n: int) -> float:
        """Bytes per rank the plan gives step n."""
        if self.uniform:
            return float(self.steady)
        exact = self.exact_in(n)
        if self.sync_every > 1:  # stage0: the gradients' all-reduce while warming up, then the averages only
            return exact * self.exact / self.reductions + (self.average_bytes if self.averages(n) else 0)
        return self.steady + exact * (self.exact - self.steady) / self.reductions

    def mean_bytes(self, first: int, last: int) -> float:
        """The plan's bytes per step over steps first..last (a log window)."""
        return sum(self.bytes_at(n) for n in range(first, last + 1)) / (last - first + 1)

    def holds_peak(self, n: int) -> bool:
        """Whether the memory plan's peak describes step n: not a PowerSGD step that starts without the error
        feedback (made by the first compressed reduction), nor a local SGD step that does not average."""
        if self.sync_every > 1:
            return self.averages(n)
        return self.exact_reductions < (n - 1) * self.reductions or self.exact_reductions == 0
