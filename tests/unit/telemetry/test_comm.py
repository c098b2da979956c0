"""trainer/telemetry/comm.py's window reader against both flight recorders, on CPU with stand-in dumps.

NCCL's collectives are recorded by ProcessGroupNCCL's own flight recorder, which a CPU wheel does
not have: the dumps here stand in for it with entries in the recorder's JSON format
(FlightRecorder.hpp: `entries`, each with `record_id`, `profiling_name`, sizes and dtypes).
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

import pytest
import torch

from trainer.telemetry.comm import CommProbe, WindowReader, window_figures
from trainer.telemetry.memory import MemoryProbe


def entry(record_id: int, name: str, numel: int) -> dict[str, Any]:
    return {
        "record_id": record_id,
        "profiling_name": name,
        "input_sizes": [[numel]],
        "input_dtypes": ["Float"],
        "output_sizes": [[numel]],
        "output_dtypes": ["Float"],
        "duration_ms": 0.5,
    }


class Recorder:
    """A flight recorder's JSON dump: (includeCollectives, onlyActive) -> bytes, as torch's binding."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def __call__(self, include_collectives: bool = True, only_active: bool = False) -> bytes:
        return json.dumps({"version": "2.7", "entries": self.entries}).encode()


@pytest.fixture
def recorders(monkeypatch) -> dict[str, Recorder]:
    c10d = torch._C._distributed_c10d
    fakes = {"nccl": Recorder(), "generic": Recorder()}
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", fakes["nccl"], raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", fakes["generic"], raising=False)
    return fakes


def test_nccl_collectives_are_read_from_nccls_own_recorder(recorders: dict[str, Recorder]) -> None:
    recorders["nccl"].entries = [entry(0, "nccl:all_reduce", 8)]  # before the window: left out
    reader = WindowReader()
    recorders["nccl"].entries += [entry(1, "nccl:_allgather_base", 1024), entry(2, "nccl:all_reduce", 4)]
    recorders["generic"].entries = [entry(0, "gloo:all_reduce", 2)]  # the cpu:gloo half of an offload group
    figures = window_figures(reader.take(), timing=reader.timing)
    assert figures["all_gather"] == 4096 and figures["all_reduce"] == 16 + 8
    assert figures["time_s"] == pytest.approx(0.0015) and figures["time_covered_pct"] == 100.0


def untimed(record_id: int, name: str, numel: int) -> dict[str, Any]:
    """An entry NCCL's watchdog has not retired yet: no duration."""
    return {**entry(record_id, name, numel), "duration_ms": None}


def test_an_nccl_duration_retired_after_its_window_counts_in_the_next(recorders: dict[str, Recorder]) -> None:
    reader = WindowReader()
    recorders["nccl"].entries = [entry(0, "nccl:all_reduce", 4), untimed(1, "nccl:all_reduce", 4)]
    first = window_figures(reader.take(), timing=reader.timing)
    assert first["time_s"] == pytest.approx(0.0005) and first["time_covered_pct"] == 50.0
    recorders["nccl"].entries[1]["duration_ms"] = 2.0  # retired since
    recorders["nccl"].entries.append(entry(2, "nccl:all_reduce", 4))
    second = window_figures(reader.take(), timing=reader.timing)
    assert second["time_s"] == pytest.approx(0.0025) and second["time_covered_pct"] == 100.0
    assert second["all_reduce"] == 16  # bytes count once, in the window that ran them


def test_an_entry_overwritten_before_its_duration_is_uncovered_not_lost(
    recorders: dict[str, Recorder],
) -> None:
    reader = WindowReader()
    recorders["nccl"].entries = [untimed(0, "nccl:all_reduce", 4)]
    reader.take()
    recorders["nccl"].entries = [entry(1, "nccl:all_reduce", 4)]  # id 0 left the ring buffer untimed
    figures = window_figures(reader.take(), timing=reader.timing)
    assert figures["time_s"] == pytest.approx(0.0005) and figures["time_covered_pct"] == 50.0


def test_gloo_entries_carry_no_time_so_none_is_reported(monkeypatch) -> None:
    c10d = torch._C._distributed_c10d
    generic = Recorder()
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", generic, raising=False)
    monkeypatch.delattr(c10d, "_dump_nccl_trace_json", raising=False)
    reader = WindowReader()
    generic.entries = [untimed(0, "gloo:all_reduce", 4)]
    figures = window_figures(reader.take(), timing=reader.timing)
    assert figures["all_reduce"] == 16 and math.isnan(figures["time_s"]) and reader.timing is None


def test_a_window_the_recorders_left_empty_is_not_measured_rather_than_zero(
    recorders: dict[str, Recorder],
) -> None:
    reader = WindowReader()
    figures = window_figures(reader.take())
    assert all(math.isnan(figures[kind]) for kind in ("all_reduce", "all_gather", "reduce_scatter"))
    # A rank alone issues no collective: the same empty window, read whole, is a zero there.
    alone = window_figures(WindowReader(alone=True).take())
    assert all(alone[kind] == 0.0 for kind in ("all_reduce", "all_gather", "reduce_scatter"))


def test_an_overwritten_ring_buffer_in_either_recorder_is_not_measured(
    recorders: dict[str, Recorder],
) -> None:
    reader = WindowReader()
    recorders["nccl"].entries = [entry(5, "nccl:all_reduce", 4)]  # ids 0-4 were overwritten
    recorders["generic"].entries = [entry(0, "gloo:all_reduce", 4)]
    assert reader.take() is None


@pytest.mark.parametrize(
    ("memory_every", "profiled"),
    [(5, [3, 8]), (0, [3]), (1, [])],  # 1 on CPU: every step is tracked, so none is a plain step to profile
)
def test_the_profiled_step_follows_a_tracked_step_and_is_never_tracked_itself(
    memory_every: int, profiled: list[int]
) -> None:
    """The steps a CPU job profiles (trainer/telemetry/metrics.py Meter.measure asks both probes so)."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters())
    memory = MemoryProbe(torch.device("cpu"), memory_every, last_step=10)
    comm = CommProbe(torch.device("cpu"), memory_every, last_step=10)
    seen = []
    for step in range(1, 11):
        tracking = memory.measure(step, model, optimizer)  # entered by a job; its choice is what counts
        if not isinstance(comm.measure(step, tracked=memory.tracks(step)), contextlib.nullcontext):
            seen.append(step)
        assert memory.tracks(step) == (not isinstance(tracking, contextlib.nullcontext))
    assert seen == profiled


@pytest.mark.parametrize(
    ("overrides", "world", "default", "replicate"),
    [
        ({"parallel__pp": 2}, 2, "pp", "world"),  # the pp dim is every rank: the default group
        ({"parallel__pp": 2}, 4, "world", "world"),  # DDP's replicas under a pipeline: the plan's world
        ({"parallel__pp": 2, "zero__stage": "stage3"}, 4, "world", "replicate"),
        ({"parallel__tp": 2, "zero__stage": "stage3", "model__n_kv_heads": 2}, 2, "tp", "replicate"),
        ({"zero__stage": "stage3"}, 2, "shard", "replicate"),
        ({"zero__stage": "stage3", "zero__shard_ranks": 2}, 4, "world", "replicate"),  # HSDP
        ({}, 2, "world", "world"),
    ],
)
def test_groups_are_named_as_the_plan_names_them(
    overrides: dict[str, Any], world: int, default: str, replicate: str
) -> None:
    """Each mesh dim's description (`mesh_<dim>`) -> plan.json's group name, and the default group's name: the
    dim spanning every rank, FSDP2's shard group over every rank, else world (trainer/plan/groups.py)."""
    from tests.helpers import tiny_config
    from trainer.telemetry.comm import entry_group, group_names

    config = tiny_config(**{"nproc": str(world), "grad_accum": 2, **overrides})
    default_group, descriptions = group_names(config, world)
    assert default_group == default
    named = {d: entry_group({"process_group": ["1", d]}, default_group, descriptions) for d in descriptions}
    assert named == {
        "mesh_dp_shard": "shard",
        "mesh_dp_shard_cp": "shard",
        "mesh_dp_replicate": replicate,
        "mesh_dp_replicate_cp": "world",
        "mesh_dim_1": "hpz",
        "mesh_hpz": "hpz",  # hpZ under a pipeline: trainer/rank/mesh.py `secondary_mesh`
        "mesh_tp": "tp",
        "mesh_cp": "cp",
        "mesh_pp": "pp",
        "mesh_ep": "ep",  # an ep group inside FSDP2's shard group: trainer/rank/mesh.py `expert_mesh`
        "mesh_expert_shard": "expert_shard",
    }
    assert entry_group({"process_group": ["0", "default_pg"]}, default_group, descriptions) == default


def mesh_entry(name: str, description: str, *input_sizes: list[int]) -> dict[str, Any]:
    return {
        "profiling_name": f"gloo:{name}",
        "process_group": ["1", description],
        "input_sizes": list(input_sizes),
    }


@pytest.mark.parametrize(
    ("stage", "world", "default", "zero_dim", "zero"),
    [
        ("stage3", 2, "shard+cp", "default_pg", "shard"),  # dp 1: ZeRO's group is the cp dim, every rank
        ("stage0", 2, "world+cp", "default_pg", "world"),
        ("stage3", 4, "shard", "default_pg", "shard"),  # dp 2: dp_shard x cp flattened, every rank
        ("stage0", 4, "world", "default_pg", "world"),
        ("stage3", 8, "world", "mesh_dp_shard_cp", "shard"),  # tp 2: the flattened dim is a group of its own
    ],
)
def test_context_parallel_groups(stage: str, world: int, default: str, zero_dim: str, zero: str) -> None:
    """parallel.cp=2: ZeRO's collectives in the dim dp x cp folds into (or cp itself at dp 1), the cp exchanges
    in cp; where both are one process group, an all-to-all or a 4-D collective is cp's, a flat one ZeRO's."""
    from tests.helpers import tiny_config
    from trainer.telemetry.comm import entry_group, group_names

    tp = {"parallel__tp": 2, "model__n_heads": 4, "model__n_kv_heads": 2} if world == 8 else {}
    config = tiny_config(
        nproc=str(world), parallel__cp=2, parallel__cp_impl="allgather", zero__stage=stage, **tp
    )
    default_group, descriptions = group_names(config, world)
    assert default_group == default
    cp_dim = "default_pg" if world == 2 else "mesh_cp"
    for kind, sizes, group in [
        ("all_to_all", [[2, 2, 32, 1, 32]], "cp"),
        ("all_gather", [[4, 32, 2, 32]], "cp"),  # the K/V all-gather
        ("all_reduce", [[8, 32, 2, 32]], "cp"),  # its reduce-scatter, as gloo runs it
    ]:
        assert entry_group(mesh_entry(kind, cp_dim, *sizes), default_group, descriptions) == group
    for kind in ("all_gather", "all_reduce"):  # FSDP2's flat buffers, DDP's buckets, the loop's flags
        assert entry_group(mesh_entry(kind, zero_dim, [4096]), default_group, descriptions) == zero


@pytest.mark.parametrize(
    ("world", "shard_ranks", "shard_dim"),
    [
        (8, 2, "mesh_dp_shard_cp"),  # HSDP (dp_replicate 2, dp_shard_cp 4): cp folded into the shard dim
        (4, 1, "mesh_cp"),  # zero.shard_ranks=1: the shard dim is cp itself, one process group for both
    ],
)
def test_context_parallel_groups_under_hsdp(world: int, shard_ranks: int, shard_dim: str) -> None:
    """parallel.cp=2 with zero.shard_ranks: FSDP2's flat collectives in the shard dim are `shard`, the all-reduce
    across replicas `replicate`, attention's exchanges `cp`, the loop's flags on the default group `world`."""
    from tests.helpers import tiny_config
    from trainer.telemetry.comm import entry_group, group_names

    config = tiny_config(
        nproc=str(world),
        parallel__cp=2,
        parallel__cp_impl="allgather",
        zero__stage="stage3",
        zero__shard_ranks=shard_ranks,
    )
    default_group, descriptions = group_names(config, world)
    assert default_group == "world"
    for kind, dim, sizes, group in [
        ("all_gather", shard_dim, [4096], "shard"),
        ("all_reduce", shard_dim, [4096], "shard"),
        ("all_reduce", "mesh_dp_replicate", [1024], "replicate"),
        ("all_to_all", "mesh_cp", [2, 2, 32, 1, 32], "cp"),
        ("all_reduce", "default_pg", [10], "world"),
    ]:
        assert entry_group(mesh_entry(kind, dim, sizes), default_group, descriptions) == group


@pytest.mark.parametrize(
    ("stage", "world", "ep", "default", "ep_dim", "zero"),
    [
        ("stage3", 2, 2, "shard+cp+ep", "default_pg", "shard"),  # dp 1: one group is ZeRO's, cp's and ep's
        ("stage0", 2, 2, "world+cp+ep", "default_pg", "world"),
        (
            "stage3",
            4,
            4,
            "shard+ep",
            "default_pg",
            "shard",
        ),  # dp 2: ep is dp_shard x cp flattened, every rank
        ("stage0", 4, 4, "world+ep", "default_pg", "world"),
        ("stage3", 4, 2, "shard", "mesh_ep", "shard"),  # an ep group of its own inside dp_shard x cp
    ],
)
def test_expert_parallel_groups_under_context_parallel(
    stage: str, world: int, ep: int, default: str, ep_dim: str, zero: str
) -> None:
    """parallel.ep under parallel.cp=2 (Ulysses): the MoE dispatch's all-to-alls (1-D counts, 2-D rows) are ep's,
    Ulysses' (5-D) cp's, ZeRO's flat collectives ZeRO's, wherever two or three of them share a process group."""
    from tests.helpers import tiny_config
    from trainer.telemetry.comm import entry_group, group_names

    config = tiny_config(
        nproc=str(world),
        parallel__cp=2,
        parallel__ep=ep,
        zero__stage=stage,
        model__n_experts=8,
        model__top_k=2,
        model__n_kv_heads=2,
    )
    default_group, descriptions = group_names(config, world)
    assert default_group == default
    cp_dim = "default_pg" if world == 2 else "mesh_cp"
    assert entry_group(mesh_entry("all_to_all", ep_dim, [8]), default_group, descriptions) == "ep"
    assert entry_group(mesh_entry("all_to_all", ep_dim, [256, 128]), default_group, descriptions) == "ep"
    assert (
        entry_group(mesh_entry("all_to_all", cp_dim, [2, 2, 32, 1, 32]), default_group, descriptions) == "cp"
    )
    for kind in ("all_gather", "all_reduce"):
        assert entry_group(mesh_entry(kind, "default_pg", [4096]), default_group, descriptions) == zero
