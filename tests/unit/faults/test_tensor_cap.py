"""device_memory_gib on CPU: the cap counts live tensor bytes exactly and refuses past it."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from trainer.faults.failures import is_out_of_memory
from trainer.faults.tensor_cap import TensorCap, active_cap

MIB = 2**20


def test_live_tensor_bytes_are_counted_exactly_views_once_and_freed() -> None:
    with TensorCap(64 * MIB) as cap:
        a = torch.ones(4 * MIB)  # 16 MiB of fp32
        view = a.view(4, MIB)[1:]
        assert (cap.held, active_cap()) == (16 * MIB, cap)
        b = torch.zeros(MIB, dtype=torch.bfloat16)  # 2 MiB
        assert cap.held == 18 * MIB
        del a
        assert cap.held == 18 * MIB  # the view keeps the storage alive
        del view, b
        gc.collect()
        assert (cap.held, cap.peak) == (0, 18 * MIB)
    assert active_cap() is None


def test_past_the_cap_an_op_raises_torchs_out_of_memory_error_and_the_cap_lifts() -> None:
    with TensorCap(64 * MIB) as cap:
        kept = torch.ones(12 * MIB)  # 48 MiB
        with pytest.raises(torch.OutOfMemoryError) as raised:
            torch.ones(5 * MIB)  # 20 MiB more: 68 > 64
        assert is_out_of_memory(raised.value)
        assert f"tried to allocate {20 * MIB} bytes while tensors held {48 * MIB} bytes" in str(raised.value)
        assert cap.at_failure() == {"held": 48.0 * MIB, "cap": 64.0 * MIB, "refused": 20.0 * MIB}
        gc.collect()
        assert cap.held == 48 * MIB  # the refused op's output died with the error
        torch.ones(4 * MIB)  # 16 MiB: exactly at the cap is within it
        del kept
    assert torch.ones(32 * MIB).numel() == 32 * MIB  # no cap once it is lifted


def test_a_storage_resize_is_counted_as_fsdp2_frees_and_refills_a_parameter() -> None:
    with TensorCap(8 * MIB) as cap:
        t = torch.empty(MIB)  # 4 MiB
        storage = t.untyped_storage()
        storage.resize_(0)
        assert cap.held == 0
        storage.resize_(4 * MIB)
        assert cap.held == 4 * MIB
        with pytest.raises(torch.OutOfMemoryError):
            storage.resize_(12 * MIB)
    assert torch.UntypedStorage.resize_ is not None and "resize_" == torch.UntypedStorage.resize_.__name__


def test_a_step_counts_parameters_gradients_and_adams_state() -> None:
    """Made under the cap: a 256x256 linear layer's weight and bias, their gradients after backward, and
    Adam's two moments (plus a step counter per parameter) after the first step."""
    with TensorCap(64 * MIB) as cap:
        layer = nn.Linear(256, 256)
        params = sum(p.numel() * 4 for p in layer.parameters())
        assert cap.held == params
        layer(torch.ones(8, 256)).sum().backward()
        gc.collect()
        assert cap.held == 2 * params
        optimizer = torch.optim.Adam(layer.parameters())
        optimizer.step()
        gc.collect()
        assert cap.held == 4 * params + 2 * 4  # two fp32 step counters
