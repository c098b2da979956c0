"""`plan:` and `advise:` (PlanConfig, AdviseConfig): the memory plan made before launch and mode=advise's
candidates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.config.enums import CheckpointMode, Compression, OffloadTarget, ReduceDType, ReduceEvery, Stage
from trainer.config.errors import _require


@dataclass
class PlanConfig:
    """conf/train.yaml `plan:`: the memory plan made before launch (trainer/plan)."""

    enforce: bool = True
    """Refuse to start a job whose predicted peak does not fit; false: warn and try anyway."""
    accelerator: str | None = None
    """Plan for this accelerator's memory (a name of trainer/devices.py, any case: h100, H200, l40s) instead of this host's."""
    cpu_rank_runtime_gib: float = 0.4
    """Host memory each CPU rank's process holds before its first tensor (Python, torch, gloo, threads;
    0.32-0.44 GiB measured with torch 2.13 on CPU), counted per rank against the host (trainer/plan/host.py)."""
    cuda_rank_runtime_gib: float = 2.0
    """Host memory each CUDA rank's process holds besides offloaded tensors (torch's CUDA libraries, the
    CUDA runtime, NCCL's host side): assumed (pytorch/pytorch#12873 measured 1.1 GiB of RSS at the first
    CUDA tensor and 0.6 GiB more at the first cuDNN call) until the GPU check's host row measures it."""
    host_memory_gib: float | None = None
    """Host memory of each node, for a plan made for another machine (null: this host's available memory
    when the job runs here, else unknown and only the need is printed)."""
    disk_gbps: float | None = None
    """offload=nvme: the local disk's read and write bandwidth per node, GB/s, for the disk stall the plan
    prints (null: measured on offload.path when the job runs here, else the traffic is printed without a stall)."""
    network_bus_gbps: float | None = None
    """mode=advise with plan.accelerator: a cluster's own bus bandwidth across nodes, GB/s, as nccl-tests'
    all_reduce_perf reports it over whole nodes (null: the node's NICs, trainer/advise/calibrate.py)."""
    nvlink_bus_gbps: float | None = None
    """mode=advise with plan.accelerator: the bus bandwidth inside a node, GB/s, as nccl-tests reports it on
    one node (null: trainer/advise/calibrate.py's figure for the accelerator)."""

    def __post_init__(self) -> None:
        from trainer.devices import accelerator_names, find_accelerator  # devices imports torch only

        for key in ("network_bus_gbps", "nvlink_bus_gbps", "disk_gbps"):
            value = getattr(self, key)
            _require(value is None or value > 0, f"plan.{key} must be > 0 (GB/s) or null, got {value}")

        _require(
            self.cpu_rank_runtime_gib >= 0,
            f"plan.cpu_rank_runtime_gib must be >= 0, got {self.cpu_rank_runtime_gib}",
        )
        _require(
            self.cuda_rank_runtime_gib >= 0,
            f"plan.cuda_rank_runtime_gib must be >= 0, got {self.cuda_rank_runtime_gib}",
        )
        _require(
            self.host_memory_gib is None or self.host_memory_gib > 0,
            f"plan.host_memory_gib must be > 0 (GiB per node) or null, got {self.host_memory_gib}",
        )
        if self.accelerator is not None:
            _require(
                find_accelerator(self.accelerator) is not None,
                f"plan.accelerator={self.accelerator} is unknown; allowed (any case): {', '.join(accelerator_names())}",
            )
            self.accelerator = self.accelerator.strip().lower()


@dataclass
class AdviseConfig:
    """conf/train.yaml `advise:`: mode=advise, which configuration to run (trainer/advise/advisor.py, docs/advisor.md)."""

    stages: list[Stage] = field(default_factory=lambda: list(Stage))
    """ZeRO stages to consider."""
    checkpointing: list[CheckpointMode] = field(default_factory=lambda: list(CheckpointMode))
    """Activation checkpointing modes to consider (selective uses checkpointing.every_n_layers)."""
    offload: list[OffloadTarget] = field(default_factory=lambda: list(OffloadTarget))
    """Offload targets to consider; cpu only with stage2/3 and only on a GPU (on a CPU host it moves nothing)."""
    reduce_dtypes: list[ReduceDType] = field(default_factory=lambda: list(ReduceDType))
    """Gradient-reduction dtypes (zero.reduce_dtype) to consider."""
    reduce_every: list[ReduceEvery] = field(default_factory=lambda: list(ReduceEvery))
    """When gradients are reduced (zero.reduce_every) to consider where grad_accum > 1; at grad_accum 1
    both are one reduction, and the stage's default is planned."""
    reshard_after_backward: list[bool] = field(default_factory=lambda: [True, False])
    """zero.reshard_after_backward choices to consider where stage2/3 accumulate (grad_accum > 1); elsewhere
    only true (it changes nothing there)."""
    compression: list[Compression] = field(default_factory=lambda: [Compression.powersgd, Compression.topk])
    """Gradient compression (zero.compression, with zero.powersgd_rank and zero.topk_ratio as set) to list
    beside each stage0/1 candidate whose step waits on the network; marked as changing the optimisation
    and never ranked in the leading tie ([] or [none]: none listed)."""
    micro_batches: list[int] | None = None
    """Micro-batches to consider; None: every power of two dividing global_batch / ranks."""
    headroom: float = 0.2
    """Fraction of each rank's memory the predicted peak must leave free."""
    top: int = 12
    """Rows of the ranked table printed (advice.json keeps every candidate)."""
    verify: int = 0
    """Run the K best configurations on this host as real jobs and show measured next to predicted."""
    verify_steps: int = 10
    """Optimizer steps of each verification job."""
    cache_dir: str = "~/.cache/zerolab"
    """Where this host's calibration (matmul, Adam and collective rates) is kept, with its date and host."""
    recalibrate: bool = False
    """Measure this host again even when a cached calibration matches it."""
    accelerators: list[str] = field(default_factory=list)
    """Rank these accelerators (names of trainer/advise/calibrate.py ACCELERATORS: h100, h200, a100-80gb, b200 ...)
    against each other: the best fitting configuration on each, at nodes x nproc of them, in one table
    (trainer/advise/accelerators.py); [] (default): one accelerator, plan.accelerator or this host."""
    gpu_hour_cost: Any = (
        None  # dict[str, float] | None: typed Any, as OmegaConf merges no dict into a typed empty or null one
    )
    """The user's price per GPU-hour of each listed accelerator (any currency, the same for all), e.g.
    {h100: 2.5, a100-80gb: 1.5}; zerolab ships no prices (conf/advise/prices_example.yaml's are examples).
    null (default): ranked by tokens/s per GPU. A price for some listed accelerators must be one for all."""
    tokens: float | None = None
    """A token budget (e.g. 1e12): the table adds days to it, GPU-hours and, with prices, its cost."""
    rank_by: str = "cost"
    """cost: by cost per million tokens (without prices: tokens/s per GPU, and the table says so); time: by
    time to the tokens (the cluster's tokens/s)."""

    def __post_init__(self) -> None:
        for key in (
            "stages",
            "checkpointing",
            "offload",
            "reduce_dtypes",
            "reduce_every",
            "reshard_after_backward",
        ):
            _require(len(getattr(self, key)) >= 1, f"advise.{key} must list at least one option")
        _require(
            self.micro_batches is None or (len(self.micro_batches) >= 1 and min(self.micro_batches) >= 1),
            f"advise.micro_batches must be null or a list of integers >= 1, got {self.micro_batches}",
        )
        _require(0 <= self.headroom < 1, f"advise.headroom must be in [0, 1), got {self.headroom}")
        _require(self.top >= 1, f"advise.top must be >= 1, got {self.top}")
        _require(self.verify >= 0, f"advise.verify must be >= 0, got {self.verify}")
        _require(self.verify_steps >= 2, f"advise.verify_steps must be >= 2, got {self.verify_steps}")
        self.check_accelerators()

    def check_accelerators(self) -> None:
        """advise.accelerators and what goes with it: names normalised (any case), prices > 0 and one for every
        listed accelerator once any is given, a budget > 0, rank_by cost or time."""
        self.accelerators = [str(name).strip().lower() for name in self.accelerators]
        prices = {str(k).strip().lower(): v for k, v in dict(self.gpu_hour_cost or {}).items()}
        _require(
            len(set(self.accelerators)) == len(self.accelerators),
            f"advise.accelerators lists an accelerator twice: {self.accelerators}",
        )
        _require(self.rank_by in ("cost", "time"), f"advise.rank_by must be cost or time, got {self.rank_by}")
        _require(
            self.tokens is None or self.tokens > 0,
            f"advise.tokens must be > 0 (a token budget) or null, got {self.tokens}",
        )
        for name, price in prices.items():
            _require(
                isinstance(price, (int, float)) and price > 0,
                f"advise.gpu_hour_cost.{name} must be a price per GPU-hour > 0, got {price}",
            )
        if not self.accelerators:
            for key, given in (
                ("gpu_hour_cost", bool(prices)),
                ("tokens", self.tokens is not None),
                ("rank_by", self.rank_by != "cost"),
            ):
                _require(
                    not given,
                    f"advise.{key} is read only with advise.accelerators=[...] (the table across accelerators)",
                )
            return
        self.gpu_hour_cost = prices or None
        missing = [name for name in self.accelerators if name not in prices]
        _require(
            not prices or not missing,
            f"advise.gpu_hour_cost has no price for {', '.join(missing)} (advise.accelerators="
            f"[{','.join(self.accelerators)}]): give one for every listed accelerator, or none to rank by tokens/s per GPU",
        )
