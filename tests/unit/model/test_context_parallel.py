"""The head-tail split of parallel.cp (trainer/model/context_parallel.py): every position held once, and every
rank the same causal attention work; the all-gather's mask and the kernel that takes it."""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.config import ConfigError
from trainer.model.attention import SdpaChoice, SDPBackend, check_document_mask, config_choice, takes_mask
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


def test_allgather_hands_attention_a_mask_so_cuda_takes_a_kernel_that_takes_one() -> None:
    """parallel.cp_impl=allgather masks every layer by true positions: on CUDA `auto` takes the efficient
    kernel (flash takes no mask) and an explicit flash is one line; Ulysses attends whole rows causally."""
    allgather = compose_config("parallel.cp=2", "parallel.cp_impl=allgather", "precision=bf16")
    assert takes_mask(allgather)
    assert config_choice(allgather, "cuda").backend == SDPBackend.EFFICIENT_ATTENTION
    ulysses = compose_config("parallel.cp=2", "precision=bf16")
    assert not takes_mask(ulysses) and config_choice(ulysses, "cuda").backend == SDPBackend.FLASH_ATTENTION
    with pytest.raises(
        ConfigError, match="^parallel.cp_impl=allgather needs an attention kernel that takes a mask"
    ):
        check_document_mask(SdpaChoice(SDPBackend.FLASH_ATTENTION), "cuda", "parallel.cp_impl=allgather")
