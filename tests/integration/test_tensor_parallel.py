"""Tensor parallelism (parallel.tp=2, sequence parallelism on) composed with ZeRO, on CPU ranks.

One job per configuration, shared by the module: tp=2 on 2 ranks (dp 1) at stage0, and on 4 ranks (dp 2)
at stage2 and stage3 (and stage3 with offload=nvme), and on 8 (HSDP: 2 replicas of 2 shards) at stage3, each
against one 1-rank run of the same global batch (8 sequences), fp32, 8 steps:
per-step losses within 1e-5; the bytes of every collective in the tp and dp (shard) groups as planned; the
stage3 run's save resumes at tp=1 on 4 data-parallel ranks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    TINY,
    Run,
    compose_config,
    layer_norms_bytes,
    run_trainer,
    train_tokenizer,
    write_documents,
)
from trainer.config import ModelConfig
from trainer.plan.states import model_shape

STEPS = ("steps=8", "precision=fp32", "optim.warmup_steps=2")
CONFIGS = {
    "tp2 dp1 stage0": ("nproc=2", "micro_batch=8", "zero=stage0", "save=off"),
    # FSDP2 over a one-rank dp dim: the peak at loss_parallel's backward, after FSDP2's output head
    "tp2 dp1 stage3": ("nproc=2", "micro_batch=8", "zero=stage3", "save=off"),
    "tp2 dp2 stage2": ("nproc=4", "micro_batch=4", "zero=stage2", "save=off"),
    "tp2 dp2 stage3": ("nproc=4", "micro_batch=4", "zero=stage3", "save.every=4"),
    # FSDP2's CPUOffloadPolicy on the 2-D (dp, tp) shards: the states on the host, the same collectives; under
    # offload=nvme, which is that policy with Adam's moments in a file per rank (bitwise offload=cpu's training:
    # tests/integration/test_nvme.py), the files hold the 2-D shards' moments
    "tp2 dp2 stage3 offload": ("nproc=4", "micro_batch=4", "zero=stage3", "offload=nvme", "save=off"),
    # HSDP beside TP: the mesh (dp_replicate 2, dp_shard 2, tp 2) on 8 ranks, FSDP2 over its two dp dims
    "tp2 hsdp 2x2 stage3": ("nproc=8", "micro_batch=2", "zero=stage3", "zero.shard_ranks=2", "save=off"),
}


def job(out_dir: Path, *overrides: str) -> Run:
    return run_trainer(out_dir, *TINY, *STEPS, *overrides, timeout=900)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return job(tmp_path_factory.mktemp("ref") / "run", "nproc=1", "micro_batch=8", "save=off")


SLOW = {"tp2 hsdp 2x2 stage3", "tp2 dp2 stage2"}
"""8 ranks on CI's 2 cores (about 45 s), and stage2 beside stage3: the slow tier's (CI runs both), keeping the
default run under 20 minutes."""


@pytest.fixture(
    scope="module",
    params=[pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in sorted(CONFIGS)],
)
def tp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Run]:
    out = tmp_path_factory.mktemp("tp") / "run"
    nvme = "offload=nvme" in CONFIGS[request.param]
    disk = [f"offload.path={out.parent}", "plan.disk_gbps=1"] if nvme else []  # a rate: no measurement
    return request.param, job(out, "parallel.tp=2", *CONFIGS[request.param], *disk)


def test_losses_equal_one_rank_of_the_same_global_batch(tp_run: tuple[str, Run], reference: Run) -> None:
    name, run = tp_run
    assert len(run.losses) == len(reference.losses) == 8
    worst = max(abs(a - b) for a, b in zip(run.losses, reference.losses))
    assert worst < 1e-5, (name, run.losses, reference.losses)


def test_the_moments_files_hold_each_tp_ranks_shards(tp_run: tuple[str, Run]) -> None:
    """offload=nvme under TP: each step reads and writes 8 bytes per element of every rank's shards: the model's
    parameters once, and the norms' weights, which the tp ranks each hold whole, once more per extra tp rank."""
    name, run = tp_run
    if "offload" not in name:
        pytest.skip("offload=nvme's point only")
    model = compose_config(*TINY).model
    replicated = (2 * model.n_layers + 1) * model.dim  # the RMSNorm weights: Replicate() over tp
    moments = 8 * (model_shape(model).num_params + replicated)
    assert {r["offload/disk_read_bytes"] for r in run.records} == {moments}
    assert {r["offload/disk_written_bytes"] for r in run.records} == {moments}


def test_composed_pairs_peaks_within_half_a_percent_of_their_plans(tp_run: tuple[str, Run]) -> None:
    """The pairs this module added to TP's (offload=cpu, HSDP, FSDP2 at dp 1): every rank's measured peak
    within 0.5% of its plan (the other points' peaks: test_tensor_parallel_plan.py)."""
    name, run = tp_run
    if "offload" not in name and "hsdp" not in name and "dp1 stage3" not in name:
        pytest.skip("test_tensor_parallel_plan.py holds TP's own points")
    assert_peaks_within_half_a_percent(run, name)


def test_plan_json_names_the_tp_group(tp_run: tuple[str, Run]) -> None:
    name, run = tp_run
    groups: dict[str, Any] = json.loads((run.out_dir / "plan.json").read_text())["comm"]["groups"]
    assert groups["tp"]["ranks"] == 2 and groups["tp"]["link"] == "intra-node", name


def loop_bytes(group: str, default_group: str, world: int) -> int:
    """The loop's own all-reduces (docs/communication.md), by group: the non-finite and stop agreement
    (world + 2 fp32 flags) and the per-layer norms (a log step) on the default group; clipping's fp32 norm
    per parameter tensor in each group the DTensor parameters are sharded over (tp, and dp's `shard` under
    FSDP2)."""
    tensors = len(model_shape(ModelConfig()).order)
    clipping = 4 * tensors if group in ("tp", "shard") else 0  # HSDP's replicate dim holds whole shards
    return clipping + (4 * (world + 2) + layer_norms_bytes() if group == default_group else 0)


def test_bytes_per_collective_per_group_equal_the_plan(tp_run: tuple[str, Run]) -> None:
    """Step 1 (its window holds no metric gather): every rank's bytes in the tp and shard groups, by kind."""
    name, run = tp_run
    groups: dict[str, Any] = json.loads((run.out_dir / "plan.json").read_text())["comm"]["groups"]
    world = int(CONFIGS[name][0].removeprefix("nproc="))
    hsdp = "zero.shard_ranks=2" in CONFIGS[name]
    # the group whose mesh is every rank (the non-finite agreement's): tp on 2 ranks, else none of the plan's
    default_group = "tp" if world == 2 else "world"
    fsdp = "zero=stage3" in CONFIGS[name] or "zero=stage2" in CONFIGS[name]
    expected = {"tp"} | ({"shard"} if fsdp else set()) | ({"replicate"} if hsdp else set())
    assert set(groups) == expected, name
    first = run.records[0]
    assert first["step"] == 1
    for rank in range(world):
        for group, planned in groups.items():
            for kind, payload in planned["bytes_by_collective"].items():
                # a one-rank group (FSDP2's shard dim at dp 1) records no collective
                one_rank = planned["ranks"] == 1
                extra = (
                    loop_bytes(group, default_group, world) if kind == "all_reduce" and not one_rank else 0
                )
                measured = first.get(f"comm/rank{rank}/{group}/{kind}_bytes_per_step", 0)
                assert measured == payload + extra, (name, rank, group, kind, measured, payload)
            assert first[f"comm/{group}/predicted_bytes_per_step"] == planned["bytes_per_step"]


def test_a_tp_save_resumes_at_tp1_on_four_data_parallel_ranks(
    tmp_path: Path, tp_run: tuple[str, Run], reference: Run
) -> None:
    """The step-4 save of tp=2 dp=2 (DTensors sharded over the 2-D mesh) goes on at tp=1 dp=4, the same global
    batch: DCP reshards; steps 5-8 as the uninterrupted run's, within test_resume.py's reshard tolerance (rel 1e-5)."""
    name, run = tp_run
    if "save.every=4" not in CONFIGS[name]:
        pytest.skip("the stage3 run saves")
    save = run.out_dir / "checkpoints" / "step_00000004"
    resumed = job(tmp_path / "run", "nproc=4", "micro_batch=2", "zero=stage3", "save=off", f"resume={save}")
    assert [r["step"] for r in resumed.records] == [5, 6, 7, 8]
    for record, expected in zip(resumed.records, reference.records[4:]):
        assert math.isclose(record["loss/train"], expected["loss/train"], rel_tol=1e-5), (record, expected)


def test_validation_loss_equals_one_rank(tmp_path: Path) -> None:
    """eval.every under tp=2 (2 ranks, dp 1): the held-out loss is taken under loss_parallel like training's,
    and each TP group reads its data-parallel replica's held-out batches; losses and `loss/val` equal one
    rank's of the same global batch within 1e-5, 4 steps, evaluated at steps 2 and 4."""
    short = ("steps=4", "precision=fp32", "optim.warmup_steps=2", "eval.every=2", "save=off")
    one = run_trainer(tmp_path / "one", *TINY, *short, "nproc=1", timeout=900)
    tp = run_trainer(tmp_path / "tp", *TINY, *short, "nproc=2", "parallel.tp=2", timeout=900)
    for run in (one, tp):
        assert [r["step"] for r in run.records if "loss/val" in r] == [2, 4], run.records
    for key in ("loss/train", "loss/val"):
        ours = [r[key] for r in tp.records if key in r]
        theirs = [r[key] for r in one.records if key in r]
        assert len(ours) == len(theirs) == (4 if key == "loss/train" else 2), (key, ours, theirs)
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-5, (key, ours, theirs)


def test_document_packing_under_sequence_parallelism_equals_one_rank(tmp_path: Path) -> None:
    """data.packing=document under tp=2 with SP: each block's attention takes the whole sequence (its input
    all-gathered) and the block-causal mask, the same on both TP ranks (they read the same documents). Losses
    within 1e-5 and gradient norms within 1e-4 relative of one rank's, 6 steps; each rank's peak within 0.5%
    of its plan (at the optimizer step: the embedding's Replicate gradient, trainer/plan/tp_walk.py)."""
    pytest.importorskip("tokenizers")  # the `data` extra
    pytest.importorskip("datasets")
    texts = write_documents(tmp_path / "corpus.jsonl", 300)
    tokenizer = train_tokenizer(tmp_path / "tokenizer", texts)
    text = (
        "data=text", f"data.files=[{tmp_path / 'corpus.jsonl'}]", f"data.tokenizer={tokenizer}",
        f"data.cache_dir={tmp_path / 'cache'}", "data.packing=document",
    )  # fmt: skip
    short = ("steps=6", "precision=fp32", "optim.warmup_steps=2", "seq_len=32", "save=off")
    one = run_trainer(tmp_path / "one", *TINY, *text, *short, "nproc=1", timeout=900)
    tp = run_trainer(tmp_path / "tp", *TINY, *text, *short, "nproc=2", "parallel.tp=2", timeout=900)
    assert len(tp.records) == len(one.records) == 6
    for ours, theirs in zip(tp.records, one.records):
        assert abs(ours["loss/train"] - theirs["loss/train"]) < 1e-5, (ours, theirs)
        assert math.isclose(ours["optim/grad_norm"], theirs["optim/grad_norm"], rel_tol=1e-4), (ours, theirs)
    assert_peaks_within_half_a_percent(tp, "tp2 document packing")


def assert_peaks_within_half_a_percent(run: Run, name: str) -> None:
    """Every rank's measured peak (the largest any record carries) within 0.5% of its plan."""
    for rank in json.loads((run.out_dir / "plan.json").read_text())["ranks"]:
        key = f"memory/rank{rank['rank']}/peak_allocated_gib"
        measured = max(r[key] for r in run.records if key in r)
        assert abs(rank["peak_gib"] - measured) / measured < 0.005, (name, rank, measured)
