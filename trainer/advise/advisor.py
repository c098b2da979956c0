"""mode=advise: which configuration to run for a global batch, ranked by predicted speed, then verified.

    python -m trainer mode=advise model=13b nproc=8 plan.accelerator=h100 seq_len=4096 precision=bf16 global_batch=512

Every combination of `advise.stages` x `advise.checkpointing` x `advise.offload` x
`advise.reduce_dtypes` x micro-batch (the powers of two dividing global_batch / dp; grad_accum
makes up the rest) x, where grad_accum > 1, `advise.reduce_every` (one reduction per step and a
full gradient held between micro-batches, or one per micro-batch and only the shard) x, where
grad_accum > 1 at stage2/3, `advise.reshard_after_backward` (false: parameters kept unsharded
between micro-batches, one forward's all-gathers per step), on several nodes x the layout (`layouts`:
parallel.tp of `tp_options` x parallel.pp of `pp_options`, pp dividing world / tp up to the blocks, where
dp = world / (tp·pp) divides the global batch) and the pipeline's schedule (`schedule_options`: 1F1B with
grad_accum >= pp, interleaved with whole rounds, GPipe where 1F1B cannot run; the best of each listed with
its bubble), is planned (trainer/plan: the worst rank's peak, which must leave `advise.headroom` of the
memory free; `evaluate_screened` skips what a configuration of less memory shows cannot fit) and timed
(trainer/advise/predict.py, with trainer/advise/calibrate.py's rates and trainer/plan/comm.py's bytes). The
table ranks what fits by predicted tokens/s and gives each row's command line; advice.json keeps every
candidate planned. `advise.verify=K` then runs the K best on this host as real jobs
(trainer/advise/verify.py). No model is allocated: the plan and the FLOPs come from shapes on the meta
device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.advise.calibrate import ACCELERATORS, Rates, accelerator_rates, advisor_accelerator, host_rates
from trainer.advise.fp8 import FIT_ERROR_PP, NO_FP8_REASON, Fp8Prediction, offers_fp8, predict_fp8
from trainer.advise.predict import StepTime, predict_step_tiers, tp_local_model
from trainer.advise.throughput import COMPILE_SPEEDUP
from trainer.advise.verify import Proposal, verify
from trainer.config import (
    STAGE_REDUCE_EVERY,
    CheckpointMode,
    Compression,
    ConfigError,
    DType,
    Fp8Recipe,
    LossKind,
    OffloadTarget,
    ReduceDType,
    ReduceEvery,
    Stage,
    TrainConfig,
    first_refusal,
    unchecked_replace,
)
from trainer.layout import divisors
from trainer.model.decoder import flops_per_token
from trainer.overrides import split_override
from trainer.plan import LINKS, Plan, build_plan, cause_of, device_memory, shard_groups
from trainer.rank.refusals import check_device_support
from trainer.telemetry.metrics import mfu_pct
from trainer.units import GIB

CHOSEN_KEYS = (
    "zero",
    "checkpointing",
    "offload",
    "zero.reduce_dtype",
    "zero.reduce_every",
    "zero.reshard_after_backward",
    "micro_batch",
    "grad_accum",
    "loss",
    "zero.shard_ranks",
    "zero.hpz_ranks",
    "parallel.tp",
    "parallel.pp",
    "parallel.pp_schedule",
    "zero.compression",
    "parallel.cp",
    "parallel.cp_impl",
    "parallel.ep",
)
SHAPE_KEYS = tuple(key for key in CHOSEN_KEYS if key not in ("micro_batch", "grad_accum"))
"""What a candidate is, besides its micro-batch split (rows that differ only there share a memory limit)."""
LOSS_SHARE = 0.2
"""loss=chunked is considered too where the full loss's fp32 logits-sized tensors (12 bytes per token and
vocabulary entry: the log-softmax and its two gradients) are at least this share of a candidate's peak."""
ADVISE_ONLY_KEYS = ("mode", "global_batch", "advise")


@dataclass(frozen=True)
class Candidate:
    """One configuration: its overrides, its plan's verdict and, where it fits, its predicted speed."""

    choice: dict[str, Any]  # the CHOSEN_KEYS' values
    peak_bytes: int
    fits: bool | None  # device with headroom, and the node's host; None: this device's memory is unknown
    step: StepTime
    tokens_per_s: float
    mfu_pct: float | None
    limiter: str
    host_bytes: int = 0  # host memory of a node (trainer/plan/host.py)
    host_fits: bool | None = None  # None: the host's memory is unknown
    # What must fit: on a GPU the allocator's reserved memory (trainer/plan/headroom.py), else the peak.
    reserved_bytes: int = 0
    tie: bool = False  # within the model's error of the fastest that fits (`rank`)
    device_fits: bool | None = None  # the device alone, with headroom
    peak_parts: dict[str, int] = dataclasses.field(default_factory=dict)  # the worst rank's peak by kind
    # offload=nvme: the bytes of Adam's moments a node's disk reads and writes per step (trainer/plan/disk.py)
    disk_bytes: int = 0

    def moving_parts(self) -> tuple[str, ...]:
        """What the configuration adds to plain FSDP2/DDP that can go wrong or change the result: a tie
        goes to the one with fewer (then to the smaller reserved memory, then to speed). The chunked loss
        is not one: the same loss and gradients, a memory saver like checkpointing."""
        c = self.choice
        parts = {
            "offload=cpu": c["offload"] != "none",
            "NVMe": c["offload"] == "nvme",
            "hpZ": c.get("zero.hpz_ranks") is not None,
            "HSDP": c.get("zero.shard_ranks") is not None,
            "keep": c.get("zero.reshard_after_backward") is False,
            "bf16 reduction": c["zero.reduce_dtype"] == "bf16",
            "TP": c.get("parallel.tp") is not None,
            "PP": c.get("parallel.pp") is not None,
            "CP": c.get("parallel.cp") is not None,
            "EP": c.get("parallel.ep") is not None,
        }
        return tuple(name for name, present in parts.items() if present)

    @property
    def lossy(self) -> bool:
        """Gradient compression: a different optimisation, not the same one faster (never in a tie)."""
        return self.choice.get("zero.compression") is not None

    def disk_note(self) -> str:
        """offload=nvme rows: what the disk costs each step."""
        if not self.disk_bytes:
            return ""
        return (
            f"; disk: {self.disk_bytes / GIB:.1f} GiB read and written per node per step, {self.step.disk_s:.3g} s "
            "of the step"
        )

    def numerics_note(self) -> str:
        """Rows whose choice changes the numbers the job computes say so."""
        if self.lossy:
            return f"; ~ changes the optimisation: {self.choice['zero.compression']} gradient compression"
        if self.choice["zero.reduce_dtype"] == "bf16":
            return "; changes numerics: bf16 gradient reduction (torchtitan and Megatron reduce in fp32)"
        return ""

    def label(self) -> str:
        c = self.choice
        groups = "".join(
            f" {name}={c[key]}"
            for name, key in (("tp", "parallel.tp"), ("shard", "zero.shard_ranks"), ("hpz", "zero.hpz_ranks"))
            if c.get(key) is not None
        )
        if c.get("parallel.pp") is not None:
            groups += f" pp={c['parallel.pp']} {c['parallel.pp_schedule']}"
        if c.get("parallel.cp") is not None:
            groups += f" cp={c['parallel.cp']}/{c['parallel.cp_impl']}"
        if c.get("parallel.ep") is not None:
            groups += f" ep={c['parallel.ep']}"
        every = {"micro_batch": "/mb", "step": "/step"}[c["zero.reduce_every"]] if c["grad_accum"] > 1 else ""
        every += " keep" if c.get("zero.reshard_after_backward") is False else ""
        loss = "" if c["loss"] == "full" else f" loss={c['loss']}"
        loss += f" ~{c['zero.compression']}" if self.lossy else ""
        return f"{c['zero']}{groups} ckpt={c['checkpointing']} offload={c['offload']} reduce={c['zero.reduce_dtype']}{every} mb={c['micro_batch']}x{c['grad_accum']}{loss}"

    def overrides(self) -> list[str]:
        """Every chosen key; the group sizes only where set (null, their default, is every rank / none),
        zero.reshard_after_backward only where false (true is every option file's); offload=nvme's
        directory where the user gave none (`nvme_variants`)."""
        chosen = [
            f"{key}={override_value(self.choice[key])}"
            for key in CHOSEN_KEYS
            if self.choice.get(key) is not None
            and not (key == "zero.reshard_after_backward" and self.choice[key] is True)
        ]
        path = self.choice.get("offload.path")
        return chosen + ([f"offload.path={path}"] if path is not None else [])

    def exposed_by_link(self) -> dict[str, float]:
        return {link: time.exposed_s for link, time in self.step.links.items()}


def override_value(value: Any) -> str:
    """A command-line value: booleans as Hydra's YAML spells them (false, not Python's False)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_advice_inputs(config: TrainConfig, world_size: int) -> None:
    """mode=advise, before anything is planned: the data-parallel ranks of some layout considered split the
    global batch evenly, and verification runs on this host only."""
    assert config.global_batch is not None  # TrainConfig requires it in mode=advise
    degrees = data_parallel_options(config, world_size)
    if not any(config.global_batch % dp == 0 for dp in degrees):
        smallest = min(degrees)
        nearest = (
            f"nearest: {max(smallest, config.global_batch // smallest * smallest)} or "
            f"{-(-config.global_batch // smallest) * smallest}"
        )
        if list(degrees) == [world_size]:
            raise ConfigError(
                f"global_batch ({config.global_batch}) must be divisible by the {world_size} ranks "
                f"(nodes={config.nodes} x nproc={config.nproc}); {nearest}"
            )
        layouts_named = ", ".join(f"{dp} (tp={tp or 1} pp={pp or 1})" for dp, (tp, pp) in degrees.items())
        raise ConfigError(
            f"global_batch ({config.global_batch}) must be divisible by the data-parallel ranks, world / "
            f"(parallel.tp x parallel.pp), of a layout the advisor considers on {world_size} ranks "
            f"(nodes={config.nodes} x nproc={config.nproc}): {layouts_named}; {nearest}"
        )
    if config.advise.verify and config.plan.accelerator is not None:
        raise ConfigError(
            f"advise.verify runs jobs on this host, which is not plan.accelerator={config.plan.accelerator}; "
            "drop plan.accelerator or set advise.verify=0"
        )
    if config.plan.accelerator is not None:
        advisor_accelerator(
            config.plan.accelerator
        )  # a device the plan knows but the advisor has no rates for


def micro_batches(config: TrainConfig, dp: int) -> list[int]:
    """advise.micro_batches, else every power of two dividing the sequences per data-parallel rank (`dp` of them)."""
    per_rank = config.global_batch // dp  # type: ignore[operator]
    if config.advise.micro_batches is not None:
        return sorted(mb for mb in set(config.advise.micro_batches) if per_rank % mb == 0)
    return [2**k for k in range(per_rank.bit_length()) if per_rank % 2**k == 0]


def choices(
    config: TrainConfig, world_size: int, device_kind: str, context: bool = False
) -> list[dict[str, Any]]:
    """Every combination to consider; offload=cpu only for FSDP2 stages on a GPU (on a CPU host
    parameters are in host memory already: offloading moves nothing, docs/memory_plan.md), and not beside a
    pipeline: the job composes and is planned when asked, but its step model counts host copies from the
    all-gathers' payload (predict.py `offload_seconds`), none where a stage has one data-parallel rank though
    every unshard still copies its shards to the GPU, and the candidates would grow a pipeline search by half
    (llama3-405b on 512 ranks: 5,948 configurations to 9,779). offload=nvme
    is not one of them: it is offered in place of an offload=cpu candidate whose host cannot hold its
    states (`nvme_variants`), so offload=cpu is planned where advise.offload lists either. `context`: the
    parallel.cp > 1 combinations instead (`cp_options`), which `advise_all` plans where nothing else fits."""
    a, out = config.advise, []
    offloads = [OffloadTarget.cpu if o == OffloadTarget.nvme else o for o in a.offload]
    options = (dict.fromkeys(a.stages), dict.fromkeys(a.checkpointing), dict.fromkeys(offloads))
    for (stage, checkpointing, offload), (tp, pp) in itertools.product(
        itertools.product(*options), layouts(config, world_size)
    ):
        if offload == OffloadTarget.cpu and (
            stage.value in ("stage0", "stage1") or device_kind != "cuda" or pp is not None
        ):
            continue
        replicas = world_size // (tp or 1) // (pp or 1)  # ZeRO's ranks: dp x cp
        if tp is not None and stage == Stage.stage0 and replicas > 1:
            continue  # DDP holds TP's parameters as local tensors: refused on several replicas (trainer/layout.py)
        contexts = cp_options(config, world_size, tp, pp) if context else [(None, None)]
        for cp, impl in contexts:
            dp = replicas // (cp or 1)
            if config.global_batch % dp:  # type: ignore[operator]
                continue
            per_rank = config.global_batch // dp  # type: ignore[operator]  # sequences per data-parallel rank
            plain = tp is None and pp is None and cp is None
            splits = itertools.product(
                dict.fromkeys(a.reduce_dtypes),
                group_options(config, stage, world_size) if plain else [(None, None)],
                micro_batches(config, dp),
            )
            for reduce_dtype, (shard, hpz), mb in splits:
                accum = per_rank // mb
                for schedule in schedule_options(pp, accum, config.model.n_layers):
                    split = (reduce_dtype, mb, per_rank, shard, hpz, tp, pp, schedule, cp, impl)
                    ways = accumulation_choices(config, stage, accum, split, (stage, checkpointing, offload))
                    ways += [with_ep for way in ways for with_ep in expert_parallel(config, way, replicas)]
                    out += [choice for choice in ways if composes(config, choice)]
    return out


def expert_parallel(config: TrainConfig, choice: dict[str, Any], dp: int) -> list[dict[str, Any]]:
    """A mixture of experts: the choice with parallel.ep, every size that divides the experts and the `dp`
    ranks ZeRO works over (data-parallel x context-parallel: trainer/layout.py `check_expert_ranks`): all of them,
    or under FSDP2 (zero=stage2/3) an ep group inside them, FSDP2 sharding each rank's experts over the rest
    (torchtitan's dp_shard_in_ep); the composition table drops what ep does not compose with (HSDP, hpZ, offload)."""
    n = config.model.n_experts
    if not config.model.is_moe or dp < 2:
        return []
    fsdp = choice["zero"] in (Stage.stage2.value, Stage.stage3.value)
    sizes = [ep for ep in divisors(dp) if ep > 1 and n % ep == 0 and (ep == dp or fsdp)]
    return [{**choice, "parallel.ep": ep} for ep in sizes]


def cp_options(
    config: TrainConfig, world_size: int, tp: int | None, pp: int | None
) -> list[tuple[int | None, str | None]]:
    """(parallel.cp, parallel.cp_impl) > 1 beside parallel.tp=`tp` (ParallelConfig.check_context): every cp
    whose group of cp x tp ranks lies inside one node (its exchanges are exposed on the critical path, as TP's
    are: docs/communication.md) and splits every sequence into 2·cp equal chunks; Ulysses where each rank gets
    whole heads and kv heads (divisible by tp x cp), the all-gather always. None beside a pipeline: the pair
    composes (tests/integration/test_pipeline_context_parallel.py) but is not searched yet, which would multiply
    the layouts planned."""
    if pp is not None:
        return []
    m, inside = config.model, world_size // config.nodes // (tp or 1)
    out: list[tuple[int | None, str | None]] = []
    for cp in range(2, inside + 1):
        if inside % cp or config.seq_len % (2 * cp):
            continue
        whole = all(n % ((tp or 1) * cp) == 0 for n in (m.n_heads, m.n_kv_heads))
        out += [(cp, "ulysses")] if whole else []
        out.append((cp, "allgather"))
    return out


def data_parallel_options(config: TrainConfig, world_size: int) -> dict[int, tuple[int | None, int | None]]:
    """Each data-parallel degree world / (tp·pp) of the layouts considered, largest first, with the first
    (tp, pp) that gives it."""
    out: dict[int, tuple[int | None, int | None]] = {}
    for tp in tp_options(config, world_size):
        for pp in pp_options(config, world_size, tp):
            out.setdefault(world_size // (tp or 1) // (pp or 1), (tp, pp))
    return dict(sorted(out.items(), reverse=True))


def layouts(config: TrainConfig, world_size: int) -> list[tuple[int | None, int | None]]:
    """(parallel.tp, parallel.pp) pairs to consider, None for 1: every tp of `tp_options` with every pp of
    `pp_options` for it, where the data-parallel degree world / (tp·pp) divides the global batch (each
    data-parallel rank reads whole sequences)."""
    return [
        (tp, pp)
        for tp in tp_options(config, world_size)
        for pp in pp_options(config, world_size, tp)
        if config.global_batch % (world_size // (tp or 1) // (pp or 1)) == 0  # type: ignore[operator]
    ]


def composes(config: TrainConfig, choice: dict[str, Any]) -> bool:
    """Whether the composition table (trainer/config/composition.py) lets the choice run. It reads the config
    the choice makes unchecked: the full checks of every choice would cost more than planning the few that run."""
    return first_refusal(configure(config, choice, check=False)) is None


def pp_options(config: TrainConfig, world_size: int, tp: int | None = None) -> list[int | None]:
    """parallel.pp to consider beside parallel.tp=`tp`: none (None), and on several nodes every pp > 1 that
    divides world / tp (whole pipelines of whole TP groups) up to the blocks' count. The blocks need not divide:
    stages split unevenly, the earlier ones taking one more (trainer/model/pipeline_split.py `stage_blocks`;
    torchtitan runs llama3-405b's 126 blocks on pp=8)."""
    if config.nodes == 1:
        return [None]
    ranks = world_size // (tp or 1)
    return [None, *(pp for pp in range(2, min(ranks, config.model.n_layers) + 1) if ranks % pp == 0)]


def schedule_options(pp: int | None, grad_accum: int, layers: int) -> list[str | None]:
    """The schedules a pipeline of pp stages can run grad_accum micro-batches with (ParallelConfig.check_pipeline):
    1F1B with a micro-batch per stage, interleaved (2 virtual stages) with whole rounds and a block per virtual
    stage; GPipe only where 1F1B cannot run (grad_accum < pp): it has 1F1B's bubble and holds every micro-batch's
    activations, 1F1B at most pp of them, so beside 1F1B it is never the better choice."""
    if pp is None:
        return [None]
    if grad_accum < pp:
        return ["gpipe"]
    options: list[str | None] = ["1f1b"]
    if grad_accum % pp == 0 and 2 * pp <= layers:
        options.append("interleaved_1f1b")
    return options


def accumulation_choices(
    config: TrainConfig, stage: Stage, accum: int, split: tuple[Any, ...], modes: tuple[Any, ...]
) -> list[dict[str, Any]]:
    """One split's choices over zero.reduce_every and zero.reshard_after_backward (a pipeline's accumulation is
    PipelineStage's own: one reduction per step, zero.reduce_every=step)."""
    reduce_dtype, mb, per_rank, shard, hpz, tp, pp, schedule, cp, impl = split
    _, checkpointing, offload = modes
    everies = reduce_every_options(config, stage, accum) if pp is None else [ReduceEvery.step]
    keeps = reshard_options(config, stage, accum) if pp is None else [True]
    out = []
    for every, keep in itertools.product(everies, keeps):
        values = (
            stage.value,
            checkpointing.value,
            offload.value,
            reduce_dtype.value,
            every.value,
            keep,
            mb,
            per_rank // mb,
            config.loss.kind.value,
            shard,
            hpz,
            tp,
            pp,
            schedule,
            None,  # zero.compression: exact; compressed variants come from `compressed_variants`
            cp,
            impl,
            None,  # parallel.ep: its variants come from `expert_parallel`
        )
        out.append(dict(zip(CHOSEN_KEYS, values)))
    return out


def tp_options(config: TrainConfig, world_size: int) -> list[int | None]:
    """parallel.tp to consider: none (None), and on several nodes every divisor > 1 of nproc (a TP group inside
    one node) that divides the heads, kv heads, MLP width and vocabulary (ParallelConfig.check_model). On one
    node ZeRO's collectives already stay on NVLink and overlap compute, while TP's are exposed on the same
    link (docs/communication.md, "Tensor parallelism"), so TP is offered where it takes traffic off the network."""
    nproc, m = world_size // config.nodes, config.model
    if config.nodes == 1:
        return [None]
    sizes = (m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size)
    return [None, *(tp for tp in range(2, nproc + 1) if nproc % tp == 0 and all(n % tp == 0 for n in sizes))]


def group_options(config: TrainConfig, stage: Stage, world_size: int) -> list[tuple[int | None, int | None]]:
    """(zero.shard_ranks, zero.hpz_ranks) to consider: on several nodes, FSDP2 over every rank, HSDP with a
    node per shard group (MiCS), and at stage3 hpZ with a node per secondary group (ZeRO++); on one node
    only the first (every group is inside the node)."""
    nproc = world_size // config.nodes
    if config.nodes == 1 or stage not in (Stage.stage2, Stage.stage3):
        return [(None, None)]
    options: list[tuple[int | None, int | None]] = [(None, None), (nproc, None)]
    if stage == Stage.stage3 and 1 < nproc < world_size:
        options.append((None, nproc))
    return options


def reduce_every_options(config: TrainConfig, stage: Stage, grad_accum: int) -> list[ReduceEvery]:
    """advise.reduce_every where micro-batches accumulate; at grad_accum 1 both choices are the
    same one reduction, so only the stage's default (conf/zero) is planned."""
    if grad_accum == 1:
        return [STAGE_REDUCE_EVERY[stage]]
    return list(dict.fromkeys(config.advise.reduce_every))


def reshard_options(config: TrainConfig, stage: Stage, grad_accum: int) -> list[bool]:
    """advise.reshard_after_backward where FSDP2 (stage2/3) accumulates micro-batches; elsewhere it changes
    nothing (DDP never shards parameters; at grad_accum 1 the only backward reshards), so only true."""
    if grad_accum == 1 or stage not in (Stage.stage2, Stage.stage3):
        return [True]
    return list(dict.fromkeys(config.advise.reshard_after_backward))


def configure(config: TrainConfig, choice: dict[str, Any], check: bool = True) -> TrainConfig:
    """The config with a choice applied; dataclasses.replace runs every __post_init__ check again
    (check=False: copies with the choice's values set, nothing checked)."""
    replace = dataclasses.replace if check else unchecked_replace
    return replace(
        config,
        zero=replace(
            config.zero,
            stage=Stage(choice["zero"]),
            reduce_dtype=ReduceDType(choice["zero.reduce_dtype"]),
            shard_ranks=choice.get("zero.shard_ranks"),
            hpz_ranks=choice.get("zero.hpz_ranks"),
            reduce_every=ReduceEvery(choice["zero.reduce_every"]),
            reshard_after_backward=choice.get("zero.reshard_after_backward", True),
            compression=Compression(choice.get("zero.compression") or Compression.none),
        ),
        checkpointing=replace(config.checkpointing, mode=CheckpointMode(choice["checkpointing"])),
        offload=replace(
            config.offload,
            target=OffloadTarget(choice["offload"]),
            path=choice.get("offload.path") or config.offload.path,
        ),
        micro_batch=choice["micro_batch"],
        grad_accum=choice["grad_accum"],
        loss=replace(config.loss, kind=LossKind(choice["loss"])),
        parallel=replace(
            config.parallel,
            tp=choice.get("parallel.tp") or 1,
            sp=None,
            pp=choice.get("parallel.pp") or 1,
            pp_schedule=choice.get("parallel.pp_schedule") or config.parallel.pp_schedule,
            cp=choice.get("parallel.cp") or 1,
            cp_impl=choice.get("parallel.cp_impl") or config.parallel.cp_impl,
            ep=choice.get("parallel.ep") or 1,
        ),
    )


def rates_for(config: TrainConfig, world_size: int, micro_batches: list[int]) -> Rates:
    if config.plan.accelerator is not None:
        return accelerator_rates(
            config.plan.accelerator,
            config.precision.compute_dtype,
            world_size,
            model=config.model,
            seq_len=config.seq_len,
            micro_batches=micro_batches,
            tf32=config.precision.tf32,
            network_bus_gbps=config.plan.network_bus_gbps,
            nvlink_bus_gbps=config.plan.nvlink_bus_gbps,
        )
    return host_rates(config, world_size, micro_batches)


def predict_config(
    config: TrainConfig,
    plan: Plan,
    device_kind: str,
    world_size: int,
    rates: Rates,
    flops: float | None = None,
) -> StepTime:
    """The step time mode=advise ranks `config` by (checks/plan_vs_published.py validates this very
    function): its plan's largest local shard for the optimizer, the plan's communication by group and
    link (plan.comm), and the FLOPs it runs (`flops`: the model's per token, where the caller has them; counting
    them builds the model on meta)."""
    local_numel = max(rank.states.local_numel for rank in plan.ranks)
    # loss=chunked computes the output projection again in backward: 2·V·D more FLOPs per token to run
    # (MFU still counts the model's own FLOPs).
    m = config.model
    run_flops = (flops_per_token(m, config.seq_len) if flops is None else flops) + (
        2.0 * m.vocab_size * m.dim if config.loss.kind == LossKind.chunked else 0.0
    )
    # Each TP rank runs 1/tp of the GEMMs, each pipeline rank its stages (predict.rank_flops: the busiest).
    step = predict_step_tiers(config, world_size, plan.comm, local_numel, run_flops, rates, device_kind)
    stall = plan.disk.stall_s if plan.disk is not None else None
    return step if stall is None else dataclasses.replace(step, disk_s=stall)


def throughput_line(config: TrainConfig, plan: Plan, world_size: int) -> str:
    """mode=plan for a named accelerator (plan.accelerator): the tokens/s and MFU the advisor's step model
    predicts for this very config, per GPU, and what limits it."""
    rates = rates_for(config, world_size, [config.micro_batch])
    flops = flops_per_token(config.model, config.seq_len)
    step = predict_config(config, plan, "cuda", world_size, rates, flops)
    tokens_per_s = config.sequences_per_step(world_size) * config.seq_len / step.step_s
    mfu = mfu_pct(flops, tokens_per_s, rates.peak_flops, world_size)
    return (
        f"throughput: {tokens_per_s / world_size:,.0f} tokens/s per GPU predicted, MFU {mfu:.1f}%, step "
        f"{step.step_s:.2f} s ({step.limiter}); the advisor's step model for plan.accelerator="
        f"{config.plan.accelerator} (docs/advisor.md)"
    )


def evaluate(
    config: TrainConfig, choice: dict[str, Any], device_kind: str, world_size: int, rates: Rates, flops: float
) -> Candidate | None:
    """Plan and time one choice; None where the schema or the device refuses the combination."""
    try:
        candidate = configure(config, choice)
        check_device_support(candidate.zero, device_kind)  # e.g. DDP's bf16 reduction needs NCCL
        shard_groups(candidate.zero, world_size, world_size // config.nodes)
    except ConfigError:
        return None
    plan = planned(candidate, choice, device_kind, world_size)
    worst = plan.worst  # a max over every rank's moments: once
    peak = worst.peak.total
    reserved = plan.required_bytes(worst)  # the allocator's reserved memory on a GPU, else the peak
    budget = (
        None
        if plan.memory.per_rank_bytes is None
        else plan.memory.per_rank_bytes * (1 - config.advise.headroom)
    )
    step = predict_config(candidate, plan, device_kind, world_size, rates, flops)
    tokens_per_s = config.global_batch * config.seq_len / step.step_s  # type: ignore[operator]
    device_fits = None if budget is None else reserved <= budget
    return Candidate(
        choice,
        peak,
        False if plan.host_fits is False else device_fits,  # a node whose host is too small runs nothing
        step,
        tokens_per_s,
        mfu_pct(flops, tokens_per_s, rates.peak_flops, world_size),
        step.limiter,
        plan.host.need_bytes,
        plan.host_fits,
        reserved,
        device_fits=device_fits,
        peak_parts=dict(worst.peak.parts),
        disk_bytes=plan.disk.traffic_bytes_per_node if plan.disk is not None else 0,
    )


_SHARED_PLANS: dict[tuple[Any, ...], Plan] | None = None
"""Within `shared_plans()`: each choice's plan by the choice, for the next accelerator (advise.accelerators)."""


@contextlib.contextmanager
def shared_plans() -> Iterator[None]:
    """Within: a choice planned for one accelerator is not planned again for the next, only given that one's
    memory (`retarget`). build_plan reads plan.accelerator for the device's memory alone (trainer/plan/build.py
    `device_memory`: the datasheet's total less the CUDA context and NCCL's buffers, which depend on the job, not
    the part); the moments, communication and host plan are the job's. Used by trainer/advise/accelerators.py."""
    global _SHARED_PLANS
    _SHARED_PLANS = {}
    try:
        yield
    finally:
        _SHARED_PLANS = None


def planned(config: TrainConfig, choice: dict[str, Any], device_kind: str, world_size: int) -> Plan:
    """build_plan, or inside `shared_plans()` the choice's plan for another accelerator retargeted to this one's."""
    if _SHARED_PLANS is None or config.plan.accelerator is None or config.device_memory_gib is not None:
        return build_plan(config, device_kind, world_size)
    key = tuple(sorted(choice.items()))
    known = _SHARED_PLANS.get(key)
    if known is None:
        _SHARED_PLANS[key] = plan = build_plan(config, device_kind, world_size)
        return plan
    return retarget(known, config)


def retarget(plan: Plan, config: TrainConfig) -> Plan:
    """`plan` for config.plan.accelerator's memory: the same share outside the allocator (the CUDA context and the
    job's NCCL communicators) taken from that device's total."""
    from trainer.devices import find_accelerator
    from trainer.plan import DeviceMemory
    from trainer.units import MIB

    was, now = find_accelerator(plan.config.plan.accelerator), find_accelerator(config.plan.accelerator)  # type: ignore[arg-type]
    assert was is not None and now is not None and plan.memory.per_rank_bytes is not None
    before, after = was.memory_mib * MIB, now.memory_mib * MIB
    source = plan.memory.source.replace(
        f"{was.short}, {before / GIB:.1f} GiB", f"{now.short}, {after / GIB:.1f} GiB", 1
    )
    memory = DeviceMemory(plan.memory.per_rank_bytes - before + after, source)
    return dataclasses.replace(plan, config=config, memory=memory)


def loss_share(config: TrainConfig, candidate: Candidate) -> float:
    """The full loss's fp32 logits-sized tensors (log-softmax and its two gradients) over the peak."""
    tokens = candidate.choice["micro_batch"] * config.seq_len
    return 12 * tokens * config.model.vocab_size / candidate.peak_bytes


def with_memory_limits(
    candidates: list[Candidate], unplanned: Sequence[dict[str, Any]] = ()
) -> list[Candidate]:
    """Mark rows whose next larger micro-batch (same everything else) does not fit: memory stops them
    (`unplanned`: choices known not to fit without a plan, evaluate_screened)."""
    refused = set()
    for choice in [c.choice for c in candidates if c.fits is False] + list(unplanned):
        # at grad_accum 1 either reduce_every is this one's
        everies = (
            [e.value for e in ReduceEvery] if choice["grad_accum"] == 1 else [choice["zero.reduce_every"]]
        )
        keeps = [True, False] if choice["grad_accum"] == 1 else [choice.get("zero.reshard_after_backward")]
        for every, keep in itertools.product(everies, keeps):
            changed = {"zero.reduce_every": every, "zero.reshard_after_backward": keep}
            key = tuple({**choice, **changed}.get(k) for k in SHAPE_KEYS)
            refused.add((key, choice["micro_batch"]))
    out = []
    for c in candidates:
        key = tuple(c.choice.get(k) for k in SHAPE_KEYS)
        if c.fits is not False and (key, 2 * c.choice["micro_batch"]) in refused:
            c = dataclasses.replace(c, limiter=f"{c.limiter}; memory stops mb={2 * c.choice['micro_batch']}")
        out.append(c)
    return out


@dataclass(frozen=True)
class Advice:
    """Every candidate planned and timed, best first (`rank`), the rates that timed them, and the choices not
    planned because a configuration of theirs with less memory does not fit (`evaluate_screened`)."""

    candidates: list[Candidate]
    rates: Rates
    unplanned: list[dict[str, Any]]
    context_note: str = ""
    """Why parallel.cp candidates were planned (`context_note`); empty where they were not."""


def advise(config: TrainConfig, device_kind: str, world_size: int) -> tuple[list[Candidate], Rates]:
    """Every candidate, the fitting ones first (`rank`: ties within the model's error, then by speed)."""
    advice = advise_all(config, device_kind, world_size)
    return advice.candidates, advice.rates


def advise_all(config: TrainConfig, device_kind: str, world_size: int) -> Advice:
    options = choices(config, world_size, device_kind)
    contexts = choices(config, world_size, device_kind, context=True)
    rates = rates_for(config, world_size, sorted({c["micro_batch"] for c in options + contexts}))
    flops = flops_per_token(config.model, config.seq_len)
    evaluated, unplanned = with_chunked_loss(config, options, device_kind, world_size, rates, flops)
    note = context_note(evaluated, contexts)
    if note:  # parallel.cp buys memory only (its FLOPs per token are the same): where memory binds
        more, skipped = with_chunked_loss(config, contexts, device_kind, world_size, rates, flops)
        evaluated, unplanned = evaluated + more, unplanned + skipped
    evaluated += nvme_variants(config, evaluated, device_kind, world_size, rates, flops)
    if OffloadTarget.cpu not in config.advise.offload and config.plan.disk_gbps is not None:
        # planned only for offload=nvme's sake (without a disk rate they stay: nvme_note counts them)
        evaluated = [c for c in evaluated if c.choice["offload"] != OffloadTarget.cpu.value]
    evaluated += compressed_variants(config, evaluated, device_kind, world_size, rates, flops)
    ranked = rank(with_memory_limits(evaluated, unplanned), rates.tie_tolerance)
    return Advice(ranked, rates, unplanned, note)


def with_chunked_loss(
    config: TrainConfig,
    options: list[dict[str, Any]],
    device_kind: str,
    world_size: int,
    rates: Rates,
    flops: float,
) -> tuple[list[Candidate], list[dict[str, Any]]]:
    """`evaluate_screened`'s candidates, and loss=chunked beside each whose full loss's logits weigh
    (LOSS_SHARE)."""
    evaluated, unplanned = evaluate_screened(config, options, device_kind, world_size, rates, flops)
    chunked = [
        evaluate(config, {**c.choice, "loss": LossKind.chunked.value}, device_kind, world_size, rates, flops)
        for c in evaluated
        if c.choice["loss"] == LossKind.full.value and loss_share(config, c) >= LOSS_SHARE
    ]
    return evaluated + [c for c in chunked if c is not None], unplanned


def context_note(evaluated: list[Candidate], contexts: list[dict[str, Any]]) -> str:
    """Why parallel.cp is planned, or "" where it is not: there are cp combinations and nothing without cp
    fits the device unless it offloads. Each cp rank holds 1/cp of every sequence, so a sequence's activations,
    which no ZeRO stage shards, shrink by cp; its FLOPs per token do not and its exchanges are exposed, so cp
    wins by memory only, and is planned where memory is what binds even with every activation recomputed
    (planned everywhere it multiplied the advisor's time by 3 to 5: 405b on 512 ranks, 13b on 8)."""
    kept = [c for c in evaluated if c.choice["offload"] == "none"]
    if not contexts or not evaluated or any(c.device_fits is not False for c in kept):
        return ""
    fitting = [c for c in evaluated if c.device_fits is not False]
    least = min(kept or evaluated, key=lambda c: c.reserved_bytes)
    activations = least.peak_parts.get("activations", 0) / GIB
    without = "nothing fits" if not fitting else "only configurations that offload fit"
    return (
        f"parallel.cp planned: without it {without}; the least planned without offload, {least.label()}, needs "
        f"{least.reserved_bytes / GIB:.1f} GiB, {activations:.1f} GiB of it activations of whole sequences "
        "(each of cp ranks holds 1/cp of every sequence)"
    )


NVME_DIR = "NVME_DIR"
"""offload.path in an offload=nvme row's command where the user gave none: a directory on each node's NVMe."""


def host_bound(candidates: list[Candidate]) -> list[Candidate]:
    """offload=cpu candidates whose devices would hold them but whose node's host cannot: nvme's cases."""
    return [
        c
        for c in candidates
        if c.choice["offload"] == OffloadTarget.cpu.value
        and c.device_fits is not False
        and c.host_fits is False
    ]


def nvme_variants(
    config: TrainConfig,
    candidates: list[Candidate],
    device_kind: str,
    world_size: int,
    rates: Rates,
    flops: float,
) -> list[Candidate]:
    """offload=nvme in place of each offload=cpu candidate whose host cannot hold its states: the same device
    plan, Adam's moments on the node's disk, the stall at plan.disk_gbps in its step time. None without
    plan.disk_gbps (the advisor measures no disk; `nvme_note` says so) or where advise.offload leaves nvme out."""
    if OffloadTarget.nvme not in config.advise.offload or config.plan.disk_gbps is None:
        return []
    path = None if config.offload.path is not None else NVME_DIR
    options = [{**c.choice, "offload": "nvme", "offload.path": path} for c in host_bound(candidates)]
    variants = (
        evaluate(config, choice, device_kind, world_size, rates, flops)
        for choice in options
        if composes(config, choice)  # the composition table refuses nvme beside tensor parallelism
    )
    return [v for v in variants if v is not None]


def nvme_note(config: TrainConfig, candidates: list[Candidate]) -> str:
    """Said once: why no offload=nvme row where one would have been offered, or what nvme rows are."""
    if OffloadTarget.nvme not in config.advise.offload:
        return ""
    if config.plan.disk_gbps is None:
        bound = len(host_bound(candidates))
        if not bound:
            return ""
        return (
            f"; offload=nvme not offered: {bound} offload=cpu configurations fit their devices but not the node's "
            "host, and nvme's disk stall needs the disk's bandwidth: give plan.disk_gbps (GB/s per node)"
        )
    if any(c.choice["offload"] == "nvme" for c in candidates):
        return (
            "; offload=nvme: where a node's host cannot hold offload=cpu's states, Adam's moments on its disk at "
            f"plan.disk_gbps={config.plan.disk_gbps:g}, ranked after every configuration that needs no disk"
        )
    return ""


SCREEN_FREE = ("zero", "checkpointing")
"""What varies inside a screened group: the ZeRO stage and activation checkpointing, each ordered by memory."""


def evaluate_screened(
    config: TrainConfig,
    options: list[dict[str, Any]],
    device_kind: str,
    world_size: int,
    rates: Rates,
    flops: float,
) -> tuple[list[Candidate], list[dict[str, Any]]]:
    """Plan and time every option, but where a group's least-memory member does not fit the device, not the
    others. A group is the options that differ only in the ZeRO stage and activation checkpointing; its least
    is zero=stage3 with checkpointing=full, which hold the least of each (stage3 shards what the others hold
    whole; full checkpointing saves only each block's input, the other modes more), so what does not fit there
    fits nowhere in the group. The planned candidates, and the options not planned."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for option in options:
        groups.setdefault(tuple(v for k, v in option.items() if k not in SCREEN_FREE), []).append(option)
    evaluated: list[Candidate] = []
    unplanned: list[dict[str, Any]] = []
    for members in groups.values():
        least = next((m for m in members if (m["zero"], m["checkpointing"]) == ("stage3", "full")), None)
        first = None if least is None else evaluate(config, least, device_kind, world_size, rates, flops)
        if first is not None and first.device_fits is False and len(members) > 1:
            evaluated.append(first)
            unplanned += [m for m in members if m is not least]
            continue
        for member in members:
            c = first if member is least else evaluate(config, member, device_kind, world_size, rates, flops)
            evaluated += [c] if c is not None else []
    return evaluated, unplanned


def compressed_variants(
    config: TrainConfig,
    candidates: list[Candidate],
    device_kind: str,
    world_size: int,
    rates: Rates,
    flops: float,
) -> list[Candidate]:
    """advise.compression's variants of every fitting stage0/1 candidate whose step waits on the network
    (exposed time there): fewer gradient bytes (trainer/plan/comm.py) at the price of another optimisation. The
    hooks' own compute (PowerSGD's matmuls, TopK's selection) is not in the step time."""
    methods = [m for m in config.advise.compression if m != Compression.none]
    waiting = [
        c
        for c in candidates
        if c.choice["zero"] in (Stage.stage0.value, Stage.stage1.value)
        and c.exposed_by_link().get("network", 0) > 0
    ]
    variants = (
        evaluate(config, {**c.choice, "zero.compression": m.value}, device_kind, world_size, rates, flops)
        for c in waiting
        for m in methods
    )
    return [v for v in variants if v is not None]


def rank(candidates: list[Candidate], tolerance: float) -> list[Candidate]:
    """What fits, best first: the exact candidates whose predicted tokens/s lie within `tolerance` (the
    model's error, Rates.tie_tolerance) of the fastest exact one are a tie, ordered by fewer moving parts,
    then smaller reserved memory, then speed, and marked; the rest by speed, compressed ones (marked `~`)
    among them; then, ranked alike, what fits only with Adam's moments on disk (offload=nvme: a disk that
    wears and a step bound to it); then what does not fit, smallest first."""
    fitting = [c for c in candidates if c.fits is not False]
    refused = sorted((c for c in candidates if c.fits is False), key=lambda c: c.reserved_bytes)
    on_disk = [c for c in fitting if c.disk_bytes]
    in_memory = [c for c in fitting if not c.disk_bytes]
    return rank_fitting(in_memory, tolerance) + rank_fitting(on_disk, tolerance) + refused


def rank_fitting(fitting: list[Candidate], tolerance: float) -> list[Candidate]:
    """Candidates that fit, best first (`rank`)."""
    if not fitting:
        return []
    exact = [c for c in fitting if not c.lossy] or fitting
    best = max(c.tokens_per_s for c in exact)
    tied = [c for c in exact if c.tokens_per_s >= best * (1 - tolerance)]
    tied.sort(key=lambda c: (len(c.moving_parts()), c.reserved_bytes, -c.tokens_per_s))
    in_tie = {id(c) for c in tied}
    if len(tied) > 1:
        tied = [dataclasses.replace(c, tie=True) for c in tied]
    rest = sorted(
        (c for c in fitting if id(c) not in in_tie),
        key=lambda c: (-c.tokens_per_s, c.reserved_bytes),
    )
    return tied + rest


# ----------------------------------------------------------------------------- what the user reads


def command_args(base_overrides: list[str], candidate: Candidate) -> list[str]:
    """The overrides that run a candidate: the user's, less the advisor's own, plus the choice."""
    kept = [
        o
        for o in base_overrides
        if split_override(o)[0] not in CHOSEN_KEYS
        and split_override(o)[0].split(".")[0] not in ADVISE_ONLY_KEYS
    ]
    return [*kept, *candidate.overrides()]


def routing_note(config: TrainConfig, candidates: list[Candidate]) -> str:
    """A mixture of experts: the routing every row's memory was planned for, and where no candidate with
    parallel.ep fits, the one that needs the least (expert parallelism refuses offload: the composition table)."""
    m = config.model
    note = (
        f"routing: planned at moe.imbalance={config.moe.imbalance:g} (the busiest expert's tokens over the mean; "
        f"1 is balanced) for {m.n_experts} experts, top_k={m.top_k}; a run logs what its routers do "
        "(moe/imbalance_max): plan again with that"
    )
    experts = [c for c in candidates if c.choice.get("parallel.ep")]
    if not experts or any(c.device_fits is not False for c in experts):
        return note
    least = min(experts, key=lambda c: c.reserved_bytes)
    return f"{note}; no parallel.ep candidate fits: the least, {least.label()}, needs {least.reserved_bytes / GIB:.1f} GiB"


def command_line(base_overrides: list[str], candidate: Candidate) -> str:
    return shlex.join(["python", "-m", "trainer", *command_args(base_overrides, candidate)])


def format_advice(
    config: TrainConfig,
    candidates: list[Candidate],
    rates: Rates,
    base: list[str],
    world_size: int,
    memory: str,
    unplanned: int = 0,
    context: str = "",
) -> str:
    fitting = [c for c in candidates if c.fits is not False]
    reserved = "reserved" if any(c.reserved_bytes != c.peak_bytes for c in candidates) else "peak"
    lines = [
        f"advice: model={config.model.name} global_batch={config.global_batch} seq_len={config.seq_len} "
        f"precision={config.precision.name} on {world_size} ranks; {len(fitting)} of {len(candidates)} configurations fit "
        f"with {config.advise.headroom:.0%} headroom on {reserved} memory ({memory}){host_note(candidates)}"
        f"{nvme_note(config, candidates)}"
        f"{unplanned_note(unplanned)}{fp8_summary(config)}",
        f"rates: {rates.source}",
        *([context] if context else []),
        *([routing_note(config, candidates)] if config.model.is_moe else []),
        f"{'#':>4} {'configuration':<72} {reserved + ' GiB':>12} {'host GiB':>9} {'tokens/s':>12} {'MFU %':>6} "
        f"{'exposed s intra/net':>20} {'bubble':>6}  limited by",
    ]
    for i, c in enumerate(fitting[: config.advise.top], 1):
        mfu = "-" if c.mfu_pct is None else f"{c.mfu_pct:.1f}"
        lines.append(
            f"{i:>3}{'=' if c.tie else ' '} {c.label():<72} {c.reserved_bytes / GIB:>12.2f} {c.host_bytes / GIB:>9.1f} "
            f"{c.tokens_per_s:>12,.0f} {mfu:>6} {exposed_cell(c):>20} {bubble_cell(c):>6}  {c.limiter}{c.numerics_note()}"
            f"{c.disk_note()}"
        )
    if any(c.tie for c in fitting[: config.advise.top]):
        lines.append(
            f"    =: within the model's error ({rates.tie_tolerance:.1%}) of the fastest, a tie: ranked by fewer "
            "moving parts (offload, hpZ, HSDP, keep, bf16 reduction, TP, CP), then smaller reserved memory, then speed"
        )
    if any(c.lossy for c in fitting[: config.advise.top]):
        lines.append(
            "    ~<method>: zero.compression, fewer gradient bytes but another optimisation (the loss after N steps "
            "differs: docs/communication.md); never in the tie, whatever its speed; its own compute is not timed"
        )
    if any(c.choice["grad_accum"] > 1 for c in fitting[: config.advise.top]):
        lines.append(
            "    reduce=<dtype>/mb: zero.reduce_every=micro_batch, every micro-batch reduces and only the gradient "
            "shard is held between them; /step: one reduction per step, a full gradient held in between"
        )
    if any(c.choice.get("zero.reshard_after_backward") is False for c in fitting[: config.advise.top]):
        lines.append(
            "    keep: zero.reshard_after_backward=false, parameters stay unsharded from one micro-batch's backward "
            "to the next forward: one forward's all-gathers per step instead of grad_accum"
        )
    if any(c.choice.get("offload.path") == NVME_DIR for c in fitting[: config.advise.top]):
        lines.append(
            f"    offload.path={NVME_DIR}: a directory on each node's local NVMe, for Adam's moments "
            '(docs/memory_plan.md, "offload=nvme")'
        )
    if not fitting and candidates:
        smallest = min(candidates, key=lambda c: c.reserved_bytes)
        lines.append(
            f"    nothing fits: the smallest is {smallest.reserved_bytes / GIB:.1f} GiB {reserved} ({smallest.label()}); "
            f"{nothing_fits_cause(candidates)}; or advise.headroom"
        )
    lines += pipeline_rows(candidates, reserved)
    lines += [f"{i:>3}: {command_line(base, c)}" for i, c in enumerate(fitting[: config.advise.top], 1)]
    return "\n".join(lines + fp8_lines(config, fitting[:FP8_ROWS], base))


FP8_ROWS = 3
"""How many of the best bf16 candidates get fp8 rows."""


def fp8_considered(config: TrainConfig) -> bool:
    """fp8 rows are for a bf16 job planned for a named accelerator."""
    return (
        config.plan.accelerator is not None
        and config.precision.compute_dtype == DType.bfloat16
        and not config.precision.is_fp8
    )


def fp8_summary(config: TrainConfig) -> str:
    if not fp8_considered(config):
        return ""
    name = advisor_accelerator(config.plan.accelerator)  # type: ignore[arg-type]
    if not offers_fp8(name):
        return f"; fp8: none offered, {config.plan.accelerator} has {NO_FP8_REASON}"
    return f"; fp8: predicted for the {FP8_ROWS} best below (compiled, torchao Float8Linear)"


def fp8_predictions(config: TrainConfig, candidate: Candidate) -> list[Fp8Prediction]:
    name = advisor_accelerator(config.plan.accelerator)  # type: ignore[arg-type]
    local = tp_local_model(config.model, candidate.choice.get("parallel.tp") or 1)
    gain = 1.0 if config.compile else COMPILE_SPEEDUP.get(ACCELERATORS[name].family, 1.0)
    return predict_fp8(
        local, config.seq_len, candidate.choice["micro_batch"], name, candidate.step, gain, config.model
    )


def fp8_lines(config: TrainConfig, best: list[Candidate], base: list[str]) -> list[str]:
    """fp8 rows for the best bf16 candidates: each recipe's predicted tokens/s and its command (compiled,
    as the published points were), or, where it does not pay, that it does not."""
    if not fp8_considered(config) or not offers_fp8(advisor_accelerator(config.plan.accelerator)):  # type: ignore[arg-type]
        return []
    lines = [
        f"fp8: predicted from the GEMM shapes, fitted to torchtitan's Llama-3.1-8B points on 8 H100 within "
        f"{FIT_ERROR_PP} percentage points (trainer/advise/fp8.py); x: over the same in bf16, both compiled; "
        "tokens/s compiled (compile's published gain where the row above is eager, trainer/advise/throughput.py); "
        "memory as bf16 (torchao keeps no fp8 casts; under fp8_all_gather an upper bound: its unsharded weights take 1 byte)"
    ]
    for i, c in enumerate(best, 1):
        for p in fp8_predictions(config, c):
            if not p.pays:
                lines.append(
                    f"{i:>3} {p.recipe:<10} does not pay: x{p.speedup:.3f} (M={c.choice['micro_batch'] * config.seq_len} "
                    "tokens per GEMM: the casts cost more than the fp8 GEMMs save)"
                )
                continue
            gather = p.recipe == "tensorwise" and c.choice["zero"] in ("stage2", "stage3")
            refused = fp8_refusal(config, c, p.recipe, gather)
            if refused is not None:
                lines.append(f"{i:>3} {p.recipe:<10} x{p.speedup:.3f}, but refused here: {refused}")
                continue
            extra = ["precision=fp8", f"precision.fp8_recipe={p.recipe}"]
            extra += ["precision.fp8_all_gather=true"] * gather + ["compile=true"]
            args = [a for a in command_args(base, c) if split_override(a)[0] not in ("precision", "compile")]
            lines.append(
                f"{i:>3} {p.recipe:<10} x{p.speedup:.3f} {c.tokens_per_s * p.tokens_factor:>12,.0f} tokens/s: "
                + shlex.join(["python", "-m", "trainer", *args, *extra])
            )
    return lines


def fp8_refusal(config: TrainConfig, candidate: Candidate, recipe: str, gather: bool) -> str | None:
    """The composition table's line refusing a candidate's fp8 row (precision=fp8, compile=true), else None."""
    chosen = configure(config, candidate.choice, check=False)
    precision = unchecked_replace(
        chosen.precision, name="fp8", fp8_recipe=Fp8Recipe(recipe), fp8_all_gather=gather
    )
    return first_refusal(unchecked_replace(chosen, precision=precision, compile=True))


def nothing_fits_cause(candidates: list[Candidate]) -> str:
    """What binds when nothing fits: the node's host where some candidate fits its devices, else the
    largest part of the smallest candidate's peak (trainer/plan/refusal.py `cause_of`)."""
    host_bound = [c for c in candidates if c.device_fits is not False and c.host_fits is False]
    if host_bound:
        least = min(host_bound, key=lambda c: c.host_bytes)
        return cause_of(least.peak_parts, True, False, least.host_bytes)
    smallest = min(candidates, key=lambda c: c.reserved_bytes)
    return cause_of(smallest.peak_parts, False, smallest.host_fits, smallest.host_bytes)


def unplanned_note(unplanned: int) -> str:
    """The configurations not planned: their least-memory sibling does not fit (evaluate_screened)."""
    if not unplanned:
        return ""
    return (
        f"; {unplanned} more not planned: the same with zero=stage3 and checkpointing=full, which hold less, "
        "does not fit"
    )


def host_note(candidates: list[Candidate]) -> str:
    """Why candidates that fit their devices are out: their node's host memory (trainer/plan/host.py)."""
    over = [c for c in candidates if c.host_fits is False]
    if not over:
        return ""
    least = min(over, key=lambda c: c.host_bytes)
    offload = sum(c.choice["offload"] == "cpu" for c in over)
    nvme = sum(c.choice["offload"] == "nvme" for c in over)
    offload_text = f"{offload} with offload=cpu" + (f", {nvme} with offload=nvme" if nvme else "")
    return (
        f"; {len(over)} need more host memory than a node has ({offload_text}; the least "
        f"{least.host_bytes / GIB:.1f} GiB per node, {least.label()})"
    )


def pipeline_rows(candidates: list[Candidate], reserved: str) -> list[str]:
    """The best candidate of each pipeline depth and schedule, whether or not it made the table: the fastest
    that fits, else the smallest; with its bubble and the time its stages' sends take."""
    best: dict[tuple[int, str], Candidate] = {}
    for c in candidates:
        key = (c.choice.get("parallel.pp"), c.choice.get("parallel.pp_schedule"))
        if key[0] is None:
            continue
        held = best.get(key)
        if held is None or pipeline_order(c) < pipeline_order(held):
            best[key] = c
    if not best:
        return []
    lines = [
        "pipeline candidates (parallel.pp; bubble: the share of the step each stage waits), best of each:"
    ]
    for (pp, schedule), c in sorted(best.items()):
        fits = {True: "fits", False: "does not fit", None: "fit unknown"}[c.fits]
        lines.append(
            f"    pp={pp} {schedule:<16} bubble {c.step.bubble:6.1%}  sends {c.step.p2p_s:.3g} s  {c.tokens_per_s:>10,.0f} tokens/s  "
            f"{c.reserved_bytes / GIB:8.1f} GiB {reserved}, {fits}  ({c.label()})"
        )
    return lines


def pipeline_order(c: Candidate) -> tuple[bool, float]:
    """Fitting first, by speed; then by memory."""
    return (c.fits is False, c.reserved_bytes if c.fits is False else -c.tokens_per_s)


def bubble_cell(c: Candidate) -> str:
    """A pipeline's bubble, the share of the step each stage waits (`-`: no pipeline)."""
    return f"{c.step.bubble:.1%}" if c.choice.get("parallel.pp") is not None else "-"


def exposed_cell(c: Candidate) -> str:
    """Exposed communication per tier: inside a node / across the network (`-`: no collective there)."""
    exposed = c.exposed_by_link()
    return "/".join(f"{exposed[link]:.2f}" if link in exposed else "-" for link in LINKS)


def advice_json(
    config: TrainConfig,
    candidates: list[Candidate],
    rates: Rates,
    base: list[str],
    world_size: int,
    memory: str,
) -> dict[str, Any]:
    return {
        "model": config.model.name,
        "global_batch": config.global_batch,
        "seq_len": config.seq_len,
        "precision": config.precision.name,
        "world_size": world_size,
        "headroom": config.advise.headroom,
        "device_memory": memory,
        "rates": {
            **dataclasses.asdict(rates),
            "compute_flops": {str(k): v for k, v in rates.compute_flops.items()},
        },
        **({"fp8": fp8_json(config, candidates)} if fp8_considered(config) else {}),
        "candidates": [
            {
                **c.choice,
                "fits": c.fits,
                "predicted_peak_gib": c.peak_bytes / GIB,
                "predicted_reserved_gib": c.reserved_bytes / GIB,
                "tie": c.tie,
                "moving_parts": list(c.moving_parts()),
                "host_gib_per_node": c.host_bytes / GIB,
                "host_fits": c.host_fits,
                "predicted_tokens_per_s": c.tokens_per_s,
                "predicted_mfu_pct": c.mfu_pct,
                "predicted_step_s": c.step.step_s,
                "compute_s": c.step.compute_s,
                "recompute_s": c.step.recompute_s,
                "exposed_comm_s": c.step.exposed_comm_s,
                "wire_s": c.step.wire_s,
                "exposed_by_link_s": c.exposed_by_link(),
                "wire_by_link_s": {link: t.wire_s for link, t in c.step.links.items()},
                "optimizer_s": c.step.optimizer_s,
                "offload_s": c.step.offload_s,
                "disk_s": c.step.disk_s,
                "disk_bytes_per_node_per_step": c.disk_bytes,
                "bubble": c.step.bubble,
                "bubble_s": c.step.bubble_s,
                "p2p_s": c.step.p2p_s,
                "tp_s": c.step.tp_s,
                "limited_by": c.limiter,
                "command": command_line(base, c),
            }
            for c in candidates
        ],
    }


def fp8_json(config: TrainConfig, candidates: list[Candidate]) -> dict[str, Any]:
    name = advisor_accelerator(config.plan.accelerator)  # type: ignore[arg-type]
    if not offers_fp8(name):
        return {"offered": False, "why": f"{config.plan.accelerator} has {NO_FP8_REASON}"}
    best = [c for c in candidates if c.fits is not False][:FP8_ROWS]
    return {
        "offered": True,
        "fit_error_pp": FIT_ERROR_PP,
        "rows": [
            {"configuration": c.label(), "recipe": p.recipe, "speedup": p.speedup, "pays": p.pays}
            for c in best
            for p in fp8_predictions(config, c)
        ],
    }


def run_advice(
    config: TrainConfig, out_dir: Path, device_kind: str, world_size: int, base_overrides: list[str]
) -> list[Candidate]:
    """mode=advise: print the ranked table, write advice.json, verify the best if asked (advise.accelerators
    runs trainer/advise/accelerators.py instead: trainer/job.py `advise_job`)."""
    advice = advise_all(config, device_kind, world_size)
    candidates, rates, unplanned = advice.candidates, advice.rates, len(advice.unplanned)
    memory = device_memory(
        config.plan, config.device_memory_gib, device_kind, world_size, config.nodes
    ).source
    text = format_advice(
        config, candidates, rates, base_overrides, world_size, memory, unplanned, advice.context_note
    )
    print(text, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = advice_json(config, candidates, rates, base_overrides, world_size, memory)
    record["unplanned"] = unplanned
    record["context_parallel"] = advice.context_note or None
    record["moe_imbalance"] = config.moe.imbalance if config.model.is_moe else None
    path = out_dir / "advice.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"advice.json: {path}", flush=True)
    if config.advise.verify:
        fitting = [c for c in candidates if c.fits is not False][: config.advise.verify]
        proposals = [
            Proposal(c.label(), command_args(base_overrides, c), c.tokens_per_s, c.peak_bytes)
            for c in fitting
        ]
        record["verify"] = verify(proposals, config.advise.verify_steps, out_dir)
        path.write_text(json.dumps(record, indent=2) + "\n")
    return candidates
