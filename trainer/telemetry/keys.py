"""The contract's names, once: the metric keys of docs/design.md section 4 and summary.json's statuses.

metrics.jsonl, summary.json, the W&B run and the reports share these keys (JSONL and W&B keys
are the same); every module that writes or reads one imports it from here. This module
imports nothing of the trainer's, so the ranks, the job process and the report all may.
"""

from __future__ import annotations

import re
from enum import Enum


class Status(str, Enum):
    """How a job ended: summary.json's `status`, the sweep report's and the W&B summary's."""

    ok = "ok"
    oom = "oom"
    """A rank ran out of memory (trainer/faults/failures.py)."""
    crashed = "crashed"
    """A rank died or raised for another reason."""
    diverged = "diverged"
    """The non-finite policy stopped every rank (trainer/rank/nonfinite.py)."""
    refused = "refused"
    """The plan refused the job before any rank started (trainer/plan/refusal.py)."""
    interrupted = "interrupted"
    """Ctrl-C (SIGINT): every rank stopped after one agreed step (trainer/faults/stop.py)."""
    preempted = "preempted"
    """SIGTERM, SIGUSR1 or submitit's SIGUSR2: stopped the same way, to be resumed."""

    def __str__(self) -> str:  # the value in f-strings and prints, on every Python (3.12 changed the default)
        return self.value


# ----------------------------------------------------------------------------- per optimizer step
LOSS = "loss/train"
LR = "optim/lr"
GRAD_NORM = "optim/grad_norm"
TOKENS_PER_S = "throughput/tokens_per_s"
TOKENS_PER_S_PER_RANK = "throughput/tokens_per_s_per_rank"
MFU_PCT = "throughput/mfu_pct"
MFU_BASIS = "throughput/mfu_basis"
"""summary.json (and W&B's summary), precision=fp8 only: what `throughput/mfu_pct` divides by (FP8_MFU_BASIS)."""
FP8_MFU_BASIS = "bf16-equivalent: the model's FLOPs over the device's bf16 dense peak, not an fp8 utilisation"
STEP_S = "time/step_s"
DATA_S = "time/data_s"
LOSS_VAL = "loss/val"
"""The held-out loss, on eval steps (eval.every, trainer/rank/evaluate.py)."""
PERPLEXITY_VAL = "loss/val_perplexity"
"""exp(loss/val)."""
Z_LOSS = "loss/z_loss"
"""loss.z_loss > 0: the z-loss the objective adds, its weight included (trainer/model/loss.py), mean over ranks
like loss/train, which stays the cross-entropy alone; absent when off."""
MOE_IMBALANCE_PREFIX = "moe/imbalance/"
"""model.n_experts > 0: `moe/imbalance/<layer>`, the layer's tokens per expert, max over mean, summed over every rank
and the log window (1.0: balanced; trainer/model/moe.py)."""
MOE_IMBALANCE_MAX = "moe/imbalance_max"
"""model.n_experts > 0: the largest of the layers' moe/imbalance/<layer>."""
MOE_IMBALANCE_PLANNED = "moe/imbalance_planned"
"""model.n_experts > 0: moe.imbalance, what the memory plan assumed, beside what the routers measured."""
MOE_DROPPED = "moe/dropped_per_step"
"""model.n_experts > 0: assignments (token, expert) dropped by moe.capacity_factor per step, every rank and layer
together (0 when dropless)."""
MOE_BALANCE_LOSS = "moe/balance_loss"
"""moe.balance != none: the balance loss, unweighted (1.0 when balanced), mean over layers, ranks and steps."""
MOE_EXPERT_BIAS_MAX = "moe/expert_bias_absmax"
"""moe.bias_rate > 0: the largest |aux-loss-free bias| of any expert of any layer after the window's last step."""


MOE_OOM_IMBALANCE = "moe/oom_imbalance"
"""summary.json, a mixture of experts whose plan fits: the routing imbalance (an expert's rows over the mean in one
forward) past which the plan's peak passes a rank's memory (trainer/job.py `routing_limit`); absent where no
routing can."""
MOE_OOM_LIMIT_GIB = "moe/oom_limit_gib"
"""summary.json, beside moe/oom_imbalance: the memory a rank has, that the plan's peak reaches there."""


def moe_imbalance_key(layer: int) -> str:
    return f"{MOE_IMBALANCE_PREFIX}{layer}"


LAYER_GRAD_NORM_PREFIX = "grad_norm/"
"""telemetry.layer_norms: `grad_norm/<layer>`, a layer's gradient L2 norm over the whole model, before clipping
(trainer/telemetry/layer_norms.py); the layers' squares add up to optim/grad_norm's."""
LAYER_PARAM_NORM_PREFIX = "param_norm/"
"""telemetry.layer_norms: `param_norm/<layer>`, a layer's parameter L2 norm after the step."""
DISK_READ_BYTES = "offload/disk_read_bytes"
"""offload=nvme: bytes of Adam's moments read from the ranks' files per step, all ranks together (mean over
the log window; trainer/rank/nvme.py). The plan's figure is 8 bytes per element of the ranks' shards."""
DISK_WRITTEN_BYTES = "offload/disk_written_bytes"
"""offload=nvme: bytes written back per step, all ranks together (as offload/disk_read_bytes)."""
DISK_WAIT_S = "offload/disk_wait_s"
"""offload=nvme: seconds per step the slowest rank spent in its file's reads and writes (the step waits on them)."""
NONFINITE_SKIPPED = "train/nonfinite_skipped"
"""Cumulative steps skipped by nonfinite=skip (trainer/rank/nonfinite.py)."""
LOSS_SPIKES = "stability/loss_spikes"
"""Cumulative loss spikes every rank agreed on (stability.spike, trainer/rank/spikes.py); absent when off."""

# ----------------------------------------------------------------------------- saves (trainer/saves/background.py)
SAVE_STEP = "save/step"
"""The step of the save whose figures a record carries (the latest completed since the record before)."""
SAVE_BLOCKING_S = "time/save_blocking_s"
"""What the step loop waited for that save (staging, and the wait for the save before it)."""
SAVE_TOTAL_S = "time/save_total_s"
"""From that save's start until it was complete and listed."""
SAVE_WRITING = "save/writing"
"""1 when a background write, or the preparation of background saves, ran during the record's steps
(save.async_mode thread or process)."""
SAVE_PREPARE_BLOCKING_S = "time/save_prepare_blocking_s"
"""What the step loop waited to start the one-time preparation of background saves after the first step."""
SAVE_PREPARE_TOTAL_S = "time/save_prepare_total_s"
"""From the preparation's start until the staging copy was allocated and the save process ready."""
SAVES = "saves"
"""summary.json: every save's step, blocking_s and total_s."""
TOKENS_PER_S_WRITING = "throughput/tokens_per_s_while_writing"
"""summary.json: the mean throughput of the steady records whose steps overlapped a background write."""

# ----------------------------------------------------------------------------- memory
MAX_RANK_PEAK = "memory/max_rank_peak_gib"
ARGMAX_RANK = "memory/argmax_rank"
IMBALANCE = "memory/imbalance"
PREDICTED_PEAK = "memory/predicted_peak_gib"
PREDICTION_ERROR_PCT = "memory/prediction_error_pct"
PREDICTED_RESERVED = "memory/predicted_reserved_gib"
RESERVED_PREDICTION_ERROR_PCT = "memory/reserved_prediction_error_pct"
MEMORY_COMPARED_WINDOWS = "memory/compared_windows"
"""summary.json: the log windows with a measured peak compared with the plan (they carry the error)."""
MEMORY_EXCLUDED_WINDOWS = "memory/excluded_windows"
"""summary.json: the windows with a measured peak but no error, none of whose measured steps the plan's peak
describes (trainer/plan/schedule.py `holds_peak`: PowerSGD before its error feedback, local SGD off its averages)."""
MEMORY_ERROR_STEP = "memory/prediction_error_step"
"""summary.json: the log step of the compared window `memory/prediction_error_pct` is of (its worst peak)."""
EVERY_MEMORY_KEY = "memory/*"
"""W&B's pattern of every memory key (its summary keeps their maximum)."""
PEAK_RSS_SUFFIX = "/peak_rss_gib"
"""How every rank's host-memory key ends (`memory/rank{r}/peak_rss_gib`)."""
LOAD_SUFFIXES = ("/load_host_peak_gib", "/load_rss_peak_gib")
"""model.weights: how a rank's figures of host memory while loading end (trainer/telemetry/memory.py
measure_load), in the first record and summary.json."""

# ----------------------------------------------------------------------------- fp16 loss scaling
LOSS_SCALE = "precision/loss_scale"
OVERFLOW = "precision/overflow"
SKIPPED_STEPS = "precision/skipped_steps"

# ----------------------------------------------------------------------------- communication
COMM_PREDICTED_BYTES = "comm/predicted_bytes_per_step"
COMM_PREDICTION_ERROR_PCT = "comm/prediction_error_pct"
"""`100 * (predicted - measured) / measured`, where the prediction is at least NEAR_ZERO_BYTES (else absent)."""
COMM_PREDICTION_ERROR_BYTES = "comm/prediction_error_bytes"
"""`predicted - measured` in bytes per step: the error a near-zero prediction (one rank, pp at dp=1, local SGD's
steps between averages) is given in, written beside the percentage wherever the plan and the measurement are."""
COMM_WINDOW_PREDICTED_BYTES = "comm/window_predicted_bytes_per_step"
"""The plan of the window's own steps (mean per step) where it is not the steady figure: PowerSGD's exact
reductions before zero.powersgd_start_step, local SGD's warm-up and its steps with and without the average
(trainer/plan/schedule.py); the errors are against it. summary.json: the plan of the compared steps."""
COMM_COMPARED_STEPS = "comm/compared_steps"
"""summary.json: the steps (after the warm-up, measured on every rank) whose bytes the error compares."""
NEAR_ZERO_BYTES = 4096
"""A prediction under this many bytes per step gets its error in bytes only: the loop's own collectives, which
the plan leaves out (its agreements, the log's gather: under 2 KiB on 2 ranks), would be most of a percentage."""
COMM_EXPOSED_PCT = "comm/exposed_pct"
COMM_RANK_PREFIX = "comm/rank"

# ----------------------------------------------------------------------------- pipeline (parallel.pp > 1)
PP_MEASURED_BYTES = "comm/pp/measured_bytes_per_step"
"""The bytes one replica's stages send each other per optimizer step (activations forward, their gradients
backward): the tensors each stage hands torch.distributed to send (trainer/rank/pipeline.py), summed over the
pp ranks, mean over replicas."""
PP_PREFIXES = ("time/pp/", "comm/pp/")
"""Every pipeline key starts with one of these (summary.json keeps their steady mean)."""


def pp_idle_key(stage: int) -> str:
    """`time/pp/stage{i}/idle_share`: the share of the schedule's step the rank at pipeline position i (stages
    i, i + pp, ... when interleaved) spent outside its stages' own forward and backward; mean over replicas."""
    return f"time/pp/stage{stage}/idle_share"


def pp_rank_idle_key(rank: int) -> str:
    """`time/rank{r}/pp_idle_share`: the same share, of one rank."""
    return f"time/rank{rank}/pp_idle_share"


def pp_sent_key(stage: int) -> str:
    """`comm/pp/stage{i}/sent_bytes_per_step`: the bytes the rank at pipeline position i sent per step."""
    return f"comm/pp/stage{stage}/sent_bytes_per_step"


def layer_grad_norm_key(layer: str) -> str:
    """`grad_norm/<layer>` (LAYER_GRAD_NORM_PREFIX)."""
    return LAYER_GRAD_NORM_PREFIX + layer


def layer_param_norm_key(layer: str) -> str:
    """`param_norm/<layer>` (LAYER_PARAM_NORM_PREFIX)."""
    return LAYER_PARAM_NORM_PREFIX + layer


"""Every per-rank communication key starts so (`comm/rank{r}/...`)."""
BYTES_PER_STEP_SUFFIX = "/bytes_per_step"

# ----------------------------------------------------------------------------- summary.json only
LOSS_FIRST = "loss/first"
LOSS_FINAL = "loss/final"
WARMUP_STEPS = "throughput/warmup_steps"
"""The last step the steady-state figures leave out."""
PEAK_STEP = "memory/peak_step"
"""The log step whose window had the worst rank's peak."""
MAX_RANK_PEAK_RSS = "memory/max_rank_peak_rss_gib"
MAX_RANK_LOAD_HOST = "memory/max_rank_load_host_peak_gib"
"""summary.json: the largest rank's anonymous host memory while loading model.weights."""
# The W&B summary's names of the steady-state figures (trainer/telemetry/wandb_run.py): W&B's own
# summary of a history key is its last value, so the steady means go under names of their own.
STEADY_TOKENS_PER_S = "throughput/steady_tokens_per_s"
STEADY_MFU_PCT = "throughput/steady_mfu_pct"
# OOM triage (trainer/autobatch.py, trainer/faults/oom.py, trainer/telemetry/creep.py): summary.json's records.
MICRO_BATCH_AUTO = "micro_batch_auto"
"""micro_batch=auto: proposed, every probe's status and peaks, chosen (summary.json and the W&B config)."""
MEMORY_CREEP = "memory/creep"
"""Per-step growth of the per-step peak beyond the plan's steady state, and when it would reach the limit."""


# ----------------------------------------------------------------------------- per rank
def memory_key(rank: int, name: str) -> str:
    """`memory/rank{r}/{name}`: one rank's memory figure (`peak_allocated_gib`, `at_peak/grads_gib`, ...)."""
    return f"memory/rank{rank}/{name}"


def comm_key(rank: int, name: str) -> str:
    """`comm/rank{r}/{name}`: one rank's communication figure (`bytes_per_step`, `all_reduce_bytes_per_step`, ...)."""
    return f"{COMM_RANK_PREFIX}{rank}/{name}"


def comm_group_predicted_key(group: str) -> str:
    """`comm/{group}/predicted_bytes_per_step`: the plan's bytes on one process group (trainer/plan/groups.py)."""
    return f"comm/{group}/predicted_bytes_per_step"


COMM_KEY = re.compile(r"comm/rank(\d+)/bytes_per_step")
"""A rank's total bytes per optimizer step; group 1 is the rank."""
COMM_GROUP_KEY = re.compile(r"comm/rank\d+/(\w+)/bytes_per_step")
"""A rank's bytes per optimizer step on one process group (trainer/plan/groups.py); group 1 is the group."""
PEAK_ALLOCATED_KEY = re.compile(r"memory/rank(\d+)/peak_allocated_gib")
"""A rank's peak tensor memory; group 1 is the rank."""
