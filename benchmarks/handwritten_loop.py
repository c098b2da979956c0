"""The baseline for runner_vs_handwritten.py: the shortest honest DDP training loop.

Run by torchrun. Same model code, same shapes, AdamW, grad clipping and cross-entropy as
`python -m trainer zero=stage0 precision=fp32`; no config system, no telemetry, random tokens.
Prints one JSON line with the steady-state tokens/s (the first `--warmup` steps excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ModelConfig
from trainer.model import build_model, materialize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // dist.get_world_size()))
    config = ModelConfig()  # the tiny preset
    model = build_model(config, device="meta")
    materialize(model, torch.device("cpu"), seed=0)
    model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
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
