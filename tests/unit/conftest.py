"""Fixtures shared by unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A one-rank gloo group in this process (DCP and FSDP2 collectives need one)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()
