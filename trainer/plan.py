"""The memory plan: what each rank will hold, known before any rank starts.

Model states follow the ZeRO paper's arithmetic (Rajbhandari et al. 2020, section 3.1) for
mixed-precision Adam, adapted to what PyTorch really keeps: fp32 master parameters (4 B per
parameter; autocast and FSDP2 cast per op / per all-gather instead of keeping a 2-byte copy),
fp32 gradients (4 B; FSDP2 reduces in fp32 and DDP's buckets are the gradients themselves with
gradient_as_bucket_view), and Adam's two fp32 moments (8 B).

    stage0  params 4P      grads 4P      optimizer 8P
    stage1  params 4P      grads 4P      optimizer 8P / N
    stage2  params 4P / N  grads 4P / N  optimizer 8P / N   (at rest)
    stage3  params 4P / N  grads 4P / N  optimizer 8P / N
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from trainer.config import OffloadTarget, Stage, TrainConfig
from trainer.model import num_params

GIB = 2**30
BYTES_PER_PARAM = {"params": 4, "grads": 4, "optimizer": 8}  # fp32 master weights, grads, Adam moments
SHARDED_FROM = {"params": Stage.stage2, "grads": Stage.stage2, "optimizer": Stage.stage1}
STAGE_ORDER = [Stage.stage0, Stage.stage1, Stage.stage2, Stage.stage3]


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states one rank holds at rest."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_states_per_rank(num_parameters: int, stage: Stage, world_size: int) -> ModelStates:
    """Per-rank model-state bytes for a stage (exact when every shard is even)."""

    def part(kind: str) -> int:
        full = BYTES_PER_PARAM[kind] * num_parameters
        sharded = STAGE_ORDER.index(stage) >= STAGE_ORDER.index(SHARDED_FROM[kind])
        return -(-full // world_size) if sharded else full  # ceil: the largest shard

    return ModelStates(params=part("params"), grads=part("grads"), optimizer=part("optimizer"))


@dataclass(frozen=True)
class DeviceMemory:
    """What each rank may use, and where the figure comes from."""

    per_rank_bytes: int
    source: str
    shared_by_ranks: bool  # CPU ranks share one host's memory


def device_memory(device_kind: str, nproc: int, cap_gib: float | None) -> DeviceMemory:
    if cap_gib is not None:
        return DeviceMemory(int(cap_gib * GIB), f"device_memory_gib={cap_gib:g}", shared_by_ranks=False)
    if device_kind == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        return DeviceMemory(total, f"{torch.cuda.get_device_name(0)} ({total / GIB:.1f} GiB)", shared_by_ranks=False)
    available = psutil.virtual_memory().available
    return DeviceMemory(available // nproc, f"this host ({available / GIB:.1f} GiB available)", shared_by_ranks=True)


def preflight(config: TrainConfig, device_kind: str, world_size: int) -> str | None:
    """None when the model states fit, else a one-line refusal with the figures and a way out."""
    states = model_states_per_rank(num_params(config.model), config.zero.stage, world_size)
    if config.offload.target == OffloadTarget.cpu and device_kind == "cuda":
        return None  # model states live in host memory; the full plan (activations) decides the rest
    memory = device_memory(device_kind, world_size, config.device_memory_gib)
    if states.total <= memory.per_rank_bytes:
        return None
    need = (
        f"model={config.model.name} ({num_params(config.model) / 1e9:.2f}B params) at zero={config.zero.stage.value} "
        f"on {world_size} {device_kind} ranks needs {states.total / GIB:.1f} GiB of model states per rank "
        f"(params {states.params / GIB:.1f} + grads {states.grads / GIB:.1f} + optimizer {states.optimizer / GIB:.1f})"
    )
    return f"does not fit: {need}, but each rank has {memory.per_rank_bytes / GIB:.1f} GiB ({memory.source}). {way_out(config, world_size, memory)}"


def way_out(config: TrainConfig, world_size: int, memory: DeviceMemory) -> str:
    """Suggest the changes that would make model states fit."""
    if memory.shared_by_ranks:
        # CPU ranks share the host: more ranks or a higher stage move states around, they do not shrink them.
        return "Try a smaller model, or a GPU host (device=cuda) with zero=stage3 and more ranks."
    total_stage3 = model_states_per_rank(num_params(config.model), Stage.stage3, 1).total
    ranks_needed = -(-total_stage3 // memory.per_rank_bytes)
    return f"Try zero=stage3 with nproc>={ranks_needed}, offload=cpu, or a smaller model."
