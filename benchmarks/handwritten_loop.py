"""The baseline for runner_vs_handwritten.py: the shortest honest training loop of each ZeRO stage.

Run by torchrun. Same model code and shapes, AdamW, grad clipping and cross-entropy as
`python -m trainer zero=<stage> precision=fp32`, with torch's own wrappers used directly:
stage0 DDP, stage1 DDP + ZeroRedundancyOptimizer, stage2/3 FSDP2 fully_shard per block and at
the root (reshard_after_forward False/True). No config system, no telemetry, no non-finite
check, random tokens. Prints one JSON line with the steady-state tokens/s (the first
`--warmup` steps excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ModelConfig
from trainer.model.decoder import build_model, materialize

ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def wrap(model: torch.nn.Module, stage: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The stage's wrapper and optimizer, built as torch's documentation shows them."""
    if stage in ("stage2", "stage3"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=stage == "stage3")
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        materialize(model, torch.device("cpu"), seed=0)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)
    materialize(model, torch.device("cpu"), seed=0)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if stage == "stage1":
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    return ddp, torch.optim.AdamW(ddp.parameters(), **ADAMW)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--stage", default="stage0", choices=["stage0", "stage1", "stage2", "stage3"])
    parser.add_argument("--model", default="{}", help="ModelConfig fields as JSON (default: the tiny preset)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // dist.get_world_size()))
    config = ModelConfig(**json.loads(args.model))
    model, optimizer = wrap(build_model(config, device="meta"), args.stage)
    tokens = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1))

    start = 0.0
    for step in range(args.steps):
        if step == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    loss.item()
    dist.barrier()
    elapsed = time.perf_counter() - start
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        measured = args.steps - args.warmup
        print(json.dumps({"tokens_per_s": measured * args.micro_batch * args.seq_len * world / elapsed}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
