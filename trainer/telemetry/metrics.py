"""Measuring a rank's training and gathering every rank's figures on log steps."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trainer.config import PrecisionConfig, TrainConfig
from trainer.devices import find_device, peak_tflops, tf32_enabled
from trainer.layout import Layout
from trainer.model.moe import moe_layers
from trainer.plan import HEADROOM, PREDICTED_GROUP_KEYS, StepSchedule
from trainer.rank.trainee import ON_DISK, local_optimizer
from trainer.telemetry import keys
from trainer.telemetry.comm import FIELDS as COMM_FIELDS
from trainer.telemetry.comm import CommProbe, comm_fields, group_names
from trainer.telemetry.layer_norms import LayerNorms
from trainer.telemetry.memory import COUNT_FIELDS, TENSOR_CATEGORIES, MemoryProbe
from trainer.telemetry.summary import comm_error
from trainer.units import GIB
from trainer.world import World

BASE_FIELDS = (
    "loss",
    "window_s",
    "data_s",
    "params",
    "grads",
    "optimizer",
    "loss_scale",
    "skipped_steps",
    "z_loss",
    "disk_read",
    "disk_written",
    "disk_wait_s",
)
PIPELINE_FIELDS = ("pp_idle_share", "pp_sent_bytes_per_step")
"""Under parallel.pp > 1, after BASE_FIELDS: what the rank's StageClock read (trainer/rank/pipeline.py)."""
"""The first columns of every rank's gathered row, in this order; with telemetry on, the memory
probe's fields (trainer/telemetry/memory.py) and then the communication probe's (comm.py FIELDS) follow."""


def columns(per_rank: torch.Tensor, *names: str) -> torch.Tensor:
    """Every rank's values of the BASE_FIELDS `names`: one column per name, one row per rank."""
    return per_rank[:, [BASE_FIELDS.index(name) for name in names]]


@dataclass
class StepRouting:
    """model.n_experts > 0: what the routers did in one step (trainer/model/moe.py RouterLog), on the device."""

    loads: torch.Tensor
    """(n_layers, n_experts) int64: the tokens that chose each expert, this rank's, or every rank's when `summed`."""
    dropped: torch.Tensor
    """(n_layers,) int64: assignments dropped by moe.capacity_factor on this rank."""
    balance: torch.Tensor
    """The balance loss (unweighted), summed over the layers, mean over the step's forwards, this rank's."""
    summed: bool = False
    """Whether `loads` were already summed over every rank (moe.bias_rate > 0 sums them every step)."""


@dataclass
class StepStats:
    """One optimizer step as the loop saw it; tensors stay on the device until a log step."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    loss_scale: float | torch.Tensor
    """fp16: the scale after the step (a device scalar, read at log steps); else 1.0."""
    overflow: bool | torch.Tensor
    """fp16: the scaler skipped this step (a device scalar, read at log steps)."""
    data_s: float
    nonfinite_skipped: int = 0
    """Cumulative steps skipped by nonfinite=skip (trainer/rank/nonfinite.py), the same on every rank."""
    z_loss: torch.Tensor | None = None
    """loss.z_loss > 0: the step's mean z-loss on this rank (a device scalar, read at log steps)."""
    layer_norms: torch.Tensor | None = None
    """Log steps (telemetry.layer_norms): every layer's gradient and parameter norm, the same on every rank
    (trainer/telemetry/layer_norms.py `LayerNorms.reduce`; a device vector, read at the log)."""
    disk: Any = None
    """offload=nvme: what the step moved between the moments file and memory (trainer/rank/nvme.py DiskTraffic)."""
    routing: StepRouting | None = None
    """model.n_experts > 0: the routers' loads, drops and balance loss (trainer/rank/loop.py `step_routing`)."""


class Meter:
    """Accumulates a log window on each rank; on log steps gathers the ranks and rank 0 writes.

    metrics.jsonl (in the job's output directory) gets one JSON object per log step; the job
    process turns it into W&B history and summary.json.
    """

    def __init__(
        self,
        config: TrainConfig,
        world: World,
        out_dir: Path,
        flops_per_token: float,
        predicted: dict[str, float],
    ) -> None:
        self.config, self.world = config, world
        self.tokens_per_step = config.sequences_per_step(world.world_size) * config.seq_len
        self.flops_per_token = flops_per_token
        self.path = out_dir / "metrics.jsonl"
        self.skipped_steps = 0
        self.last_record: dict[str, Any] | None = None
        self.val_loss: float | None = None
        """The held-out loss of this step (eval steps only), written with its record."""
        telemetry = config.telemetry
        self.memory = (
            MemoryProbe(
                world.device,
                telemetry.memory_every,
                config.steps,
                track_first=config.device_memory_gib is not None,
                also=frozenset(
                    config.memory.snapshot_steps if config.memory.snapshot.value == "steps" else ()
                ),
                pipelined=config.parallel.pp > 1,
            )
            if telemetry.enabled
            else None
        )
        # Collectives from here on: the model's construction and a resume's load are not steps.
        self.comm = (
            CommProbe(
                world.device,
                telemetry.memory_every,
                config.steps,
                *group_names(config, world.world_size),
                alone=world.world_size == 1,
            )
            if telemetry.enabled
            else None
        )
        self.peak_flops = (
            device_peak_flops(world.device, config.precision, telemetry.peak_tflops)
            if telemetry.enabled
            else None
        )
        # The job's plan (trainer/job.py rank_predictions), next to what is measured in every record (rank 0 writes them).
        self.predicted_peak_gib = (
            predicted.get(keys.PREDICTED_PEAK) if telemetry.enabled and world.is_main else None
        )
        self.predicted_comm = (
            predicted.get(keys.COMM_PREDICTED_BYTES) if telemetry.enabled and world.is_main else None
        )
        self.predicted_groups = {
            group: predicted[key]
            for group, key in PREDICTED_GROUP_KEYS.items()
            if key in predicted and telemetry.enabled and world.is_main
        }
        # The plan of each step where steps differ (PowerSGD's warm-up, local SGD): what each window is compared with.
        self.schedule = (
            StepSchedule.of(
                config,
                world.world_size,
                "nccl" if world.device.type == "cuda" else "gloo",
                steady=self.predicted_comm,
            )
            if self.predicted_comm is not None
            else None
        )
        self.first_step: int | None = None
        """The process's first step: the n = 1 of the schedule (the hooks' counts start afresh on resume)."""
        # On a GPU, also what the allocator will reserve for it (trainer/plan/headroom.py).
        self.predicted_reserved_gib = (
            HEADROOM.reserved(int(self.predicted_peak_gib * GIB)) / GIB
            if self.predicted_peak_gib is not None and world.device.type == "cuda"
            else None
        )
        self.layer_norms = (
            LayerNorms(config.model, world.world_size, config.parallel.pp, world.device)
            if telemetry.layer_norms
            else None
        )
        """telemetry.layer_norms: what train_step is given on log steps (the loop's `should_log`)."""
        self.pipeline: Any = None
        """parallel.pp > 1: the rank's StageClock (trainer/rank/pipeline.py), read at each log (`read(steps)`)."""
        self._open_window()

    def _open_window(self) -> None:
        if self.memory is not None:
            self.memory.reset()
        self.window_start = time.perf_counter()
        self.window_steps = 0
        self.window_data_s = 0.0
        self.window_overflows = 0
        self.window_disk = np.zeros(3)  # offload=nvme: bytes read, bytes written, seconds waiting
        self.window_routing: StepRouting | None = None  # model.n_experts > 0: summed over the window
        self.last: StepStats | None = None

    def measure(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> AbstractContextManager:
        """Wrap a training step: tensor-level memory tracking, or profiling of communication, on the steps chosen for them."""
        if self.first_step is None:
            self.first_step = step
        if self.memory is None or self.comm is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self.memory.measure(step, model, optimizer))
        stack.enter_context(self.comm.measure(step, tracked=self.memory.tracks(step)))
        return stack

    def update(self, stats: StepStats) -> None:
        self.window_steps += 1
        self.window_data_s += stats.data_s
        self.window_overflows += stats.overflow  # a device tensor under fp16: summed without a sync
        if stats.disk is not None:
            self.window_disk += (stats.disk.read_bytes, stats.disk.written_bytes, stats.disk.wait_s)
        self.skipped_steps += stats.overflow
        if stats.routing is not None:
            self.window_routing = add_routing(self.window_routing, stats.routing)
        self.last = stats

    def should_log(self, step: int) -> bool:
        every = self.config.eval.every
        evaluates = every > 0 and step % every == 0  # evaluation steps log their loss/val
        return step % self.config.log_every == 0 or step == self.config.steps or evaluates

    def log(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Gather this window from every rank (a collective: every rank calls it) and write it,
        with rank 0's `extra` fields (its saves' figures, trainer/saves/background.py)."""
        assert self.last is not None
        if self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)  # the window's time must include its kernels
        elapsed = time.perf_counter() - self.window_start
        # The fp16 figures were summed on the device; read them here, where the host syncs anyway.
        self.window_overflows, self.skipped_steps = int(self.window_overflows), int(self.skipped_steps)
        self.last.loss_scale = float(self.last.loss_scale)
        params, grads, optimizer_state = model_state_bytes(model, optimizer)
        fields = dict(
            loss=self.last.loss.item(),
            window_s=elapsed,
            data_s=self.window_data_s,
            params=params,
            grads=grads,
            optimizer=optimizer_state,
            loss_scale=self.last.loss_scale,
            skipped_steps=self.skipped_steps,
            z_loss=float("nan") if self.last.z_loss is None else self.last.z_loss.item(),
            **dict(zip(("disk_read", "disk_written", "disk_wait_s"), self.window_disk.tolist())),
        )
        row = [fields[name] for name in BASE_FIELDS]
        if self.pipeline is not None:
            row += self.pipeline.read(self.window_steps)
        if self.memory is not None and self.comm is not None:
            row += self.memory.read() + self.comm.read()  # the flight recorder, before this gather joins it
        per_rank = gather_rows(torch.tensor(row, dtype=torch.float64), self.world)
        routing = {} if self.window_routing is None else self.routing_fields(self.window_routing, model)
        if self.world.is_main:
            self.last_record = {**self.build_record(step, per_rank), **routing, **(extra or {})}
            self.write(self.last_record)
        self._open_window()

    def routing_fields(self, window: StepRouting, model: nn.Module) -> dict[str, float]:
        """model.n_experts > 0: the window's routing over every rank (one all-reduce: every rank calls it)."""
        loads = window.loads.clone()
        extra = torch.cat((window.dropped.double(), window.balance.double()[None]))  # drops, then the loss
        if self.world.world_size > 1:
            if not window.summed:
                dist.all_reduce(loads)
            dist.all_reduce(extra)
        steps, ranks = self.window_steps, self.world.world_size
        biases = [layer.router.expert_bias for layer in moe_layers(model)]
        return routing_record(
            loads, extra[:-1], float(extra[-1]) / (steps * ranks), steps, biases, self.config
        )

    def build_record(self, step: int, per_rank: torch.Tensor) -> dict[str, Any]:
        assert self.last is not None
        check_ranks_agree(columns(per_rank, "loss_scale", "skipped_steps"))
        record: dict[str, Any] = {
            "step": step,
            keys.LOSS: columns(per_rank, "loss")[:, 0].mean().item(),
            keys.LR: self.last.lr,
            keys.GRAD_NORM: float(self.last.grad_norm.item()),
            keys.NONFINITE_SKIPPED: self.last.nonfinite_skipped,
            **self.throughput_fields(per_rank),
        }
        if self.last.z_loss is not None:
            record[keys.Z_LOSS] = columns(per_rank, "z_loss")[:, 0].mean().item()
        if self.last.disk is not None:
            record.update(
                disk_fields(columns(per_rank, "disk_read", "disk_written", "disk_wait_s"), self.window_steps)
            )
        if self.last.layer_norms is not None and self.layer_norms is not None:
            record.update(self.layer_norms.fields(self.last.layer_norms))
        for rank, (params, grads, optimizer) in enumerate(
            columns(per_rank, "params", "grads", "optimizer").tolist()
        ):
            record[keys.memory_key(rank, "params_gib")] = params / GIB
            record[keys.memory_key(rank, "grads_gib")] = grads / GIB
            record[keys.memory_key(rank, "optimizer_gib")] = optimizer / GIB
        memory_start = len(BASE_FIELDS)
        if self.pipeline is not None:
            record.update(
                pipeline_fields(
                    per_rank[:, memory_start : memory_start + 2],
                    Layout.from_config(self.config, self.world.world_size),
                )
            )
            memory_start += len(PIPELINE_FIELDS)
        if self.memory is not None:
            memory = memory_fields(
                self.memory.fields,
                per_rank[:, memory_start : memory_start + len(self.memory.fields)],
                self.predicted_peak_gib,
                self.predicted_reserved_gib,
            )
            if not self.window_holds_peak(step):  # none of its measured steps is the plan's: no error
                memory.pop(keys.PREDICTION_ERROR_PCT, None)
                memory.pop(keys.RESERVED_PREDICTION_ERROR_PCT, None)
            record.update(memory)
            # The plan and its error are this module's (comm_fields' own, without a prediction, is left out).
            record.update(
                comm_fields(per_rank[:, -len(COMM_FIELDS) :], self.window_steps, None, self.predicted_groups)
            )
            record.update(self.comm_plan_fields(step, record, per_rank.shape[0]))
        if self.val_loss is not None:
            record[keys.LOSS_VAL] = self.val_loss
            record[keys.PERPLEXITY_VAL] = math.exp(self.val_loss) if self.val_loss < 700 else math.inf
            self.val_loss = None
        if self.config.precision.is_fp16:
            record[keys.LOSS_SCALE] = self.last.loss_scale
            record[keys.OVERFLOW] = self.window_overflows
            record[keys.SKIPPED_STEPS] = self.skipped_steps
        return record

    def window_steps_n(self, step: int) -> range:
        """The window's steps as the schedule numbers them (the process's first step is 1)."""
        first = step - self.window_steps + 1
        origin = self.first_step if self.first_step is not None else first
        return range(first - origin + 1, step - origin + 2)

    def window_holds_peak(self, step: int) -> bool:
        """Whether a step of the window whose peak was measured (every step on a GPU, tracked ones on a CPU) is
        one the memory plan's peak describes (trainer/plan/schedule.py `holds_peak`)."""
        if self.schedule is None or self.schedule.uniform or self.memory is None:
            return True
        origin = self.first_step or 1
        return any(
            self.schedule.holds_peak(n)
            and (self.world.device.type == "cuda" or self.memory.tracks(n + origin - 1))
            for n in self.window_steps_n(step)
        )

    def comm_plan_fields(self, step: int, record: dict[str, Any], world_size: int) -> dict[str, float]:
        """The plan next to the worst rank's bytes per step: plan.json's steady figure, the plan of the window's
        own steps where that differs, and the error against the latter where every rank measured."""
        if self.predicted_comm is None or self.schedule is None:
            return {}
        fields: dict[str, float] = {keys.COMM_PREDICTED_BYTES: self.predicted_comm}
        steps = self.window_steps_n(step)
        predicted = self.schedule.mean_bytes(steps.start, steps.stop - 1)
        if predicted != self.predicted_comm:
            fields[keys.COMM_WINDOW_PREDICTED_BYTES] = predicted
        totals = [record.get(keys.comm_key(rank, "bytes_per_step")) for rank in range(world_size)]
        if all(total is not None for total in totals):
            fields.update(comm_error(predicted, max(totals)))
        return fields

    def throughput_fields(self, per_rank: torch.Tensor) -> dict[str, float]:
        # The slowest rank sets the pace: every rank waits for it at the collectives.
        step_s = columns(per_rank, "window_s").max().item() / self.window_steps
        tokens_per_s = self.tokens_per_step / step_s
        fields = {
            keys.TOKENS_PER_S: tokens_per_s,
            keys.TOKENS_PER_S_PER_RANK: tokens_per_s / self.world.world_size,
            keys.STEP_S: step_s,
            keys.DATA_S: columns(per_rank, "data_s").max().item() / self.window_steps,
        }
        if self.peak_flops is not None:
            fields[keys.MFU_PCT] = mfu_pct(
                self.flops_per_token, tokens_per_s, self.peak_flops, self.world.world_size
            )
        return fields

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")
        print(progress_line(record, self.config.steps), flush=True)

    def finish(self) -> dict[str, Any] | None:
        return self.last_record


def memory_fields(
    fields: tuple[str, ...],
    per_rank: torch.Tensor,
    predicted_gib: float | None,
    predicted_reserved_gib: float | None = None,
) -> dict[str, float]:
    """Every rank's memory figures, the worst rank and the plan's prediction next to it.

    A figure a rank did not measure in this window (NaN) is left out rather than logged.
    """
    record: dict[str, float] = {}
    for rank, row in enumerate(per_rank.tolist()):
        for name, value in zip(fields, row):
            if not math.isnan(value):
                record[memory_field_key(rank, name)] = value if name in COUNT_FIELDS else value / GIB
    peaks = per_rank[:, fields.index("peak_allocated")]
    measured = not torch.isnan(peaks).any().item()
    if measured:
        worst = int(peaks.argmax().item())
        record[keys.MAX_RANK_PEAK] = peaks[worst].item() / GIB
        record[keys.ARGMAX_RANK] = worst
        record[keys.IMBALANCE] = (peaks.max() / peaks.mean()).item()
    if predicted_gib is not None:
        record[keys.PREDICTED_PEAK] = predicted_gib
        if measured:
            # Positive: the plan over-predicts; relative to what was measured.
            record[keys.PREDICTION_ERROR_PCT] = (
                100.0 * (predicted_gib - record[keys.MAX_RANK_PEAK]) / record[keys.MAX_RANK_PEAK]
            )
    if predicted_reserved_gib is not None and "peak_reserved" in fields:
        reserved = per_rank[:, fields.index("peak_reserved")].max().item() / GIB
        record[keys.PREDICTED_RESERVED] = predicted_reserved_gib
        if reserved > 0:
            record[keys.RESERVED_PREDICTION_ERROR_PCT] = (
                100.0 * (predicted_reserved_gib - reserved) / reserved
            )
    return record


def memory_field_key(rank: int, name: str) -> str:
    """The key (keys.memory_key) of one field a rank's MemoryProbe measured (trainer/telemetry/memory.py):
    `peak_allocated` -> `memory/rank{r}/peak_allocated_gib`, `peak_grads` -> `.../at_peak/grads_gib`."""
    if name in COUNT_FIELDS:
        return keys.memory_key(rank, name)
    category = name.removeprefix("peak_")
    if category in TENSOR_CATEGORIES:
        return keys.memory_key(rank, f"at_peak/{category}_gib")  # what the tensors at the peak moment were
    return keys.memory_key(rank, f"{name}_gib")


def check_ranks_agree(scale_and_skips: torch.Tensor) -> None:
    """Every rank must have taken (or skipped) the same steps with the same loss scale: ranks that
    disagree train different models. A real check, not an assert (`python -O` strips those)."""
    if not (scale_and_skips == scale_and_skips[0]).all():
        raise RuntimeError(
            f"ranks disagree on loss scale and skipped steps (rank by rank): {scale_and_skips.tolist()}"
        )


def mfu_pct(flops_per_token: float, tokens_per_s: float, peak_flops: float, world_size: int) -> float:
    """Model FLOPs utilisation: the model's training FLOPs per second over the ranks' summed peak."""
    return 100.0 * flops_per_token * tokens_per_s / (peak_flops * world_size)


def device_peak_flops(
    device: torch.device, precision: PrecisionConfig, override_tflops: float | None
) -> float | None:
    """Dense peak FLOP/s of one device for this precision; None where unknown (CPU without an
    override, a device trainer/devices.py does not list by its exact name, a MIG slice)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    spec = find_device(torch.cuda.get_device_name(device))
    if spec is None:
        return None
    peak = peak_tflops(spec, precision.compute_dtype, tf32_enabled())
    return peak * 1e12 if peak is not None else None


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of memory this rank keeps alive for these tensors (a DTensor's local shard), each
    storage counted once. numel() would miss FSDP2's padding: a sharded parameter is a view into
    its padded shard (dim 0 rounded up to a multiple of the ranks, so the last rank's view is
    shorter than what it holds), and a gradient a view into its group's reduce-scatter output."""
    # Here, not at the top: the advisor imports this module (mfu_pct) in the job process, which
    # would otherwise load DTensor for nothing (tests/unit/test_imports.py).
    from torch.distributed.tensor import DTensor

    storages: dict[tuple[torch.device, int], int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in ON_DISK:  # offload=nvme's moments: on disk, not held
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds right now.

    Optimizer state counts Adam's moment tensors; the per-parameter 0-dim `step` counters
    (4 bytes each, never sharded) are left out so that the ZeRO arithmetic is exact.
    """
    params = held_bytes(model.parameters())
    grads = held_bytes(p.grad for p in model.parameters() if p.grad is not None)
    moments = held_bytes(
        value
        for state in local_optimizer(optimizer).state.values()  # ZeRO-1: this rank's partition only
        for value in state.values()
        if torch.is_tensor(value) and value.dim() > 0
    )
    return params, grads, moments


def disk_fields(per_rank: torch.Tensor, steps: int) -> dict[str, float]:
    """offload=nvme's window per step: bytes read and written by all ranks together (a node's traffic when
    they share one), and the slowest rank's wait on its disk."""
    read, written, wait_s = per_rank.sum(0).tolist()[:2] + [per_rank[:, 2].max().item()]
    return {
        keys.DISK_READ_BYTES: read / steps,
        keys.DISK_WRITTEN_BYTES: written / steps,
        keys.DISK_WAIT_S: wait_s / steps,
    }


def add_routing(window: StepRouting | None, step: StepRouting) -> StepRouting:
    """The log window's routing so far, with one more step's."""
    if window is None:
        return StepRouting(step.loads.clone(), step.dropped.clone(), step.balance.clone(), step.summed)
    return StepRouting(
        window.loads + step.loads, window.dropped + step.dropped, window.balance + step.balance, step.summed
    )


def routing_record(
    loads_LE: torch.Tensor,
    dropped_L: torch.Tensor,
    balance: float,
    steps: int,
    biases: list[torch.Tensor],
    config: TrainConfig,
) -> dict[str, float]:
    """The moe/ keys of a log record (trainer/telemetry/keys.py) from the window's loads summed over ranks."""
    loads = loads_LE.double()
    imbalance_L = (loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-12)).tolist()
    record = {keys.moe_imbalance_key(layer): ratio for layer, ratio in enumerate(imbalance_L)}
    record[keys.MOE_IMBALANCE_MAX] = max(imbalance_L)
    record[keys.MOE_IMBALANCE_PLANNED] = config.moe.imbalance
    record[keys.MOE_DROPPED] = float(dropped_L.sum()) / steps
    if config.moe.balance.value != "none":
        record[keys.MOE_BALANCE_LOSS] = balance / len(imbalance_L)
    if config.moe.bias_rate > 0:
        record[keys.MOE_EXPERT_BIAS_MAX] = max(float(bias.abs().max()) for bias in biases)
    return record


def gather_rows(local: torch.Tensor, world: World) -> torch.Tensor:
    """Stack one row per rank (rank order); the collective runs on the backend's device. One rank gathers
    from no one: no collective, so a one-rank job moves nothing (its plan's 0 bytes)."""
    if world.world_size == 1:
        return local[None].cpu()
    device_row = local.to(world.device)
    rows = [torch.empty_like(device_row) for _ in range(world.world_size)]
    dist.all_gather(rows, device_row)
    return torch.stack(rows).cpu()


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """One console line per log step: step, loss, tokens/s, and the worst rank's memory."""
    parts = [
        f"step {record['step']:>{len(str(total_steps))}}/{total_steps}",
        f"loss {record[keys.LOSS]:.4f}",
        f"lr {record[keys.LR]:.2e}",
        f"{record[keys.TOKENS_PER_S]:,.0f} tok/s",
    ]
    if keys.MFU_PCT in record:
        parts.append(f"mfu {record[keys.MFU_PCT]:.1f}%")
    worst = worst_rank_memory(record)
    if worst is not None:
        parts.append(worst)
    if keys.LOSS_SCALE in record:
        parts.append(f"scale {record[keys.LOSS_SCALE]:g}")
    return " | ".join(parts)


def worst_rank_memory(record: dict[str, Any]) -> str | None:
    """The worst rank's peak: tensor memory where measured this window, else host RSS (CPU)."""
    if keys.MAX_RANK_PEAK in record:
        return f"peak {format_gib(record[keys.MAX_RANK_PEAK])} (rank {record[keys.ARGMAX_RANK]})"
    rss = {key: value for key, value in record.items() if key.endswith(keys.PEAK_RSS_SUFFIX)}
    if not rss:
        return None
    key = max(rss, key=rss.__getitem__)
    return f"rss {format_gib(rss[key])} ({key.split('/')[1].replace('rank', 'rank ')})"


def pipeline_fields(per_rank: torch.Tensor, layout: Layout) -> dict[str, float]:
    """Each rank's idle share, and per pipeline position (its pp coordinate, trainer/layout.py) the mean over
    the replicas of the idle share and of the bytes sent; the bytes one replica's stages sent each other."""
    pp = layout.pp
    record: dict[str, float] = {}
    idle, sent = per_rank[:, 0], per_rank[:, 1]
    for rank, share in enumerate(idle.tolist()):
        record[keys.pp_rank_idle_key(rank)] = share
    by_stage = torch.tensor([layout.coords(rank)["pp"] for rank in range(per_rank.shape[0])])
    for stage in range(pp):
        record[keys.pp_idle_key(stage)] = idle[by_stage == stage].mean().item()
        record[keys.pp_sent_key(stage)] = sent[by_stage == stage].mean().item()
    record[keys.PP_MEASURED_BYTES] = sum(record[keys.pp_sent_key(stage)] for stage in range(pp))
    return record


def format_gib(gib: float) -> str:
    """A memory figure readable at every scale: MiB below 1 GiB."""
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"
