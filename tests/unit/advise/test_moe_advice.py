"""mode=advise for a mixture of experts: expert parallelism among the candidates, and the routing it assumed."""

from __future__ import annotations

from tests.helpers import compose_config
from trainer.advise.advisor import choices, configure, routing_note
from trainer.config import first_refusal

ADVISE = ("mode=advise", "precision=bf16", "plan.accelerator=h100", "seq_len=4096")


def expert_degrees(model: str, nodes: int, global_batch: int) -> set[int | None]:
    config = compose_config(
        *ADVISE, f"model={model}", "nproc=8", f"nodes={nodes}", f"global_batch={global_batch}"
    )
    return {c.get("parallel.ep") for c in choices(config, 8 * nodes, "cuda")}


def test_ep_is_every_data_parallel_rank_where_they_divide_the_experts() -> None:
    """Qwen3-30B-A3B's 128 experts: ep=8 on 8 H100s, ep=64 on 64 (the ep group is, for now, FSDP2's whole group).
    Mixtral's 8 experts: ep=8 on 8 H100s; none on 64, which 8 experts do not divide."""
    assert expert_degrees("qwen3-30b-a3b", 1, 64) == {None, 8}
    assert expert_degrees("qwen3-30b-a3b", 8, 512) == {None, 64}
    assert expert_degrees("mixtral-8x7b", 1, 64) == {None, 8}
    assert expert_degrees("mixtral-8x7b", 8, 512) == {None}
    assert expert_degrees("llama3-8b", 1, 64) == {None}  # dense: no experts to shard


def test_every_ep_candidate_composes_and_configures() -> None:
    config = compose_config(*ADVISE, "model=qwen3-30b-a3b", "nproc=8", "global_batch=64")
    with_ep = [c for c in choices(config, 8, "cuda") if c.get("parallel.ep")]
    # DDP with ZeroRedundancyOptimizer (stage1) is refused by the table; DDP alone (stage0) composes
    assert with_ep and {c["zero"] for c in with_ep} <= {"stage0", "stage2", "stage3"}
    assert "stage0" in {c["zero"] for c in with_ep}
    assert all(c["offload"] == "none" and c.get("zero.shard_ranks") is None for c in with_ep)
    for choice in with_ep:
        configured = configure(config, choice)
        assert configured.parallel.ep == 8 and first_refusal(configured) is None


def test_the_advice_says_the_routing_it_planned_for() -> None:
    config = compose_config(*ADVISE, "model=mixtral-8x7b", "nproc=8", "global_batch=64", "moe.imbalance=1.5")
    assert routing_note(config) == (
        "routing: planned at moe.imbalance=1.5 (the busiest expert's tokens over the mean; 1 is balanced) for 8 "
        "experts, top_k=2; a run logs what its routers do (moe/imbalance_max): plan again with that"
    )
