"""precision=fp8: the block linears as torchao's Float8Linear (`convert_to_float8_training`).

torchao is an optional extra (`pip install 'zerolab[fp8]'`), imported only where a model is converted.
Which linears convert is arithmetic on the model's shapes (`fp8_split`), so the plan lists the
modules left in bf16 without torchao: the output head (torchtitan leaves it out too: its
`filter_fqns = ["output"]`, the logits feed an fp32 loss), any linear whose dims fp8 GEMMs
cannot take (torch._scaled_mm needs both dims divisible by 16), and under precision.fp8_filter=auto
(the default) the small GEMMs torchao's own filter skips because fp8's casts cost more there than
its GEMM saves (`SMALL_GEMM_RULES`). In a mixture of experts only the attention linears convert: the
router's gate, the shared experts and the routed experts' 3-D weights stay bf16 (float8 grouped GEMMs are
not built). On CPU the emulated path runs (`Float8LinearConfig.emulate`): the casts to float8 and their
scales are real, the matmul is done in high precision on the dequantized values.

torchao's matmul (`matmul_with_hp_or_float8_args`, torchao/float8/float8_linear.py) saves its
high-precision input and weight for backward, not their fp8 casts, and casts again in backward:
fp8 saves no activation memory (pytorch/ao#2262, pytorch/torchtitan#820). The plan's terms:
trainer/plan/activations.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from trainer.config import ConfigError, Fp8Filter, Fp8Recipe, ModelConfig, PrecisionConfig, TpLocalModel

FP8_EXTRA = "precision=fp8 needs torchao: pip install 'zerolab[fp8]' (torchao>=0.18)"
GEMM_MULTIPLE = 16  # torch._scaled_mm: both dims of a float8 GEMM's weight divisible by 16
KEPT_BY_NAME = {
    "output": "the output head: logits feed the fp32 loss (torchtitan's filter_fqns)",
    "feed_forward": "the mixture of experts: router, routed and shared experts (float8 grouped GEMMs not built)",
}


@dataclass(frozen=True)
class Fp8Split:
    """Which linears of the model run fp8 (per block, by name in the block) and which stay bf16, and why."""

    converted: tuple[str, ...]  # names inside a block, e.g. attention.wq
    kept: tuple[tuple[str, str], ...]  # (fully qualified name or block-relative name, why)


def block_linears(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every linear of one block by its name in the block: (in_features, out_features)."""
    HQ, KQ = m.n_heads * m.head_width, m.n_kv_heads * m.head_width
    attention = {
        "attention.wq": (m.dim, HQ),
        "attention.wk": (m.dim, KQ),
        "attention.wv": (m.dim, KQ),
        "attention.wo": (HQ, m.dim),
    }
    if m.is_moe:  # the MoE's router, experts and shared experts stay bf16 (KEPT_BY_NAME)
        return attention
    return {
        **attention,
        "feed_forward.w1": (m.dim, m.ffn_dim),
        "feed_forward.w3": (m.dim, m.ffn_dim),
        "feed_forward.w2": (m.ffn_dim, m.dim),
    }


ROWWISE = frozenset({"attention.wo", "feed_forward.w2"})
"""The linears tensor parallelism shards by their input (trainer/rank/tensor_parallel.py); the others by output."""


def whole_block_linears(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """`block_linears` of the whole model, where `m` is one TP rank's (TpLocalModel): the dims torchao's
    conversion, which runs before sharding (apply_fp8), decides on."""
    tp = m.tp if isinstance(m, TpLocalModel) else 1
    return {
        name: (n_in * tp, n_out) if name in ROWWISE else (n_in, n_out * tp)
        for name, (n_in, n_out) in block_linears(m).items()
    }


def tensorwise_small(n_in: int, n_out: int) -> str | None:
    """torchao's `_auto_filter_for_tensorwise` (torchao/float8/float8_linear_utils.py, torchao 0.18;
    `N, K = mod.weight.shape`, so N is out_features and K in_features): skip K <= 4096 and N <= 1024."""
    return "in_features <= 4096 and out_features <= 1024" if n_in <= 4096 and n_out <= 1024 else None


def rowwise_small(n_in: int, n_out: int) -> str | None:
    """torchao's `_auto_filter_for_rowwise` (the same file): skip N <= 2048, or K <= 1024, or N <= 4096
    and K <= 2048 (N out_features, K in_features)."""
    if n_out <= 2048:
        return "out_features <= 2048"
    if n_in <= 1024:
        return "in_features <= 1024"
    if n_out <= 4096 and n_in <= 2048:
        return "out_features <= 4096 and in_features <= 2048"
    return None


SMALL_GEMM_RULES = {Fp8Recipe.tensorwise: tensorwise_small, Fp8Recipe.rowwise: rowwise_small}
"""torchao's `_auto_filter_for_recipe` per recipe (its thresholds from H100 benchmarks, torchao/float8's README);
it has none for rowwise_with_gw_hp (NotImplementedError): precision.fp8_filter=auto refuses that recipe."""


def fp8_split(m: ModelConfig, fp8_filter: Fp8Filter, recipe: Fp8Recipe, tp: int | None = None) -> Fp8Split:
    """The block linears `apply_fp8` converts under `fp8_filter` and `recipe`, and those it keeps in bf16, why:
    decided on the whole model's dims, also where `m` is one TP rank's, but for the GEMM's own rule, which the
    rank's shard must meet too (under TP each rank multiplies its shard: torch._scaled_mm on the local dims).
    `tp`: the TP degree where `m` is the whole model (apply_fp8's); a TpLocalModel's own otherwise."""
    converted, kept = [], [("output", KEPT_BY_NAME["output"])]
    if m.is_moe:
        kept.append(("layers.*.feed_forward", KEPT_BY_NAME["feed_forward"]))
    tp = tp or (m.tp if isinstance(m, TpLocalModel) else 1)
    for name, (n_in, n_out) in whole_block_linears(m).items():
        small = SMALL_GEMM_RULES[recipe](n_in, n_out) if fp8_filter == Fp8Filter.auto else None
        local_in, local_out = (n_in // tp, n_out) if name in ROWWISE else (n_in, n_out // tp)
        if n_in % GEMM_MULTIPLE or n_out % GEMM_MULTIPLE:
            why = f"{n_in}x{n_out}: fp8 GEMMs need dims divisible by {GEMM_MULTIPLE}"
        elif local_in % GEMM_MULTIPLE or local_out % GEMM_MULTIPLE:
            why = (
                f"{n_in}x{n_out} is {local_in}x{local_out} on each of {tp} TP ranks: fp8 GEMMs need dims "
                f"divisible by {GEMM_MULTIPLE}"
            )
        elif small is not None:
            why = f"{n_in}x{n_out}: torchao's small-GEMM filter ({recipe.value}): {small}, fp8 does not pay"
        else:
            converted.append(name)
            continue
        kept.append((f"layers.*.{name}", why))
    return Fp8Split(tuple(converted), tuple(kept))


def precision_split(m: ModelConfig, precision: PrecisionConfig, tp: int | None = None) -> Fp8Split:
    """`fp8_split` for a job's precision config (precision=fp8)."""
    return fp8_split(m, precision.fp8_filter, precision.fp8_recipe, tp)


def converted_numel(m: ModelConfig, precision: PrecisionConfig) -> int:
    """Weights and biases of one block's converted linears: what autocast no longer caches a cast of
    (Float8Linear hands its fp32 weight to torchao's matmul, which casts it to float8 per call)."""
    linears = block_linears(m)
    biases = {"attention.wq", "attention.wk", "attention.wv"} if m.qkv_bias else set()
    converted = precision_split(m, precision).converted
    return converted_weight_numel(m, precision) + sum(
        linears[name][1] for name in converted if name in biases
    )


def converted_weight_numel(m: ModelConfig, precision: PrecisionConfig) -> int:
    """The weights alone of one block's converted linears: what precision.fp8_all_gather all-gathers in float8
    (torchao wraps each Float8Linear's weight, not its bias)."""
    linears = block_linears(m)
    return sum(linears[name][0] * linears[name][1] for name in precision_split(m, precision).converted)


NORM_READERS = (
    ("attention.wq", "attention.wk", "attention.wv"),  # read attention_norm's output
    ("feed_forward.w1", "feed_forward.w3"),  # read ffn_norm's output
)


def autocast_input_saving(m: ModelConfig, precision: PrecisionConfig, device_kind: str) -> int:
    """Bytes per token a block saves less under autocast (stages 0-1) with fp8 than with bf16.

    Under bf16 autocast every linear reading an RMSNorm's fp32 output saves its own bf16 cast of it
    (2·D each). Float8Linear casts its input to the autocast dtype only where
    `torch.is_autocast_enabled()` says so, which asks about CUDA: on CUDA it saves the same bf16
    casts, on CPU the readers of one norm save the fp32 output itself, once (4·D). The other
    linears read bf16 already (SDPA's output, the SwiGLU product): the same in both.
    """
    if device_kind == "cuda":
        return 0
    converted = set(precision_split(m, precision).converted)
    saving = 0
    for readers in NORM_READERS:
        n = sum(name in converted for name in readers)
        saving += 2 * m.dim * n - (4 * m.dim if n else 0)
    return saving


def converts(fqn: str, converted: tuple[str, ...]) -> bool:
    """Whether the linear at `fqn` (`layers.3.attention.wq`, `layers.3._checkpoint_wrapped_module...`
    never: conversion comes before checkpointing) is one of a block's converted linears."""
    parts = fqn.split(".")
    return len(parts) >= 3 and parts[0] == "layers" and ".".join(parts[2:]) in converted


def import_float8() -> ModuleType:
    """torchao.float8, or one line naming the extra. Quietly: importing torchao logs a warning per
    optional kernel library it cannot load (CUDA's, absent from a CPU host) and torch warns of an
    Enum torchao registers with pytree; neither concerns Float8Linear, and every rank would print them."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    pytree = logging.getLogger("torch.utils._pytree")  # torch logs its Enum notice, not warnings.warn
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module("torchao.float8")
    except ImportError:
        raise ConfigError(FP8_EXTRA) from None
    finally:
        pytree.setLevel(level)


def float8_config(precision: PrecisionConfig, device_kind: str) -> Any:
    """torchao's Float8LinearConfig of the named recipe; emulated off CUDA; fp8 all-gather as asked."""
    config = import_float8().Float8LinearConfig.from_recipe_name(precision.fp8_recipe.value)
    return dataclasses.replace(
        config, emulate=device_kind != "cuda", enable_fsdp_float8_all_gather=precision.fp8_all_gather
    )


def apply_fp8(model: nn.Module, precision: PrecisionConfig, device_kind: str, tp: int = 1) -> int:
    """Swap the block linears `fp8_split` names for Float8Linear (on the meta model, before
    checkpointing, compile and sharding: torchtitan's order; `tp`: parallel.tp, which shards them after);
    returns how many (0 without fp8)."""
    if precision.fp8_recipe == Fp8Recipe.none:
        return 0
    converted = precision_split(model.config, precision, tp).converted
    float8 = import_float8()
    float8.convert_to_float8_training(
        model,
        config=float8_config(precision, device_kind),
        module_filter_fn=lambda module, fqn: converts(fqn, converted),
    )
    return sum(type(module).__name__ == "Float8Linear" for module in model.modules())
