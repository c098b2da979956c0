"""Predicted step time of one configuration: compute, communication and the optimizer, in seconds.

The arithmetic (docs/advisor.md has it with its assumptions; tests/unit/advise/test_predict.py pins it):

    tokens per rank per step   t = micro_batch · grad_accum · seq_len / cp   (its data-parallel share of the batch;
        under parallel.cp each rank of a cp group holds 1/cp of every sequence)
    compute                    C = t · (S·F + R) / rate(micro_batch · seq_len)   of the busiest rank (`rank_flops`)
        F = 6N + 12·L·H·Q·T, the model's training FLOPs per token (trainer.model.decoder.flops_per_token)
        S = the rank's share of F: 1/tp of each GEMM (its local model: H/tp and K/tp heads, ffn_dim/tp,
            vocab/tp) of its pipeline stages' blocks, (b·blocks + head on the last stage) / F / tp with
            b = 6·N_block + 12·H·Q·T; the stages split unevenly (trainer/model/pipeline_split.py), the
            pipeline rank with the most work sets the pace; S = 1 at tp = pp = 1
        R = k · (2·(N_block − D·M) + 4·H·Q·T), recompute per token for the rank's k checkpointed blocks, on its
            local model (1/tp of each block): the block's forward again, less its last matmul (w2), which
            non-reentrant checkpointing's early stop never reruns (its output is not saved for backward)
        R = k · (2·Σ numel of the recomputed matmuls + 4·H·Q·T unless the SDPA op is saved) for
            checkpointing=op: its policy keeps wq, wv, w1, w2 and attention, so wk, wo and w3
            are rerun (w2 never is), 2·(D·KQ + D·HQ + D·M) per token per block by default
        rate: calibrate.py's; on a named accelerator (the fitted efficiency times the GEMM-shape factor,
            trainer/advise/throughput.py) a TP rank's narrower GEMMs by its local model's shape factor;
            compile=true times throughput.COMPILE_SPEEDUP where published runs measured it (h100 family);
            parallel.cp: the GEMMs' rows are micro_batch · seq_len / cp and attention's queries the rank's
            (`cp_shape_factor`); F stays per token at the whole T: head-tail balance gives each rank 1/cp of
            the row's causal attention pairs (trainer/model/context_parallel.py `attention_pairs`)
            precision=fp8 over fp8.py's compute factor for the recipe (on the local model's GEMMs)
    wire time of a collective  W_c = B_c · f_c / busbw_c   (B_c: the payload bytes trainer/plan/comm.py predicts)
        f = 2(n−1)/n for all-reduce (ring), (n−1)/n for all-gather, reduce-scatter and broadcast
        (ZeroRedundancyOptimizer's broadcasts of each rank's shard add up to an all-gather);
        the plan books gloo's reduce-scatter under all-reduce (gloo runs it as one), so on CPU
        FSDP2's gradient reduction is timed as a ring all-reduce; busbw in the dtype the collective
        runs in where calibrated (this host: fp32 and bf16; gloo's bf16 reduction is slow); by tier
        (`predict_step_tiers`) each group on its link, across nodes with the share of the node's NICs
        its g ranks there hold (g from the layout, trainer/layout.py: a dp group beside tp = nproc has
        one rank a node, so one NIC's share)
    exposed communication      E = Σ_c max(W_c / L, W_c − window_c) where collectives overlap
        compute (NCCL streams), else E = Σ_c W_c (CPU: gloo's threads share the cores):
        all-gather overlaps the forwards that gather (every micro-batch's; the first one's alone under
        zero.reshard_after_backward=false) and, at stage3, every backward;
        all-reduce (DDP) and reduce-scatter (FSDP2) the backward of the micro-batches that reduce:
        the last one under zero.reduce_every=step, every one under micro_batch (whose bytes
        trainer/plan/comm.py counts grad_accum times); the broadcast after ZeroRedundancyOptimizer's step overlaps nothing;
        at least one block's share (W_c / L, L the rank's blocks) is always exposed (the first gather, the last bucket)
    context parallelism        the cp group's collectives (trainer/plan/comm.py `cp_moves`: Ulysses' all-to-alls, or
        the K/V all-gather and its reduce-scatter) exposed whole, as T below: each feeds or drains the attention
        beside it; an all-to-all at the all-gather's bus bandwidth, f = (n−1)/n (each rank sends that share)
    tensor parallelism         T = Σ W_c of the tp group (trainer/plan/tensor_parallel.py's bytes, NVLink), exposed
        whole: each collective feeds or drains the GEMM beside it, so it is on the critical path (torch's async
        TP, which overlaps them, is not an option of zerolab); T is in E
    optimizer                  O = local_numel / adam_rate   (host AdamW under offload=cpu and nvme)
    offload transfers          X = (4/p · B_all_gather + 4/r · B_reduce_scatter) / n / pcie + (k − 1) · 12 · local_numel / host
        (each rank's fp32 shards, once per collective: p, r the bytes of the compute and reduce dtypes;
        k reductions a step, each after the first a blocking copy and a CPU add, FSDP2's foreach_reduce)
    pipeline (parallel.pp > 1) P = the busiest stage's sends per step / the link between stages (not
        overlapped; across nodes one NIC's share a rank: a node's ranks send at once), f the bubble:
        (pp − 1) / (m + pp − 1) for gpipe and 1f1b, (pp − 1) / (v·m + pp − 1) interleaved (m = grad_accum,
        v = parallel.pp_virtual_stages; Narayanan et al. 2021, section 2.2); the busy time C + T + P (the TP
        collectives run inside every micro-batch's forward and backward) is stretched to (C + T + P) / (1 − f):
        B = (C + T + P) · f / (1 − f)
    disk (offload=nvme)        D = the node's moment bytes read and written per step / plan.disk_gbps
        (trainer/plan/disk.py; the chunked step reads, updates and writes in turn: nothing overlaps it)
    step                       S = C + E + O + X + P + B + D;  tokens/s = global_batch · seq_len / S
    MFU                        F · tokens/s / (peak · n)    (model FLOPs: recompute excluded)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from trainer.advise.calibrate import ACCELERATORS, HOST_MEMORY_BYTES_PER_S, Rates
from trainer.advise.fp8 import fp8_compute_factor
from trainer.advise.host import host_ops, host_seconds
from trainer.advise.throughput import COMPILE_SPEEDUP, shape_factor
from trainer.config import (
    CheckpointingConfig,
    CheckpointMode,
    DType,
    ModelConfig,
    PrecisionConfig,
    ReduceDType,
    Stage,
    TrainConfig,
    ZeroConfig,
)
from trainer.layout import Layout
from trainer.model.attention import config_choice, sdpa_op
from trainer.model.checkpointing import BLOCK_MATMULS, op_saved_matmuls, op_saves, should_checkpoint
from trainer.model.fp8 import precision_split
from trainer.plan import (
    INTRA_NODE,
    LINKS,
    NETWORK,
    PARAM_BYTES,
    REDUCE_BYTES,
    CommPlan,
    forward_gathers,
    model_shape,
    pipeline_bubble,
    reductions,
    stage_blocks,
    tp_local_model,
)

FORWARD_SHARE = 1 / 3  # forward is 2 of the 6 FLOPs per parameter per token, backward the other 4


@dataclass(frozen=True)
class LinkTime:
    """One link's share of a step: its collectives' wire time, serialised, against the compute they overlap."""

    link: str  # intra-node | network (trainer/plan/groups.py)
    wire_s: float  # every collective on this link, one after another
    window_s: float  # the compute any of them can hide behind (the union of their windows)
    exposed_s: float

    @property
    def saturated(self) -> bool:
        return self.window_s > 0 and self.wire_s > self.window_s


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one rank, by what spends them."""

    compute_s: float
    recompute_s: float  # included in compute_s
    wire_s: dict[str, float]  # each collective's time on the wire
    exposed_comm_s: float
    optimizer_s: float
    offload_s: float
    links: dict[str, LinkTime] = field(default_factory=dict)
    """Per link (intra-node, network) where the step was timed by tier (`predict_step_tiers`)."""
    tp_s: float = 0.0
    """The tp group's collectives (in exposed_comm_s): each feeds or drains a GEMM, on every micro-batch's path."""
    bubble: float = 0.0  # parallel.pp > 1: the share of the step a stage waits (trainer/plan/pipeline.py)
    p2p_s: float = 0.0  # the sends between stages, on the critical path
    disk_s: float = (
        0.0  # offload=nvme: the node's disk reading and writing Adam's moments (trainer/plan/disk.py)
    )
    host_s: float = 0.0
    """An eager GPU step's host time, launching its ops (trainer/advise/host.py): the step takes at least this."""
    host_ops: int = 0

    @property
    def busy_s(self) -> float:
        """A pipeline rank's work on its micro-batches: compute, its TP collectives and its sends."""
        return self.compute_s + self.tp_s + self.p2p_s

    @property
    def bubble_s(self) -> float:
        """The seconds a stage waits: with busy time B the step's pipeline part is B / (1 - f)."""
        return self.busy_s * self.bubble / (1 - self.bubble)

    def with_compute_scaled(self, factor: float) -> StepTime:
        """The step with its compute (recompute included) `factor` times as long: the bubble follows the busy
        time; communication, optimizer and offload stay as they were (an approximation where compute shrinks:
        shorter compute hides less of the collectives that overlap it, which this does not re-time)."""
        return dataclasses.replace(
            self, compute_s=self.compute_s * factor, recompute_s=self.recompute_s * factor
        )

    @property
    def device_s(self) -> float:
        """What the device's work and waits take, the host's launching aside."""
        return (
            self.compute_s
            + self.exposed_comm_s
            + self.optimizer_s
            + self.offload_s
            + self.bubble_s
            + self.p2p_s
            + self.disk_s
        )

    @property
    def step_s(self) -> float:
        """The device's time, or the host's where launching the ops takes longer (the GPU then waits for it)."""
        return max(self.device_s, self.host_s)

    @property
    def limiter(self) -> str:
        """What the step spends most of its time on; a link whose collectives need more time on the wire
        than the compute they can hide behind bounds the step, whatever the largest part is."""
        saturated = [link for link in self.links.values() if link.saturated]
        if self.host_s > self.device_s:
            return f"host ({self.host_ops:,} ops launched per step take {self.host_s:.3g} s > {self.device_s:.3g} s on the device)"
        if saturated:
            worst = max(saturated, key=lambda link: link.wire_s - link.window_s)
            return f"{worst.link} ({worst.wire_s:.3g} s on the wire > {worst.window_s:.3g} s of compute to hide it)"
        parts = {
            "compute": self.compute_s,
            "communication": self.exposed_comm_s,
            "optimizer": self.optimizer_s,
            "offload transfers": self.offload_s,
            "pipeline bubble": self.bubble_s,
            "pipeline sends": self.p2p_s,
            "disk (offload=nvme)": self.disk_s,
        }
        return max(parts, key=parts.__getitem__)


def recompute_flops_per_token(
    m: ModelConfig,
    checkpointing: CheckpointingConfig,
    seq_len: int,
    *,
    attention_op: str | None = None,
    blocks: Iterable[int] | None = None,
) -> float:
    """FLOPs per token that activation checkpointing adds over `blocks` (every block of `m` by default):
    each checkpointed block's `block_recompute_flops_per_token`."""
    blocks = range(m.n_layers) if blocks is None else blocks
    checkpointed = sum(should_checkpoint(i, checkpointing) for i in blocks)
    return checkpointed * block_recompute_flops_per_token(m, checkpointing, seq_len, attention_op)


def block_recompute_flops_per_token(
    m: ModelConfig, checkpointing: CheckpointingConfig, seq_len: int, attention_op: str | None
) -> float:
    """One checkpointed block's rerun per token: its forward, less w2; for mode=op, the matmuls and attention
    its policy does not save (`attention_op`: the SDPA op the run's kernel runs, None for math, whose
    composite op the policy never sees)."""
    if checkpointing.mode == CheckpointMode.op:
        return op_recompute_flops_per_token(m, checkpointing, seq_len, attention_op)
    block_params = sum(_numel(s) for s in model_shape(m).block)
    return 2.0 * (block_params - m.dim * m.ffn_dim) + 4.0 * m.n_heads * m.head_width * seq_len


def op_recompute_flops_per_token(
    m: ModelConfig, checkpointing: CheckpointingConfig, seq_len: int, attention_op: str | None
) -> float:
    """One block's recompute under mode=op, per token: the matmuls the policy does not save, but
    w2 (early stop ends the recompute once w2's input is back), and attention unless its op is saved."""
    HQ, KQ, M = m.n_heads * m.head_width, m.n_kv_heads * m.head_width, m.ffn_dim
    width = dict(wq=HQ, wk=KQ, wv=KQ, wo=HQ, w1=M, w3=M, w2=M)  # each matmul is D x width
    saved = op_saved_matmuls(checkpointing.save_ops)
    matmuls = sum(2.0 * m.dim * width[name] for name in BLOCK_MATMULS[:-1] if name not in saved)
    attention = 0.0 if op_saves(checkpointing.save_ops, attention_op) else 4.0 * HQ * seq_len
    return matmuls + attention


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def wire_factor(collective: str, world_size: int) -> tuple[float, str]:
    """(bytes on the wire per payload byte, the bandwidth it runs at) for a ring implementation."""
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n, "all_reduce"
    return (n - 1) / n, "all_gather"


def bandwidth(
    rates: Rates, kind: str, collective: str, zero: ZeroConfig, precision: PrecisionConfig
) -> float:
    """The bus bandwidth in the dtype the collective runs in, where the rates have it: gradients
    reduce in zero.reduce_dtype, FSDP2 gathers in the compute dtype, the broadcast is fp32."""
    if collective in ("all_reduce", "reduce_scatter"):
        half = zero.reduce_dtype == ReduceDType.bf16
    else:
        half = collective in ("all_gather", "all_to_all") and precision.compute_dtype != DType.float32
    return (
        rates.bus_bytes_per_s.get(f"{kind}_bf16", rates.bus_bytes_per_s[kind])
        if half
        else rates.bus_bytes_per_s[kind]
    )


def gathering_forward(config: TrainConfig, forward_s: float) -> float:
    """The forwards that all-gather: every micro-batch's, or under zero.reshard_after_backward=false
    the first one's only (the later ones start unsharded), so their all-gathers hide behind it alone."""
    return forward_s * forward_gathers(config) / config.grad_accum


def overlap_window(
    collective: str, stage: Stage, forward_s: float, backward_s: float, reducing_backward_s: float
) -> float:
    """Compute that a collective of this kind can hide behind (see the module docstring)."""
    if collective == "all_gather":
        return forward_s + backward_s if stage == Stage.stage3 else forward_s
    if collective in ("all_reduce", "reduce_scatter"):
        return reducing_backward_s
    return 0.0  # broadcast: after the optimizer step, nothing left to overlap


def rank_parts(config: TrainConfig) -> list[tuple[list[int], bool]]:
    """Per pipeline rank: the blocks it runs (their index in the whole model) and whether it holds the output
    head; at pp = 1 one rank runs them all. The split is the ranks' own (trainer/model/pipeline_split.py
    `stage_blocks`: uneven where the blocks do not divide, the earlier stages taking one more); under
    interleaved_1f1b rank r holds stages r, r + pp, ... (trainer/plan/pipeline.py `rank_stages`)."""
    p, layers = config.parallel, config.model.n_layers
    if p.pp == 1:
        return [(list(range(layers)), True)]
    blocks = stage_blocks(layers, p.stages)
    held = [range(r, p.stages, p.pp) for r in range(p.pp)]
    return [([i for s in stages for i in blocks[s]], p.stages - 1 in stages) for stages in held]


def block_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """One block's training FLOPs per token, as flops_per_token counts them: 6 per parameter (its norms
    included) and 12·H·Q·T of attention."""
    return 6.0 * sum(_numel(s) for s in model_shape(m).block) + 12.0 * m.n_heads * m.head_width * seq_len


def rank_flops(config: TrainConfig, attention_op: str | None) -> tuple[float, float]:
    """(S, R) of the busiest rank: S its share of the model's training FLOPs, R the FLOPs per token its
    activation checkpointing reruns (module docstring). A TP rank runs 1/tp of every GEMM (its local model,
    trainer/plan/tensor_parallel.py `tp_local_model`), a pipeline rank its stages' blocks, plus the output
    head on the last; the rank with the most work sets the pipeline's pace."""
    m, tp, seq_len = config.model, config.parallel.tp, config.seq_len
    block = block_flops_per_token(m, seq_len)
    total = m.n_layers * block + 6.0 * (m.dim + m.dim * m.vocab_size)  # + the final norm and the head
    rerun = block_recompute_flops_per_token(
        tp_local_model(m, tp), config.checkpointing, seq_len, attention_op
    )
    ranks = [
        (
            (len(blocks) * block + has_head * (total - m.n_layers * block)) / total / tp,
            sum(should_checkpoint(i, config.checkpointing) for i in blocks) * rerun,
        )
        for blocks, has_head in rank_parts(config)
    ]
    return ranks[0] if len(ranks) == 1 else max(ranks, key=lambda r: r[0] * total + r[1])


def rank_rate(config: TrainConfig, rates: Rates) -> float:
    """FLOP/s at the rank's micro-batch: where the rates follow the model's GEMM shapes (a named accelerator,
    trainer/advise/throughput.py), a TP rank's narrower GEMMs (its local model's) by their own shape factor;
    under compile=true times the published compile gain (`compile_speedup`); under precision=fp8 on an
    accelerator with fp8 tensor cores, over fp8's compute factor for the recipe (trainer/advise/fp8.py: the
    block linears at the fp8 peak plus their casts, against compiled bf16)."""
    rows, seq_len = config.micro_batch * config.seq_len, config.seq_len
    rate = rates.flops_at(rows)
    local = tp_local_model(config.model, config.parallel.tp)
    if rates.gemm_shaped and config.parallel.tp > 1:
        rate *= shape_factor(local, rows, seq_len) / shape_factor(config.model, rows, seq_len)
    if rates.gemm_shaped and config.parallel.cp > 1:
        rate *= cp_shape_factor(config, local) / shape_factor(local, rows, seq_len)
    if config.compile:
        rate *= compile_speedup(rates)
    fp8 = (
        fp8_compute_factor(
            local,
            seq_len,
            config.micro_batch,
            rates.accelerator,
            config.precision.fp8_recipe.value,
            precision_split(config.model, config.precision, config.parallel.tp).converted,
        )
        if config.precision.is_fp8 and rates.accelerator is not None
        else None
    )
    return rate if fp8 is None else rate / fp8


def cp_shape_factor(config: TrainConfig, local: ModelConfig) -> float:
    """The shape factor of a cp rank's GEMMs: micro_batch · seq_len / cp rows through every linear; attention's
    products over the whole row's keys for the rank's queries, all T of them on H/cp heads under Ulysses, its
    T/cp under the all-gather (the heads' count changes the work, not the shape)."""
    cp, seq_len = config.parallel.cp, config.seq_len
    queries = seq_len if config.parallel.cp_impl == "ulysses" else seq_len // cp
    return shape_factor(local, config.micro_batch * seq_len // cp, seq_len, queries=queries)


def compile_speedup(rates: Rates) -> float:
    """compile=true's compute over eager's on these rates' accelerator (throughput.COMPILE_SPEEDUP); 1 where no
    published pair of runs measured it (this host's calibration, an accelerator family without one)."""
    if rates.accelerator is None:
        return 1.0
    return COMPILE_SPEEDUP.get(ACCELERATORS[rates.accelerator].family, 1.0)


def compute_seconds(
    config: TrainConfig, flops_per_token: float, rates: Rates, device_kind: str
) -> tuple[float, float, float]:
    """(C, the forwards' share of it, the recompute's share of it) for the busiest rank: the tokens of its
    data-parallel batch times its share S of the model's FLOPs plus its recompute R, at its rate."""
    tokens = config.micro_batch * config.grad_accum * config.seq_len // config.parallel.cp
    rate = rank_rate(config, rates)
    choice = config_choice(config, device_kind)
    share, recompute = rank_flops(config, sdpa_op(choice, device_kind))
    model = tokens * flops_per_token * share / rate
    recompute_s = tokens * recompute / rate
    return model + recompute_s, model * FORWARD_SHARE, recompute_s


def predict_step(
    config: TrainConfig,
    world_size: int,
    comm_bytes: dict[str, int],
    local_numel: int,
    flops_per_token: float,
    rates: Rates,
    device_kind: str = "cpu",
) -> StepTime:
    """The step time of `config` on `world_size` ranks (module docstring: the formulas); `flops_per_token`
    the model's training FLOPs per token, of which the busiest rank runs its share (`rank_flops`)."""
    compute_s, forward_s, recompute_s = compute_seconds(config, flops_per_token, rates, device_kind)
    backward_s = compute_s - forward_s
    reducing_backward_s = (
        backward_s * reductions(config) / config.grad_accum
    )  # backward of the micro-batches that reduce
    gathering_forward_s = gathering_forward(config, forward_s)
    wire_s, exposed = {}, 0.0
    for collective, payload in comm_bytes.items():
        if not payload:
            continue
        factor, kind = wire_factor(collective, world_size)
        wire_s[collective] = (
            payload * factor / bandwidth(rates, kind, collective, config.zero, config.precision)
        )
        if rates.overlap:
            window = overlap_window(
                collective, config.zero.stage, gathering_forward_s, backward_s, reducing_backward_s
            )
            exposed += max(wire_s[collective] / config.model.n_layers, wire_s[collective] - window)
        else:
            exposed += wire_s[collective]
    offload = config.offload.on_host and rates.offload_bytes_per_s is not None  # cpu and nvme move alike
    adam_rate = (
        rates.host_adam_params_per_s if offload and rates.host_adam_params_per_s else rates.adam_params_per_s
    )
    offload_s = offload_seconds(config, comm_bytes, world_size, local_numel, rates) if offload else 0.0
    blocks, on_gpu = (
        -(-config.model.n_layers // config.parallel.pp),
        device_kind == "cuda" or bool(rates.accelerator),
    )
    replicas = max(1, world_size // (config.parallel.tp * config.parallel.pp))
    return StepTime(
        compute_s,
        recompute_s,
        wire_s,
        exposed,
        local_numel / adam_rate,
        offload_s,
        host_s=host_seconds(config, blocks, replicas, on_gpu),
        host_ops=host_ops(config, blocks, replicas),
    )


def offload_seconds(
    config: TrainConfig, comm_bytes: dict[str, int], world_size: int, local_numel: int, rates: Rates
) -> float:
    """offload=cpu as FSDP2's CPUOffloadPolicy runs it (torch/distributed/fsdp/_fully_shard): every
    all-gather first copies the rank's fp32 shard to the GPU (_fsdp_param.py `all_gather_inputs`), every
    reduction copies the fp32 gradient shard back (foreach_reduce casts the reduce-scatter output to the
    parameter dtype first), and every reduction after the first in a step, a blocking copy, is added to
    the held gradient on the CPU: 12 bytes per element at the host's memory rate."""
    assert rates.offload_bytes_per_s is not None
    up = comm_bytes.get("all_gather", 0) * 4 / PARAM_BYTES[config.precision.compute_dtype]
    down = comm_bytes.get("reduce_scatter", 0) * 4 / REDUCE_BYTES[config.zero.reduce_dtype]
    adds = (
        (reductions(config) - 1)
        * local_numel
        * 12
        / (rates.host_memory_bytes_per_s or HOST_MEMORY_BYTES_PER_S)
    )
    return (up + down) / world_size / rates.offload_bytes_per_s + adds


# ----------------------------------------------------------------------------- tiers and shared links


def group_window(
    group: str, collective: str, config: TrainConfig, hpz: bool, windows: dict[str, float]
) -> tuple[str, ...]:
    """The compute phases a group's collective overlaps: `forward`, `backward` (every micro-batch's),
    `last_backward` (those that reduce: the last, or every one under zero.reduce_every=micro_batch). hpZ moves stage3 backward's all-gathers to the hpz group.
    tp: none. Each tensor-parallel collective feeds or drains the very GEMM beside it (no async TP here), so
    it sits on the critical path; so does each cp exchange, which attention waits on or backward's next op takes."""
    if group in ("tp", "cp"):
        return ()
    if collective == "all_gather":
        if group == "hpz":
            return ("backward",)
        stage3 = config.zero.stage == Stage.stage3
        return ("forward", "backward") if stage3 and not hpz else ("forward",)
    if collective in ("all_reduce", "reduce_scatter"):
        return ("last_backward",)
    return ()  # broadcast: after the optimizer step


def union_window(phases: set[str], windows: dict[str, float]) -> float:
    """Seconds of compute covered by some phase (the reducing backwards lie inside backward)."""
    if "backward" in phases:
        phases = phases - {"last_backward"}
    return sum(windows[phase] for phase in phases)


GROUP_AXES: dict[str, str | tuple[str, ...]] = {
    "shard": ("dp_shard", "cp"),
    "replicate": "dp_replicate",
    "world": ("dp", "cp"),
    "hpz": "hpz",
    "tp": "tp",
    "cp": "cp",
    "pp": "pp",
    "ep": ("dp_shard", "cp"),
}
"""The layout's axes each of the plan's process groups (trainer/plan/groups.py) runs along: DDP's group
(`world`) is every data-parallel rank, and ZeRO works over cp too (trainer/layout.py `zero_axes`); the
pipeline's loss and norm all-reduces (`pp`) run along pp; the MoE dispatch's all-to-alls (`ep`) in FSDP2's
shard group, which is the ep group (trainer/rank/experts.py), or a group inside it (`group_ranks_per_node`)."""


def group_ranks_per_node(name: str, config: TrainConfig, world_size: int) -> int:
    """How many of a node's ranks a group holds, from the layout (trainer/layout.py): under tp or pp a dp group
    strides over the TP ranks (one rank a node at tp = nproc), and a replicate group over the shard group."""
    layout = Layout.from_config(config, world_size)
    ep = config.parallel.ep
    if name in ("ep", "expert_shard") and config.zero.uses_fsdp and 1 < ep < layout.dp * layout.cp:
        # an ep group inside the shard group, dp_shard x cp (trainer/rank/mesh.py `expert_mesh`; a mixture of
        # experts takes no tp or pp): ep consecutive ranks, and the ranks holding the same experts, every ep-th
        per_node = world_size // config.nodes
        return min(ep, per_node) if name == "ep" else max(1, per_node // ep)
    return ranks_per_node(layout, GROUP_AXES[name])


@functools.lru_cache(maxsize=256)
def ranks_per_node(layout: Layout, axes: str | tuple[str, ...]) -> int:
    return layout.per_node(axes)


def predict_step_tiers(
    config: TrainConfig,
    world_size: int,
    comm: CommPlan,
    local_numel: int,
    flops_per_token: float,
    rates: Rates,
    device_kind: str = "cpu",
) -> StepTime:
    """The step time with each process group's collectives on its own link (comm.groups: intra-node at
    NVLink's bandwidth, network at the node's NICs' share the group holds, where `rates.link_bus_bytes_per_s`
    has both), and the collectives that share a link serialised on it before overlap is credited (module
    docstring):

        W_c   = B_c · f(n_group) / busbw(link, g)        each collective in its group of n_group ranks, g of
                them on each node: across nodes busbw = min(NVLink, node NICs' busbw · g / ranks per node)
        E_l   = T_l + max(Σ_c max(W_c / L, W_c − window_c),  Σ_c W_c − window_l)   per link l (window_l: the
                union of its collectives' windows; T_l: the tp group's wire time on it, never hidden;
                without overlap E_l = Σ_c W_c)
        E     = Σ_l E_l
    """
    # Each rank offloads its own shards: 1/shard-group of every payload (HSDP shards over fewer ranks).
    sharded_over = comm.groups["shard"].ranks if "shard" in comm.groups else world_size
    base = predict_step(
        config, sharded_over, comm.bytes_by_collective, local_numel, flops_per_token, rates, device_kind
    )
    forward_s = compute_seconds(config, flops_per_token, rates, device_kind)[1]
    backward_s = base.compute_s - forward_s
    # The backwards that reduce: the last micro-batch's, or every one under zero.reduce_every=micro_batch.
    reducing_s = backward_s * reductions(config) / config.grad_accum
    windows = {
        "forward": gathering_forward(config, forward_s),
        "backward": backward_s,
        "last_backward": reducing_s,
    }
    hpz = "hpz" in comm.groups
    # A pipeline rank's collectives are its blocks': one block's share of them is W / its blocks.
    layers = max(len(blocks) for blocks, _ in rank_parts(config))
    wire: dict[str, float] = {}
    per_link: dict[str, list[tuple[float, tuple[str, ...]]]] = {link: [] for link in LINKS}
    for name, group in comm.groups.items():
        for collective, payload in group.bytes_by_collective.items():
            if not payload:
                continue
            factor, kind = wire_factor(collective, group.ranks)
            bus = (
                rates.group_bus_bytes_per_s(group.link, group_ranks_per_node(name, config, world_size))
                if rates.link_bus_bytes_per_s
                else bandwidth(rates, kind, collective, config.zero, config.precision)
            )
            seconds = payload * factor / bus
            wire[f"{name}/{collective}"] = seconds
            per_link[group.link].append((seconds, group_window(name, collective, config, hpz, windows)))
    links = {}
    for link, moves in per_link.items():
        if not moves:
            continue
        total = sum(seconds for seconds, _ in moves)
        window = union_window({phase for _, phases in moves for phase in phases}, windows)
        critical = sum(seconds for seconds, phases in moves if not phases)  # tp: exposed whole
        if rates.overlap:
            hidden = [(w, phases) for w, phases in moves if phases]
            alone = sum(max(w / layers, w - sum(windows[p] for p in phases)) for w, phases in hidden)
            exposed = critical + max(alone, total - critical - window)
        else:
            exposed = total
        links[link] = LinkTime(link, total, window, exposed)
    tp_s = sum(seconds for key, seconds in wire.items() if key.startswith("tp/"))
    bubble, p2p_s = pipeline_seconds(config, comm, rates)
    return dataclasses.replace(
        base,
        wire_s=wire,
        exposed_comm_s=sum(link.exposed_s for link in links.values()),
        links=links,
        tp_s=tp_s,
        bubble=bubble,
        p2p_s=p2p_s,
    )


def pipeline_seconds(config: TrainConfig, comm: CommPlan, rates: Rates) -> tuple[float, float]:
    """parallel.pp > 1: (bubble share f, send seconds P) of a step (module docstring; StepTime.bubble_s
    turns f into seconds).

    The busiest pipeline rank's sends P = sent bytes / the bandwidth of the slowest link between stages, not
    overlapped: torch's schedules wait on each batch of sends and receives before the next compute. Where a
    boundary leaves a node every rank of the node sends its own boundary tensor at once (a node's ranks are
    one stage's dp x tp ranks, or several stages'), so each gets one rank's share of the node's NICs (one NIC
    of a rail-optimised node); inside a node, NVLink."""
    p2p = comm.p2p
    if p2p is None:
        return 0.0, 0.0
    if rates.link_bus_bytes_per_s:
        bus = rates.group_bus_bytes_per_s(NETWORK if p2p.network else INTRA_NODE, 1)
    else:
        bus = rates.bus_bytes_per_s["all_gather"]
    return pipeline_bubble(config.parallel, config.grad_accum), max(p2p.sent) / bus
