"""Tensor parallelism (Megatron-LM's column- and row-parallel layers) and sequence parallelism, on torch's
own `parallelize_module`, laid out as torchtitan lays out Llama 3 (pytorch/torchtitan,
torchtitan/models/llama3/infra/parallelize.py `apply_tp`):

- attention wq, wk, wv and MLP w1, w3: ColwiseParallel (each rank computes H / tp heads, M / tp hidden);
- attention wo and MLP w2: RowwiseParallel (partial sums reduced: all-reduce, or with SP reduce-scatter
  over the sequence);
- the norms: SequenceParallel (with SP each rank normalises T / tp positions; the block's input is
  all-gathered by PrepareModuleInput before attention and the MLP);
- the embedding: RowwiseParallel over the vocabulary; the output head: ColwiseParallel over the vocabulary,
  its logits left sharded (Shard(-1)) for `loss_parallel`, which takes the cross-entropy without
  gathering them.

Without SP (parallel.sp=false) the residual stream is replicated over the TP group and the norms hold a
replicated DTensor weight (`distribute_module`), so that every parameter lives on the TP mesh.

The mesh: the job's one mesh (trainer/rank/mesh.py); `tp` is its innermost dim (trainer/layout.py), so a TP
group is `tp` consecutive ranks inside one node (parallel.tp divides nproc). zero shards over the dp dims.
Applied on the meta-device model, before activation checkpointing and FSDP2 (torchtitan's order).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, sp: bool, chunked_loss: bool = False
) -> None:
    """Shard the meta model's layers over `tp_mesh` (torchtitan's apply_tp, with or without SP). Under
    `chunked_loss` (loss=chunked) the final norm's output stays a DTensor (`replicate_norm`)."""
    between = Shard(1) if sp else Replicate()  # the residual stream between the layers
    root = {
        "tok_embeddings": SyncRowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    # A pipeline stage (trainer/model/pipeline_split.py) holds the embedding only on the first stage, the
    # final norm and head only on the last: the rest are None, and the plan names only what is there. Between
    # stages the residual stream crosses as each TP rank's local tensor (its sequence shard under SP), so the
    # next stage's first norm and attention receive it as they would from the block before.
    held = {name: style for name, style in root.items() if getattr(model, name, None) is not None}
    if held:
        parallelize_module(model, tp_mesh, held)
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan(block, sp))
    final = [model.norm] if model.norm is not None else []
    norms = [*final, *(n for b in model.layers for n in (b.attention_norm, b.ffn_norm))]
    if sp:
        for norm in norms:
            parallelize_module(norm, tp_mesh, SequenceParallel())
    else:
        for norm in norms:
            replicate_norm(norm, tp_mesh, local_output=not (chunked_loss and norm is model.norm))


class SyncRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output's reduction is waited for before it leaves the module.

    torch's RowwiseParallel reduces its Partial output with `async_op=True`, so the embedding hands the first
    block an AsyncCollectiveTensor. A compiled block (compile=true) takes that as a graph input, and its
    backward then returns a plain tensor where the embedding's Redistribute expects a DTensor: measured on 2
    CPU ranks, torch 2.13, a crash in eager autograd or, under FSDP2, a step-1 gradient norm of 1.044 against
    eager's 1.156. torch does not wait such tensors at compiled-graph boundaries (pytorch/pytorch#180614,
    open). The next op needs the reduced output at once, so waiting here costs no overlap."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh
    ) -> torch.Tensor:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def block_plan(block: nn.Module, sp: bool) -> dict[str, Any]:
    """One block's layers (the norms are apply_tensor_parallel's)."""
    plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sp:  # the norm's sequence shard is gathered whole before the column-parallel layers
        # attention(x, rotary table, mask): only x is a sequence-sharded activation; the block-causal mask
        # (data.packing=document) is the whole sequence's on every TP rank, which read the same documents
        plan["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
    if hasattr(
        block.attention, "q_norm"
    ):  # Qwen3: per-head norms of the rank's local heads (torchtitan's plan)
        plan["attention.q_norm"] = SequenceParallel(use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(use_local_output=True)
    return plan


def replicate_norm(norm: nn.Module, tp_mesh: DeviceMesh, local_output: bool = True) -> None:
    """Without SP: the norm's weight a Replicate DTensor (torch's distribute_module replicates what no
    partition_fn shards), its input and output plain replicated tensors as the layers around it expect. The
    final norm's output under loss=chunked stays the Replicate DTensor (`local_output` false): the chunked loss
    projects it by the head's Shard(0) weight itself (trainer/model/loss.py), bypassing ColwiseParallel's input
    conversion, and DTensor's matmul refuses a plain tensor beside a DTensor."""

    def to_dtensor(
        _module: nn.Module, inputs: tuple[torch.Tensor, ...], mesh: DeviceMesh
    ) -> tuple[DTensor, ...]:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

    def to_local(_module: nn.Module, output: DTensor, _mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()

    distribute_module(norm, tp_mesh, input_fn=to_dtensor, output_fn=to_local if local_output else None)


def loss_context(tp: int) -> AbstractContextManager:
    """Around the loss and its backward: `loss_parallel` takes the cross-entropy of the vocabulary-sharded
    logits without gathering them (torch.distributed.tensor.parallel.loss_parallel)."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor (loss_parallel's is a replicated DTensor), for the loop's sums."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def replicate_partial_grads(model: nn.Module) -> None:
    """Without FSDP2 (zero=stage0 on one replica): reduce each sequence-parallel norm's gradient once, in
    backward. Autograd leaves it Partial (each rank's sequence shard contributes), and every later use of a
    Partial gradient (the norm for clipping, each of AdamW's ops) would all-reduce it again; FSDP2's
    reduction does this conversion itself."""

    def to_replicate(param: torch.Tensor) -> None:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)

    for param in model.parameters():
        if isinstance(param, DTensor):
            param.register_post_accumulate_grad_hook(to_replicate)
