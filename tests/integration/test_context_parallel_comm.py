"""Context parallelism's communication (parallel.cp=2 on 2 CPU ranks, tiny, fp32): every rank's bytes per
collective per group, read from c10d's flight recorder, equal plan.json's `comm.groups`.

At dp = 1 the cp group and ZeRO's (FSDP2's shard group, DDP's world) are one process group, the default one
here: the measurement gives its all-to-alls and its (rows, positions, heads, head_dim) collectives to `cp`,
the rest to ZeRO's group (trainer/telemetry/comm.py `entry_group`). One job per point, 2 steps, step 1's
window (no metric gather in it); the loop's own all-reduces on ZeRO's group are added as
test_tensor_parallel.py adds them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import TINY, Run, layer_norms_bytes, run_trainer
from trainer.config import ModelConfig
from trainer.plan.states import model_shape

POINTS = {
    "ulysses stage3": ("parallel.cp_impl=ulysses", "zero=stage3"),
    "allgather stage0": ("parallel.cp_impl=allgather", "zero=stage0"),
    "ulysses stage0 full": ("parallel.cp_impl=ulysses", "zero=stage0", "checkpointing=full"),
    "allgather stage3 full": ("parallel.cp_impl=allgather", "zero=stage3", "checkpointing=full"),
}
WORLD = 2
# b = 2 rows of s = 64 positions, 32 on each rank; H = 4 heads and K = 2 kv heads of Q = 32, fp32
ROWS, Q_BYTES, KV_BYTES = 2 * 32, 4 * 32 * 4, 2 * 32 * 4
LAYERS = 4


@pytest.fixture(scope="module", params=sorted(POINTS))
def cp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Run]:
    out = tmp_path_factory.mktemp("cp") / "run"
    overrides = (*TINY, "nproc=2", "parallel.cp=2", "precision=fp32", "steps=2", "save=off")
    return request.param, run_trainer(out, *overrides, *POINTS[request.param], timeout=600)


def comm_groups(run: Run) -> dict[str, Any]:
    return json.loads((run.out_dir / "plan.json").read_text())["comm"]["groups"]


def test_plan_states_the_exchange_per_block(cp_run: tuple[str, Run]) -> None:
    """Ulysses: q and the output b·(s/cp)·H·Q·c, k and v b·(s/cp)·K·Q·c, each way; the all-gather cp times
    k and v's, b·s·2·K·Q·c."""
    name, run = cp_run
    cp = comm_groups(run)["cp"]
    assert cp["ranks"] == 2 and cp["link"] == "intra-node"
    exchange = cp["exchange"]
    per_block = exchange["forward"]["bytes_per_block"]
    if "ulysses" in name:
        assert per_block == {"q": 32_768, "k": 16_384, "v": 16_384, "output": 32_768}
        assert per_block == {
            "q": ROWS * Q_BYTES,
            "k": ROWS * KV_BYTES,
            "v": ROWS * KV_BYTES,
            "output": ROWS * Q_BYTES,
        }
    else:
        assert per_block == {"kv": 2 * 2 * ROWS * KV_BYTES} == {"kv": 65_536}
    assert exchange["backward"]["bytes_per_block"] == per_block
    assert exchange["wire_share"] == 0.5
    assert exchange["recomputed_blocks"] == (LAYERS if "full" in name else 0)


def test_cp_group_bytes_per_step(cp_run: tuple[str, Run]) -> None:
    """Per step: every block's forward (twice under checkpointing=full) and backward exchange. On gloo the
    K/V all-gather is recorded as one rank's chunk (payload / cp) and its reduce-scatter as an all-reduce."""
    name, run = cp_run
    planned = comm_groups(run)["cp"]["bytes_by_collective"]
    forwards = 2 * LAYERS if "full" in name else LAYERS
    if "ulysses" in name:
        expected = {"all_to_all": (forwards + LAYERS) * 2 * ROWS * (Q_BYTES + KV_BYTES)}
    else:
        expected = {"all_gather": forwards * 65_536 // 2, "all_reduce": LAYERS * 65_536}
    assert {kind: b for kind, b in planned.items() if b} == expected, name


def loop_bytes(group: str, zero_group: str, fsdp: bool) -> int:
    """The loop's own all-reduces on step 1, all on ZeRO's group (the default one): the non-finite and stop
    agreement (world + 2 fp32 flags), the per-layer norms and, under FSDP2, clipping's fp32 norm per
    parameter tensor."""
    if group != zero_group:
        return 0
    clipping = 4 * len(model_shape(ModelConfig()).order) if fsdp else 0
    return 4 * (WORLD + 2) + layer_norms_bytes() + clipping


def test_bytes_per_collective_per_group_equal_the_plan(cp_run: tuple[str, Run]) -> None:
    name, run = cp_run
    groups = comm_groups(run)
    fsdp = "stage3" in name
    zero_group = "shard" if fsdp else "world"
    assert set(groups) == {zero_group, "cp"}, name
    first = run.records[0]
    assert first["step"] == 1
    for rank in range(WORLD):
        for group, planned in groups.items():
            for kind, payload in planned["bytes_by_collective"].items():
                extra = loop_bytes(group, zero_group, fsdp) if kind == "all_reduce" else 0
                measured = first.get(f"comm/rank{rank}/{group}/{kind}_bytes_per_step", 0)
                assert measured == payload + extra, (name, rank, group, kind, measured, payload)
            assert first[f"comm/{group}/predicted_bytes_per_step"] == planned["bytes_per_step"]
        # nothing left unnamed: every recorded byte is a planned kind
        total = first[f"comm/rank{rank}/bytes_per_step"]
        named = sum(first.get(f"comm/rank{rank}/{g}/bytes_per_step", 0) for g in groups)
        assert total == named, (name, rank, total, named)


def test_the_cp_group_holds_no_loop_collective(cp_run: tuple[str, Run]) -> None:
    """The loop's scalars are flat: none lands in cp, so its measured bytes are the plan's to the byte."""
    name, run = cp_run
    planned = comm_groups(run)["cp"]["bytes_per_step"]
    for record in run.records:
        for rank in range(WORLD):
            assert record[f"comm/rank{rank}/cp/bytes_per_step"] == planned, (name, record["step"])
