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
| cudnn | refused: a CUDA kernel | cuDNN (takes grouped K/V) | refused: cuDNN needs bf16 or fp16 |
| math | math: saves the scores | math: saves the scores | math: saves the scores |

CUDA's flash kernel takes no attention mask, so under data.packing=document (a block-causal mask) `auto`
chooses the efficient kernel, which does, and `flash` is refused (check_document_mask). Nor does it run
below compute capability 8.0 (FlashAttention-2's kernels in torch need Ampere): there `auto` takes the
efficient kernel in half precision too, and `flash` is refused. A plan made where no GPU is visible
assumes a GPU that has it (every accelerator the plan names does).

`cudnn` is SDPA's cuDNN backend (SDPBackend.CUDNN_ATTENTION), which `auto` never takes: asked for, it runs
or is refused in one line. What it needs, from torch's aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
(pytorch/pytorch@001f694aef6f, `can_use_cudnn_attention`): CUDA; bf16 or fp16 (`check_dtypes_low_precision`);
compute capability 8.0 to 12.1 (`check_cudnn_hardware_support`); heads a multiple of 8 and at most 128 wide
(`check_cudnn_tensor_shapes`; 256 only on sm90/sm10x with cuDNN 9.22 or later, not assumed here); and no
`torch.use_deterministic_algorithms` (zerolab sets none). It groups K/V heads itself
(`check_batch_size_and_num_heads_dense<supports_gqa=true>`, pytorch/pytorch#150337: SDPA hands it K and V
unrepeated) and takes an attention mask (`check_attn_mask_shape`; SDPA makes a boolean one additive in q's
dtype, `convert_boolean_attn_mask_cudnn`), so data.packing=document runs on it. For backward it saves what
flash does (torch 2.13's derivatives.yaml `_scaled_dot_product_cudnn_attention`: q, k, v, the output laid out
as q and an fp32 B·H·T·1 logsumexp, as torch/_meta_registrations.py's meta kernel makes them), two philox
scalars (not planned, as flash's rng state is not) and, under a mask, the additive mask, as efficient does.

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
CUDNN_CAPABILITY = (8, 0)
"""The compute capability SDPA's cuDNN backend needs (sdp_utils.cpp `check_cudnn_hardware_support`)."""
CUDNN_HEAD_WIDTH = 128
"""The widest head SDPA's cuDNN backend takes on every GPU (sdp_utils.cpp `check_cudnn_tensor_shapes`)."""


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
    if kernel == AttentionKernel.cudnn:
        return cudnn_choice(device_kind, half, capability)
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


def cudnn_choice(device_kind: str, half: bool, capability: tuple[int, int] | None) -> SdpaChoice:
    """attention=cudnn (module docstring): SDPA's cuDNN backend, K/V unrepeated (it groups heads itself);
    ConfigError off CUDA, in fp32 and below compute capability 8.0."""
    if device_kind != "cuda":
        raise ConfigError(
            "attention=cudnn needs a CUDA GPU (SDPA's cuDNN backend); allowed on CPU: auto, flash, math"
        )
    if not half:
        raise ConfigError(
            "attention=cudnn needs precision=bf16 or fp16 (cuDNN's attention takes no fp32); "
            "allowed in fp32: auto, efficient, math"
        )
    if capability is not None and capability < CUDNN_CAPABILITY:
        raise ConfigError(
            f"attention=cudnn needs compute capability 8.0 or later (Ampere); this GPU has "
            f"{capability[0]}.{capability[1]}; use attention=efficient or attention=math"
        )
    return SdpaChoice(SDPBackend.CUDNN_ATTENTION)


def check_cudnn_head(model: ModelConfig) -> None:
    """attention=cudnn takes heads of a multiple of 8 up to CUDNN_HEAD_WIDTH wide; ConfigError otherwise."""
    width = model.head_width
    if width % 8 or width > CUDNN_HEAD_WIDTH:
        raise ConfigError(
            f"attention=cudnn takes a head width that is a multiple of 8 and at most {CUDNN_HEAD_WIDTH} "
            f"(model.head_dim, dim / n_heads unless set: {width}); use attention=flash or attention=efficient"
        )


def run_choice(
    kernel: AttentionKernel, model: ModelConfig, dtype: DType, device_kind: str, masked: bool = False
) -> SdpaChoice:
    """The choice of a run, `masked` under data.packing=document (raises ConfigError before any rank starts,
    when called from the job)."""
    grouped = model.n_kv_heads != model.n_heads
    choice = choose_sdpa(kernel, device_kind, dtype, grouped, masked, visible_capability(device_kind))
    if choice.backend == SDPBackend.CUDNN_ATTENTION:
        check_cudnn_head(model)
    return choice


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
            f"{setting} needs an attention kernel that takes a mask on CUDA: attention=efficient, "
            "attention=cudnn or attention=math (flash takes none)"
        )


def sdpa_op(choice: SdpaChoice, device_kind: str) -> str | None:
    """The aten op the chosen kernel runs as, as a dispatch mode (checkpointing=op's policy) sees it;
    None for math, whose op is composite: it decomposes into matmuls and a softmax first."""
    if choice.backend == SDPBackend.MATH:
        return None
    if choice.backend == SDPBackend.EFFICIENT_ATTENTION:
        return "aten._scaled_dot_product_efficient_attention"
    if choice.backend == SDPBackend.CUDNN_ATTENTION:
        return "aten._scaled_dot_product_cudnn_attention"
    return (
        "aten._scaled_dot_product_flash_attention_for_cpu"
        if device_kind == "cpu"
        else "aten._scaled_dot_product_flash_attention"
    )
