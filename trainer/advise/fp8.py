"""mode=advise under bf16: whether precision=fp8 pays, per candidate, from the shapes of its GEMMs.

An fp8 GEMM runs at twice bf16's dense peak on Hopper (H100/H200 SXM datasheets: 1,979 against 989
TFLOPS), but each of a linear's three GEMMs (forward, input gradient, weight gradient) first casts
its operands: the input, the weight and the output gradient, each twice (torchao keeps the
high-precision tensors for backward and casts them again there), reading 2 bytes and writing 1
per element. The casts cost memory traffic, the GEMM saves compute time, so fp8 pays on large
GEMMs and loses on small ones (torchao's README shows the same break-even by shape). Per block
linear of shape (M tokens, K in, N out):

    t_bf16 = 2MKN / bf16_peak        t_fp8 = 2MKN / fp8_peak + c_recipe * 6(MK + KN + MN) / hbm

per GEMM triple summed over the block's converted linears (those `fp8_split` names for the filter and
recipe: the advised commands leave precision.fp8_filter at auto, torchao's small-GEMM filter); their
share f of the step's FLOPs (the output head stays bf16, attention is not a linear) turns it into the
step's compute time,
compute_fp8 = compute_bf16 * (1 - f + f * sum t_fp8 / sum t_bf16). The one constant per recipe,
c_recipe, is fitted to the published points (PUBLISHED), all Llama-3.1-8B on 8 H100s at
seq_len 8192, one sequence per rank, compiled (fp8 is fast only compiled: the advisor's fp8 rows run
with compile=true). The tensorwise points disagree by 3 percentage points, so the fit is held to
FIT_ERROR_PP either way (tests/unit/advise/test_fp8_advice.py). The published runs converted every block
linear (torchtitan docs/float8.md's commands pass no `filter_fqns`, so not torchao's `auto_filter_small_kn`:
its default keeps only the output head), so the fit takes precision.fp8_filter=all's split (PUBLISHED_FILTER).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.advise.calibrate import ACCELERATORS
from trainer.config import Fp8Filter, Fp8Recipe, ModelConfig
from trainer.model.decoder import flops_per_token
from trainer.model.fp8 import block_linears, fp8_split

if TYPE_CHECKING:  # predict.py times fp8 jobs with this module: the step's type only in annotations
    from trainer.advise.predict import StepTime

FP8_DENSE_TFLOPS = {"h100": 1978.9, "h200": 1978.9, "h100-hbm2e": 1978.9, "b200": 4500.0}
"""Dense fp8 (e4m3) tensor-core peaks, the NVIDIA H100 SXM5 and H200 SXM datasheets (3,958 with sparsity); the
96 GB HBM2e H100 torchtitan measured on takes the SXM part's, as its bf16 peak does (trainer/devices.py; its
own clocks are not published). B200: the HGX B200 datasheet's 72 PFLOPS fp8 for 8 GPUs with sparsity, halved,
per GPU (trainer/advise/calibrate.py's b200 row; the cast fit is Hopper's, unvalidated there)."""
BF16_DENSE_TFLOPS = {
    "h100": 989.4,
    "h200": 989.4,
    "h100-hbm2e": 989.4,
    "b200": 2250.0,
}  # the same; trainer/devices.py's figures
NO_FP8_REASON = "no fp8 tensor cores (fp8 GEMMs need compute capability 8.9 or later: Ada, Hopper, Blackwell)"
CAST_BYTES = 6  # per element of each operand: two casts (forward, backward) of 2 bytes read + 1 written


@dataclass(frozen=True)
class Published:
    recipe: str
    speedup: float  # tokens/s over compiled bf16
    source: str


PUBLISHED = (
    Published(
        "tensorwise",
        1.25,
        "torchtitan docs/float8.md and torchao's float8 README: Llama-3.1-8B, 8 H100, tensorwise with fp8 "
        "all-gather, compiled, +25% tokens/s over bf16, peak memory +0.3%",
    ),
    Published(
        "tensorwise", 1.28, "torchtitan docs/float8.md: the same with torch.compile, +28% over compiled bf16"
    ),
    Published(
        "rowwise", 1.10, "torchtitan docs/float8.md and torchao's float8 README: rowwise, +10% over bf16"
    ),
)
LLAMA31_8B = ModelConfig(
    name="llama3-8b",
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    ffn_dim=14336,
    max_seq_len=131072,
)  # conf/model/llama3-8b.yaml's GEMM shapes (rope settings change no GEMM; tests/unit/advise checks they agree)
PUBLISHED_SHAPE: dict[str, Any] = dict(accelerator="h100", seq_len=8192, micro_batch=1)  # llama3-8b, 8 ranks
FIT_ERROR_PP = 1.5  # percentage points: half the spread of the two tensorwise figures
PUBLISHED_FILTER = Fp8Filter.all  # what the published runs converted (module docstring)


def offers_fp8(accelerator: str | None) -> bool:
    return accelerator in FP8_DENSE_TFLOPS


def every_linear(m: ModelConfig, converted: tuple[str, ...] | None) -> tuple[str, ...]:
    """`converted`, or where None every block linear fp8 GEMMs can take (precision.fp8_filter=all's split)."""
    return fp8_split(m, Fp8Filter.all, Fp8Recipe.tensorwise).converted if converted is None else converted


def gemm_ratio(
    m: ModelConfig,
    tokens: int,
    accelerator: str,
    hbm_tbps: float,
    cast_cost: float,
    converted: tuple[str, ...] | None = None,
) -> float:
    """sum t_fp8 / sum t_bf16 over one block's `converted` linears (of `m`'s shapes; None: every one),
    `tokens` = M per GEMM."""
    hbm = hbm_tbps * 1e12
    bf16, fp8 = BF16_DENSE_TFLOPS[accelerator] * 1e12, FP8_DENSE_TFLOPS[accelerator] * 1e12
    t_bf16 = t_fp8 = 0.0
    linears = block_linears(m)
    for name in every_linear(m, converted):
        k, n = linears[name]
        flops = 6.0 * tokens * k * n
        t_bf16 += flops / bf16
        t_fp8 += flops / fp8 + cast_cost * CAST_BYTES * (tokens * k + k * n + tokens * n) / hbm
    return t_fp8 / t_bf16 if t_bf16 else 1.0


def linear_share(m: ModelConfig, seq_len: int, converted: tuple[str, ...] | None = None) -> float:
    """The `converted` block linears' (None: every one's) share of a step's FLOPs (6 per parameter and token)."""
    linears = block_linears(m)
    numel = sum(linears[name][0] * linears[name][1] for name in every_linear(m, converted))
    return 6.0 * numel * m.n_layers / flops_per_token(m, seq_len)


def compute_factor(
    m: ModelConfig,
    seq_len: int,
    micro_batch: int,
    accelerator: str,
    hbm_tbps: float,
    cast_cost: float,
    converted: tuple[str, ...] | None = None,
) -> float:
    """compute_fp8 / compute_bf16 of one step with a block's `converted` linears (None: every one) in fp8."""
    f = linear_share(m, seq_len, converted)
    return 1.0 - f + f * gemm_ratio(m, micro_batch * seq_len, accelerator, hbm_tbps, cast_cost, converted)


def fit_cast_cost(m: ModelConfig, hbm_tbps: float, recipe: str) -> float:
    """c_recipe: the mean published speed-up of `recipe` at PUBLISHED_SHAPE, solved for (the model is
    linear in c, so one division), taking the step as compute (torchtitan's 8B run on one node hides
    FSDP's collectives behind compute)."""
    points = [p.speedup for p in PUBLISHED if p.recipe == recipe]
    target = sum(points) / len(points)
    s = PUBLISHED_SHAPE
    converted = fp8_split(m, PUBLISHED_FILTER, Fp8Recipe(recipe)).converted
    f = linear_share(m, s["seq_len"], converted)
    ratio = (1.0 / target - (1.0 - f)) / f  # the sum t_fp8 / sum t_bf16 the target needs
    tokens = s["micro_batch"] * s["seq_len"]
    free = gemm_ratio(m, tokens, s["accelerator"], hbm_tbps, 0.0, converted)  # casts cost nothing
    per_unit = gemm_ratio(m, tokens, s["accelerator"], hbm_tbps, 1.0, converted) - free
    return (ratio - free) / per_unit


def fp8_compute_factor(
    m: ModelConfig,
    seq_len: int,
    micro_batch: int,
    accelerator: str,
    recipe: str,
    converted: tuple[str, ...] | None = None,
) -> float | None:
    """compute_fp8 / compute_bf16 of a step of `m` (a TP rank's local model under parallel.tp) in `recipe` with
    a block's `converted` linears in fp8 (`fp8_split` of the whole model: torchao converts before sharding;
    None: every one);
    None where the accelerator has no fp8 tensor cores or the recipe no published point to fit its casts by
    (rowwise_with_gw_hp)."""
    if not offers_fp8(accelerator) or recipe not in {p.recipe for p in PUBLISHED}:
        return None
    cost = fit_cast_cost(LLAMA31_8B, ACCELERATORS[PUBLISHED_SHAPE["accelerator"]].hbm_tbps, recipe)
    hbm = ACCELERATORS[accelerator].hbm_tbps
    return compute_factor(m, seq_len, micro_batch, accelerator, hbm, cost, converted)


@dataclass(frozen=True)
class Fp8Prediction:
    recipe: str
    speedup: float  # tokens/s over the same configuration in bf16, both compiled
    pays: bool
    tokens_factor: float = 1.0  # tokens/s over the bf16 candidate as it was timed (eager unless compile=true)


def predict_fp8(
    m: ModelConfig,
    seq_len: int,
    micro_batch: int,
    accelerator: str,
    step: StepTime,
    compile_gain: float = 1.0,
    model: ModelConfig | None = None,
) -> list[Fp8Prediction]:
    """Each recipe's predicted speed-up for one bf16 candidate (`m`: the model its ranks run, a TP rank's local
    one under parallel.tp, `model` the whole one where that differs, whose shapes torchao's filter sees;
    `compile_gain`: its compute time over compiled compute's, 1 if it compiles already), compiled as the fp8
    rows run, with the advised command's precision.fp8_filter (auto): its compute time scaled, with the
    pipeline bubble that follows it; its communication, optimizer and offload time as timed
    (StepTime.with_compute_scaled)."""
    compiled = step.with_compute_scaled(1.0 / compile_gain).step_s
    out = []
    for recipe in ("tensorwise", "rowwise"):
        converted = fp8_split(model or m, Fp8Filter.auto, Fp8Recipe(recipe)).converted
        factor = fp8_compute_factor(m, seq_len, micro_batch, accelerator, recipe, converted)
        assert factor is not None, f"{accelerator} offers fp8 and {recipe} has published points"
        fp8_s = step.with_compute_scaled(factor / compile_gain).step_s
        out.append(Fp8Prediction(recipe, compiled / fp8_s, compiled > fp8_s, step.step_s / fp8_s))
    return out
