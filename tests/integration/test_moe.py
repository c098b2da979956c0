"""A mixture of experts (model=tiny-moe: 8 experts, 2 per token) trained on CPU ranks.

Expert parallelism (parallel.ep=2: each of 2 ranks holds 4 experts, tokens sent to them and back by all-to-all)
against one rank holding all 8, the same global batch (4 sequences of 64 tokens), fp32 and dropless: every
step's loss within 1e-5, the ep=2 run with its blocks recomputed in backward (checkpointing=full). The balance loss is per sequence (moe.balance=seq_aux), whose mean over sequences does
not depend on how the batch is split over ranks (a per-micro-batch loss would). With the aux-loss-free bias
(moe.bias_rate) the routers' biases after 10 steps are bitwise equal on 1 and 2 ranks: each step moves them by
the sign of the loads summed over every rank, integers. Under a capacity (moe.capacity_factor=1.0) assignments
are dropped, and the count logged is the routers' own (tests/unit/model/test_moe.py checks the drops against a
reference loop). ep=2's save resumes on one rank. At zero=stage0 (DDP, the experts left out of its buckets) ep=2
trains as one rank does and its save resumes there too (slow tier).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import TINY, Run, compose_config, run_trainer, wandb_file, wandb_records
from trainer.plan import build_plan
from trainer.units import GIB

# the all-to-all's autograd functional collective and FSDP2's ignored_params, under every torch the project claims
pytestmark = pytest.mark.torch_versions

MOE = (*TINY, "model=tiny-moe", "precision=fp32", "moe.balance=seq_aux", "optim.warmup_steps=2")
ONE_RANK = ("nproc=1", "micro_batch=4")
EP2 = ("nproc=2", "micro_batch=2", "parallel.ep=2", "zero=stage3")
EP2_DDP = ("nproc=2", "micro_batch=2", "parallel.ep=2", "zero=stage0")


def job(out_dir: Path, *overrides: str) -> Run:
    return run_trainer(out_dir, *MOE, *overrides, timeout=900)


@pytest.fixture(scope="module")
def biased(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """10 steps with the aux-loss-free bias, saved at the end: one rank (ep=1) and two (ep=2)."""
    out = tmp_path_factory.mktemp("moe")
    common = ("steps=10", "moe.bias_rate=0.001", "save.every=5")
    # The ep=2 run recomputes its blocks in backward: a recompute routes again and records nothing.
    ep2 = job(out / "ep2", *EP2, *common, "checkpointing=full")
    return {"ep1": job(out / "ep1", *ONE_RANK, *common), "ep2": ep2}


def expert_biases(run: Run, scratch: Path) -> dict[str, torch.Tensor]:
    """Every router's expert_bias in the run's step-10 save, through DCP's own converter."""
    target = scratch / f"{run.out_dir.parent.name}.pt"
    dcp_to_torch_save(run.out_dir / "checkpoints" / "step_00000010", target)
    state: dict[str, Any] = torch.load(target, weights_only=False)
    flat = {f"{k}.{name}": v for k, d in state.items() if isinstance(d, dict) for name, v in d.items()}
    return {key: value for key, value in flat.items() if key.endswith("expert_bias")}


def test_expert_parallel_losses_equal_one_rank(biased: dict[str, Run]) -> None:
    one, two = biased["ep1"].losses, biased["ep2"].losses
    assert len(one) == len(two) == 10
    worst = max(abs(a - b) for a, b in zip(one, two))
    assert worst < 1e-5, (one, two)


def test_the_aux_loss_free_biases_are_bitwise_equal_on_one_and_two_ranks(
    biased: dict[str, Run], tmp_path: Path
) -> None:
    one, two = (expert_biases(biased[name], tmp_path) for name in ("ep1", "ep2"))
    assert len(one) == 4 and one.keys() == two.keys()  # one per block
    for key in one:
        assert torch.equal(one[key], two[key]), key
        assert one[key].abs().max() > 0  # they moved: 10 steps of +-1e-3, centred
    record = biased["ep2"].records[-1]
    assert record["moe/expert_bias_absmax"] == pytest.approx(max(float(b.abs().max()) for b in one.values()))


def test_an_expert_parallel_save_resumes_on_one_rank(biased: dict[str, Run], tmp_path: Path) -> None:
    """ep=2's step-5 save (experts sharded over 2 ranks, the routers' biases) goes on at one rank holding all 8:
    DCP reshards; step 6 as the one-rank run's, within 1e-5."""
    save = biased["ep2"].out_dir / "checkpoints" / "step_00000005"
    resumed = job(tmp_path / "run", *ONE_RANK, "steps=6", "moe.bias_rate=0.001", "save=off", f"resume={save}")
    assert [r["step"] for r in resumed.records] == [6]
    assert abs(resumed.losses[0] - biased["ep1"].losses[5]) < 1e-5, (resumed.losses, biased["ep1"].losses)


@pytest.mark.slow  # ~25 s of two jobs (2 ranks, then 1): the default tier is at its budget
def test_under_ddp_expert_parallel_trains_as_one_rank_and_resumes_there(
    biased: dict[str, Run], tmp_path: Path
) -> None:
    """zero=stage0 (DDP, the experts left out of its buckets: trainer/rank/experts.py) at ep=2, the same 10 steps:
    every loss and gradient norm (the experts' DTensor gradients' norm over both ranks with the replicated rest,
    trainer/rank/optim.py `clip_gradients`) within 1e-5 of one rank's, the routers' biases bitwise equal; its
    step-5 save goes on at one rank, step 6 as the one-rank run's."""
    ddp = job(tmp_path / "ddp", *EP2_DDP, "steps=10", "moe.bias_rate=0.001", "save.every=5")
    one = biased["ep1"]
    assert len(ddp.losses) == 10
    assert max(abs(a - b) for a, b in zip(one.losses, ddp.losses)) < 1e-5, (one.losses, ddp.losses)
    norms = [[r["optim/grad_norm"] for r in run.records] for run in (one, ddp)]
    assert max(abs(a - b) for a, b in zip(*norms)) < 1e-5, norms
    ours, theirs = (expert_biases(run, tmp_path) for run in (ddp, one))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    save = ddp.out_dir / "checkpoints" / "step_00000005"
    resumed = job(tmp_path / "run", *ONE_RANK, "steps=6", "moe.bias_rate=0.001", "save=off", f"resume={save}")
    assert abs(resumed.losses[0] - one.losses[5]) < 1e-5, (resumed.losses, one.losses)


def test_routing_is_logged_per_layer(biased: dict[str, Run]) -> None:
    """moe/imbalance/<layer>: tokens per expert, max over mean (>= 1), for each of the 4 blocks."""
    record = biased["ep2"].records[-1]
    ratios = [record[f"moe/imbalance/{layer}"] for layer in range(4)]
    assert all(1.0 <= r < 8.0 for r in ratios), ratios
    assert record["moe/imbalance_max"] == max(ratios)
    assert record["moe/dropped_per_step"] == 0  # dropless
    assert record["moe/balance_loss"] >= 1.0 - 1e-6  # E * sum f P >= ... its balanced value is 1


@pytest.mark.slow  # ~20 s of a 2-rank run with W&B: the default tier measured 1,212 s: .ci/run runs the slow tier
def test_a_capacity_drops_and_logs_the_count_to_the_file_and_wandb(tmp_path: Path) -> None:
    """moe.capacity_factor=1.0: each expert takes at most its even share; the busiest experts drop the rest. W&B
    (offline, read back with its own reader) records the routing keys as metrics.jsonl has them."""
    capped = ("steps=2", "save=off", "moe.capacity_factor=1.0", "moe.drop_policy=position", "logger=wandb")
    run = run_trainer(tmp_path / "run", *MOE, *EP2, *capped, env={"WANDB_MODE": "offline"}, timeout=900)
    dropped = [record["moe/dropped_per_step"] for record in run.records]
    assert all(d > 0 for d in dropped), dropped
    history = [r["history"] for r in wandb_records(wandb_file(run.out_dir)) if r["type"] == "history"]
    logged = {int(h["step"]["num"]): h["item"] for h in history}
    for record in run.records:
        for key in ("moe/dropped_per_step", "moe/imbalance/0", "moe/imbalance/3", "moe/balance_loss"):
            assert logged[record["step"]][key] == record[key], key


WATCHED = (
    "model=tiny-moe", "device=cpu", "logger=none", "nproc=1", "seq_len=256", "micro_batch=4",
    "model.moe_ffn_dim=512", "save=off", "steps=3", "log_every=1", "moe.imbalance=2.0",
)  # fmt: skip


@pytest.mark.slow  # ~12 s of two jobs: the default tier measured 1,212 s: .ci/run runs the slow tier
def test_a_routing_that_would_run_out_of_memory_is_named_with_its_step(tmp_path: Path) -> None:
    """Memory for the plan at imbalance 3 (between its plans at 2, which the job assumes, and at 4, every token on
    one expert): the job finds the limit near 3; a run whose routing stays near balanced (its blocks measured 1.2 to
    2.0 here) prints no warning and ends ok; with expert 0 forced from step 2 (fault.kind=route_skew) the first
    forward of step 2 prints the one line, then the rank runs out of memory as it said."""
    cap = build_plan(compose_config(*WATCHED, "moe.imbalance=3.0"), "cpu", 1).peak_bytes / GIB
    steady = run_trainer(tmp_path / "steady", *WATCHED, f"device_memory_gib={cap!r}", timeout=900)
    assert 2.9 < steady.summary["moe/oom_imbalance"] < 3.1
    assert "warning: rank" not in steady.stderr and steady.summary["status"] == "ok"
    skewed = run_trainer(
        tmp_path / "skewed", *WATCHED, f"device_memory_gib={cap!r}", "fault.kind=route_skew", "fault.step=2",
        check=False, timeout=900,
    )  # fmt: skip
    warnings = [line for line in skewed.stderr.splitlines() if line.startswith("warning: rank")]
    assert len(warnings) == 1, skewed.stderr
    assert warnings[0].startswith(
        "warning: rank 0 step 2: block 0 sent 1024 of 2048 assignments to one expert, imbalance 4.00 (planned: "
        "moe.imbalance=2); past 3."
    )
    assert skewed.summary["status"] == "oom"
