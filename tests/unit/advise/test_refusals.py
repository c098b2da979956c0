"""Issue 39, A6: refusals lead with reserved memory, offer multi-node ways out in nodes=, try pairs of
changes, and name what binds when nothing fits (mode=plan and mode=advise)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from trainer.advise.advisor import advise, format_advice
from trainer.cli import register_configs
from trainer.config import TrainConfig, validate
from trainer.plan import build_plan, refusal

CONF = Path(__file__).resolve().parents[3] / "conf"
GPU = ("plan.accelerator=h100", "precision=bf16", "zero=stage3", "checkpointing=full", "micro_batch=1")


def composed(*overrides: str) -> TrainConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return validate(compose("train", overrides=["logger=none", *overrides]))


def test_a_two_node_refusal_leads_with_reserved_memory_and_grows_in_nodes() -> None:
    config = composed("mode=plan", "model=llama3-405b", "nodes=2", "nproc=8", "seq_len=4096", *GPU)
    plan = build_plan(config, "cuda", 16)
    line = refusal(plan)
    assert line is not None and "\n" not in line
    assert line.startswith(
        f"does not fit: {line.split(' needs ')[0][len('does not fit: ') :]} needs "
        f"{plan.required_bytes(plan.worst) / 2**30:.2f} GiB reserved on rank 0 (tensors {plan.peak_bytes / 2**30:.2f} GiB"
    )
    assert "zero=stage3 nodes=128 (73.72 GiB reserved)" in line and "nproc=" not in line.split("needs")[1]


def test_405b_nothing_fits_names_the_per_block_buffers() -> None:
    config = composed(
        "mode=plan",
        "model=llama3-405b",
        "nodes=2",
        "nproc=8",
        "seq_len=8192",
        "plan.host_memory_gib=1024",
        *GPU,
    )
    line = refusal(build_plan(config, "cuda", 16))
    assert line is not None
    assert "Nothing simple fits (what binds: per-block buffers (39.0 GiB: FSDP2's gathered blocks" in line


def test_a_pair_of_changes_is_tried_before_giving_up() -> None:
    """13b on one H100 at micro_batch 8 without checkpointing: offload leaves the activations, checkpointing
    or a smaller micro-batch the model states; a pair of them fits."""
    config = composed(
        "mode=plan", "model=13b", "nproc=1", "seq_len=4096", *GPU[:2], "zero=stage3", "micro_batch=8"
    )
    line = refusal(build_plan(config, "cuda", 1))
    assert line is not None and "Try checkpointing=full offload=cpu (" in line, line
    assert "Nothing simple fits" not in line


def test_the_offloaded_70b_under_mode_advise_names_host_memory() -> None:
    config = composed(
        "mode=advise", "model=70b", "nproc=8", "plan.accelerator=h100", "seq_len=4096", "precision=bf16",
        "global_batch=8", "plan.host_memory_gib=1024", "advise.stages=[stage3]", "advise.checkpointing=[full]",
    )  # fmt: skip
    ranked, rates = advise(config, "cuda", 8)
    assert not any(c.fits for c in ranked)
    text = format_advice(config, ranked, rates, [], 8, "h100")
    assert "nothing fits: the smallest is" in text
    assert "what binds: host memory (a node needs 1104 GiB of it, plan.host_memory_gib" in text
