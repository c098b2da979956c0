"""offload=nvme in the plan (trainer/plan/disk.py): the moments' files, their traffic and stall, the host
and device plans without the moments, the refusals of offload.path, and the advisor's nvme rows.

Every byte figure is counted here from the model's own parameters (the decoder built on meta) and
torch.chunk's split, not from the plan's code. The tiny model on 2 ranks, per rank (FSDP2's unpadded
shards): tok_embeddings and output 256x128 = 32,768 elements each, per block wq and wo 8,192, wk and wv
4,096, w1, w2, w3 24,576, two norms 64, the final norm 64: 459,328 elements, so 8 x 459,328 = 3,674,624
bytes of moments read and as many written per step. In the file each moment of each parameter is rounded
up to whole 1024-element pages: the 9 norms (64 -> 1,024) add 9 x 960 elements, 467,968 elements a moment,
2 x 4 x 467,968 = 3,743,744 bytes a file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import trainer.plan.disk
from tests.helpers import compose_config, run_in_one_process
from trainer.advise.advisor import advise, format_advice
from trainer.config import ConfigError, TrainConfig
from trainer.model.decoder import build_model
from trainer.plan import build_plan, format_plan, measure_disk
from trainer.plan.disk import check_offload_path, nvme_chunk
from trainer.units import GIB, MIB

RUNTIME = 2 * GIB  # plan.cuda_rank_runtime_gib's default
PINNED_SHARDS = 2 * 2_230_528  # tiny's fp32 parameter and gradient shards on 2 ranks, pinned (test_host.py)
MOMENTS = 3_674_624  # 8 B x 459,328 elements
FILE = 3_743_744  # the same with each moment's region rounded up to 1024 elements
COUNTERS = 39 * 4  # Adam's step counters: 39 parameters


def nvme(*overrides: str, path: Path | str = "/nonexistent-plan-only") -> TrainConfig:
    """tiny under offload=nvme, planned for a 16 GiB host (mode=plan: offload.path is not checked)."""
    return compose_config(
        "model=tiny",
        "zero=stage3",
        "mode=plan",
        "plan.host_memory_gib=16",
        "offload=nvme",
        f"offload.path={path}",
        *overrides,
    )


def local_numels(config: TrainConfig, ranks: int, rank: int) -> list[int]:
    """Each parameter's elements on `rank`: torch.chunk's rows of dim 0 (FSDP2's Shard(0)), unpadded."""
    out = []
    for p in build_model(config.model, device="meta").parameters():
        chunks = torch.empty(p.shape[0], device="meta").chunk(ranks)
        rows = chunks[rank].shape[0] if rank < len(chunks) else 0
        out.append(rows * math.prod(p.shape[1:]))
    return out


def file_bytes(numels: list[int]) -> int:
    return sum(2 * 4 * math.ceil(n / 1024) * 1024 for n in numels)


# ----------------------------------------------------------------------------- the disk plan


def test_files_and_traffic_of_two_ranks_match_the_hand_count() -> None:
    config = nvme("plan.disk_gbps=2")
    numels = local_numels(config, 2, 0)
    assert sum(numels) == 459_328 and file_bytes(numels) == FILE
    disk = build_plan(config, "cuda", 2).disk
    assert disk is not None
    assert disk.file_bytes == (FILE, FILE) and disk.file_bytes_per_node == 2 * FILE
    assert disk.read_bytes_per_rank == disk.written_bytes_per_rank == 8 * 459_328 == MOMENTS
    assert disk.traffic_bytes_per_node == 2 * 2 * MOMENTS
    assert disk.stall_s == pytest.approx(4 * MOMENTS / 2e9, rel=1e-12)
    assert disk.buffer_bytes == 64 * MIB and disk.chunk == 64 * MIB // 8


def test_uneven_shards_of_three_ranks_round_each_region_up() -> None:
    """tiny on 3 ranks: dims 512, 384, 128, 64 split 171/171/170, 128/128/128, 43/43/42, 22/22/20."""
    config = nvme("plan.disk_gbps=1")
    plan = build_plan(config, "cpu", 3)
    assert plan.disk is not None
    expected = [file_bytes(local_numels(config, 3, r)) for r in range(3)]
    assert list(plan.disk.file_bytes) == expected and expected[0] != expected[2]
    moments = [8 * sum(local_numels(config, 3, r)) for r in range(3)]
    assert list(plan.disk.moment_bytes) == moments == [r.states.optimizer for r in plan.ranks]
    assert plan.disk.stall_s == pytest.approx(2 * sum(moments) / 1e9, rel=1e-12)


def test_no_rate_leaves_the_stall_unknown_and_offload_cpu_has_no_disk_plan() -> None:
    plan = build_plan(nvme(), "cuda", 2)
    assert plan.disk is not None and plan.disk.stall_s is None
    assert "stall unknown: give plan.disk_gbps" in format_plan(plan)
    assert build_plan(compose_config("model=tiny", "zero=stage3", "offload=cpu"), "cuda", 2).disk is None


def test_the_chunk_is_half_the_buffer_in_whole_pages() -> None:
    assert [nvme_chunk(mib) for mib in (1, 3, 64)] == [131_072, 393_216, 8_388_608]


def test_the_disk_is_measured_once_with_a_file_it_deletes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rate = measure_disk(str(tmp_path), 2 * MIB)
    assert rate.bytes_per_s is not None and rate.bytes_per_s > 0 and rate.source.startswith("measured on")
    assert "disk: measured offload.path=" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    assert measure_disk(str(tmp_path), 2 * MIB) is rate  # once per process
    assert capsys.readouterr().out == ""


def test_a_job_that_trains_here_measures_its_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer.plan.disk, "MEASURE_BYTES", MIB)
    plan = build_plan(nvme("mode=train", path=tmp_path), "cpu", 2)
    assert plan.disk is not None and plan.disk.stall_s is not None
    assert plan.disk.rate.source.startswith(f"measured on {tmp_path}")


# ----------------------------------------------------------------------------- host and device without the moments


def test_the_host_holds_the_buffer_instead_of_the_moments() -> None:
    """On a GPU both place the same pinned shards in host memory; cpu adds the moments (its fused AdamW
    makes no temporaries), nvme its 64 MiB buffer, the step counters and one chunk's temporaries: the
    chunk (8 Mi elements) is larger than any tensor, so 2 x 4 B x the largest local tensor (32,768)."""
    cpu = build_plan(nvme("offload=cpu", "offload.path=null"), "cuda", 2).host.ranks[0]
    disk = build_plan(nvme(), "cuda", 2).host.ranks[0]
    assert cpu.pinned == disk.pinned == PINNED_SHARDS
    assert (cpu.pageable, cpu.buffer) == (MOMENTS + COUNTERS, 0)
    assert (disk.pageable, disk.buffer) == (COUNTERS + 8 * 32_768, 64 * MIB)
    assert disk.total == RUNTIME + PINNED_SHARDS + COUNTERS + 8 * 32_768 + 64 * MIB


def test_the_device_plan_on_a_gpu_is_offload_cpus() -> None:
    cpu = build_plan(nvme("offload=cpu", "offload.path=null"), "cuda", 2).ranks[0]
    disk = build_plan(nvme(), "cuda", 2).ranks[0]
    assert disk.moments == cpu.moments
    assert disk.on_disk == MOMENTS and disk.offloaded == cpu.offloaded - MOMENTS + 64 * MIB


def test_cpu_ranks_hold_the_buffer_and_a_chunks_temporaries_instead_of_the_moments() -> None:
    """A CPU rank's tensors: every moment holds the 1 MiB buffer where offload=cpu held 3,674,624 bytes of
    moments; the step's temporaries are one chunk's (8 x 32,768 B: the chunk, 131,072, is larger than any
    tensor), not the per-tensor loop's (its worst, fp32: w2's 24,576 twice and w1's before it)."""
    cpu = build_plan(nvme("offload=cpu", "offload.path=null"), "cpu", 2).ranks[0]
    disk = build_plan(nvme("offload.buffer_mib=1"), "cpu", 2).ranks[0]
    assert {m.parts["optimizer"] for m in cpu.moments} == {MOMENTS}
    assert {m.parts["optimizer"] for m in disk.moments} == {MIB}
    step = {m.name: m.parts["temporary"] for m in disk.moments}["optimizer step"]
    assert step == 2 * 4 * 32_768
    assert {m.name: m.parts["temporary"] for m in cpu.moments}["optimizer step"] == 4 * 3 * 24_576
    assert disk.figures()["optimizer_gib"] == MIB / GIB and disk.figures()["on_disk_gib"] == MOMENTS / GIB


def test_a_chunk_smaller_than_the_largest_tensor_bounds_the_temporaries() -> None:
    """7b's embedding shard on 2 ranks is 65.5M elements; a 1 MiB buffer streams it 131,072 at a time."""
    plan = build_plan(nvme("model=7b", "offload.buffer_mib=1"), "cpu", 2)
    step = {m.name: m.parts["temporary"] for m in plan.ranks[0].moments}["optimizer step"]
    assert step == 2 * 4 * 131_072


# ----------------------------------------------------------------------------- the command line

# `python -m trainer` in one process for every case (trainer/__main__.py as __main__): one interpreter's
# imports for all of them.
LLAMA3_70B = 70_553_706_496
PLAN_70B = [
    "mode=plan",
    "model=llama3-70b",
    "nproc=8",
    "plan.accelerator=h100",
    "zero=stage3",
    "offload=nvme",
]
TRAIN = ["device=cpu", "logger=none", "model=tiny", "zero=stage3", "offload=nvme", "steps=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The plan of the issue's command (checkpointing=full: a plan that fits, so no way out is searched), and
    the three refusals of offload.path: missing, a file, too small for llama3-405b's files (3 TB a node)."""
    tmp = tmp_path_factory.mktemp("nvme")
    (tmp / "disk").mkdir()
    (tmp / "a-file").write_text("")
    cases = {
        "plan": [*PLAN_70B, f"offload.path={tmp / 'disk'}", "plan.disk_gbps=10", "checkpointing=full"],
        "missing": [*TRAIN, f"offload.path={tmp / 'missing'}"],
        "file": [*TRAIN, f"offload.path={tmp / 'a-file'}"],
        "full": [*TRAIN, "model=llama3-405b", "seq_len=64", f"offload.path={tmp / 'disk'}"],
    }
    argvs = [[*argv, f"hydra.run.dir={tmp / 'out' / name}"] for name, argv in cases.items()]
    env = {**os.environ, "WANDB_MODE": "offline"}
    results = run_in_one_process(argvs, tmp / "results.json", timeout=300, env=env)
    return {
        name: {**result, "out": tmp / "out" / name, "disk": tmp / "disk"}
        for name, result in zip(cases, results)
    }


def test_the_plan_of_70b_on_8_h100s_prints_the_files_traffic_and_stall(
    runs: dict[str, dict[str, Any]],
) -> None:
    """llama3-70b on 8 ranks: every dim 0 divides by 8 into whole pages, so a file is the moments exactly,
    8 x P / 8 bytes; a node's 8 ranks read and write 16 x P bytes a step, at 10 GB/s 112.9 s."""
    run = runs["plan"]
    assert run["returncode"] == 0, run["stderr"]
    per_rank = 8 * LLAMA3_70B // 8
    (line,) = [line for line in run["stdout"].splitlines() if line.startswith("disk (offload=nvme")]
    assert (
        f"files of {per_rank / GIB:.2f} GiB per rank, {8 * per_rank / GIB:.2f} GiB per node (8 ranks)" in line
    )
    assert f"reads {per_rank / GIB:.2f} GiB and writes {per_rank / GIB:.2f} GiB per rank" in line
    assert f"({16 * per_rank / GIB:.2f} GiB per node)" in line
    assert f"stall {16 * per_rank / 1e10:.3g} s per step at 10 GB/s (plan.disk_gbps=10)" in line
    disk = json.loads((run["out"] / "plan.json").read_text())["disk"]
    assert disk["file_bytes_per_rank"] == disk["read_bytes_per_rank_per_step"] == per_rank
    assert disk["traffic_bytes_per_node_per_step"] == 16 * per_rank
    assert disk["stall_s_per_step"] == pytest.approx(16 * per_rank / 1e10, rel=1e-12)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("missing", "does not exist"),
        ("file", "is not a writable directory"),
        ("full", "free, but the files of Adam's moments of this node's 2 ranks take"),
    ],
)
def test_a_bad_offload_path_is_one_line_before_anything_is_written(
    runs: dict[str, dict[str, Any]], case: str, says: str
) -> None:
    run = runs[case]
    if case == "full" and shutil.disk_usage(run["disk"]).free > 4 * 1024**4:
        pytest.skip("this disk holds llama3-405b's moments")
    lines = [line for line in run["stderr"].splitlines() if line.strip()]
    assert run["returncode"] == 2 and len(lines) == 1, run["stderr"]
    assert lines[0].startswith("error: offload.path=") and says in lines[0]
    assert not any((run["out"] / name).exists() for name in ("plan.json", "metrics.jsonl", "summary.json"))
    assert list(run["disk"].iterdir()) == []


def test_files_already_there_count_as_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = nvme("mode=train", path=tmp_path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=2 * FILE - 1))
    with pytest.raises(ConfigError, match=r"offload.path=.* free, but .* 2 ranks take 7.14 MiB"):
        check_offload_path(config, 2)
    (tmp_path / "zerolab-rank1.adam").write_bytes(b"\0")  # an earlier run's file, overwritten
    check_offload_path(config, 2)


# ----------------------------------------------------------------------------- the advisor

ADVISE_7B = [
    "mode=advise", "model=7b", "nproc=8", "plan.accelerator=h100", "seq_len=1024", "precision=bf16", "global_batch=8",
    "advise.stages=[stage3]", "advise.checkpointing=[full]", "advise.reduce_dtypes=[fp32]", "advise.micro_batches=[1]",
    "plan.host_memory_gib=100",
]  # fmt: skip


def test_advise_offers_nvme_below_what_needs_no_disk_where_the_host_cannot_hold_offload_cpu() -> None:
    """7b on 8 H100s, a 100 GiB host: offload=none fits (16 GiB of runtimes), offload=cpu needs 132 GiB,
    offload=nvme without the moments 83 GiB: offered, its 16 x P / 8 bytes per rank at 10 GB/s in its step."""
    config = compose_config(*ADVISE_7B, "plan.disk_gbps=10")
    candidates, rates = advise(config, "cuda", 8)
    assert [(c.choice["offload"], c.fits) for c in candidates] == [
        ("none", True),
        ("nvme", True),
        ("cpu", False),
    ]
    disk = candidates[1]
    moments = 8 * 6_738_415_616  # Llama 2 7b's parameters: 8 bytes each over the node's 8 ranks
    assert disk.disk_bytes == 2 * moments and disk.step.disk_s == pytest.approx(2 * moments / 1e10)
    assert disk.step.step_s >= disk.step.disk_s and disk.limiter == "disk (offload=nvme)"
    assert "offload.path=NVME_DIR" in disk.overrides()
    table = format_advice(config, candidates, rates, ADVISE_7B, 8, "h100")
    (row,) = [line for line in table.splitlines() if line.startswith("  2  stage3")]
    assert (
        "offload=nvme" in row
        and f"disk: {2 * moments / GIB:.1f} GiB read and written per node per step" in row
    )


def test_advise_without_a_disk_rate_offers_no_nvme_and_says_why_once() -> None:
    config = compose_config(*ADVISE_7B)
    candidates, rates = advise(config, "cuda", 8)
    assert [c.choice["offload"] for c in candidates] == ["none", "cpu"]
    table = format_advice(config, candidates, rates, ADVISE_7B, 8, "h100")
    assert table.count("offload=nvme not offered") == 1 and "give plan.disk_gbps" in table
