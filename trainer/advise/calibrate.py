"""The rates the advisor turns FLOPs and bytes into seconds with: measured on this host, or from a table.

Two sources, and the advisor's table says which one it used:

- **This host** (no `plan.accelerator`): a micro-benchmark run once by `world_size` real ranks
  started with torch's elastic launcher, each with the threads a training rank would get
  (trainer/world.py splits the cores): the matmul rate in the compute dtype at the MLP's shape
  for each candidate micro-batch, AdamW's update rate (torch.optim.AdamW itself), and the bus
  bandwidth of gloo's all-reduce and all-gather between those ranks. The figures are cached as
  JSON under `advise.cache_dir` (default ~/.cache/zerolab/) with the date, the host name and
  everything they depend on; `advise.recalibrate=true` measures again.
- **A named accelerator** (`plan.accelerator=h100` ...): the `ACCELERATORS` table below, a
  datasheet figure and an efficiency factor for each rate; every row names its sources, and the
  efficiency factors are assumptions (no such device here to measure), stated as such.

Bus bandwidth is nccl-tests' convention: the bytes one rank moves on the wire per second, so a
collective of P payload bytes takes P·f/busbw with f = 2(n-1)/n for a ring all-reduce and
(n-1)/n for all-gather, reduce-scatter and a broadcast of shards (trainer/advise/predict.py).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError, DType, ModelConfig, TrainConfig
from trainer.plan import INTRA_NODE, NETWORK
from trainer.units import MIB
from trainer.world import usable_cores

GB = 1e9


@dataclass(frozen=True)
class Rates:
    """Per-rank rates of one device kind; `source` is printed with every advice."""

    source: str
    peak_flops: float
    """The MFU denominator: the datasheet's dense peak, or on this host the best measured matmul rate."""
    compute_flops: dict[int, float]
    """Achieved FLOP/s of one rank's forward and backward by tokens per micro-batch; key 0: any."""
    bus_bytes_per_s: dict[str, float]
    """Bus bandwidth per collective (all_reduce, all_gather; reduce_scatter and broadcast use all_gather's),
    and where measured in bf16 as well (`all_reduce_bf16`, `all_gather_bf16`); else bf16 runs at fp32's."""
    adam_params_per_s: float
    """Parameters AdamW updates per second on one rank."""
    overlap: bool
    """Collectives run beside compute (NCCL's own streams); False on CPU, where gloo's threads share the cores."""
    offload_bytes_per_s: float | None = None
    """Host-device link (PCIe) for offload=cpu; None where there is no device memory to offload from."""
    host_adam_params_per_s: float | None = None
    """AdamW on the host CPU (offload=cpu steps the optimizer there)."""
    link_bus_bytes_per_s: dict[str, float] | None = None
    """Bus bandwidth of each link (trainer/plan/groups.py: intra-node, network), for a collective by the link
    its process group crosses; None: every group at `bus_bytes_per_s` (this host: one link, measured).
    The network's is a collective's over whole nodes; a group with fewer of a node's ranks gets its share
    (`group_bus_bytes_per_s`)."""
    host_memory_bytes_per_s: float | None = None
    """The host's memory rate for offload=cpu's gradient accumulation on the CPU (None: HOST_MEMORY_BYTES_PER_S)."""
    gpus_per_node: int = 1
    accelerator: str | None = None
    """The ACCELERATORS key the rates are for (None: this host, measured); a precision=fp8 job's GEMMs are
    timed on its fp8 tensor cores (trainer/advise/fp8.py)."""
    gemm_shaped: bool = False
    """Whether `compute_flops` follow the model's GEMM shapes (a named accelerator: the fitted efficiency times
    trainer/advise/throughput.py's shape factor), so that a TP rank's narrower GEMMs are rated by their own."""
    tie_tolerance: float = 0.10
    """How far apart two predicted tokens/s may be and still be a tie (fractions of the faster): a named
    accelerator's error between two configurations of one model (throughput.FIT_ERROR); on this host the 10% its ranking is held to
    (checks/advisor_accuracy.py: the top pick within 10% of the fastest measured point)."""

    def group_bus_bytes_per_s(self, link: str, ranks_per_node: int) -> float:
        """A group's bus bandwidth on its link: across nodes, `ranks_per_node` of the node's ranks use
        that share of its NICs (the other groups of the node run at the same time on the rest)."""
        assert self.link_bus_bytes_per_s is not None
        bus = self.link_bus_bytes_per_s[link]
        if link == NETWORK:
            share = min(1.0, ranks_per_node / self.gpus_per_node)
            bus = min(self.link_bus_bytes_per_s[INTRA_NODE], bus * share)
        return bus

    def flops_at(self, rows: int) -> float:
        """The rate measured at these tokens per micro-batch, else at the nearest measured."""
        if rows in self.compute_flops:
            return self.compute_flops[rows]
        return self.compute_flops[min(self.compute_flops, key=lambda measured: abs(measured - rows))]


# ----------------------------------------------------------------------------- named accelerators


@dataclass(frozen=True)
class AcceleratorSpec:
    datasheet: str  # the device of trainer/devices.py whose dense peaks these are
    family: str  # the throughput.FAMILY_EFFICIENCY fit its matmuls follow
    nvlink_bus_gbps: float  # nccl-tests bus bandwidth inside a node (GB/s per rank, NVLink/NVSwitch)
    nics_per_node: int  # the node's network cards, one rail each
    nic_bus_gbps: float  # nccl-tests bus bandwidth one NIC carries between nodes (GB/s)
    gpus_per_node: int
    pcie_gbps: float  # host link per direction (offload)
    hbm_tbps: float  # memory bandwidth (AdamW is memory-bound)
    sources: str
    unvalidated: str = ""
    """Why the rates' error is unknown (no published run zerolab can express on this part); "" where the family's
    fit was validated on published runs (throughput.FIT_ERROR)."""

    @property
    def network_bus_gbps(self) -> float:
        """A collective over whole nodes: every NIC of the node carries its own channels (rings or trees),
        so the bus bandwidth is the node's NICs together, capped by the NVLink the rings cross inside."""
        return min(self.nvlink_bus_gbps, self.nics_per_node * self.nic_bus_gbps)


# Dense peaks are trainer/devices.py's datasheet figures (the MFU denominator of every run; fp32
# runs at the TF32 peak where precision.tf32 allows it). A step's matmul efficiency is fitted to
# published runs (trainer/advise/throughput.py: one figure per family, times a GEMM-shape factor).
# The SXM H100/H200 (700 W) take the fit of the 500 W HBM2e H100 torchtitan measured, the A100 40GB
# the 80GB's: no published run zerolab can express exists for them (a lower bound for the 700 W
# parts).
#
# Bus bandwidth, in nccl-tests' convention (the time of a collective is payload x f / busbw), as NCCL
# achieves it rather than a link's datasheet rate:
# - Across nodes NCCL runs its channels over every NIC of a rail-optimised node at once, so a ring or
#   tree over whole nodes moves the node's NICs together: NVIDIA measures 192 GB/s all-reduce busbw
#   between DGX A100s with 8 x 200 Gb/s HDR (NVIDIA/nccl#812, 2023-03-31: 24 GB/s a NIC), and the same
#   ~24 GB/s with one HDR NIC for the node's 8 GPUs (NVIDIA/nccl#412, 2023-04-24); 4 HDR NICs reach
#   84.8-96 GB/s (NVIDIA/nccl-tests#119); a 400 Gb/s NDR NIC 46-48 GB/s (NVIDIA/nccl-tests#290,
#   2025-03-03), 8 of them ~350 GB/s over 248 H200 nodes (NVIDIA/nccl-tests#283). A process group with
#   g of a node's ranks shares the NICs with the node's other groups: g / gpus_per_node of them each
#   (an HSDP replicate group, one rank a node, runs on its rank's rail alone).
# - Inside a node: 232.5 GB/s all-reduce busbw on 8 A100 SXM over NVSwitch (NVIDIA/nccl-tests#175),
#   0.78 of NVLink 3's 300 GB/s a direction; H100/H200 NVLink 4 at the same 0.8 of 450 GB/s, 360 GB/s
#   (NVLink SHARP lifts all-reduce to 476 GB/s, NVIDIA/nccl-tests#290, but FSDP's all-gathers and
#   reduce-scatters run as rings). AdamW at 0.8 of HBM is an assumption.
# `plan.network_bus_gbps` / `plan.nvlink_bus_gbps` replace both with a cluster's own nccl-tests figures.
ACCELERATORS: dict[str, AcceleratorSpec] = {
    "h100": AcceleratorSpec(
        "h100-sxm",
        "h100-hbm2e",
        0.8 * 450,
        8,
        47,
        8,
        64,
        3.35,
        "NVIDIA H100 SXM5 datasheet (dense bf16 989 TFLOPS, NVLink 4 900 GB/s bidirectional, HBM3 3.35 TB/s, "
        "PCIe Gen5 128 GB/s bidirectional); DGX H100: 8 x 400 Gb/s ConnectX-7 NICs, one per GPU",
    ),
    "h200": AcceleratorSpec(
        "h200",
        "h100-hbm2e",
        0.8 * 450,
        8,
        47,
        8,
        64,
        4.8,
        "NVIDIA H200 SXM datasheet (the H100's compute and NVLink 4, HBM3e 4.8 TB/s); DGX H200: 8 x 400 Gb/s NICs",
    ),
    "a100-80gb": AcceleratorSpec(
        "a100-80gb",
        "a100",
        232,
        8,
        24,
        8,
        32,
        2.04,
        "NVIDIA A100 SXM4 80GB datasheet (dense bf16 312 TFLOPS, NVLink 3 600 GB/s bidirectional, HBM2e 2.04 TB/s, "
        "PCIe Gen4 64 GB/s bidirectional); DGX A100: 8 x 200 Gb/s HDR NICs, one per GPU",
    ),
    "a100-40gb": AcceleratorSpec(
        "a100-40gb",
        "a100",
        232,
        8,
        24,
        8,
        32,
        1.56,
        "NVIDIA A100 SXM4 40GB datasheet (as the 80GB, HBM2 1.56 TB/s); DGX A100: 8 x 200 Gb/s HDR NICs",
    ),
    "h100-hbm2e": AcceleratorSpec(
        "h100-hbm2e",
        "h100-hbm2e",
        0.8 * 450,
        8,
        47,
        8,
        64,
        2.4,
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md lines 11-15 (Grand Teton: 8 H100 per host on "
        "NVLink, 96GB HBM2e at 2.4 TB/s, 500 W, 400 Gb/s RDMA per GPU); dense peaks of the SXM part",
    ),
    # B200 (HGX/DGX B200, 1,000 W), each figure from NVIDIA's datasheets:
    # - dense bf16 2,250 TFLOPS, dense fp8 4,500 TFLOPS per GPU: the HGX B200 datasheet's 8-GPU figures with
    #   sparsity (bf16 36 PFLOPS, fp8 72 PFLOPS) halved and divided by 8 (trainer/devices.py's 2250.0; the
    #   per-GPU table at glennklockwood.com/garden/processors/B200 lists the same, "HGX variant ... 1,000 W");
    # - HBM3e 8 TB/s per GPU: DGX B200 "64 TB/s HBM3e bandwidth" over its 8 GPUs (nvidia.com/en-us/data-center/dgx-b200/);
    #   memory 1,440 GB / 8 = 180 GB (nvidia-smi: 183,359 MiB, trainer/devices.py);
    # - NVLink 5: 1.8 TB/s bidirectional per GPU (DGX B200 "14.4 TB/s aggregate NVLink bandwidth" / 8), 900 GB/s a
    #   direction, of which NCCL's ring bus bandwidth is taken at H100's 0.8 (an assumption: no nccl-tests B200
    #   figure was found), 720 GB/s;
    # - network: DGX B200's 8 single-port ConnectX-7 at 400 Gb/s, one per GPU, at the NDR NIC's measured
    #   47 GB/s (NVIDIA/nccl-tests#290); host PCIe Gen5 (DGX B200's Xeon Platinum 8570 hosts), 64 GB/s a direction.
    # The matmul efficiency is the h100-hbm2e fit's (Hopper's): no published run zerolab can express exists on
    # B200, so its tokens/s are unvalidated. The one published cross-check, Megatron Bridge's Llama 3 8B FP8 on
    # 8 GPUs (B200 30,624 tokens/s per GPU, H100 14,451; NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md,
    # 25.11), is another framework: tests/unit/advise/test_accelerators.py holds the predicted H100/B200 ratio
    # to it, not B200's absolute tokens/s.
    "b200": AcceleratorSpec(
        "b200",
        "h100-hbm2e",
        0.8 * 900,
        8,
        47,
        8,
        64,
        8.0,
        "NVIDIA HGX B200 datasheet (dense bf16 2,250 TFLOPS and fp8 4,500 per GPU: the sparse 8-GPU 36 / 72 PFLOPS "
        "halved), DGX B200 (8 GPUs, 1,440 GB HBM3e, 64 TB/s, NVLink 5 14.4 TB/s aggregate: 1.8 TB/s a GPU "
        "bidirectional; 8 x 400 Gb/s ConnectX-7)",
        unvalidated="no published training run zerolab can express on B200; the matmul efficiency is Hopper's "
        "h100-hbm2e fit and NCCL's share of NVLink 5 H100's 0.8, both assumed",
    ),
}
ADAM_BYTES_PER_PARAM = 28  # fused/foreach AdamW reads fp32 param, grad, m, v and writes param, m, v
HBM_EFFICIENCY = 0.8
HOST_ADAM_PARAMS_PER_S = 5e8  # assumption: torch's CPU AdamW on a GPU server's host, for offload=cpu
HOST_MEMORY_BYTES_PER_S = (
    1e10  # assumption: a rank's CPU add (read two fp32, write one) on a GPU server's host
)


def advisor_accelerator(name: str) -> str:
    """The ACCELERATORS key a `plan.accelerator` name means (`h100-sxm` is `h100`); ConfigError, in one
    line naming the rates that are missing, when the table lacks it."""
    key = {"h100-sxm": "h100"}.get(name.strip().lower(), name.strip().lower())
    if key not in ACCELERATORS:
        raise ConfigError(
            f"mode=advise has no rates for plan.accelerator={name}: missing its matmul efficiency (no published "
            f"training run to fit, trainer/advise/throughput.py) and its NVLink, network, PCIe and HBM rates "
            f"(trainer/advise/calibrate.py ACCELERATORS); it has them for {', '.join(ACCELERATORS)}"
        )
    return key


def accelerator_rates(
    name: str,
    compute_dtype: DType,
    world_size: int,
    *,
    model: ModelConfig | None = None,
    seq_len: int = 0,
    micro_batches: list[int] | None = None,
    tf32: bool = True,
    network_bus_gbps: float | None = None,
    nvlink_bus_gbps: float | None = None,
) -> Rates:
    """The table's rates for `world_size` GPUs: NVLink within a node, the node's NICs beyond one (a
    cluster's own figures where `network_bus_gbps` / `nvlink_bus_gbps` are given: plan.*); the matmul
    rate per micro-batch from the fitted efficiency and the model's GEMM shapes (trainer/advise/throughput.py;
    without a model, the family's large-GEMM figure)."""
    from trainer.advise.throughput import FAMILY_EFFICIENCY, FIT_ERROR, shape_factor, validation_note
    from trainer.plan import model_shape

    name = advisor_accelerator(name)
    spec = ACCELERATORS[name]
    dense = dense_peak_flops(spec.datasheet, compute_dtype, tf32)
    efficiency = FAMILY_EFFICIENCY[spec.family]
    nvlink = nvlink_bus_gbps or spec.nvlink_bus_gbps
    network = network_bus_gbps or min(nvlink, spec.network_bus_gbps)  # a measured figure as it is
    inside = world_size <= spec.gpus_per_node
    if model is None:
        compute = {0: dense * efficiency}
    else:
        compute = {
            mb * seq_len: dense * efficiency * shape_factor(model, mb * seq_len, seq_len)
            for mb in micro_batches or [1]
        }
    dtype = "tf32" if compute_dtype == DType.float32 and tf32 else compute_dtype.value
    validation = "" if model is None else validation_note(model_shape(model).num_params)
    expected = f"unvalidated: {spec.unvalidated}" if spec.unvalidated else str(FIT_ERROR[spec.family])
    return Rates(
        source=(
            f"published fit: {name}, dense {dtype} {dense / 1e12:.1f} TFLOPS x {efficiency} ({spec.family} fit, "
            f"expected error: {expected}{validation}) x the GEMM-shape factor; "
            f"{link_note(spec, nvlink, network, network_bus_gbps, nvlink_bus_gbps)}; sources: {spec.sources}"
        ),
        peak_flops=dense,
        compute_flops=compute,
        bus_bytes_per_s=dict.fromkeys(("all_reduce", "all_gather"), (nvlink if inside else network) * GB),
        adam_params_per_s=spec.hbm_tbps * 1e12 * HBM_EFFICIENCY / ADAM_BYTES_PER_PARAM,
        overlap=True,
        offload_bytes_per_s=spec.pcie_gbps * GB,
        host_adam_params_per_s=HOST_ADAM_PARAMS_PER_S,
        link_bus_bytes_per_s={INTRA_NODE: nvlink * GB, NETWORK: network * GB},
        gpus_per_node=spec.gpus_per_node,
        accelerator=name,
        gemm_shaped=model is not None,
        tie_tolerance=FIT_ERROR[spec.family].between,
    )


def fit_error_cell(name: str, model: ModelConfig | None = None) -> str:
    """The advisor's expected error on an accelerator, short: the family's range of tokens/s errors on its
    published validation runs (throughput.FIT_ERROR), or "unvalidated" where there are none for the part or
    for the model's size (throughput.validation_note)."""
    from trainer.advise.throughput import FIT_ERROR, validation_note
    from trainer.plan import model_shape

    spec = ACCELERATORS[advisor_accelerator(name)]
    if spec.unvalidated or (model is not None and validation_note(model_shape(model).num_params)):
        return "unvalidated"
    error = FIT_ERROR[spec.family]
    return f"{error.low:+.0%}..{error.high:+.0%}"


def link_note(
    spec: AcceleratorSpec, nvlink: float, network: float, network_set: float | None, nvlink_set: float | None
) -> str:
    """The bus bandwidths the table uses and where they come from (nccl-tests figures, calibrate.py)."""
    inside = f"plan.nvlink_bus_gbps={nvlink_set:g}" if nvlink_set else "nccl-tests"
    across = (
        f"plan.network_bus_gbps={network_set:g}"
        if network_set
        else f"{spec.nics_per_node} NICs x {spec.nic_bus_gbps:g} GB/s, nccl-tests"
    )
    return (
        f"bus bandwidth inside a node {nvlink:g} GB/s ({inside}), across nodes {network:g} GB/s a node "
        f"({across}; a group with g of a node's {spec.gpus_per_node} ranks gets g/{spec.gpus_per_node} of it)"
    )


def dense_peak_flops(datasheet: str, compute_dtype: DType, tf32: bool = False) -> float:
    """The datasheet's dense peak in the dtype the matmuls run in: fp32 runs on TF32 tensor cores
    where precision.tf32 allows it (trainer/devices.py's peak_tflops)."""
    from trainer.devices import find_accelerator, peak_tflops

    spec = find_accelerator(datasheet)
    assert spec is not None, f"{datasheet} is not in trainer/devices.py"
    peak = peak_tflops(spec, compute_dtype, tf32)
    assert peak is not None, f"{datasheet} has no dense {compute_dtype.value} peak"
    return peak * 1e12


# ----------------------------------------------------------------------------- this host, measured once


@dataclass(frozen=True)
class HostProbe:
    """What the host's rates depend on: the cache key."""

    host: str
    torch_version: str
    world_size: int
    threads: int
    dtype: str
    model: tuple[tuple[str, Any], ...]  # the ModelConfig's fields (one block is timed)
    seq_len: int
    micro_batches: tuple[int, ...]

    def cache_path(self, cache_dir: Path) -> Path:
        digest = hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return cache_dir / f"calibration-{self.host}-{digest}.json"


PAYLOAD_BYTES = 32 * MIB  # collective payload of the benchmark: large enough to be bandwidth-bound
MIN_SECONDS = 0.3  # each timed figure repeats its operation at least this long


def host_threads(world_size: int) -> int:
    """The threads each training rank takes (trainer/world.py): the usable cores split between ranks."""
    return max(1, usable_cores() // world_size)


def host_rates(config: TrainConfig, world_size: int, micro_batches: list[int]) -> Rates:
    """This host's rates from the cache, else measured now by `world_size` real ranks and cached."""
    probe = HostProbe(
        socket.gethostname(),
        torch.__version__,
        world_size,
        host_threads(world_size),
        config.precision.compute_dtype.value,
        tuple(sorted(asdict(config.model).items())),
        config.seq_len,
        tuple(sorted(set(micro_batches))),
    )
    path = probe.cache_path(Path(config.advise.cache_dir).expanduser())
    if path.is_file() and not config.advise.recalibrate:
        cached = json.loads(path.read_text())
        return rates_from_record(
            cached, f"host calibration: measured on {probe.host} {cached['date']} (cached: {path})"
        )
    print(
        f"calibrating this host: {world_size} gloo ranks x {probe.threads} threads, {probe.dtype} (once; cached in {path})",
        flush=True,
    )
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **asdict(probe),
        **measure(probe),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return rates_from_record(
        record, f"host calibration: measured on {probe.host} {record['date']} (now; cached: {path})"
    )


def rates_from_record(record: dict[str, Any], source: str) -> Rates:
    return Rates(
        source=(
            f"{source}: {record['world_size']} gloo ranks x {record['threads']} threads; expected error: "
            "absolute tokens/s not validated, rankings rho >= 0.8 (checks/advisor_accuracy.py, docs/advisor.md)"
        ),
        peak_flops=max(record["matmul_flops"].values()),
        compute_flops={int(rows): flops for rows, flops in record["block_flops"].items()},
        bus_bytes_per_s=record["bus_bytes_per_s"],
        adam_params_per_s=record["adam_params_per_s"],
        overlap=False,
    )


def measure(probe: HostProbe) -> dict[str, Any]:
    """Run the micro-benchmark on `probe.world_size` real ranks (elastic launch, gloo); rank 0's figures."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainer.rank.main import fork_server

    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=probe.world_size,
        run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=fork_server(),
    )  # port 0: the OS picks a free one, as trainer/launch.py does for jobs
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    return elastic_launch(launch, calibration_rank)(asdict(probe))[0]


def calibration_rank(probe: dict[str, Any]) -> dict[str, Any]:
    """One rank of the benchmark: every rank computes at once, as in training, then they communicate."""
    import torch.distributed as dist

    from trainer.world import init_world, shutdown_world

    init_world("cpu")  # sets the threads a training rank gets
    dtype, model, seq_len = (
        getattr(torch, probe["dtype"]),
        ModelConfig(**dict(probe["model"])),
        probe["seq_len"],
    )
    figures = {
        "matmul_flops": {
            str(mb * seq_len): matmul_rate(mb * seq_len, model.dim, model.ffn_dim, dtype)
            for mb in probe["micro_batches"]
        },
        "block_flops": {
            str(mb * seq_len): block_rate(model, mb, seq_len, dtype) for mb in probe["micro_batches"]
        },
        "adam_params_per_s": adam_rate(),
        "bus_bytes_per_s": collective_rates(dist.get_world_size()),
    }
    shutdown_world()
    return figures


def timed(run: Any, repeats: int | None = None) -> float:
    """Fastest seconds of one call of `run` after a warm-up call, over `repeats` calls (collectives:
    every rank must issue the same number), else as many as MIN_SECONDS takes, at least 3. The
    fastest, as timeit advises: slower calls measure whatever else ran on the cores, not `run`."""
    run()
    times: list[float] = []
    while (len(times) < repeats) if repeats else (sum(times) < MIN_SECONDS or len(times) < 3):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_rate(rows: int, dim: int, ffn_dim: int, dtype: torch.dtype) -> float:
    """FLOP/s of the MLP's up-projection at `rows` tokens, the shape most of a step's FLOPs run at."""
    x, w = torch.randn(rows, dim, dtype=dtype), torch.randn(dim, ffn_dim, dtype=dtype)
    return 2.0 * rows * dim * ffn_dim / timed(lambda: torch.matmul(x, w))


def block_rate(model: ModelConfig, micro_batch: int, seq_len: int, dtype: torch.dtype) -> float:
    """FLOP/s of the model's own TransformerBlock, forward and backward, at this micro-batch: the
    matmuls and everything between them (norms, rotary, attention, elementwise, dispatch)."""
    from trainer.model.decoder import TransformerBlock, build_rope_table

    block = TransformerBlock(model)
    x = torch.randn(micro_batch, seq_len, model.dim, requires_grad=True)
    cis = build_rope_table(model.dim // model.n_heads, seq_len, model.rope_theta, torch.device("cpu"))

    def step() -> None:
        # bf16/fp16 as stages 0-1 run them (autocast); FSDP2's bf16 parameters behave alike here
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = block(x, cis)
        out.float().sum().backward()

    block_params = sum(p.numel() for p in block.parameters())
    flops = micro_batch * seq_len * (6.0 * block_params + 12.0 * model.dim * seq_len)  # 12·H·Q·T, H·Q = dim
    return flops / timed(step)


def adam_rate(numel: int = 2**22) -> float:
    """Parameters per second torch.optim.AdamW updates (the optimizer the training loop builds)."""
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    optimizer = torch.optim.AdamW([param])
    return numel / timed(optimizer.step)


def collective_rates(world_size: int) -> dict[str, float]:
    """Bus bandwidth of all-reduce and all-gather of PAYLOAD_BYTES between the ranks, in fp32 and in
    bf16 (`<collective>_bf16`): gloo reduces bf16 on the CPU much more slowly than fp32."""
    import torch.distributed as dist

    n, rates = world_size, {}
    dist.barrier()  # the ranks left their matmuls at different times
    for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
        numel = PAYLOAD_BYTES // dtype.itemsize
        full, shard = torch.ones(numel, dtype=dtype), torch.ones(numel // n, dtype=dtype)
        reduce_s = timed(lambda full=full: dist.all_reduce(full), repeats=5)
        gather_s = timed(lambda full=full, shard=shard: dist.all_gather_into_tensor(full, shard), repeats=5)
        rates[f"all_reduce{suffix}"] = PAYLOAD_BYTES * 2 * (n - 1) / n / reduce_s
        rates[f"all_gather{suffix}"] = PAYLOAD_BYTES * (n - 1) / n / gather_s
    return rates
