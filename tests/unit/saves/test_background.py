"""trainer/saves/background.py: what the staging of a background save is, without a process group."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager

from trainer.config import SaveAsync
from trainer.saves.background import staging_options


@pytest.mark.parametrize(
    ("mode", "device", "expected"),
    [
        (SaveAsync.thread, "cpu", (False, False, False, False)),
        (SaveAsync.process, "cpu", (False, True, False, False)),
        (SaveAsync.thread, "cuda", (True, False, False, True)),
        (SaveAsync.process, "cuda", (True, True, False, True)),
    ],
)
def test_staging_is_pinned_on_cuda_shared_for_a_process_and_done_before_the_next_step(
    mode: SaveAsync, device: str, expected: tuple[bool, ...]
) -> None:
    options = staging_options(mode, device)
    assert (
        options.use_pinned_memory,
        options.use_shared_memory,
        options.use_async_staging,
        options.use_non_blocking_copy,
    ) == expected


@pytest.mark.torch_versions
@pytest.mark.parametrize("mode", [SaveAsync.thread, SaveAsync.process])
def test_the_staged_state_is_a_copy_the_next_step_cannot_change(mode: SaveAsync) -> None:
    """The write runs beside the next steps, which change the parameters and moments in place:
    what it writes must be the copy made at the save."""
    weight = torch.arange(6, dtype=torch.float32)
    stager = DefaultStager(staging_options(mode, "cpu"))
    try:
        staged = stager.stage({"model": {"w": weight}, "progress": {"step": 4}})
        weight.add_(1)  # the next optimizer step
        assert torch.equal(staged["model"]["w"], torch.arange(6, dtype=torch.float32))
        assert staged["model"]["w"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
        assert staged["model"]["w"].is_shared() == (mode == SaveAsync.process)
        assert staged["progress"] == {"step": 4}
    finally:
        stager.close()
