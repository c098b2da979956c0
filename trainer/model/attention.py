"""Which SDPA kernel attention runs on, chosen explicitly (`attention=`), and what it keeps for backward.

Left to itself, `F.scaled_dot_product_attention` picks the first kernel that accepts its inputs,
and a fallback is silent. On CUDA grouped K/V heads (`enable_gqa`) are taken by the flash
kernel only in bf16/fp16 (and by math); the memory-efficient kernel takes fp32 but not
`enable_gqa`. So fp32 with grouped heads used to fall back to math, which materialises the
B·H·T·T score matrix: slower, and far more memory than a plan of q, k, v, output and logsumexp.

The choice here is made once per run, from the device, the compute dtype and whether K/V are
grouped, and the model enters `torch.nn.attention.sdpa_kernel` with exactly that kernel, so an
impossible combination fails loudly instead of falling back:

| attention= | CPU | CUDA bf16/fp16 | CUDA fp32 |
|---|---|---|---|
| auto | flash (takes grouped K/V) | flash (takes grouped K/V); efficient, K/V repeated, under a document mask | efficient, K/V repeated to every query head |
| flash | flash | flash | refused: flash on CUDA needs bf16 or fp16 |
| efficient | refused: no such CPU kernel | efficient, K/V repeated | efficient, K/V repeated |
| math | math: saves the scores | math: saves the scores | math: saves the scores |

CUDA's flash kernel takes no attention mask, so under data.packing=document (a block-causal mask) `auto`
chooses the efficient kernel, which does, and `flash` is refused (check_document_mask). Nor does it run
below compute capability 8.0 (FlashAttention-2's kernels in torch need Ampere): there `auto` takes the
efficient kernel in half precision too, and `flash` is refused. A plan made where no GPU is visible
assumes a GPU that has it (every accelerator the plan names does).

Repeating K/V costs 2·(H - K)·Q more values per token saved for backward, far less than the
H·T scores of math. trainer/plan/activations.py counts what each choice saves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from trainer.config import AttentionKernel, ConfigError, DType, ModelConfig, TrainConfig


@dataclass(frozen=True)
class SdpaChoice:
    """The kernel attention runs on, and how its inputs are prepared for it."""

    backend: SDPBackend | None = None
    """None: SDPA's own choice (a model used outside a run, e.g. in tests)."""
    repeat_kv: bool = False
    """K/V heads repeated to the query heads before SDPA (the kernel cannot group them)."""

    @property
    def saves_scores(self) -> bool:
        """The math kernel keeps the softmax output, B·H·T·T, for backward."""
        return self.backend == SDPBackend.MATH


FLASH_CAPABILITY = (8, 0)
"""The compute capability torch's CUDA flash kernel needs."""


def choose_sdpa(
    kernel: AttentionKernel,
    device_kind: str,
    dtype: DType,
    grouped: bool,
    masked: bool = False,
    capability: tuple[int, int] | None = None,
) -> SdpaChoice:
    """The kernel for this device and dtype (see the module docstring), `masked` under a document mask, on
    a CUDA device of compute `capability` (None: one that has flash); ConfigError where it cannot run."""
    half = dtype in (DType.bfloat16, DType.float16)
    no_flash = device_kind == "cuda" and capability is not None and capability < FLASH_CAPABILITY
    if kernel == AttentionKernel.flash and no_flash:
        raise ConfigError(
            f"attention=flash needs compute capability 8.0 or later on CUDA (Ampere); this GPU has "
            f"{capability[0]}.{capability[1]}; use attention=efficient or attention=math"
        )
    if kernel == AttentionKernel.math:
        return SdpaChoice(SDPBackend.MATH)
    if kernel == AttentionKernel.efficient:
        if device_kind != "cuda":
            raise ConfigError("attention=efficient is a CUDA kernel; allowed on CPU: auto, flash, math")
        return SdpaChoice(SDPBackend.EFFICIENT_ATTENTION, repeat_kv=grouped)
    if kernel == AttentionKernel.flash and device_kind == "cuda" and not half:
        raise ConfigError(
            "attention=flash needs precision=bf16 or fp16 on CUDA; allowed in fp32: auto, efficient, math"
        )
    if device_kind == "cuda" and (not half or no_flash or (masked and kernel == AttentionKernel.auto)):
        return SdpaChoice(
            SDPBackend.EFFICIENT_ATTENTION, repeat_kv=grouped
        )  # auto in fp32, masked, or pre-Ampere
    return SdpaChoice(SDPBackend.FLASH_ATTENTION)


def run_choice(
    kernel: AttentionKernel, model: ModelConfig, dtype: DType, device_kind: str, masked: bool = False
) -> SdpaChoice:
    """The choice of a run, `masked` under data.packing=document (raises ConfigError before any rank starts,
    when called from the job)."""
    grouped = model.n_kv_heads != model.n_heads
    return choose_sdpa(kernel, device_kind, dtype, grouped, masked, visible_capability(device_kind))


def visible_capability(device_kind: str) -> tuple[int, int] | None:
    """The compute capability of this process's CUDA device, where one is visible; None otherwise (a plan
    made for another machine)."""
    if device_kind != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def config_choice(config: TrainConfig, device_kind: str, model: ModelConfig | None = None) -> SdpaChoice:
    """run_choice of a config (its kernel, compute dtype, document mask), for its `model` or another (a TP
    rank's local one)."""
    return run_choice(
        config.attention,
        config.model if model is None else model,
        config.precision.compute_dtype,
        device_kind,
        takes_mask(config),
    )


def takes_mask(config: TrainConfig) -> bool:
    """Whether attention is handed a mask: data.packing=document's block-causal one, or parallel.cp=allgather's
    (each rank's queries against every key, by true positions: trainer/model/context_parallel.py)."""
    allgather = config.parallel.cp > 1 and config.parallel.cp_impl == "allgather"
    return config.data.masks_documents or allgather


def check_document_mask(choice: SdpaChoice, device_kind: str, setting: str = "data.packing=document") -> None:
    """data.packing=document (or parallel.cp_impl=allgather: `setting`) hands SDPA an attn_mask, which CUDA's
    flash kernel does not take (the CPU one does); ConfigError before any rank starts."""
    if device_kind == "cuda" and choice.backend == SDPBackend.FLASH_ATTENTION:
        raise ConfigError(
            f"{setting} needs an attention kernel that takes a mask on CUDA: attention=efficient "
            "or attention=math (flash takes none)"
        )


def sdpa_op(choice: SdpaChoice, device_kind: str) -> str | None:
    """The aten op the chosen kernel runs as, as a dispatch mode (checkpointing=op's policy) sees it;
    None for math, whose op is composite: it decomposes into matmuls and a softmax first."""
    if choice.backend == SDPBackend.MATH:
        return None
    if choice.backend == SDPBackend.EFFICIENT_ATTENTION:
        return "aten._scaled_dot_product_efficient_attention"
    return (
        "aten._scaled_dot_product_flash_attention_for_cpu"
        if device_kind == "cpu"
        else "aten._scaled_dot_product_flash_attention"
    )
