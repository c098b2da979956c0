"""The str Enums the config groups' keys take (`memory.snapshot`'s sits beside its group in runtime.py)."""

from __future__ import annotations

from enum import Enum


# OmegaConf 2.3 rejects Literal[...]; a str Enum validates at compose time and prints the
# allowed names. Enum members are matched by name, so each name equals its value.
class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Fp8Recipe(str, Enum):
    """precision.fp8_recipe: none, or one of torchao's named recipes (Float8LinearRecipeName)."""

    none = "none"
    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"


class Fp8Filter(str, Enum):
    """precision.fp8_filter: which block linears precision=fp8 converts (trainer/model/fp8.py `fp8_split`)."""

    auto = "auto"  # torchao's small-GEMM filter for the recipe (_auto_filter_for_recipe)
    all = "all"  # every linear whose dims fp8 GEMMs can take


class RouterScore(str, Enum):
    """model.router_score: how a mixture of experts scores its experts (trainer/model/moe.py)."""

    softmax = "softmax"
    sigmoid = "sigmoid"


class BalanceLoss(str, Enum):
    """moe.balance: the auxiliary load-balancing loss (trainer/model/moe.py)."""

    none = "none"
    aux = "aux"
    seq_aux = "seq_aux"


class DropPolicy(str, Enum):
    """moe.drop_policy: which of an expert's tokens beyond its capacity are dropped."""

    probs = "probs"
    position = "position"


class Stage(str, Enum):
    stage0 = "stage0"
    stage1 = "stage1"
    stage2 = "stage2"
    stage3 = "stage3"


class ReduceDType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Compression(str, Enum):
    none = "none"
    powersgd = "powersgd"
    topk = "topk"


class ReduceEvery(str, Enum):
    micro_batch = "micro_batch"
    step = "step"


class CheckpointMode(str, Enum):
    none = "none"
    full = "full"
    selective = "selective"
    op = "op"


class OffloadTarget(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class DataKind(str, Enum):
    synthetic = "synthetic"
    tokens = "tokens"
    text = "text"


class Packing(str, Enum):
    concat = "concat"
    document = "document"


class LoggerBackend(str, Enum):
    wandb = "wandb"
    none = "none"


class Mode(str, Enum):
    train = "train"
    plan = "plan"
    advise = "advise"


class DeviceKind(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


# `raise` is a keyword, so this Enum is built from a mapping rather than a class body.
NonFinitePolicy = Enum("NonFinitePolicy", {"raise": "raise", "skip": "skip"}, type=str)


class SpikeAction(str, Enum):
    """stability.spike.action: what a loss spike agreed by every rank does (trainer/rank/spikes.py)."""

    none = "none"
    log = "log"
    skip = "skip"
    rollback = "rollback"


class AttentionKernel(str, Enum):
    auto = "auto"
    flash = "flash"
    efficient = "efficient"
    cudnn = "cudnn"
    math = "math"


class RopeScaling(str, Enum):
    none = "none"
    llama3 = "llama3"


class LossKind(str, Enum):
    full = "full"
    chunked = "chunked"


class HfExport(str, Enum):
    none = "none"
    last = "last"


class FaultKind(str, Enum):
    none = "none"
    inf_grad = "inf_grad"
    nan_loss = "nan_loss"
    raise_error = "raise_error"
    kill = "kill"
    kill_during_save = "kill_during_save"
    term_during_save = "term_during_save"
    oom = "oom"
    hang = "hang"
    loss_spike = "loss_spike"
    route_skew = "route_skew"


LOSS_FAULTS = frozenset({FaultKind.inf_grad, FaultKind.nan_loss, FaultKind.loss_spike})
"""The fault kinds injected into the rank's loss (trainer/rank/loop.py inject_fault); the others act on the
rank itself (raise, kill, run out of memory, hang) or on its save."""


class SaveAsync(str, Enum):
    """save.async_mode: how a save is written (torch.distributed.checkpoint.async_save's AsyncCheckpointerType)."""

    off = "off"
    thread = "thread"
    process = "process"
