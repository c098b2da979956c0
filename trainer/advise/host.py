"""The host's part of an eager GPU step: launching its ops can take longer than the GPU runs them.

An eager step dispatches every aten op from Python, one after another; the GPU runs each kernel as soon
as it is queued. Where the kernels are short (a small model, a small micro-batch) the GPU waits for the
host, and the step takes the host's time, not the GPU's. The H200 run of 2026-12-04 (docs/gpu.md
"Results") measured it: 125m at micro_batch 8, seq_len 1024 ran at 150,838 tokens/s (54.3 ms a step)
where the advisor's GPU time alone said 390,132 (21 ms); 1b, whose kernels are longer, ran as predicted.

The host's time is the ops a rank dispatches per step times a per-op cost:

    H = grad_accum · (fixed + per_block · blocks on the rank) · HOST_OP_S

The op counts are counted, not fitted: every op one training step of the 125m preset dispatches below
autograd (a TorchDispatchMode over forward, backward, gradient clipping and fused AdamW, bf16), at one
and two blocks, for each way a rank wraps its model (tests/unit/advise/test_host_term.py counts them
again on CPU and holds these figures). The per-op cost is fitted on the one H200 point above, the run that
still wrapped DDP at one rank: 54.3 ms / 3,421 ops (that code's count). Its check is the other point of that
run, 125m at stage3 (FSDP2): 3,876 ops (that code's) predict 61.5 ms, 16% faster than the measured 71.1 ms,
which FSDP2's Python hooks take beyond their ops. Compiled steps (compile=true) launch fused kernels whose count this does
not know yet: they get no host term; nor do CPU ranks, whose host is their device.
"""

from __future__ import annotations

from trainer.config import TrainConfig

HOST_OPS: dict[str, tuple[int, int]] = {
    "none": (74, 235),  # one replica (a one-rank job): no wrapper
    "ddp": (84, 254),  # zero=stage0/1 over several replicas: DDP's bucket copies and all-reduces
    "fsdp": (107, 288),  # zero=stage2/3: FSDP2's all-gathers, casts and reduce-scatters per block
}
"""Per wrapper, the ops one step of one micro-batch dispatches: (outside the blocks, per block)."""

MEASURED_STEP_OPS = 85 + 278 * 12
"""The ops of the measured 125m step, DDP at one rank, as that run's code dispatched them: its rotary
embedding took 24 more ops a block than the complex multiply since (trainer/model/decoder.py `apply_rope`)."""

HOST_OP_S = 54.3e-3 / MEASURED_STEP_OPS
"""Seconds of host time per dispatched op in an eager step: the 125m step on one H200 (module docstring),
15.9 µs."""


def wrapper(config: TrainConfig, replicas: int) -> str:
    """Which of HOST_OPS' wrappers a rank's model has (trainer/rank/parallelize.py)."""
    if config.zero.uses_fsdp:
        return "fsdp"
    return "ddp" if replicas > 1 else "none"


def host_ops(config: TrainConfig, blocks: int, replicas: int) -> int:
    """The ops one rank dispatches per optimizer step, over its `blocks` and every micro-batch."""
    fixed, per_block = HOST_OPS[wrapper(config, replicas)]
    return config.grad_accum * (fixed + per_block * blocks)


def host_seconds(config: TrainConfig, blocks: int, replicas: int, on_gpu: bool) -> float:
    """H (module docstring) for an eager step on a GPU; 0 where it does not apply (compiled, CPU ranks)."""
    if config.compile or not on_gpu:
        return 0.0
    return host_ops(config, blocks, replicas) * HOST_OP_S
