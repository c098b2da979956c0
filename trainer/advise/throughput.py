"""What fraction of a GPU's dense peak a training step's matmuls reach: fitted to published runs.

A step's FLOPs are the model's GEMMs, each (rows x k) @ (k x n), run forward and twice backward with
the same three sizes permuted, plus attention's two batched products per head (T x Q by Q x T and
T x T by T x Q). A GEMM with a small dimension reaches less of the tensor cores' peak (tiles are
partly empty, the kernel is bound by memory rather than math), so each GEMM's share of the peak is

    efficiency(m, n, k) = E_acc · s(m) · s(n) · s(k),   s(x) = x / (x + X0)

and a step's efficiency is the FLOP-weighted mean over its GEMMs. E_acc (one per accelerator
family: what a large GEMM reaches inside a whole training step, power and clocks included) and
X0 (shared) are fitted by checks/plan_vs_published.py on published torchtitan runs and
validated on the others (docs/memory_plan.md, "Held against published GPU measurements"); the
script fails when these constants drift from its fit. Parts without a published run zerolab can
express get no efficiency: mode=advise refuses them, naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ModelConfig

GEMM_HALF_SIZE = 128.0
"""X0: the GEMM dimension at which s(x) = 1/2 (fitted on the grid 8..1024. Every published run zerolab
can express is a >= 7B model whose GEMMs are >= 128 wide, so these points constrain the shape term
loosely: a small model's efficiency is extrapolated, not validated)."""

FAMILY_EFFICIENCY: dict[str, float] = {
    # 64 A100-SXM4-80GB, torchtitan docs/performance.md (commit 4d88a8a44^): Llama-2-13B and 70B.
    "a100": 0.6797,
    # 8 H100 96 GB HBM2e at 500 W (Grand Teton), torchtitan commit 9dc418a8b: Llama-3-8B, no AC.
    "h100-hbm2e": 0.4491,
}
"""E_acc: a large GEMM's share of the dense peak inside a training step (fitted)."""

COMPILE_SPEEDUP: dict[str, float] = {
    # pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (at 820504e20), the Grand Teton H100s
    # (96 GB HBM2e, 500 W): Llama 3.1 8B, FSDP, local batch 2, selective AC; FSDP + torch.compile over FSDP:
    # Table 1 (8 GPUs) 6,667 / 5,762 = 1.157, Table 3 (128 GPUs) 6,514 / 5,605 = 1.162; their mean.
    "h100-hbm2e": (6667 / 5762 + 6514 / 5605) / 2,
}
"""compile=true: a step's compute over eager's (E_acc is fitted on eager runs), per family where a published
pair of runs measured it; elsewhere compile=true is timed as eager. Measured on an 8B model: what compile fuses
(norms, rotary, SwiGLU's elementwise product, the residual adds) moves D- or M-wide rows per token, a share of a
step that falls as the GEMMs widen, so on larger models this likely overstates the gain."""


@dataclass(frozen=True)
class FitError:
    """What checks/plan_vs_published.py measured on a family's validation points: predicted
    tokens/s against published, from `low` to `high` (fractions), `within` of `runs` within 20%; and
    `between`: the largest difference of two errors of one model on one cluster (fit points too), how
    far the model can misjudge two configurations against each other."""

    low: float
    high: float
    runs: int
    within: int
    between: float

    def __str__(self) -> str:
        return (
            f"tokens/s {self.low:+.1%} to {self.high:+.1%} on {self.runs} published validation runs, "
            f"{self.within} within 20%; two configurations of one model on one cluster {self.between:.1%} apart"
        )


FIT_ERROR = {
    "a100": FitError(-0.063, 0.097, 8, 8, 0.097),
    "h100-hbm2e": FitError(0.013, 0.246, 6, 5, 0.051),
}
"""What checks/plan_vs_published.py measured on the points the fit did not use, as it prints it
(`fit_errors`); the script fails when these figures and its output differ."""


VALIDATED_PARAMS = (6_738_415_616, 70_553_706_496)
"""The smallest and largest model of checks/plan_vs_published.py's tokens/s points (Llama-2-7B,
Llama-3-70B): outside them a prediction is extrapolated, and the advice says "unvalidated"."""


def validation_note(num_params: int) -> str:
    """Empty inside the published models' sizes, else why the figure is unvalidated."""
    low, high = VALIDATED_PARAMS
    if low <= num_params <= high:
        return ""
    return (
        f"; unvalidated: {num_params / 1e9:.2f}B parameters, the published runs are {low / 1e9:.2f}B-{high / 1e9:.2f}B "
        "(a small model's norms, rotary and vocabulary cost more than its GEMM shapes show)"
    )


def gemms(
    m: ModelConfig, rows: int, seq_len: int, queries: int | None = None
) -> list[tuple[float, tuple[int, int, int]]]:
    """(training FLOPs per token, (m, n, k)) of every GEMM of one token's step, as flops_per_token counts them;
    `queries` the rows of attention's products (a cp rank's under parallel.cp_impl=allgather), else seq_len."""
    heads = m.n_heads * m.head_width  # H·Q: dim unless model.head_dim sets the width (Qwen3)
    kv = m.n_kv_heads * m.head_width
    block = [(m.dim, heads), (m.dim, kv), (m.dim, kv), (heads, m.dim)]  # wq, wk, wv, wo (k, n)
    block += [(m.dim, m.ffn_dim), (m.dim, m.ffn_dim), (m.ffn_dim, m.dim)]  # w1, w3, w2
    out = [(6.0 * k * n * m.n_layers, (rows, n, k)) for k, n in block]
    out.append((6.0 * m.dim * m.vocab_size, (rows, m.vocab_size, m.dim)))  # the output head
    # Attention: scores (T x Q @ Q x T) and the weighted sum (T x T @ T x Q), 12·L·H·Q·T per token.
    attention = (seq_len if queries is None else queries, seq_len, m.head_width)
    out.append((12.0 * m.n_layers * m.n_heads * m.head_width * seq_len, attention))
    return out


def shape_factor(
    m: ModelConfig, rows: int, seq_len: int, half: float | None = None, queries: int | None = None
) -> float:
    """The FLOP-weighted mean of s(m)·s(n)·s(k) over the step's GEMMs (rows: tokens per micro-batch;
    `queries`: attention's, `gemms`)."""
    half = GEMM_HALF_SIZE if half is None else half

    def s(x: int) -> float:
        return x / (x + half)

    parts = gemms(m, rows, seq_len, queries)
    total = sum(flops for flops, _ in parts)
    return sum(flops * s(a) * s(b) * s(c) for flops, (a, b, c) in parts) / total
