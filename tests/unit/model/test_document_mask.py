"""data.packing=document: a packed row's documents do not see each other (trainer/model/decoder.py
block_causal_mask through SDPA's attn_mask), so the row's loss is its documents' losses, each computed alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from tests.helpers import materialized, tiny_config
from trainer.config import ConfigError
from trainer.model.attention import SdpaChoice, check_document_mask
from trainer.model.decoder import apply_loss_choice, apply_sdpa_choice, block_causal_mask
from trainer.text.packed import IGNORE_INDEX, document_batch

# Whether the CPU flash kernel takes an attn_mask depends on torch's version: run under 2.11 and 2.13.
pytestmark = pytest.mark.torch_versions

LENGTHS = (7, 12, 5, 9)  # one row of 33 tokens: 32 inputs and their targets


def packed_row(vocab_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Four random documents, and the (2, 33) sample PackedText would give for them packed end to end."""
    g = torch.Generator().manual_seed(0)
    documents = [torch.randint(vocab_size, (n,), generator=g) for n in LENGTHS]
    numbers = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    return documents, torch.stack([torch.cat(documents), numbers])[None]


@pytest.mark.parametrize("backend", [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
def test_a_packed_rows_loss_is_the_token_weighted_mean_of_its_documents_losses(backend: SDPBackend) -> None:
    config = tiny_config().model
    model = materialized(config)
    apply_sdpa_choice(model, SdpaChoice(backend))
    documents, sample = packed_row(config.vocab_size)
    inputs, targets, numbers = document_batch(sample)
    with torch.no_grad():
        packed = F.cross_entropy(model(inputs, None, numbers).flatten(0, 1), targets.flatten())
        alone = [F.cross_entropy(model(doc[None, :-1])[0], doc[1:], reduction="sum") for doc in documents]
    # Each document predicts its own next tokens, n - 1 of them; targets crossing a boundary are ignored.
    assert int((targets != IGNORE_INDEX).sum()) == sum(n - 1 for n in LENGTHS)
    assert abs(packed.item() - (sum(alone) / sum(n - 1 for n in LENGTHS)).item()) < 1e-5


def test_the_chunked_loss_counts_only_the_targets_that_count() -> None:
    config = tiny_config().model
    model = materialized(config)
    _, sample = packed_row(config.vocab_size)
    inputs, targets, numbers = document_batch(sample)
    with torch.no_grad():
        full = F.cross_entropy(model(inputs, None, numbers).flatten(0, 1), targets.flatten())
        apply_loss_choice(model, tiny_config(loss__kind="chunked", loss__chunk_tokens=8).loss)
        chunked = model(inputs, targets, numbers)
    assert abs(full.item() - chunked.item()) < 1e-6


def test_the_mask_is_causal_within_a_document_and_closed_across() -> None:
    mask = block_causal_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0]
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]


def test_without_documents_the_row_attends_across_them() -> None:
    """The check above can fail: with plain causal attention (packing=concat) the losses differ."""
    config = tiny_config().model
    model = materialized(config)
    _, sample = packed_row(config.vocab_size)
    inputs, targets, numbers = document_batch(sample)
    with torch.no_grad():
        masked = F.cross_entropy(model(inputs, None, numbers).flatten(0, 1), targets.flatten())
        causal = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    assert abs(masked.item() - causal.item()) > 1e-3


def test_cudas_flash_kernel_is_refused_for_document_masks() -> None:
    check_document_mask(SdpaChoice(SDPBackend.FLASH_ATTENTION), "cpu")  # the CPU kernel takes a mask
    check_document_mask(SdpaChoice(SDPBackend.EFFICIENT_ATTENTION), "cuda")
    check_document_mask(SdpaChoice(SDPBackend.CUDNN_ATTENTION), "cuda")  # cuDNN takes one too
    with pytest.raises(
        ConfigError,
        match=r"^data.packing=document needs .* attention=efficient, attention=cudnn or attention=math",
    ):
        check_document_mask(SdpaChoice(SDPBackend.FLASH_ATTENTION), "cuda")
