"""What runs beside the steps: `save:`, `logger:`, `fault:`, `telemetry:` and `memory:` (SaveConfig,
LoggerConfig, FaultConfig, TelemetryConfig, MemoryConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from trainer.config.enums import FaultKind, HfExport, LoggerBackend, SaveAsync
from trainer.config.errors import _require


@dataclass
class SaveConfig:
    """conf/save/*.yaml: full training state saved with torch.distributed.checkpoint."""

    every: int = 100
    """Save every N optimizer steps (and at the end); 0 disables saving."""
    keep: int = 2
    """How many saves to keep."""
    hf: HfExport = HfExport.none
    """last: when the run ends ok, its last save exported to <run>/hf as a Hugging Face checkpoint
    (trainer/saves/hf_export.py, what `python -m trainer.export` writes)."""
    async_mode: SaveAsync = SaveAsync.off
    """off: every rank writes, then training goes on; thread or process: the state is staged (a copy
    in host memory, pinned on CUDA, shared with the writer in process mode) and written in the
    background by a thread or a process of each rank (`async` itself is a Python keyword)."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"save.every must be >= 0, got {self.every}")
        _require(self.keep >= 1, f"save.keep must be >= 1, got {self.keep}")
        _require(
            self.hf == HfExport.none or self.every >= 1,
            "save.hf=last exports the run's last save: needs save.every >= 1 (save=default), got save.every=0",
        )


@dataclass
class LoggerConfig:
    """conf/logger/*.yaml: where metrics go besides the always-written metrics.jsonl."""

    backend: LoggerBackend = LoggerBackend.wandb
    """wandb or none."""
    project: str = "zerolab"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None uses the account's default."""


@dataclass
class FaultConfig:
    """Fault injection for tests and rehearsals: what goes wrong, on which rank, at which step."""

    kind: FaultKind = FaultKind.none
    """none, inf_grad, nan_loss, raise_error, kill, kill_during_save (SIGKILL once the save of
    `step` is written, before it is renamed into place; with save.async_mode, while it is written in
    the background), term_during_save (the rank sends itself SIGTERM while the background write
    of `step` runs), or oom (an allocation no device can hold, which the allocator refuses: a real
    out-of-memory error on one rank), or hang (the rank stops where it is and never returns, as one
    stuck in a collective does: only a kill or a timeout ends the job), or loss_spike (the rank's loss
    multiplied by 100, a finite spike for stability.spike to catch), or route_skew (a mixture of experts: from
    `step` on, the rank's routers send every token to expert 0, by a bias of 1 on it, which softmax scores never
    outweigh: an imbalance of n_experts / top_k for the routing watch, docs/moe.md). Fires in the launcher's first
    attempt only."""
    step: int = 0
    """Optimizer step (1-based) at which the fault happens."""
    rank: int = 0
    """Rank on which it happens."""


@dataclass
class TelemetryConfig:
    """conf/train.yaml `telemetry:`: what ranks measure besides loss and time (trainer/telemetry/metrics.py, memory.py)."""

    enabled: bool = True
    """false: no memory figures and no MFU, only loss, lr, grad norm, throughput and the loss scale."""
    layer_norms: bool = True
    """Every log step, each layer's gradient and parameter L2 norm over the whole model (`grad_norm/<layer>`,
    `param_norm/<layer>`: trainer/telemetry/layer_norms.py, docs/stability.md); false: none."""
    memory_every: int = 500
    """CPU: tensor-level memory tracking (torch's MemTracker, several times slower than a plain step)
    runs on the run's second step and then every this many steps; 0: that step only. GPU counters
    and host RSS are read on every log step at no cost."""
    peak_tflops: float | None = None
    """Dense peak TFLOPS of one device, for MFU; None: looked up from the GPU's name (CPU: no MFU)."""
    warmup_steps: int | None = None
    """Steps that steady-state throughput leaves out; None: 10% of steps, at least the first log window."""
    trace_steps: list[int] = field(default_factory=list)
    """Optimizer steps (1-based) that each of `trace_ranks` records with torch.profiler, one chrome trace per
    rank and step in traces/ (trainer/telemetry/traces.py); empty (the default): no profiler is made."""
    trace_ranks: list[int] = field(default_factory=lambda: [0])
    """The global ranks that write `trace_steps`' traces; [0] as Megatron's --profile-ranks (torchtitan traces every rank)."""

    def __post_init__(self) -> None:
        _require(self.memory_every >= 0, f"telemetry.memory_every must be >= 0, got {self.memory_every}")
        _require(
            all(step >= 1 for step in self.trace_steps),
            f"telemetry.trace_steps must be steps >= 1, got {self.trace_steps}",
        )
        _require(
            all(rank >= 0 for rank in self.trace_ranks),
            f"telemetry.trace_ranks must be ranks >= 0, got {self.trace_ranks}",
        )
        _require(
            self.peak_tflops is None or self.peak_tflops > 0,
            f"telemetry.peak_tflops must be > 0 or null, got {self.peak_tflops}",
        )
        _require(
            self.warmup_steps is None or self.warmup_steps >= 0,
            f"telemetry.warmup_steps must be >= 0 or null, got {self.warmup_steps}",
        )

    def check_traces(self, steps: int, world_size: int) -> None:
        """`trace_steps` within the run's steps and `trace_ranks` within its world, once the world is known."""
        _require(
            all(step <= steps for step in self.trace_steps),
            f"telemetry.trace_steps must be within 1..{steps} (steps={steps}), got {self.trace_steps}",
        )
        _require(
            all(rank < world_size for rank in self.trace_ranks),
            f"telemetry.trace_ranks must be within 0..{world_size - 1} (world size {world_size}), got {self.trace_ranks}",
        )


class SnapshotMode(str, Enum):
    off = "off"
    oom = "oom"
    steps = "steps"


@dataclass
class MemoryConfig:
    """`memory.*`: the CUDA allocator's history (trainer/telemetry/snapshot.py, docs/faults.md)."""

    snapshot: SnapshotMode = SnapshotMode.off
    """off; oom: each rank records the allocator's history and dumps it when it runs out; steps: dumps it
    after each of `snapshot_steps`. CUDA only (torch.cuda.memory._record_memory_history); on CPU one
    line says so and the tensor tracker's figures by category are written instead."""
    snapshot_steps: list[int] = field(default_factory=list)
    """memory.snapshot=steps: the optimizer steps (1-based) after which each rank dumps a snapshot."""
    snapshot_max_entries: int = 100_000
    """Allocator events kept (a ring): bounds the recording's memory and the dump's size."""

    def __post_init__(self) -> None:
        _require(
            self.snapshot_max_entries >= 1,
            f"memory.snapshot_max_entries must be >= 1, got {self.snapshot_max_entries}",
        )
        _require(
            all(step >= 1 for step in self.snapshot_steps),
            f"memory.snapshot_steps must be steps >= 1, got {self.snapshot_steps}",
        )
        _require(
            self.snapshot != SnapshotMode.steps or bool(self.snapshot_steps),
            "memory.snapshot=steps needs memory.snapshot_steps=[N,...]",
        )
