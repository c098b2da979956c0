"""Each term of the FSDP2 walk against a hand count in bytes, on a configuration where it shows.

The tiny model cut to 2 blocks, 1 x 16 tokens, on 2 CPU ranks (no padding: every dim 0 is even).
Each test names the moment the term sits in and counts that moment's parts tensor by tensor
(docs/memory_plan.md, "What is modelled"), so a dropped or mis-sized term fails here in seconds;
tests/integration/ holds the same walk against measured runs.
"""

from __future__ import annotations

import pytest

from tests.helpers import compose_config
from trainer.plan import build_plan

# conf/model/tiny.yaml: dim, heads, kv heads, vocabulary, MLP width; 2 blocks here, 1 x 16 tokens
D, H, K, V, M, L, N = 128, 4, 2, 512, 384, 2, 16
Q = D // H
KQ = K * Q
BLOCK = 2 * D * D + 2 * KQ * D + 3 * M * D + 2 * D  # wq wo, wk wv, w1 w2 w3, the two norms
ROOT = 2 * V * D + D  # embedding, output head, final norm
HEAD = V * D + D  # the output head's and final norm's weights: the gradient FSDP2 reduces last
P = L * BLOCK + ROOT
BLOCK_ACTS = 4 * (8 * D + 2 * KQ + 4 * M) + 4 * H + 8  # fp32, per token (docs/memory_plan.md's table)
BATCH = 16 * N  # int64 inputs and targets
INCOMING = 4 * N * D  # the gradient arriving down the fp32 residual stream
SMALL = ("model=tiny", f"model.n_layers={L}", "micro_batch=1", f"seq_len={N}")


def parts(*overrides: str, name: str, world_size: int = 2) -> dict[str, int]:
    """The parts of moment `name` of rank 0's plan on CPU ranks."""
    plan = build_plan(compose_config(*SMALL, *overrides), "cpu", world_size)
    (found,) = [m for m in plan.ranks[0].moments if m.name == name]
    return found.parts


def test_stage3_copy_out_holds_the_flat_all_gather_output_beside_the_unsharded_block() -> None:
    """Block 0's pre-backward copy-out: its unsharded copy and the flat all-gather output it is copied
    from, both fp32, beside block 1's retained reduce-scatter input and the head's kept gradient."""
    got = parts("zero=stage3", name="backward: block 0 all-gather copy-out")
    root, block, flat, head, retained = 4 * ROOT, 4 * BLOCK, 4 * BLOCK, 4 * HEAD, 4 * BLOCK
    assert got["temporary"] == root + block + flat + head + retained + INCOMING
    assert got["activations"] == BATCH + N * BLOCK_ACTS  # block 0's own, saved in forward
    assert got["grads"] == 4 * BLOCK // 2  # block 1's gradient shard


def test_block_end_holds_rmsnorms_cpu_backward() -> None:
    """A block's end on CPU: the attention RMSNorm's composite backward holds five fp32 B·T·D tensors
    beside its saved fp32 input (6 x 4 N D), next to the incoming gradient and the block's unsharded
    weight gradient; CUDA's fused kernel holds the incoming gradient and the outgoing one."""
    got = parts("zero=stage3", name="backward: block 0 end")
    root, block, head, retained, weight_grads = 4 * ROOT, 4 * BLOCK, 4 * HEAD, 4 * BLOCK, 4 * BLOCK
    assert got["temporary"] == root + block + head + retained + weight_grads + INCOMING + 6 * 4 * N * D


STEP = (
    "grad_accum=2",
    "zero.reduce_every=step",
)  # fp32: the accumulated gradient is the fp32 gradient itself


def test_head_backward_holds_its_new_weight_gradient_beside_the_accumulated_one() -> None:
    """reduce_every=step, the last micro-batch: mm writes the head's new weight gradient before
    autograd adds it into the accumulated one in place (AccumulateGrad), so both are alive."""
    got = parts("zero=stage3", *STEP, name="backward: output head")
    root, accumulated, new = 4 * ROOT, 4 * P, 4 * HEAD
    logits_and_input_grads = 4 * N * (V + D)
    assert got["temporary"] == root + accumulated + logits_and_input_grads + new


def test_in_place_accumulation_holds_no_fresh_weight_gradient() -> None:
    """fp32 gradient, fp32 reduce dtype: autograd adds each new weight gradient into the accumulated
    one (same dtype) and frees it, so a block's end holds no unsharded weight gradient of its own and
    nothing of the head's; in bf16 with an fp32 reduce dtype both are kept until the post-backward."""
    got = parts("zero=stage3", *STEP, name="backward: block 1 end")
    root, block, prefetched, accumulated = 4 * ROOT, 4 * BLOCK, 4 * BLOCK, 4 * P  # nothing reduced yet
    assert got["temporary"] == root + block + prefetched + accumulated + INCOMING + 6 * 4 * N * D
    kept = parts(
        "zero=stage3", "precision=bf16", "zero.reduce_dtype=fp32", *STEP, name="backward: block 1 end"
    )
    root, block, prefetched, head, weight_grads = 2 * ROOT, 2 * BLOCK, 2 * BLOCK, 2 * HEAD, 2 * BLOCK
    rmsnorm = 2 * N * D + 6 * 4 * N * D  # the bf16 incoming gradient beside the fp32 composite backward
    assert kept["temporary"] == root + block + prefetched + head + 4 * P + weight_grads + rmsnorm


def test_chunked_loss_backward_holds_the_prefetched_last_block_at_stage3() -> None:
    """loss=chunked (one chunk of 16 tokens): the loss's backward holds the root unsharded and 12 bytes
    per logit; at stage3 the root's pre-backward prefetch has all-gathered the last block too."""
    stage3 = parts("zero=stage3", "loss=chunked", name="backward: loss")
    assert stage3["temporary"] == 4 * ROOT + 4 * BLOCK + 12 * N * V
    stage2 = parts("zero=stage2", "loss=chunked", name="backward: loss")
    assert stage2["temporary"] == 4 * ROOT + L * 4 * BLOCK + 12 * N * V  # every block still unsharded


# q/k RMSNorm (Qwen3) with head_dim apart from dim / n_heads: q is H·QK wide, k K·QK.
QK = 48


@pytest.mark.parametrize(
    "overrides",
    [
        ("zero=stage0",),
        ("zero=stage1", "precision=bf16"),
        ("zero=stage2", "precision=bf16"),
        ("zero=stage3", "precision=bf16"),
    ],
)
def test_qk_norm_saves_its_fp32_input_normalised_heads_and_a_rstd_per_head(
    overrides: tuple[str, ...],
) -> None:
    """In every regime the q/k norms save their fp32 input and x·rstd (8 bytes per element of q and k)
    and an fp32 rstd per head (4 bytes per head of q and of k), per token of every block."""
    base = (*SMALL, f"model.head_dim={QK}", *overrides)
    with_norm = build_plan(compose_config(*base, "model.qk_norm=true"), "cpu", 2).ranks[0].activations
    without = build_plan(compose_config(*base), "cpu", 2).ranks[0].activations
    per_token = 8 * (H * QK + K * QK) + 4 * (H + K)
    assert with_norm - without == L * N * per_token
