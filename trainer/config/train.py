"""The root config, `TrainConfig` (conf/train.yaml), with its top-level keys and cross-group rules, and
what reads it whole: `validate` (the composed config checked), `to_plain` and `from_plain`."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer.config.checkpointing import CheckpointingConfig
from trainer.config.composition import check_composition
from trainer.config.data import DataConfig, DataloaderConfig, EvalConfig
from trainer.config.enums import (
    AttentionKernel,
    DataKind,
    DeviceKind,
    FaultKind,
    Mode,
    NonFinitePolicy,
    OffloadTarget,
    SaveAsync,
    SpikeAction,
)
from trainer.config.errors import ConfigError, _require
from trainer.config.model import LossConfig, ModelConfig
from trainer.config.moe import MoeConfig
from trainer.config.offload import OffloadConfig
from trainer.config.optim import OptimConfig
from trainer.config.parallel import ParallelConfig
from trainer.config.planning import AdviseConfig, PlanConfig
from trainer.config.precision import PrecisionConfig
from trainer.config.runtime import FaultConfig, LoggerConfig, MemoryConfig, SaveConfig, TelemetryConfig
from trainer.config.stability import StabilityConfig
from trainer.config.zero import ZeroConfig


@dataclass
class TrainConfig:
    """conf/train.yaml: one training job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    advise: AdviseConfig = field(default_factory=AdviseConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)

    micro_batch: Any = 8
    """Sequences per rank per forward pass (an integer), or `auto`: the largest the plan says fits,
    confirmed by probe runs (trainer/autobatch.py `choose_micro_batch`), with grad_accum from global_batch
    where that is given (then grad_accum=N is refused), else the job's grad_accum and a global batch that
    follows memory (said on the console); the job replaces it by the integer before anything is planned or run."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; the global batch is micro_batch * grad_accum * world size."""
    seq_len: int = 128
    """Tokens per sequence."""
    steps: int = 200
    """Optimizer steps."""
    seed: int = 0
    """Seed of initialisation and data order."""
    nproc: str = "auto"
    """Ranks on this host: auto (every visible GPU, else 2 CPU ranks) or a positive integer."""
    device: DeviceKind = DeviceKind.auto
    """auto (CUDA when present), cpu or cuda."""
    mode: Mode = Mode.train
    """train; plan: print the memory plan and train nothing; advise: rank configurations for global_batch."""
    global_batch: int | None = None
    """mode=advise, or micro_batch=auto: sequences per optimizer step, over all ranks (the advisor, or
    auto, chooses micro_batch and grad_accum); otherwise train and plan take micro_batch and grad_accum
    and refuse it."""
    resume: str = "false"
    """false, true (the newest save of this config) or a path to a save."""
    max_restarts: int = 0
    """Times the launcher restarts all ranks after one dies."""
    nonfinite: NonFinitePolicy = NonFinitePolicy["raise"]  # type: ignore[valid-type]
    """raise (stop, naming the step and ranks) or skip (skip the optimizer step)."""
    max_nonfinite_skips: int = 3
    """nonfinite=skip stops the run once this many steps in a row were non-finite."""
    device_memory_gib: float | None = None
    """Cap each rank's memory to rehearse a smaller device; None uses what the device has."""
    fail_fast: bool = False
    """Multirun: stop the sweep (exit 1) at the first point that does not end `ok`; false records it and goes on."""
    log_every: int = 10
    """Optimizer steps between log lines (each one gathers every rank's figures)."""
    nodes: int = 1
    """Hosts the job spans, `nproc` ranks on each (trainer/cluster.py); the world size is nodes * nproc."""
    node_rank: int = 0
    """This host's place among `nodes` (0 .. nodes-1); under SLURM it comes from the allocation."""
    rdzv_endpoint: str | None = None
    """host:port where every node's elastic launcher meets (c10d); under SLURM derived from the allocation."""
    compile: bool = False
    """torch.compile each transformer block in place (after activation checkpointing, before sharding)."""
    compile_backend: str = "inductor"
    """compile=true only: the torch.compile backend (inductor; aot_eager checks composition without generating code)."""
    attention: AttentionKernel = AttentionKernel.auto
    """SDPA kernel (torch.nn.attention.sdpa_kernel): auto picks flash, else efficient (K/V repeated), as trainer/model/attention.py says; cudnn is SDPA's cuDNN backend (CUDA, bf16/fp16, never picked by auto); math materialises the scores."""

    def __post_init__(self) -> None:
        _require(
            self.micro_batch == AUTO or (type(self.micro_batch) is int and self.micro_batch >= 1),
            f"micro_batch must be an integer >= 1 or auto, got {self.micro_batch}",
        )
        for key in ("grad_accum", "seq_len", "steps", "log_every"):
            _require(getattr(self, key) >= 1, f"{key} must be >= 1, got {getattr(self, key)}")
        _require(self.max_restarts >= 0, f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.resume.lower() in ("true", "false"):
            self.resume = (
                self.resume.lower()
            )  # `resume=true` on the command line arrives as the bool's str "True"
        _require(
            self.max_nonfinite_skips >= 1, f"max_nonfinite_skips must be >= 1, got {self.max_nonfinite_skips}"
        )
        _require(
            self.nproc == "auto" or (self.nproc.isdigit() and int(self.nproc) >= 1),
            f"nproc must be auto or an integer >= 1, got {self.nproc}",
        )
        _require(
            self.seq_len <= self.model.max_seq_len,
            f"seq_len ({self.seq_len}) must be <= model.max_seq_len ({self.model.max_seq_len}) of model={self.model.name}",
        )
        _require(
            self.offload.target == OffloadTarget.none or self.zero.uses_fsdp,
            f"offload={self.offload.target.value} needs zero=stage2 or zero=stage3 (FSDP2 CPUOffloadPolicy), "
            f"got zero={self.zero.stage.value}",
        )
        _require(
            self.offload.target != OffloadTarget.nvme or not self.optim.fused,
            "optim.fused=true with offload=nvme: the step streams Adam's moments from disk in chunks through "
            "torch's per-tensor AdamW; use optim.fused=null",
        )
        _require(
            self.offload.target != OffloadTarget.nvme or self.save.async_mode == SaveAsync.off,
            f"save.async_mode={self.save.async_mode.value} with offload=nvme: the asynchronous save's staging copy "
            "would hold Adam's moments in host memory, which offload=nvme keeps on disk; use save.async_mode=off",
        )
        _require(
            self.device_memory_gib is None or self.device_memory_gib > 0,
            f"device_memory_gib must be > 0, got {self.device_memory_gib}",
        )
        _require(self.save.every == 0 or self.save.every >= 1, "save.every must be >= 0")
        _require(
            self.stability.spike.action != SpikeAction.rollback or self.save.every >= 1,
            "stability.spike.action=rollback reloads the last save: needs save.every >= 1 (save=default), "
            "got save.every=0",
        )
        _require(self.nodes >= 1, f"nodes must be an integer >= 1, got {self.nodes}")
        _require(
            0 <= self.node_rank < self.nodes,
            f"node_rank must be in 0..{self.nodes - 1} (nodes={self.nodes}), got {self.node_rank}",
        )
        _require(
            self.rdzv_endpoint is None or is_endpoint(self.rdzv_endpoint),
            f"rdzv_endpoint must be host:port (port 0-65535; 0: any free port, one node only), got {self.rdzv_endpoint}",
        )
        backends = ("inductor", "aot_eager", "eager")
        _require(
            self.compile_backend in backends,
            f"compile_backend must be one of {', '.join(backends)}, got {self.compile_backend}",
        )
        self._check_global_batch()
        if self.data.kind == DataKind.text and not self.data.tokenizer and self.model.name.startswith("hf:"):
            self.data.tokenizer = str(
                Path(self.model.name[3:]).parent
            )  # model=hf's directory: its own tokenizer
        # The text itself is read by a job that trains: a plan (mode=plan, advise) for another machine needs
        # none of it, only the shape of what the ranks will hold (a document mask, evaluations).
        reads_text = self.data.kind == DataKind.text and self.mode == Mode.train
        _require(
            not reads_text or bool(self.data.files),
            "data.files must list at least one file (txt, json, jsonl, parquet) when data=text",
        )
        _require(
            not reads_text or bool(self.data.tokenizer),
            "data.tokenizer must name a tokenizer.json or a model directory when data=text "
            "(model=hf: the directory of model.config, by default)",
        )
        _require(
            self.eval.every == 0 or self.data.kind != DataKind.tokens,
            "eval.every needs held-out data: data=text (data.validation_files or data.validation_fraction) or data=synthetic",
        )
        _require(
            self.eval.every == 0 or not reads_text or self.data.has_validation,
            "eval.every with data=text needs data.validation_files or data.validation_fraction > 0",
        )
        _require(
            self.fault.kind != FaultKind.route_skew or self.model.is_moe,
            f"fault.kind=route_skew skews a mixture of experts' routing, and model={self.model.name} is dense "
            "(model.n_experts=0); use a model with experts (e.g. model=tiny-moe)",
        )
        self.parallel.check_model(self.model, self.seq_len)
        check_composition(self)  # the composition table's rows, in its order (composition.py)
        self.parallel.check_pipeline(self.model, self.grad_accum)

    def _check_global_batch(self) -> None:
        if self.micro_batch == AUTO:
            _require(
                self.mode != Mode.advise, "mode=advise chooses micro_batch itself: drop micro_batch=auto"
            )
            _require(
                self.global_batch is None or self.global_batch >= 1,
                f"global_batch must be >= 1, got {self.global_batch}",
            )
            # With global_batch, auto derives grad_accum from it: an explicit one would be overridden.
            # grad_accum's schema default (1) cannot be told from grad_accum=1, which is what auto may set.
            _require(
                self.global_batch is None
                or self.grad_accum == TrainConfig.__dataclass_fields__["grad_accum"].default,
                f"grad_accum={self.grad_accum} with micro_batch=auto and global_batch={self.global_batch}: auto sets "
                "grad_accum to global_batch / (ranks x micro_batch); drop grad_accum, or drop "
                "global_batch to keep it",
            )
            return
        if self.mode != Mode.advise:
            _require(
                self.global_batch is None,
                f"global_batch is read by mode=advise only; mode={self.mode.value} takes micro_batch and grad_accum "
                "(global batch = micro_batch * grad_accum * ranks)",
            )
            return
        _require(
            self.global_batch is not None,
            "mode=advise needs global_batch=N (sequences per optimizer step, over all ranks)",
        )
        _require(self.global_batch >= 1, f"global_batch must be >= 1, got {self.global_batch}")

    def sequences_per_step(self, world_size: int) -> int:
        """The global batch: sequences per optimizer step, over all ranks (not the `global_batch`
        key, which mode=advise reads to choose micro_batch and grad_accum)."""
        return global_batch(self.micro_batch, self.grad_accum, self.parallel.dp(world_size))


AUTO = "auto"
"""micro_batch=auto (TrainConfig.micro_batch)."""


def is_endpoint(value: str) -> bool:
    """`host:port` with a TCP port (c10d's rendezvous endpoint)."""
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and int(port) <= 65535


def validate(cfg: DictConfig) -> TrainConfig:
    """The composed config as a typed, checked `TrainConfig`; raises ConfigError naming the key."""
    try:
        config = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as err:  # OmegaConf wraps errors raised inside __post_init__
        cause = err.__cause__ or err.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise
    assert isinstance(config, TrainConfig)
    _reject_unknown_keys(config)
    return config


def _reject_unknown_keys(node: Any, prefix: str = "") -> None:
    """`+foo=1` adds a key the schema lacks and OmegaConf.to_object keeps it as a stray attribute:
    a typo'd option would be silently ignored, so it is refused instead."""
    known = {f.name for f in dataclasses.fields(node)}
    for name in vars(node):
        _require(
            name in known, f"{prefix}{name} is not a config key; `python -m trainer --cfg job` shows them all"
        )
    for name in known:
        value = getattr(node, name)
        if dataclasses.is_dataclass(value):
            _reject_unknown_keys(value, f"{prefix}{name}.")


def to_plain(config: TrainConfig) -> dict[str, Any]:
    """The config as plain data (enums as strings) to hand to ranks and loggers."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True, enum_to_str=True)  # type: ignore[return-value]


def from_plain(plain: dict[str, Any]) -> TrainConfig:
    """Rebuild a checked `TrainConfig` from `to_plain`'s output (inside a rank)."""
    return validate(OmegaConf.merge(OmegaConf.structured(TrainConfig), plain))  # type: ignore[arg-type]


def uses_fused(optim: OptimConfig, device_kind: str, offload: OffloadTarget = OffloadTarget.none) -> bool:
    """AdamW's fused kernel: `optim.fused`, else on CUDA (one kernel per step instead of a loop of
    small ones; torchtitan's default too). On CPU the per-tensor loop stays the default: the
    memory plan (trainer/plan/moments.py) and its CPU measurements are of that loop, and the ranks
    (trainer/rank/loop.py) step with the same choice. Never under offload=nvme, whose step streams the
    moments from disk in chunks through torch's per-tensor AdamW (trainer/rank/nvme.py)."""
    if offload == OffloadTarget.nvme:
        return False
    return optim.fused if optim.fused is not None else device_kind == "cuda"


def global_batch(micro_batch: int, grad_accum: int, world_size: int) -> int:
    """Sequences per optimizer step over all ranks: always micro_batch * grad_accum * world size
    (the data stream, the saves' progress and the throughput all count steps in it)."""
    return micro_batch * grad_accum * world_size


def unchecked_replace(obj: Any, **changes: Any) -> Any:
    """dataclasses.replace without __post_init__: a shallow copy with `changes` set (for a config already
    checked, asked again under other values: the advisor's candidates, the world a job resolves)."""
    new = copy.copy(obj)
    vars(new).update(changes)
    return new
