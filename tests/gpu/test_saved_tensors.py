"""A CUDA plan's activation bytes are what autograd saves on a GPU (marked gpu: skipped without CUDA).

On CUDA, RMSNorm runs torch's fused kernel and SDPA the kernel trainer/model/attention.py chooses;
trainer/plan/activations.py counts what those save (`fused_norm_saving`, `attention_extra_per_token`).
This lists every storage autograd saves in one forward + loss of the tiny model on the GPU and
compares the sum with `activations(config, "cuda")`, as tests/unit/plan/test_plan.py does on CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import compose_config, saved_storage_bytes
from trainer.model.attention import run_choice
from trainer.model.decoder import apply_sdpa_choice, build_model, init_weights
from trainer.plan.activations import activations
from trainer.plan.states import model_shape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# The flash and cuDNN kernels also save their philox seed and offset (two int64 scalars) per layer; nothing else.
SMALL_TENSORS_PER_LAYER = 64


def saved_bytes_on_cuda(config, regime: str) -> int:
    """Bytes of the distinct storages autograd saves on the GPU, parameters and rotary tables excluded."""
    model = build_model(config.model, device="cuda")
    init_weights(model, seed=0)
    apply_sdpa_choice(
        model, run_choice(config.attention, config.model, config.precision.compute_dtype, "cuda")
    )
    shape = (config.micro_batch, config.seq_len)
    inputs, targets = (torch.randint(0, config.model.vocab_size, shape, device="cuda") for _ in range(2))
    return saved_storage_bytes(model, inputs, targets, regime)


@pytest.mark.parametrize(
    ("regime", "overrides"),
    [
        ("fp32", ["precision=fp32"]),
        ("autocast", ["precision=bf16", "zero=stage1"]),
        ("fsdp_mp", ["precision=bf16", "zero=stage3"]),
        ("autocast", ["precision=bf16", "zero=stage1", "attention=math"]),
        ("fsdp_mp", ["precision=bf16", "zero=stage3", "attention=cudnn"]),  # planned as flash
    ],
)
def test_cuda_plan_activations_are_what_autograd_saves_on_a_gpu(regime: str, overrides: list[str]) -> None:
    # seq_len a multiple of 32: the efficient kernel (fp32) pads its logsumexp to 32 positions.
    config = compose_config("model=tiny", "micro_batch=3", "seq_len=64", "device=cuda", *overrides)
    planned = activations(config, "cuda").total
    expected = planned
    if regime == "autocast":  # autocast's cached bf16 weights: the plan counts them as temporary
        shape = model_shape(config.model)
        expected += 2 * (
            shape.block_linear_numel * config.model.n_layers + config.model.vocab_size * config.model.dim
        )
    saved = saved_bytes_on_cuda(config, regime)
    assert abs(saved - expected) <= SMALL_TENSORS_PER_LAYER * config.model.n_layers, (saved, expected)
    # The fused RMSNorm saves less than the CPU decomposition.
    assert planned < activations(config, "cpu").total
