"""trainer/model/decoder.py: shapes and counts of the presets, sharding-invariant init, and a decoder that learns."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tests.helpers import load_preset, materialized
from trainer.config import ModelConfig, RopeScaling
from trainer.model.context_parallel import local_positions
from trainer.model.decoder import (
    apply_rope,
    build_model,
    build_rope_table,
    canonical_name,
    flops_per_token,
    init_weights,
    llama3_scaled_frequencies,
    materialize,
    num_params,
    param_seed,
)

CPU = torch.device("cpu")


def tiny_count_by_hand(c: ModelConfig) -> int:
    """Parameters of a preset from its shapes alone: embedding, blocks, final norm, untied head."""
    head_dim = c.dim // c.n_heads
    attention = c.dim * c.n_heads * head_dim * 2 + c.dim * c.n_kv_heads * head_dim * 2  # wq, wo; wk, wv
    block = attention + 3 * c.dim * c.ffn_dim + 2 * c.dim  # SwiGLU w1 w2 w3; two RMSNorms
    return c.vocab_size * c.dim + c.n_layers * block + c.dim + c.dim * c.vocab_size


def canonical_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(k): v for k, v in model.state_dict().items()}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from intra-op threads; on a busy CI host they spin and run 2-4x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return load_preset("tiny")


# ----------------------------------------------------------------------------- counts and cost


LLAMA2_COUNTS = [("7b", 6_738_415_616), ("13b", 13_015_864_320), ("70b", 68_976_648_192)]


@pytest.mark.parametrize(("preset", "expected"), LLAMA2_COUNTS)
def test_llama2_presets_have_the_published_parameter_counts(preset: str, expected: int) -> None:
    assert num_params(load_preset(preset)) == expected


def test_tiny_parameter_count_matches_its_shapes(tiny: ModelConfig) -> None:
    assert tiny_count_by_hand(tiny) == 918_656
    assert num_params(tiny) == 918_656


def test_building_70b_on_meta_allocates_nothing_and_is_fast() -> None:
    start = time.perf_counter()
    model = build_model(load_preset("70b"))
    elapsed = time.perf_counter() - start
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert elapsed < 2.0


def test_flops_per_token_is_6n_without_embedding_plus_attention(tiny: ModelConfig) -> None:
    seq_len = 256
    head_dim = tiny.dim // tiny.n_heads
    n_without_embedding = tiny_count_by_hand(tiny) - tiny.vocab_size * tiny.dim
    expected = 6 * n_without_embedding + 12 * tiny.n_layers * tiny.n_heads * head_dim * seq_len
    assert flops_per_token(tiny, seq_len) == expected == 6 * 853_120 + 12 * 4 * 4 * 32 * 256


# ----------------------------------------------------------------------------- initialisation


def test_canonical_name_strips_wrapper_segments() -> None:
    wrapped = "module._orig_mod.layers.3._checkpoint_wrapped_module.attention.wq.weight"
    assert canonical_name(wrapped) == "layers.3.attention.wq.weight"


def test_every_parameter_and_seed_gets_its_own_generator_seed() -> None:
    # The CPU generator keeps only 32 bits of a seed; (seed, name) must still map to distinct seeds.
    names = [name for name, _ in build_model(load_preset("70b")).named_parameters()]
    seeds = {param_seed(seed, name) for seed in range(3) for name in names}
    assert len(seeds) == 3 * len(names) == 3 * 723
    assert all(0 <= s < 2**32 for s in seeds)


def test_init_is_invariant_to_checkpoint_wrapping(tiny: ModelConfig) -> None:
    plain = materialized(tiny, seed=7)
    wrapped = build_model(tiny)  # the real order: meta -> wrap blocks -> materialise
    for i, block in enumerate(wrapped.layers):
        wrapped.layers[i] = checkpoint_wrapper(block)
    materialize(wrapped, CPU, seed=7)
    plain_state, wrapped_state = canonical_state(plain), canonical_state(wrapped)
    assert any("_checkpoint_wrapped_module" in name for name, _ in wrapped.named_parameters())
    assert plain_state.keys() == wrapped_state.keys()
    assert all(torch.equal(plain_state[k], wrapped_state[k]) for k in plain_state)
    tokens_BT = torch.randint(0, tiny.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(plain(tokens_BT), wrapped(tokens_BT))


def test_init_is_reproducible_and_depends_on_the_seed(tiny: ModelConfig) -> None:
    a, b, c = materialized(tiny, seed=0), materialized(tiny, seed=0), materialized(tiny, seed=1)
    w_a, w_b, w_c = (
        a.layers[0].attention.wq.weight,
        b.layers[0].attention.wq.weight,
        c.layers[0].attention.wq.weight,
    )
    assert torch.equal(w_a, w_b)
    assert not torch.equal(w_a, w_c)
    # Each parameter has its own stream: two same-shaped weights of one model differ.
    assert not torch.equal(a.layers[0].attention.wq.weight, a.layers[1].attention.wq.weight)


def test_init_distributions_follow_gpt2(tiny: ModelConfig) -> None:
    model = materialized(tiny, seed=0)
    assert torch.equal(model.norm.weight, torch.ones(tiny.dim))
    assert torch.equal(model.layers[2].ffn_norm.weight, torch.ones(tiny.dim))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.layers[0].feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.02)
    residual_std = 0.02 / math.sqrt(2 * tiny.n_layers)
    assert model.layers[0].feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.02)
    assert model.layers[0].attention.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)


def test_meta_build_then_materialize_equals_a_cpu_build(tiny: ModelConfig) -> None:
    from_meta = materialized(tiny, seed=3)
    on_cpu = build_model(tiny, device="cpu")
    init_weights(on_cpu, seed=3)
    tokens_BT = torch.arange(32).view(2, 16)
    assert torch.equal(from_meta(tokens_BT), on_cpu(tokens_BT))


def test_model_has_no_buffers_and_rope_tables_survive_inference_mode(tiny: ModelConfig) -> None:
    # No buffers: nothing for to_empty to leave as garbage, for offload to strand, or for DDP to broadcast.
    model = materialized(tiny)
    assert list(model.buffers()) == []
    tokens_BT = torch.arange(16).view(1, 16)
    with torch.inference_mode():
        evaluated = model(tokens_BT)  # the first call builds and caches the tables
    logits = model(tokens_BT)
    logits.float().sum().backward()  # would fail if the cached tables were inference tensors
    assert torch.equal(evaluated, logits.detach())
    assert model.output.weight.grad is not None


def test_rotary_scores_depend_only_on_relative_position() -> None:
    head_dim, theta = 16, 10000.0
    cis_TF = build_rope_table(head_dim, 64, theta, CPU)
    generator = torch.Generator().manual_seed(0)
    q_Q, k_Q = torch.randn(head_dim, generator=generator), torch.randn(head_dim, generator=generator)
    x_1THQ = torch.stack([q_Q, k_Q]).expand(64, 2, head_dim)[None]  # q and k at every position, as two heads

    rotated = apply_rope(x_1THQ, cis_TF)[0]  # T, 2 heads, Q

    def score(m: int, n: int) -> float:
        return torch.dot(rotated[m, 0], rotated[n, 1]).item()

    assert score(10, 3) == pytest.approx(score(50, 43), abs=1e-5)
    assert score(0, 0) == pytest.approx(torch.dot(q_Q, k_Q).item(), abs=1e-6)  # position 0: no rotation
    assert cis_TF[7, 1].real.item() == pytest.approx(math.cos(7 * theta ** (-2 / head_dim)), abs=1e-6)


def previous_rope_tables(
    head_dim: int, max_seq_len: int, theta: float, config: ModelConfig | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous implementation's tables (decoder.py before issue 59): fp32 cos and sin, T x F."""
    inv_freq_F = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if config is not None:
        inv_freq_F = llama3_scaled_frequencies(inv_freq_F, config)
    angles_TF = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq_F)
    return angles_TF.cos(), angles_TF.sin()


def previous_apply_rope(x_BTHQ: torch.Tensor, cos_TF: torch.Tensor, sin_TF: torch.Tensor) -> torch.Tensor:
    """The previous implementation of apply_rope (decoder.py before issue 59), the reference: the pairs
    rotated in real arithmetic, seven kernels."""
    x0_BTHF, x1_BTHF = x_BTHQ.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos_1T1F, sin_1T1F = cos_TF[None, :, None, :], sin_TF[None, :, None, :]
    y0_BTHF = x0_BTHF * cos_1T1F - x1_BTHF * sin_1T1F
    y1_BTHF = x0_BTHF * sin_1T1F + x1_BTHF * cos_1T1F
    return torch.stack((y0_BTHF, y1_BTHF), dim=-1).flatten(-2).type_as(x_BTHQ)


@pytest.mark.parametrize("preset", ["tiny", "llama3-8b"])  # llama3-8b: head width 128, Llama-3.1's scaling
@pytest.mark.parametrize(
    "positions", ["first", "cp"]
)  # cp: rank 1 of 4's head-tail positions, as parallel.cp reads
def test_complex_rotary_equals_the_previous_real_form(preset: str, positions: str) -> None:
    """Issue 59: the one complex multiply (torchtitan's form) gives the previous real form's output and input
    gradient within 1e-6 in fp32, on random input, at the first positions and at a rank's offset ones."""
    config = load_preset(preset)
    scaled = config if config.rope_scaling == RopeScaling.llama3 else None
    max_len, T = 512, 128
    cis_TF = build_rope_table(config.head_width, max_len, config.rope_theta, CPU, config)
    cos_TF, sin_TF = previous_rope_tables(config.head_width, max_len, config.rope_theta, scaled)
    at_T = (
        torch.arange(T) if positions == "first" else torch.tensor(local_positions(max_len, 4, 1))
    )  # 64-127, 384-447
    generator = torch.Generator().manual_seed(0)
    x_BTHQ = torch.randn(2, T, 3, config.head_width, generator=generator).requires_grad_()
    grad_BTHQ = torch.randn(2, T, 3, config.head_width, generator=generator)

    new = apply_rope(x_BTHQ, cis_TF.index_select(0, at_T))
    (new_grad,) = torch.autograd.grad(new, x_BTHQ, grad_BTHQ)
    old = previous_apply_rope(x_BTHQ, cos_TF.index_select(0, at_T), sin_TF.index_select(0, at_T))
    (old_grad,) = torch.autograd.grad(old, x_BTHQ, grad_BTHQ)

    assert cis_TF.dtype == torch.complex64 and new.dtype == torch.float32
    assert (new - old).abs().max().item() <= 1e-6
    assert (new_grad - old_grad).abs().max().item() <= 1e-6
    assert not torch.equal(new, x_BTHQ)  # the positions rotate: the check compares rotations, not copies


@pytest.mark.usefixtures("process_group")
def test_fsdp2_hands_every_block_the_complex_table_uncast(tiny: ModelConfig) -> None:
    """FSDP2's MixedPrecisionPolicy casts a block's floating-point forward inputs to param_dtype; the complex
    table is not floating point, so each block gets the fp32 table itself (a view of the cache), and saves no
    half-precision copy of it (trainer/plan/activations.py counts none; docs/memory_plan.md)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(tiny)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    materialize(model, CPU, seed=0)
    seen: list[torch.Tensor] = []
    # FSDP2 prepends its own pre-forward hook: these see the inputs as it cast them
    for block in model.layers:
        block.register_forward_pre_hook(lambda _module, args: seen.append(args[1]))
    model(torch.arange(16).view(1, 16))
    (cached,) = model.cached_rope_tables()
    assert len(seen) == tiny.n_layers
    assert all(t.dtype == torch.complex64 and t.data_ptr() == cached.data_ptr() for t in seen)


# ----------------------------------------------------------------------------- forward


def test_forward_gives_logits_in_the_compute_dtype(tiny: ModelConfig) -> None:
    model = materialized(tiny)
    tokens_BT = torch.randint(0, tiny.vocab_size, (3, 20))
    logits_BTV = model(tokens_BT)
    assert logits_BTV.shape == (3, 20, tiny.vocab_size)
    assert logits_BTV.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(tokens_BT).dtype == torch.bfloat16


def test_forward_is_causal(tiny: ModelConfig) -> None:
    model = materialized(tiny)
    tokens_BT = torch.randint(0, tiny.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    changed_BT = tokens_BT.clone()
    changed_BT[:, 10] = (changed_BT[:, 10] + 1) % tiny.vocab_size
    before, after = model(tokens_BT), model(changed_BT)
    assert torch.allclose(before[:, :10], after[:, :10], rtol=0, atol=1e-6)
    assert (before[:, 10:] - after[:, 10:]).abs().amax().item() > 1e-3


def test_forward_rejects_sequences_longer_than_max_seq_len(tiny: ModelConfig) -> None:
    model = materialized(tiny)
    with pytest.raises(ValueError, match="model.max_seq_len"):
        model(torch.zeros(1, tiny.max_seq_len + 1, dtype=torch.long))


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads() -> None:
    gqa_config = ModelConfig(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=97, ffn_dim=96, max_seq_len=32
    )
    mha_config = ModelConfig(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=97, ffn_dim=96, max_seq_len=32
    )
    gqa, mha = materialized(gqa_config, seed=5), materialized(mha_config, seed=5)
    assert gqa.layers[0].attention.wk.weight.shape == (2 * 8, 64)
    group, head_dim = 8 // 2, 64 // 8
    state = gqa.state_dict()
    for name, weight in list(state.items()):
        if name.endswith(
            ("attention.wk.weight", "attention.wv.weight")
        ):  # each kv head serves `group` queries
            state[name] = (
                weight.view(2, head_dim, 64).repeat_interleave(group, dim=0).reshape(8 * head_dim, 64)
            )
    mha.load_state_dict(state)
    tokens_BT = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(gqa(tokens_BT), mha(tokens_BT), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- learning


def test_tiny_model_learns_a_repeating_sequence(tiny: ModelConfig) -> None:
    torch.manual_seed(0)
    model = materialized(tiny, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pattern = torch.randint(0, tiny.vocab_size, (16,), generator=torch.Generator().manual_seed(0))
    tokens_BT = pattern.repeat(2, 3)[:, :33]  # each row repeats the 16-token pattern
    inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(inputs_BT).float().flatten(0, 1), targets_BT.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(tiny.vocab_size), rel=0.05)  # N(0, 0.02) init: near uniform
    assert losses[-1] < 0.5
