"""offload=nvme's AdamW (trainer/rank/nvme.py) on plain tensors in this process: bitwise torch's AdamW, chunk by
chunk through a buffer smaller than the tensors; the traffic it counts; its file gone from the directory at once;
its state loaded from another AdamW's state dict; the CPU cap not counting the mapped file."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from trainer.faults.tensor_cap import TensorCap
from trainer.rank.nvme import ALIGN, NvmeAdamW, chunk_elements
from trainer.units import MIB

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = [(300_001,), (700, 513), (7,)]  # one tensor of several chunks, uneven ends, one smaller than a page


def parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def step_both(ours: NvmeAdamW, theirs: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        ours.step()
        theirs.step()


def test_chunked_steps_are_torchs_adamw_bitwise_and_counted(tmp_path: Path) -> None:
    buffer = MIB  # 131,072-element chunks: the first tensor takes three
    ours, theirs = (
        NvmeAdamW(parameters(), tmp_path, 0, buffer, **HYPER),
        torch.optim.AdamW(parameters(), **HYPER),
    )
    assert chunk_elements(buffer) == 131_072 and list(tmp_path.iterdir()) == []  # unlinked once open
    step_both(ours, theirs, steps=3)
    for a, b in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[a][key], theirs.state[b][key])
        assert ours.state[a]["step"].item() == theirs.state[b]["step"].item() == 3
    traffic = ours.take_traffic()  # the three steps': 8 bytes each way per element and step
    elements = sum(p.numel() for p in parameters())
    assert traffic.read_bytes == traffic.written_bytes == 3 * 8 * elements
    assert ours.take_traffic().read_bytes == 0  # counted afresh
    assert ours.file.mapping.numel() == sum(2 * -(-n // ALIGN) * ALIGN for n in (300_001, 700 * 513, 7))


def test_a_state_dict_of_torchs_adamw_loads_into_the_file(tmp_path: Path) -> None:
    theirs = torch.optim.AdamW(parameters(), **HYPER)
    step_both(NvmeAdamW(parameters(), tmp_path, 1, MIB, **HYPER), theirs, steps=2)
    ours = NvmeAdamW(parameters(), tmp_path, 2, MIB, **HYPER)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # as from a save: no tensor shared with theirs
    for a, b in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            mapped = ours.state[a][key]
            assert mapped.untyped_storage().data_ptr() == ours.file.mapping.untyped_storage().data_ptr()
            assert torch.equal(mapped, theirs.state[b][key])
    theirs_params = theirs.param_groups[0]["params"]
    with torch.no_grad():
        for a, b in zip(ours.param_groups[0]["params"], theirs_params):
            a.copy_(b)
    step_both(ours, theirs, steps=1, seed=2)  # and steps on from it as torch's does
    assert all(torch.equal(a, b) for a, b in zip(ours.param_groups[0]["params"], theirs_params))


def test_the_cpu_cap_counts_the_buffer_not_the_mapped_moments(tmp_path: Path) -> None:
    with TensorCap(2**40) as cap:
        params = parameters()
        held = cap.held
        optimizer = NvmeAdamW(params, tmp_path, 3, MIB, **HYPER)
        assert cap.held - held == MIB + 4 * len(params)  # the buffer and the step counters
        del optimizer
