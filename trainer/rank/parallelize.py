"""The one sequence of transforms that turns a meta-device model part into what this rank trains.

Applied to the whole model, or to each of this rank's pipeline stages (trainer/rank/pipeline.py), in the
one order torchtitan applies them (pytorch/torchtitan torchtitan/models/llama3/parallelize.py
`parallelize_llama`), each step taking its sub-mesh of the job's one mesh by name (trainer/rank/mesh.py):

1. fp8: the block linears become Float8Linear (precision=fp8), so that every later step wraps them;
2. tensor parallelism over `mesh["tp"]` (parallel.tp), on the layers' own names;
3. the attention kernel, context parallelism's group (parallel.cp) and the loss's chunk size (attention,
   loss.chunk_tokens);
4. activation checkpointing of the blocks (checkpointing), before sharding: it wraps blocks;
5. compile of each block (compile), after checkpointing and before sharding, in place;
6. expert parallelism (parallel.ep): each rank's experts, sharded over the data-parallel sub-mesh, which
   ZeRO (FSDP2 or DDP) then leaves alone, or over an ep group inside it, FSDP2 sharding them over the rest;
7. ZeRO over the data-parallel sub-mesh: DDP with its bucket settings and communication hook, FSDP2's
   fully_shard, or nothing at one model-parallel replica; then each rank materialises (or loads
   model.weights into) only what it holds.

What does not compose is refused before any rank starts (the composition table); nothing here drops a
setting it was given.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.config import LossKind, TrainConfig
from trainer.faults.failures import watch_blocks
from trainer.layout import Layout
from trainer.model.attention import config_choice
from trainer.model.checkpointing import apply_activation_checkpointing
from trainer.model.compile import apply_compile
from trainer.model.context_parallel import ContextParallel
from trainer.model.decoder import apply_context_parallel, apply_loss_choice, apply_sdpa_choice
from trainer.model.fp8 import apply_fp8
from trainer.model.moe import apply_moe_choice
from trainer.rank.experts import apply_expert_parallel
from trainer.rank.mesh import data_parallel_mesh, expert_mesh
from trainer.rank.sharding import apply_zero
from trainer.rank.tensor_parallel import apply_tensor_parallel, replicate_partial_grads
from trainer.world import World


def parallelize(
    part: nn.Module,
    *,
    config: TrainConfig,
    layout: Layout,
    mesh: DeviceMesh,
    world: World,
    secondary: DeviceMesh | None = None,
) -> nn.Module:
    """Transform one meta-device part (the decoder, or a pipeline stage of it) in the module's order;
    returns the module this rank trains (DDP's wrapper, or the part itself). `secondary`: hpZ's mesh under a
    pipeline (trainer/rank/mesh.py `secondary_mesh`)."""
    apply_fp8(part, config.precision, world.device.type, config.parallel.tp)
    if layout.enabled("tp"):
        apply_tensor_parallel(
            part, mesh["tp"], config.parallel.sequence_parallel, config.loss.kind == LossKind.chunked
        )
    choice = config_choice(config, world.device.type)
    apply_sdpa_choice(part, choice)
    if layout.enabled("cp"):
        cp = config.parallel.cp
        group = ContextParallel(
            mesh["cp"].get_group(), cp, layout.coords(world.rank)["cp"], config.parallel.cp_impl
        )
        apply_context_parallel(part, group)
    apply_loss_choice(part, config.loss)
    apply_moe_choice(part, config.moe)
    apply_activation_checkpointing(part, config.checkpointing)
    apply_compile(part, config.compile, config.compile_backend)
    if not config.compile:  # a compiled block would trace the hooks' side effects into its graph
        watch_blocks(
            list(part.layers)
        )  # an out-of-memory failure names its block (trainer/faults/failures.py)
    dp_mesh = data_parallel_mesh(mesh, layout, config.zero)
    experts = expert_mesh(layout, world.device.type, config.parallel.ep)
    ignored = None
    if config.parallel.ep > 1:  # the experts over the ep group: the data-parallel one, or one inside it
        ignored = apply_expert_parallel(part, dp_mesh if experts is None else experts["ep"])
    part = apply_zero(
        part,
        config.zero,
        config.precision,
        config.offload,
        world,
        config.seed,
        config.model.weights,
        dp_mesh=dp_mesh,
        replicas=replicas_to_wrap(layout),
        ignored=ignored,
        secondary=secondary,
        experts_mesh=None if experts is None else experts["expert_shard"],
    )
    if layout.enabled("tp") and not config.zero.uses_fsdp:
        replicate_partial_grads(part)
    return part


def replicas_to_wrap(layout: Layout) -> bool:
    """Whether DDP wraps the part (zero=stage0/1): only over several data-parallel replicas (dp x cp; a cp
    group is replicas too, each rank its own chunks). One replica has nothing to reduce: DDP there would
    only all-reduce each bucket with itself and copy every gradient into its buckets (on one GPU ~85 NCCL
    calls a step the plan does not count), and under TP or PP torch's DDP would swap the DTensor parameters
    for local tensors (_pre_dp_module_transform), hiding them from the gradient norm."""
    return layout.replicas > 1
