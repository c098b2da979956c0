"""What fraction of a GPU's dense peak a training step's matmuls reach: fitted to published runs.

A step's FLOPs are the model's GEMMs, each (rows x k) @ (k x n), run forward and twice backward with
the same three sizes permuted, plus attention's two batched products per head (T x Q by Q x T and
T x T by T x Q). A GEMM with a small dimension reaches less of the tensor cores' peak (tiles are
partly empty, the kernel is bound by memory rather than math), so each GEMM's share of the peak is

    efficiency(m, n, k) = E_acc · s(m) · s(n) · s(k),   s(x) = x / (x + X0)

and a step's efficiency is the FLOP-weighted mean over its GEMMs. E_acc (one per accelerator
family: what a large GEMM reaches inside a whole training step, power and clocks included) and
X0 (shared) are fitted by benchmarks/plan_vs_published.py on published torchtitan runs and
validated on the others (docs/memory_plan.md, "Held against published GPU measurements"); the
script fails when these constants drift from its fit. Parts without a published run zerolab can
express get no efficiency: mode=advise refuses them, naming what is missing.
"""

from __future__ import annotations

from trainer.config import ModelConfig

GEMM_HALF_SIZE = 8.0
"""X0: the GEMM dimension at which s(x) = 1/2 (fitted: the lower end of the searched grid. Every
published run zerolab can express is a >= 7B model whose GEMMs are >= 128 wide, so these points
barely constrain the shape term, and a small model's lower efficiency is not yet in the fit)."""

FAMILY_EFFICIENCY: dict[str, float] = {
    # 64 A100-SXM4-80GB, torchtitan docs/performance.md (commit 4d88a8a44^): Llama-2-13B and 70B.
    "a100": 0.6471,
    # 8 H100 96 GB HBM2e at 500 W (Grand Teton), torchtitan commit 9dc418a8b: Llama-3-8B, no AC.
    "h100-hbm2e": 0.3831,
}
"""E_acc: a large GEMM's share of the dense peak inside a training step (fitted)."""

FIT_ERROR = {
    "a100": "tokens/s -42.5% to +18.8% on 8 published validation runs, 7 within 20% "
    "(the miss: 70B at batch 1 on 64 GPUs, bound by the assumed network rate)",
    "h100-hbm2e": "tokens/s +1.3% to +16.2% on 6 published validation runs",
}
"""What benchmarks/plan_vs_published.py measured on the points the fit did not use."""


def gemms(m: ModelConfig, rows: int, seq_len: int) -> list[tuple[float, tuple[int, int, int]]]:
    """(training FLOPs per token, (m, n, k)) of every GEMM of one token's step, as flops_per_token counts them."""
    heads = m.n_heads * m.head_width  # H·Q: dim unless model.head_dim sets the width (Qwen3)
    kv = m.n_kv_heads * m.head_width
    block = [(m.dim, heads), (m.dim, kv), (m.dim, kv), (heads, m.dim)]  # wq, wk, wv, wo (k, n)
    block += [(m.dim, m.ffn_dim), (m.dim, m.ffn_dim), (m.ffn_dim, m.dim)]  # w1, w3, w2
    out = [(6.0 * k * n * m.n_layers, (rows, n, k)) for k, n in block]
    out.append((6.0 * m.dim * m.vocab_size, (rows, m.vocab_size, m.dim)))  # the output head
    # Attention: scores (T x Q @ Q x T) and the weighted sum (T x T @ T x Q), 12·L·H·Q·T per token.
    out.append((12.0 * m.n_layers * m.n_heads * m.head_width * seq_len, (seq_len, seq_len, m.head_width)))
    return out


def shape_factor(m: ModelConfig, rows: int, seq_len: int, half: float | None = None) -> float:
    """The FLOP-weighted mean of s(m)·s(n)·s(k) over the step's GEMMs (rows: tokens per micro-batch)."""
    half = GEMM_HALF_SIZE if half is None else half

    def s(x: int) -> float:
        return x / (x + half)

    parts = gemms(m, rows, seq_len)
    total = sum(flops for flops, _ in parts)
    return sum(flops * s(a) * s(b) * s(c) for flops, (a, b, c) in parts) / total
