"""trainer/model/attention.py: the SDPA kernel is a choice, and the plan counts what the chosen kernel saves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from tests.helpers import compose_config
from trainer.advise.predict import op_recompute_flops_per_token
from trainer.config import AttentionKernel, ConfigError, DType, ModelConfig
from trainer.config.checkpointing import TORCHTITAN_SAVE_OPS
from trainer.model.attention import SdpaChoice, choose_sdpa, run_choice, sdpa_op
from trainer.model.decoder import apply_sdpa_choice, build_model, init_weights, rope_cache
from trainer.plan.activations import activations, attention_extra_per_token, document_mask_per_token

pytestmark = pytest.mark.torch_versions  # which SDPA kernels a torch build offers

FLASH, EFFICIENT, MATH = SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH
CUDNN = SDPBackend.CUDNN_ATTENTION


def choice_of(config) -> tuple:
    """run_choice's config arguments, as the job and the loop pass them."""
    return config.attention, config.model, config.precision.compute_dtype


@pytest.mark.parametrize(
    ("kernel", "device", "dtype", "expected"),
    [
        ("auto", "cpu", "float32", SdpaChoice(FLASH)),
        ("auto", "cpu", "bfloat16", SdpaChoice(FLASH)),
        ("auto", "cuda", "bfloat16", SdpaChoice(FLASH)),
        ("auto", "cuda", "float16", SdpaChoice(FLASH)),
        ("auto", "cuda", "float32", SdpaChoice(EFFICIENT, repeat_kv=True)),  # not math's B·H·T·T scores
        ("flash", "cuda", "bfloat16", SdpaChoice(FLASH)),
        ("efficient", "cuda", "bfloat16", SdpaChoice(EFFICIENT, repeat_kv=True)),
        ("cudnn", "cuda", "bfloat16", SdpaChoice(CUDNN)),  # grouped K/V handed over unrepeated
        ("cudnn", "cuda", "float16", SdpaChoice(CUDNN)),
        ("math", "cuda", "float32", SdpaChoice(MATH)),
        ("math", "cpu", "bfloat16", SdpaChoice(MATH)),
    ],
)
def test_the_kernel_is_chosen_from_device_and_dtype(
    kernel: str, device: str, dtype: str, expected: SdpaChoice
) -> None:
    assert choose_sdpa(AttentionKernel(kernel), device, DType(dtype), grouped=True) == expected


def test_ungrouped_heads_are_never_repeated() -> None:
    assert choose_sdpa(AttentionKernel.auto, "cuda", DType.float32, grouped=False) == SdpaChoice(
        EFFICIENT, repeat_kv=False
    )


def test_kernels_a_device_cannot_run_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^attention=flash needs precision=bf16 or fp16 on CUDA"):
        run_choice(*choice_of(compose_config("attention=flash", "precision=fp32")), "cuda")
    with pytest.raises(
        ConfigError, match=r"^attention=efficient is a CUDA kernel; allowed on CPU: auto, flash, math"
    ):
        run_choice(*choice_of(compose_config("attention=efficient")), "cpu")


def test_a_kernel_that_cannot_take_the_inputs_fails_instead_of_falling_back() -> None:
    model = build_model(ModelConfig(), device="cpu")
    init_weights(model, seed=0)
    apply_sdpa_choice(model, SdpaChoice(EFFICIENT))  # no CPU kernel of that name
    with pytest.raises(RuntimeError, match="No viable backend"):
        model(torch.zeros(1, 8, dtype=torch.long))


def saved_bytes(choice: SdpaChoice, dtype: torch.dtype, micro_batch: int = 3, seq_len: int = 40) -> int:
    """Bytes autograd saves in one forward + loss of the tiny model under `choice` (parameters and rotary tables excluded)."""
    config = ModelConfig()
    model = build_model(config, device="cpu")
    init_weights(model, seed=0)
    model.to(dtype)  # as FSDP2's MixedPrecisionPolicy computes (fp32: unchanged)
    apply_sdpa_choice(model, choice)
    inputs, targets = (torch.randint(0, config.vocab_size, (micro_batch, seq_len)) for _ in range(2))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
    excluded = {t.untyped_storage().data_ptr() for t in model.parameters()}
    excluded |= {t.untyped_storage().data_ptr() for t in rope_cache(model)}
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in excluded)


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_planned_activations_are_what_the_chosen_kernel_saves(
    precision: str, dtype: torch.dtype, kernel: str
) -> None:
    config = compose_config(
        "model=tiny",
        "micro_batch=3",
        "seq_len=40",
        f"precision={precision}",
        "zero=stage3",
        f"attention={kernel}",
    )
    choice = run_choice(*choice_of(config), "cpu")
    assert saved_bytes(choice, dtype) == activations(config, "cpu").total


def test_math_scores_grow_with_the_square_of_the_sequence() -> None:
    short = compose_config("model=tiny", "seq_len=64", "attention=math")
    long = compose_config("model=tiny", "seq_len=128", "attention=math")
    flash = compose_config("model=tiny", "seq_len=128")
    # Per token, the scores are H·T fp32 values: B·H·T·T in all.
    assert attention_extra_per_token(long, "cpu") - attention_extra_per_token(
        short, "cpu"
    ) == 4 * short.model.n_heads * (128 - 64)
    assert attention_extra_per_token(flash, "cpu") == 0


def test_repeated_kv_is_what_the_plan_adds_for_cuda_fp32() -> None:
    """The repeat path is CUDA's (fp32); its saved tensors are the same on CPU's flash kernel."""
    config = compose_config("model=tiny", "micro_batch=3", "seq_len=40", "precision=fp32", "zero=stage3")
    m = config.model
    extra = attention_extra_per_token(config, "cuda")
    assert extra == 2 * (m.n_heads - m.n_kv_heads) * (m.dim // m.n_heads) * 4
    measured = saved_bytes(SdpaChoice(FLASH, repeat_kv=True), torch.float32) - saved_bytes(
        SdpaChoice(FLASH), torch.float32
    )
    assert measured == extra * m.n_layers * config.micro_batch * config.seq_len


def test_auto_takes_the_kernel_that_takes_a_mask_under_document_packing() -> None:
    """CUDA's flash kernel takes no attn_mask: under data.packing=document `auto` chooses the efficient one
    (K/V repeated where grouped), an explicit flash is still refused (check_document_mask)."""
    masked = choose_sdpa(AttentionKernel.auto, "cuda", DType.bfloat16, grouped=True, masked=True)
    assert masked == SdpaChoice(EFFICIENT, repeat_kv=True)
    assert choose_sdpa(AttentionKernel.auto, "cpu", DType.bfloat16, grouped=True, masked=True) == SdpaChoice(
        FLASH
    )
    assert choose_sdpa(
        AttentionKernel.flash, "cuda", DType.bfloat16, grouped=True, masked=True
    ) == SdpaChoice(FLASH)


def test_cudnn_is_refused_where_it_cannot_run_naming_the_key() -> None:
    """SDPA's cuDNN backend (torch's sdp_utils.cpp `can_use_cudnn_attention`): CUDA only, bf16/fp16 only,
    heads a multiple of 8 and at most 128 wide; each refusal one line."""
    refusals = {
        ("cpu", "attention=cudnn", "precision=bf16"): r"^attention=cudnn needs a CUDA GPU .*allowed on CPU: auto, flash, math$",
        ("cuda", "attention=cudnn", "precision=fp32"): r"^attention=cudnn needs precision=bf16 or fp16 .*allowed in fp32: auto, efficient, math$",
        ("cuda", "attention=cudnn", "precision=bf16", "model.head_dim=20"): r"^attention=cudnn takes a head width that is a multiple of 8 and at most 128 .*: 20\)",
        ("cuda", "attention=cudnn", "precision=bf16", "model.head_dim=256"): r"^attention=cudnn takes a head width .*: 256\); use attention=flash",
    }  # fmt: skip
    for (device, *overrides), message in refusals.items():
        with pytest.raises(ConfigError, match=message) as refused:
            run_choice(*choice_of(compose_config("model=tiny", *overrides)), device)
        assert "\n" not in str(refused.value)
    tiny = compose_config("model=tiny", "attention=cudnn", "precision=bf16")
    assert tiny.model.head_width == 32 and run_choice(*choice_of(tiny), "cuda") == SdpaChoice(CUDNN)


def test_cudnn_runs_as_the_op_checkpointing_saves() -> None:
    """checkpointing=op's default list keeps cuDNN's output, so the advisor's recompute counts no attention
    for it, as for flash's (trainer/advise/predict.py)."""
    op = sdpa_op(SdpaChoice(CUDNN), "cuda")
    assert op == "aten._scaled_dot_product_cudnn_attention" and op in TORCHTITAN_SAVE_OPS
    config = compose_config("model=tiny", "checkpointing=op")
    rerun = [
        op_recompute_flops_per_token(
            config.model, config.checkpointing, 64, sdpa_op(SdpaChoice(kernel), "cuda")
        )
        for kernel in (CUDNN, FLASH, MATH)
    ]
    HQ = config.model.n_heads * config.model.head_width
    assert rerun[0] == rerun[1] == rerun[2] - 4 * HQ * 64  # math's composite op is never saved


def test_a_cudnn_plan_counts_what_flash_saves_and_the_mask_as_efficient() -> None:
    """cuDNN saves q, k, v (unrepeated), the output and an fp32 B·H·T logsumexp, as flash does (torch's
    derivatives.yaml `_scaled_dot_product_cudnn_attention`): a CUDA plan equal to flash's to the byte. Under
    data.packing=document it also saves the additive B·1·T·T mask in bf16, as the efficient kernel (auto's
    choice there) does; efficient repeats the grouped K/V besides, cuDNN does not."""
    common = ("model=tiny", "micro_batch=3", "seq_len=64", "precision=bf16", "zero=stage3")
    cudnn, flash = (compose_config(*common, f"attention={kernel}") for kernel in ("cudnn", "flash"))
    assert attention_extra_per_token(cudnn, "cuda") == 0
    assert activations(cudnn, "cuda").total == activations(flash, "cuda").total
    documents = (*common, "data=text", "data.files=[a.txt]", "data.tokenizer=t.json", "data.packing=document")
    masked, auto = (compose_config(*documents, f"attention={kernel}") for kernel in ("cudnn", "auto"))
    m, B, T = masked.model, 3, 64
    assert document_mask_per_token(masked, "cuda") == document_mask_per_token(auto, "cuda") == 2 * T
    plain, documented = activations(cudnn, "cuda"), activations(masked, "cuda")
    assert documented.full_block - plain.full_block == B * T * T * 2  # the bf16 additive mask
    assert documented.batch - plain.batch == 8 * B * T  # the documents' int64 ids
    repeated = 2 * (m.n_heads - m.n_kv_heads) * m.head_width * 2  # bf16 K and V for every query head
    assert attention_extra_per_token(auto, "cuda") == repeated
    assert activations(auto, "cuda").full_block - documented.full_block == repeated * B * T
