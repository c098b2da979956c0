"""The typed schema: one dataclass per config group and the root config.

Hydra composes conf/ against `TrainConfig` (registered as `train_schema` by trainer/cli.py), so a misspelt key
or a value of the wrong type fails at compose time. Range and cross-field rules live in
`__post_init__`, which OmegaConf runs only in `OmegaConf.to_object`: `validate` (train.py) is the
first thing a job does.

One module per config group, the root last; other modules import every name from `trainer.config` itself:

- errors.py: `ConfigError`, a user mistake naming its dotted key, and `_require`, which raises it;
- enums.py: the str Enums the groups' keys take (OmegaConf 2.3 rejects Literal[...]);
- model.py: `model:` (ModelConfig, model=hf's config.json read into it) and `loss:` (LossConfig);
- precision.py: `precision:` (PrecisionConfig), fp16's loss scaler and fp8's rules;
- zero.py: `zero:` (ZeroConfig), and STAGE_REDUCE_EVERY, each stage's zero.reduce_every;
- checkpointing.py: `checkpointing:` (CheckpointingConfig), and TORCHTITAN_SAVE_OPS, the default of its op list;
- offload.py: `offload:` (OffloadConfig);
- data.py: `data:`, `dataloader:` and `eval:` (DataConfig, DataloaderConfig, EvalConfig);
- optim.py: `optim:` (OptimConfig);
- parallel.py: `parallel:` (ParallelConfig), PIPELINE_SCHEDULES, CONTEXT_PARALLEL_IMPLS, TP_SPLIT_KEYS;
- composition.py: what tensor and pipeline parallelism do not compose with, one table (REFUSALS of
  `Refusal` rows, each with its reason and way out) read by the config check (`check_composition`,
  `first_refusal`), the advisor and docs/design.md (`refusals_markdown`);
- runtime.py: `save:`, `logger:`, `fault:`, `telemetry:` and `memory:` (SaveConfig, LoggerConfig,
  FaultConfig, TelemetryConfig, MemoryConfig and its SnapshotMode);
- planning.py: `plan:` and `advise:` (PlanConfig, AdviseConfig);
- moe.py: `moe:` (MoeConfig), how a mixture of experts routes while it trains;
- stability.py: `stability:` (StabilityConfig) and its `spike:` (SpikeConfig), loss spikes and skipped steps;
- train.py: the root, `TrainConfig`, and what reads it whole: `validate`, `to_plain`, `from_plain`;
  `uses_fused`, `global_batch`, `is_endpoint`.
"""

from trainer.config.checkpointing import TORCHTITAN_SAVE_OPS, CheckpointingConfig
from trainer.config.composition import (
    REFUSALS,
    Refusal,
    check_composition,
    first_refusal,
    refusals_markdown,
)
from trainer.config.data import DataConfig, DataloaderConfig, EvalConfig
from trainer.config.enums import (
    LOSS_FAULTS,
    AttentionKernel,
    BalanceLoss,
    CheckpointMode,
    Compression,
    DataKind,
    DeviceKind,
    DropPolicy,
    DType,
    FaultKind,
    Fp8Filter,
    Fp8Recipe,
    HfExport,
    LoggerBackend,
    LossKind,
    Mode,
    NonFinitePolicy,
    OffloadTarget,
    Packing,
    ReduceDType,
    ReduceEvery,
    RopeScaling,
    RouterScore,
    SaveAsync,
    SpikeAction,
    Stage,
)
from trainer.config.errors import ConfigError
from trainer.config.errors import _require as _require  # private, kept importable as before
from trainer.config.model import LossConfig, ModelConfig, TpLocalModel
from trainer.config.moe import MoeConfig
from trainer.config.offload import OffloadConfig
from trainer.config.optim import OptimConfig
from trainer.config.parallel import CONTEXT_PARALLEL_IMPLS, PIPELINE_SCHEDULES, TP_SPLIT_KEYS, ParallelConfig
from trainer.config.planning import AdviseConfig, PlanConfig
from trainer.config.precision import PrecisionConfig
from trainer.config.runtime import (
    FaultConfig,
    LoggerConfig,
    MemoryConfig,
    SaveConfig,
    SnapshotMode,
    TelemetryConfig,
)
from trainer.config.stability import SpikeConfig, StabilityConfig
from trainer.config.train import (
    AUTO,
    TrainConfig,
    from_plain,
    global_batch,
    is_endpoint,
    to_plain,
    unchecked_replace,
    uses_fused,
    validate,
)
from trainer.config.train import _reject_unknown_keys as _reject_unknown_keys  # private, as _require
from trainer.config.zero import STAGE_REDUCE_EVERY, ZeroConfig

__all__ = [
    "ConfigError",
    "DType",
    "Fp8Recipe",
    "Fp8Filter",
    "Stage",
    "ReduceDType",
    "Compression",
    "ReduceEvery",
    "STAGE_REDUCE_EVERY",
    "CheckpointMode",
    "OffloadTarget",
    "DataKind",
    "Packing",
    "LoggerBackend",
    "Mode",
    "DeviceKind",
    "NonFinitePolicy",
    "AttentionKernel",
    "RopeScaling",
    "RouterScore",
    "BalanceLoss",
    "DropPolicy",
    "MoeConfig",
    "LossKind",
    "HfExport",
    "FaultKind",
    "LOSS_FAULTS",
    "SaveAsync",
    "SpikeAction",
    "ModelConfig",
    "TpLocalModel",
    "LossConfig",
    "PrecisionConfig",
    "ZeroConfig",
    "TORCHTITAN_SAVE_OPS",
    "CheckpointingConfig",
    "OffloadConfig",
    "DataloaderConfig",
    "DataConfig",
    "EvalConfig",
    "OptimConfig",
    "Refusal",
    "REFUSALS",
    "first_refusal",
    "unchecked_replace",
    "check_composition",
    "refusals_markdown",
    "CONTEXT_PARALLEL_IMPLS",
    "PIPELINE_SCHEDULES",
    "ParallelConfig",
    "TP_SPLIT_KEYS",
    "SaveConfig",
    "LoggerConfig",
    "FaultConfig",
    "TelemetryConfig",
    "SnapshotMode",
    "MemoryConfig",
    "SpikeConfig",
    "StabilityConfig",
    "PlanConfig",
    "AdviseConfig",
    "TrainConfig",
    "AUTO",
    "is_endpoint",
    "validate",
    "to_plain",
    "from_plain",
    "uses_fused",
    "global_batch",
]
