"""torch.compile, per transformer block, in place (torchtitan's way).

Order matters and is the caller's (trainer/rank/loop.py build_trainee): activation checkpointing
first (the compiled region then contains the checkpoint, so recomputation is compiled too),
then each block compiled, then FSDP2's fully_shard, whose hooks stay eager around the compiled
blocks. `Module.compile()` compiles in place: parameter names keep no `_orig_mod.` segment
(which `torch.compile(module)` would add), so a save from a compiled run and one from an eager
run hold the same keys and load into each other. Per block rather than the whole model: every
block has the same code, so one compiled graph serves all of them, and compile time does not
grow with depth.

A mixture-of-experts block keeps two of its MoE layer's calls eager inside the compiled block
(`eager_inside_compiled`), applied here rather than as decorators so that importing the model (the job
process, the advisor) does not import torch._dynamo.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.model.moe import moe_layers


def apply_compile(model: nn.Module, enabled: bool, backend: str) -> int:
    """Compile each block of `model.layers` in place with `backend`; returns how many (0 when disabled)."""
    if not enabled:
        return 0
    for block in model.layers:
        eager_inside_compiled(block)
        block.compile(backend=backend)
    return len(model.layers)


def eager_inside_compiled(block: nn.Module) -> None:
    """Each MoE layer's expert run and router log, run eager (torch.compiler.disable) in the compiled block.
    run_experts: the counts go to the host (.tolist(), a graph break), and the loop's and the all-to-alls' split
    sizes are those counts, which change every forward, so a trace past the break would guard on them.
    write_log: traced, the log's Python state (its list of losses, whether its loads exist yet, the layer's
    index) became guards, measured as a recompile per layer (TORCH_LOGS=recompiles)."""
    for layer in moe_layers(block):
        layer.run_experts = torch.compiler.disable(layer.run_experts)
        layer.write_log = torch.compiler.disable(layer.write_log)
