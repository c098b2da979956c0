"""Each layer's gradient and parameter L2 norm over the whole model, on log steps (telemetry.layer_norms).

A layer is one of the decoder's own top-level modules: `tok_embeddings`, each block `layers.{i}`, the final
`norm` and the output head `output` (none of its own with tied embeddings: the one weight is the
embedding's). The gradient norms are taken where the loop takes the global one (trainer/rank/optim.py
`clip_gradients`): after the reduction and the fp16 unscale, before clipping, so that the squares of the
layers' norms add up to the square of `optim/grad_norm`; the parameter norms after the optimizer step.
Composer's OptimizerMonitor logs the same per-layer norms after the reduction.

One collective a log step: each rank sums the squares of what it holds, layer by layer, each tensor weighted
so that the ranks' sum counts every element once, and one all-reduce of that vector (2 x layers float64)
over every rank adds them:

- a plain tensor (DDP, ZeroRedundancyOptimizer: every rank of a stage holds it whole) is held by the
  world_size / pp ranks of its pipeline stage: weight pp / world_size;
- a DTensor (FSDP2, tensor parallelism, both) holds a local piece: its mesh dims with a Shard placement
  (FSDP2's _StridedShard under TP too) cut the tensor (their pieces add up), the Replicate dims copy it, and the ranks outside its mesh (DDP's
  replicas beside a TP mesh, the other pipeline stages) copy it or hold none of it. Over the stage's
  world_size / pp ranks each element is held (world_size / pp) / (product of the Shard dims' sizes) times:
  weight (product of the Shard dims' sizes) * pp / world_size.

Every layer lives on exactly one pipeline stage (trainer/model/pipeline_split.py), so under parallel.pp the
other stages add zeros to its entries. Under local SGD (zero.sync_every > 1) the replicas' gradients differ
between averages: the figure is then the root of their mean square, not any one replica's norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import ModelConfig
from trainer.model.decoder import canonical_name
from trainer.telemetry import keys


def layer_names(model: ModelConfig) -> list[str]:
    """The layers, in the model's order: embedding, blocks, final norm, output head (untied only)."""
    blocks = [f"layers.{i}" for i in range(model.n_layers)]
    return ["tok_embeddings", *blocks, "norm", *([] if model.tie_embeddings else ["output"])]


def layer_of(name: str) -> str:
    """The layer a parameter's (possibly wrapped) name belongs to: `layers.3.attention.wq.weight` -> `layers.3`."""
    parts = canonical_name(name).split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


class LayerNorms:
    """The layers' norms of one rank's model: its local squared sums, then the one all-reduce."""

    def __init__(self, model: ModelConfig, world_size: int, pp: int, device: torch.device) -> None:
        self.layers = layer_names(model)
        self.device = device
        """Where the vector is reduced: the rank's device (offload=cpu keeps the parameters on the host)."""
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.world_size = world_size
        self.stage_ranks = world_size // pp
        """The ranks that hold each layer (some piece of it): those of its pipeline stage."""

    def squares(self, model: nn.Module, grads: bool) -> torch.Tensor:
        """This rank's weighted squared sums per layer (float64, on the rank's device), of the gradients or
        of the parameters; no collective."""
        named = [(name, param.grad if grads else param.detach()) for name, param in model.named_parameters()]
        named = [(name, tensor) for name, tensor in named if tensor is not None]
        out = torch.zeros(len(self.layers), dtype=torch.float64, device=self.device)
        if not named:
            return out
        locals_, weights = zip(*(self.local_piece(tensor) for _, tensor in named))
        # One norm per tensor in fp32 (the master weights' and gradients' dtype), squared in float64.
        norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in locals_])
        index = torch.tensor([self.index[layer_of(name)] for name, _ in named], device=self.device)
        weight = torch.tensor(weights, dtype=torch.float64, device=self.device)
        return out.index_add_(0, index, norms.to(self.device, torch.float64).square() * weight)

    def local_piece(self, tensor: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The tensor this rank holds and its weight in the ranks' sum (the module docstring)."""
        if type(tensor).__name__ != "DTensor":  # no DTensor import in a process that never makes one
            return tensor, 1.0 / self.stage_ranks
        if any(p.is_partial() for p in tensor.placements):
            # Not met in the loop: gradients reach clipping reduced (FSDP2's reduce-scatter, TP's
            # replicate_partial_grads); a Partial piece's square is not its share of the whole's square.
            raise ValueError(f"layer norms of a Partial DTensor ({tensor.placements}): reduce it first")
        mesh = tensor.device_mesh
        shards = 1
        for dim, placement in enumerate(tensor.placements):
            # Every other placement cuts the tensor: Shard, and FSDP2's _StridedShard under TP, which
            # is_shard() does not count (torch 2.13: measured, tp=2 x dp=2 stage3 halved its sums).
            if not placement.is_replicate():
                shards *= mesh.size(dim)
        return tensor.to_local(), shards / self.stage_ranks

    def reduce(self, grad_squares: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """[grad norms per layer, parameter norms per layer] over the whole model: this rank's gradient squares
        (taken before clipping) and its parameters' now, in one all-reduce; left on the device."""
        both = torch.cat([grad_squares, self.squares(model, grads=False)])
        if self.world_size > 1:
            dist.all_reduce(both)
        return both.sqrt()

    def fields(self, norms: torch.Tensor) -> dict[str, float]:
        """The record's keys (`grad_norm/<layer>`, `param_norm/<layer>`) from `reduce`'s vector (a host sync)."""
        values = norms.tolist()
        n = len(self.layers)
        return {
            **{keys.layer_grad_norm_key(layer): values[i] for i, layer in enumerate(self.layers)},
            **{keys.layer_param_norm_key(layer): values[n + i] for i, layer in enumerate(self.layers)},
        }
