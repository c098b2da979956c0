"""The head-tail split of parallel.cp (trainer/model/context_parallel.py): every position held once, and every
rank the same causal attention work."""

from __future__ import annotations

import pytest

from trainer.model.context_parallel import attention_pairs, chunk_ranks, local_positions


@pytest.mark.parametrize(("cp", "seq_len"), [(2, 8), (2, 64), (4, 64), (8, 4096)])
def test_every_position_is_held_by_one_rank(cp: int, seq_len: int) -> None:
    held = [p for rank in range(cp) for p in local_positions(seq_len, cp, rank)]
    assert sorted(held) == list(range(seq_len))
    assert {len(local_positions(seq_len, cp, rank)) for rank in range(cp)} == {seq_len // cp}


@pytest.mark.parametrize(("cp", "seq_len"), [(2, 8), (2, 64), (4, 64), (8, 4096)])
def test_head_tail_chunks_give_every_rank_equal_causal_attention_flops(cp: int, seq_len: int) -> None:
    """A causal query at position p attends p + 1 keys: the pairs each rank computes (its attention FLOPs,
    4 x head width a pair forward per head) are equal across the ranks, and sum to the whole row's."""
    pairs = [attention_pairs(seq_len, cp, rank) for rank in range(cp)]
    assert len(set(pairs)) == 1, pairs
    assert sum(pairs) == seq_len * (seq_len + 1) // 2


def test_a_contiguous_split_would_not_be_balanced() -> None:
    """What head-tail corrects: with rank r holding positions [r T / cp, (r + 1) T / cp), the last rank does
    904 pairs to the first's 136 (cp = 4, T = 64): nearly 2 cp - 1 = 7 times, the bound as T grows."""
    cp, seq_len = 4, 64
    block = seq_len // cp
    contiguous = [sum(p + 1 for p in range(r * block, (r + 1) * block)) for r in range(cp)]
    assert contiguous == [136, 392, 648, 904]
    assert [chunk_ranks(cp, r) for r in range(cp)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert attention_pairs(seq_len, cp, 0) == sum(contiguous) // cp == 520
