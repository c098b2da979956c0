"""torch.compile, per transformer block, in place (torchtitan's way).

Order matters and is the caller's (trainer/rank/loop.py build_trainee): activation checkpointing
first (the compiled region then contains the checkpoint, so recomputation is compiled too),
then each block compiled, then FSDP2's fully_shard, whose hooks stay eager around the compiled
blocks. `Module.compile()` compiles in place: parameter names keep no `_orig_mod.` segment
(which `torch.compile(module)` would add), so a save from a compiled run and one from an eager
run hold the same keys and load into each other. Per block rather than the whole model: every
block has the same code, so one compiled graph serves all of them, and compile time does not
grow with depth.
"""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module, enabled: bool, backend: str) -> int:
    """Compile each block of `model.layers` in place with `backend`; returns how many (0 when disabled)."""
    if not enabled:
        return 0
    for block in model.layers:
        block.compile(backend=backend)
    return len(model.layers)
