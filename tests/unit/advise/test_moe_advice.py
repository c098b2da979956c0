"""mode=advise for a mixture of experts: expert parallelism among the candidates, and the routing it assumed."""

from __future__ import annotations

from tests.helpers import compose_config
from trainer.advise.advisor import choices, configure, evaluate, rates_for, routing_note
from trainer.config import first_refusal
from trainer.model.decoder import flops_per_token
from trainer.units import GIB

ADVISE = ("mode=advise", "precision=bf16", "plan.accelerator=h100", "seq_len=4096")


def expert_degrees(model: str, nodes: int, global_batch: int) -> set[int | None]:
    config = compose_config(
        *ADVISE, f"model={model}", "nproc=8", f"nodes={nodes}", f"global_batch={global_batch}"
    )
    return {c.get("parallel.ep") for c in choices(config, 8 * nodes, "cuda")}


def test_ep_is_every_size_dividing_the_experts_and_the_data_parallel_ranks() -> None:
    """Qwen3-30B-A3B's 128 experts: every power of two up to the 8 ranks (an ep group smaller than the
    data-parallel ranks under FSDP2, trainer/rank/mesh.py `expert_mesh`). Mixtral's 8 experts: 2, 4 and 8 on 8 H100s
    and on 64 (where ep=64 does not divide them)."""
    assert expert_degrees("qwen3-30b-a3b", 1, 64) == {None, 2, 4, 8}
    assert expert_degrees("mixtral-8x7b", 1, 64) == {None, 2, 4, 8}
    assert expert_degrees("mixtral-8x7b", 8, 512) == {None, 2, 4, 8}
    assert expert_degrees("llama3-8b", 1, 64) == {None}  # dense: no experts to shard


def test_every_ep_candidate_composes_and_configures() -> None:
    config = compose_config(*ADVISE, "model=qwen3-30b-a3b", "nproc=8", "global_batch=64")
    with_ep = [c for c in choices(config, 8, "cuda") if c.get("parallel.ep")]
    # DDP with ZeroRedundancyOptimizer (stage1) is refused by the table; DDP alone (stage0) composes
    assert with_ep and {c["zero"] for c in with_ep} <= {"stage0", "stage2", "stage3"}
    assert "stage0" in {c["zero"] for c in with_ep}
    assert all(c.get("zero.shard_ranks") is None for c in with_ep)
    # offload only where an ep group lies inside the data-parallel ranks: FSDP2 holds (and offloads) the experts
    assert {c["parallel.ep"] for c in with_ep if c["offload"] != "none"} == {2, 4}
    for choice in with_ep:
        configured = configure(config, choice)
        assert first_refusal(configured) is None
        # an ep group inside the data-parallel ranks only under FSDP2: DDP's replicas take ep = dp
        assert configured.parallel.ep == 8 or choice["zero"] in ("stage2", "stage3")


def test_the_advice_says_the_routing_it_planned_for() -> None:
    config = compose_config(*ADVISE, "model=mixtral-8x7b", "nproc=8", "global_batch=64", "moe.imbalance=1.5")
    assert routing_note(config, []) == (
        "routing: planned at moe.imbalance=1.5 (the busiest expert's tokens over the mean; 1 is balanced) for 8 "
        "experts, top_k=2; a run logs what its routers do (moe/imbalance_max): plan again with that"
    )


def test_mixtral_on_8_h100s_fits_with_an_ep_group_inside_the_ranks_offloaded() -> None:
    """Mixtral's 46.7B parameters' states (16 bytes each) pass 80 GiB a rank on 8 H100s: ep=4 inside the 8
    data-parallel ranks, its experts FSDP2's and offloaded with the rest, fits."""
    config = compose_config(*ADVISE, "model=mixtral-8x7b", "nproc=8", "global_batch=64")
    choice = next(
        c
        for c in choices(config, 8, "cuda")
        if c.get("parallel.ep") == 4
        and c["zero"] == "stage3"
        and c["offload"] == "cpu"
        and c["checkpointing"] == "full"
    )
    rates = rates_for(config, 8, [choice["micro_batch"]])
    candidate = evaluate(config, choice, "cuda", 8, rates, flops_per_token(config.model, config.seq_len))
    assert candidate is not None and candidate.device_fits
    assert candidate.reserved_bytes < 40 * GIB  # the states in host memory: activations and gathers remain


def test_where_no_ep_candidate_fits_the_advice_names_the_least() -> None:
    """Mixtral's 46.7B parameters on 8 H100s: with ep=8 (every data-parallel rank: no offload) its states alone
    pass 80 GiB a rank; the note names the candidate that needs the least, with what it needs."""
    config = compose_config(*ADVISE, "model=mixtral-8x7b", "nproc=8", "global_batch=8")
    choice = next(
        c for c in choices(config, 8, "cuda") if c.get("parallel.ep") == 8 and c["zero"] == "stage3"
    )
    rates = rates_for(config, 8, [choice["micro_batch"]])
    candidate = evaluate(config, choice, "cuda", 8, rates, flops_per_token(config.model, config.seq_len))
    assert candidate is not None and candidate.device_fits is False
    note = routing_note(config, [candidate])
    assert note.endswith(
        f"; no parallel.ep candidate fits: the least, {candidate.label()}, needs "
        f"{candidate.reserved_bytes / GIB:.1f} GiB"
    )
    assert candidate.reserved_bytes > 80 * GIB
