"""trainer/plan/host.py: a node's host memory, pinned against hand calculations for the tiny model.

The tiny model (conf/model/tiny.yaml) on 2 ranks: every dim 0 is even, so FSDP2's shards are
unpadded halves. Its fp32 parameters, tensor by tensor (bytes of one rank's shard = 2 x numel):

    tok_embeddings 512x128  131,072 B   (a power of two already)
    per block      wq 128x128 32,768; wk, wv 64x128 16,384 each; wo 32,768;
                   w1, w3 384x128 and w2 128x384 98,304 each -> pinned as 131,072;
                   attention_norm, ffn_norm 128: 256 each
    norm 128       256 B
    output 128x512 131,072 B

Pinned, a block's parameters take 32,768 + 2 x 16,384 + 32,768 + 3 x 131,072 + 2 x 256 = 492,032 B
(unpinned 393,728 B); four blocks and the root (262,400 B) make 2,230,528 B pinned (1,837,312 B
unpinned) for the parameters, and as much again for the gradients. Adam's moments: 8 B x 459,328
elements = 3,674,624 B, and 39 step counters of 4 B.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import compose_config as compose_for_any_host
from trainer.config import TrainConfig
from trainer.plan import build_plan, host_refusal
from trainer.plan.host import pinned_bytes
from trainer.units import GIB

RUNTIME = 2 * GIB  # plan.cuda_rank_runtime_gib's default
PARAMS_PINNED = GRADS_PINNED = 2_230_528
PARAMS = GRADS = 1_837_312
ADAM = 3_674_624 + 39 * 4


def compose_config(*overrides: str) -> TrainConfig:
    """A config planned against a 16 GiB host unless an override says otherwise."""
    return compose_for_any_host("plan.host_memory_gib=16", *overrides)


def test_pinned_tensors_take_the_next_power_of_two() -> None:
    assert [pinned_bytes(n) for n in (0, 1, 256, 257, 98_304, 131_072)] == [0, 1, 256, 512, 131_072, 131_072]


@pytest.mark.parametrize("stage", ["stage2", "stage3"])
def test_an_offloading_node_holds_pinned_shards_adam_and_the_runtime(stage: str) -> None:
    plan = build_plan(compose_config("model=tiny", f"zero={stage}", "offload=cpu"), "cuda", 2)
    rank = RUNTIME + PARAMS_PINNED + GRADS_PINNED + ADAM
    assert [r.total for r in plan.host.ranks] == [rank, rank]
    assert plan.host.need_bytes == 2 * rank == 4_311_238_968
    assert plan.host.available_bytes == 16 * GIB and plan.host_fits is True


def test_unpinned_offload_holds_the_shards_as_they_are() -> None:
    config = compose_config("model=tiny", "zero=stage3", "offload=cpu", "offload.pin_memory=false")
    plan = build_plan(config, "cuda", 2)
    assert plan.host.ranks[0].pinned == 0
    assert plan.host.need_bytes == 2 * (RUNTIME + PARAMS + GRADS + ADAM)


def test_an_unfused_cpu_adam_adds_its_loop_temporaries() -> None:
    # The largest: w2's shard (24,576 elements) twice, plus w1's before it: 73,728 fp32 elements.
    config = compose_config("model=tiny", "zero=stage3", "offload=cpu", "optim.fused=false")
    plan = build_plan(config, "cuda", 2)
    assert plan.host.ranks[0].total == RUNTIME + PARAMS_PINNED + GRADS_PINNED + ADAM + 4 * 73_728


@pytest.mark.parametrize("stage", ["stage0", "stage1"])
def test_gpu_ranks_without_offload_hold_only_their_runtime(stage: str) -> None:
    plan = build_plan(compose_config("model=tiny", f"zero={stage}"), "cuda", 2)
    assert plan.host.need_bytes == 2 * RUNTIME == 4_294_967_296


def test_cpu_ranks_hold_their_tensors_and_their_runtime() -> None:
    plan = build_plan(compose_config("model=tiny", "zero=stage0"), "cpu", 2)
    runtime = int(0.4 * GIB)  # plan.cpu_rank_runtime_gib's default
    assert plan.host.need_bytes == sum(runtime + r.peak.total for r in plan.ranks)


def test_a_node_counts_only_its_own_ranks() -> None:
    plan = build_plan(compose_config("model=tiny", "zero=stage3", "offload=cpu", "nodes=2"), "cuda", 4)
    assert len(plan.host.ranks) == 2  # world 4 over 2 nodes


def test_a_host_too_small_is_refused_with_the_figures_and_a_way_out() -> None:
    config = compose_config("model=tiny", "zero=stage3", "offload=cpu", "plan.host_memory_gib=4.01")
    plan = build_plan(config, "cuda", 2)
    line = host_refusal(plan)
    assert line is not None and "\n" not in line
    assert line.startswith("does not fit this host: 2 ranks per node each hold 2.00 GiB of process runtime")
    assert "= 4.0 GiB per node, but the host has 4.0 GiB (plan.host_memory_gib=4.01)" in line
    assert "Try offload=none" in line  # the tiny model fits any GPU without offload


def test_an_unknown_host_is_said_to_be_unknown() -> None:
    config = compose_config("model=tiny", "zero=stage3", "offload=cpu", "plan.accelerator=h100", "mode=plan")
    config.plan.host_memory_gib = None
    plan = build_plan(config, "cuda", 8)
    assert plan.host.available_bytes is None and plan.host_fits is None
    assert "set plan.host_memory_gib" in plan.host.describe()


def test_hsdp_offload_sizes_each_ranks_states_over_its_shard_group() -> None:
    """70b, stage3 HSDP 8 x 8 (a shard group per node) offloading: each rank holds 1/8 of every tensor,
    not 1/64. Per rank (every dim 0 of 70b divides by 8, so no padding): pinned fp32 parameter shards
    wq, wo 32 MiB; wk, wv 4 MiB; w1, w2, w3 112 MiB each, pinned as 128 MiB; two norms 4 KiB; so a
    block 456 MiB + 8 KiB, 80 of them, and the root's embedding and output 125 MiB each (pinned 128) and
    norm 4 KiB: 36,736 MiB + 644 KiB, as much again for the gradients; Adam's moments 8P / 8 = P bytes
    and 723 step counters; the 2 GiB runtime. Eight such ranks need 1,103.9 GiB: refused on 1,024."""
    config = compose_config(
        "model=70b",
        "zero=stage3",
        "zero.shard_ranks=8",
        "offload=cpu",
        "nodes=8",
        "nproc=8",
        "precision=bf16",
        "plan.host_memory_gib=1024",
        "mode=plan",
    )
    plan = build_plan(config, "cuda", 64)
    pinned = 2 * (36_736 * 2**20 + 644 * 2**10)
    pageable = 68_976_648_192 + 723 * 4  # Llama 2 70b's parameter count, times 8 bytes over 8 ranks
    assert [r.total for r in plan.host.ranks] == [RUNTIME + pinned + pageable] * 8
    assert plan.host.need_bytes == 1_185_331_436_128  # 1,103.9 GiB
    assert plan.host_fits is False
    assert "= 1103.9 GiB per node, but the host has 1024.0 GiB" in (host_refusal(plan) or "")


def test_three_ranks_pad_parameter_shards_but_not_gradient_shards() -> None:
    """tiny on 3 ranks, unpinned: FSDP2 pads each parameter's dim 0 to a multiple of 3 (512 -> 171
    rows a rank, 128 -> 43, 64 -> 22, 384 -> 128), 307,843 elements a rank; gradient shards and Adam's
    moments are torch.chunk's unpadded rows: the same on ranks 0 and 1, and on rank 2 170, 42, 20 and
    128 rows: 302,970 elements."""
    config = compose_config("model=tiny", "zero=stage3", "offload=cpu", "offload.pin_memory=false", "nproc=3")
    plan = build_plan(config, "cuda", 3)
    padded, last = 307_843, 302_970
    steps = 39 * 4
    full = RUNTIME + 4 * padded + 4 * padded + 8 * padded + steps
    assert [r.total for r in plan.host.ranks] == [full, full, RUNTIME + 4 * padded + 12 * last + steps]


# Saving in the background (save.async_mode): each rank's staging copy is its saved state, as it
# holds it: stage0 the whole fp32 parameters (918,656 elements: 3,674,624 B), Adam's moments
# (7,349,248 B) and step counters (156 B); stage3 on 2 ranks the unpadded halves of both (PARAMS and
# ADAM above). process mode adds a save process per rank (plan.cpu_rank_runtime_gib, 0.4 GiB).
STAGING_STAGE0 = 3_674_624 + 7_349_248 + 156
STAGING_STAGE3 = PARAMS + ADAM
WRITER = int(0.4 * GIB)


def test_saving_in_a_thread_holds_a_staging_copy_of_each_ranks_state() -> None:
    plan = build_plan(compose_config("model=tiny", "zero=stage0", "save.async_mode=thread"), "cuda", 2)
    assert [(r.staging, r.writer) for r in plan.host.ranks] == [(STAGING_STAGE0, 0)] * 2
    assert plan.host.need_bytes == 2 * (RUNTIME + 11_024_028)
    assert "0.0103 GiB staging copy of the save" in plan.host.describe()


def test_saving_in_a_process_adds_the_save_process_of_every_rank() -> None:
    plan = build_plan(compose_config("model=tiny", "zero=stage3", "save.async_mode=process"), "cuda", 2)
    assert [(r.staging, r.writer) for r in plan.host.ranks] == [(STAGING_STAGE3, WRITER)] * 2
    assert plan.host.need_bytes == 2 * (RUNTIME + 5_512_092 + WRITER)
    in_place = build_plan(
        compose_config("model=tiny", "zero=stage3", "save.async_mode=process", "save=off"), "cuda", 2
    )
    assert in_place.host.need_bytes == 2 * RUNTIME  # nothing saved, nothing staged


def test_a_host_too_small_for_the_staging_copy_is_refused_with_saving_in_place_as_the_way_out() -> None:
    # 4.005 GiB holds the two runtimes (4 GiB) but not their staging copies as well (21.0 MiB).
    config = compose_config(
        "model=tiny", "zero=stage0", "save.async_mode=thread", "plan.host_memory_gib=4.005"
    )
    line = host_refusal(build_plan(config, "cuda", 2))
    assert line is not None and "\n" not in line
    assert "+ 0.01 GiB to save in the background (save.async_mode=thread) = 4.0 GiB per node" in line
    assert "Try save.async_mode=off (4.0 GiB per node)" in line


@pytest.mark.parametrize(
    ("device", "overrides", "shard"),
    [
        ("cpu", ("zero=stage3",), PARAMS),  # a CPU rank's shard is in host memory
        ("cuda", ("zero=stage3",), 0),  # on the GPU
        ("cuda", ("zero=stage3", "offload=cpu"), PARAMS),  # offloaded: in host memory again
    ],
)
def test_loading_holds_the_shard_where_it_lives_and_the_largest_tensor(
    tmp_path: Path, device: str, overrides: tuple[str, ...], shard: int
) -> None:
    """The largest tensor by its stored bytes (the headers' data offsets): 1,000 bf16 elements, 2,000 B,
    over 300 fp32 (1,200 B). The shard: one rank's fp32 parameters (PARAMS, unpadded halves)."""
    from safetensors.torch import save_file

    save_file(
        {"a": torch.zeros(1000, dtype=torch.bfloat16), "b": torch.zeros(3, 100)},
        tmp_path / "model.safetensors",
    )
    plan = build_plan(compose_config("model=tiny", f"model.weights={tmp_path}", *overrides), device, 2)
    assert [r.loading for r in plan.host.ranks] == [shard + 2_000] * 2
    assert plan.host.to_json()["loading_gib"] == (shard + 2_000) / GIB
