"""Context parallelism in the plan (trainer/plan/context_parallel.py): ZeRO's ranks folded with cp, one rank's step
at T / cp positions, and what each exchange adds to it, against the arithmetic by hand on model=tiny (D 128, 4 heads
of 32, 2 K/V heads, M 384, V 512, 4 blocks)."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.plan import build_plan
from trainer.plan.activations import activations
from trainer.plan.context_parallel import cp_local, cp_positions, row_length

TINY = ("model=tiny", "device=cpu", "seq_len=64", "micro_batch=2", "precision=fp32")
B, T, t, HQ, KQ, Q = 2, 64, 32, 128, 64, 32


def plan(*overrides: str, nproc: int = 2):  # noqa: ANN201 - trainer.plan.Plan
    return build_plan(compose_config(*TINY, f"nproc={nproc}", *overrides), "cpu", nproc)


def test_one_ranks_step_is_a_row_of_t_over_cp() -> None:
    config = compose_config(*TINY, "nproc=2", "parallel.cp=2")
    local = cp_local(config)
    assert (local.seq_len, row_length(local), config.seq_len) == (32, 64, 64)
    assert cp_local(compose_config(*TINY)).seq_len == 64
    assert cp_positions(local) == 8 * (
        32 + 2 * 64
    )  # int64: its own positions, the gathered order, its inverse


@pytest.mark.parametrize("zero", ["stage2", "stage3"])
def test_fsdp_shards_over_dp_shard_times_cp(zero: str) -> None:
    """cp=2 on 2 ranks: one data-parallel rank, yet FSDP2 shards over both (dp_shard x cp), as dp=2 does."""
    folded, data_parallel = plan(f"zero={zero}", "parallel.cp=2"), plan(f"zero={zero}")
    assert [r.states for r in folded.ranks] == [r.states for r in data_parallel.ranks]
    assert folded.ranks[0].states.params < plan(f"zero={zero}", nproc=1).ranks[0].states.params


def test_zero1_partitions_over_dp_times_cp_and_stage0_replicates() -> None:
    assert [r.states for r in plan("zero=stage1", "parallel.cp=2").ranks] == [
        r.states for r in plan("zero=stage1").ranks
    ]
    assert (
        plan("zero=stage0", "parallel.cp=2").ranks[0].states == plan("zero=stage0", nproc=1).ranks[0].states
    )


@pytest.mark.parametrize(
    ("impl", "per_block"),
    [
        ("ulysses", B * t * HQ * 4),  # wo's input: the output's all-to-all result, no view of SDPA's output
        (
            "allgather",
            2 * KQ * B * t * 4 + t * T * 4,
        ),  # the other rank's K and V; the (1, 1, t, T) mask, fp32
    ],
)
@pytest.mark.parametrize("zero", ["stage0", "stage3"])
def test_each_exchange_adds_to_a_block_what_it_saves(impl: str, per_block: int, zero: str) -> None:
    """A block at cp=2 saves a row of T / 2's set and the exchange's tensors; the batch holds the whole rows of
    inputs and targets (int64) beside the rank's positions, and the rotary tables at them (fp32, t x Q/2 each)."""
    cp = activations(
        cp_local(
            compose_config(*TINY, "nproc=2", f"zero={zero}", "parallel.cp=2", f"parallel.cp_impl={impl}")
        )
    )
    half = activations(compose_config(*TINY, "seq_len=32", f"zero={zero}"))
    assert cp.full_block - half.full_block == per_block
    assert cp.batch - half.batch == 16 * B * (T - t) + 2 * t * (Q // 2) * 4


def test_allgather_keeps_its_mask_through_backward_where_blocks_are_checkpointed() -> None:
    def batch(mode: str) -> int:
        config = compose_config(
            *TINY, "nproc=2", "parallel.cp=2", "parallel.cp_impl=allgather", f"checkpointing={mode}"
        )
        return activations(cp_local(config)).batch

    assert batch("full") - batch("none") == t * T  # (1, 1, t, T) bools


def test_ulysses_document_mask_is_the_whole_rows() -> None:
    """data.packing=document: every rank attends whole rows under the row's B x T x T mask, so each block saves
    SDPA's additive copy of all of it (fp32), not half; the batch holds the rows' document numbers and, for the
    checkpointed blocks, the boolean mask, as without cp."""
    docs = (
        "data=text",
        "data.files=[a.txt]",
        "data.tokenizer=tokenizer.json",
        "data.packing=document",
        "checkpointing=full",
    )
    cp = activations(cp_local(compose_config(*TINY, *docs, "nproc=2", "parallel.cp=2")))
    plain = activations(compose_config(*TINY, *docs))
    assert cp.full_block - plain.full_block // 2 == B * t * HQ * 4 + B * T * T * 4 // 2
    assert cp.batch - plain.batch == 2 * t * (Q // 2) * 4  # the rotary tables at the rank's positions


def test_allgather_under_a_kernel_that_repeats_kv_saves_the_whole_rows_repeated_heads() -> None:
    """CUDA in fp32 takes the efficient kernel with K/V repeated to every query head (trainer/model/attention.py):
    under allgather SDPA saves the whole row's repeated K and V, 2·H·Q·(cp - 1) values per local token beyond a
    row of T / 2's, and the mask's additive form."""
    overrides = (*TINY, "nproc=2", "parallel.cp=2", "parallel.cp_impl=allgather")
    cp = activations(cp_local(compose_config(*overrides)), "cuda")
    half = activations(compose_config(*TINY, "seq_len=32"), "cuda")
    assert cp.full_block - half.full_block == 2 * HQ * B * t * 4 + t * T * 4
