"""A mixture of experts under context parallelism (parallel.cp=2 on 2 CPU ranks, Ulysses) against one rank of
the same global batch: each cp rank holds half of every sequence, and the balance loss all-reduces its sums over
the cp group (trainer/model/moe.py `balance_loss`), so the losses, the balance loss and the routing equal one
rank's; the plan holds each rank's peak and counts those all-reduces to the byte."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import TINY, Run, compose_config, run_trainer
from trainer.config import BalanceLoss
from trainer.plan.comm import moe_balance_moves

STEPS = 6
COMMON = (*TINY, "model=tiny-moe", "precision=fp32", "save=off", f"steps={STEPS}", "telemetry.memory_every=2")
BALANCES = ["seq_aux", pytest.param("aux", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int, int], Run]:
    return {}


def run(runs: dict[tuple[str, int, int], Run], tmp: Path, balance: str, cp: int, ep: int = 1) -> Run:
    """The job at `moe.balance`, parallel.cp (nproc = cp) and parallel.ep, run once per module."""
    if (balance, cp, ep) not in runs:
        args = ("nproc=1",) if cp == 1 else ("nproc=2", "parallel.cp=2", f"parallel.ep={ep}")
        result = run_trainer(tmp / f"{balance}_cp{cp}_ep{ep}", *COMMON, f"moe.balance={balance}", *args)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[(balance, cp, ep)] = result
    return runs[(balance, cp, ep)]


@pytest.mark.parametrize("balance", BALANCES)
def test_losses_and_the_balance_loss_equal_one_rank(runs: dict, tmp_path: Path, balance: str) -> None:
    one, two = run(runs, tmp_path, balance, 1), run(runs, tmp_path, balance, 2)
    assert len(two.losses) == STEPS
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    balance_one = [r["moe/balance_loss"] for r in one.records if "moe/balance_loss" in r]
    balance_two = [r["moe/balance_loss"] for r in two.records if "moe/balance_loss" in r]
    assert len(balance_two) == STEPS and balance_two == pytest.approx(balance_one, rel=1e-5)


def test_with_expert_parallelism_over_the_cp_ranks_the_losses_are_one_ranks(
    runs: dict, tmp_path: Path
) -> None:
    """parallel.ep=2 beside cp=2 on 2 ranks: the ep group is the cp ranks (dp = 1), each rank holds 4 experts and
    the two ranks' tokens reach them through the dispatch's all-to-alls; the losses and the balance loss are one
    rank's (and so cp=2's at ep=1). tests/integration/test_moe_ep_context_parallel.py holds its plan."""
    one, experts = run(runs, tmp_path, "seq_aux", 1), run(runs, tmp_path, "seq_aux", 2, ep=2)
    assert len(experts.losses) == STEPS
    assert experts.losses == pytest.approx(one.losses, rel=1e-5)
    balance_one = [r["moe/balance_loss"] for r in one.records if "moe/balance_loss" in r]
    balance_ep = [r["moe/balance_loss"] for r in experts.records if "moe/balance_loss" in r]
    assert len(balance_ep) == STEPS and balance_ep == pytest.approx(balance_one, rel=1e-5)


@pytest.mark.parametrize("balance", BALANCES)
def test_each_ranks_peak_is_the_plans_within_half_a_percent(runs: dict, tmp_path: Path, balance: str) -> None:
    two = run(runs, tmp_path, balance, 2)
    errors = [r["memory/prediction_error_pct"] for r in two.records if "memory/prediction_error_pct" in r]
    assert len(errors) == 3 and all(abs(e) < 0.5 for e in errors), errors


def test_the_balance_losss_all_reduces_are_the_plans(runs: dict, tmp_path: Path) -> None:
    """Against the same job without a balance loss, every rank all-reduces exactly the planned bytes more per step:
    per MoE layer the choices and scores forward (R x E fp32 each), the scores' gradient backward. (At dp = 1 the
    cp group is ZeRO's group too, and the flight recorder books these 2-D all-reduces to DDP's `world`.)"""
    with_balance, without = run(runs, tmp_path, "seq_aux", 2), run(runs, tmp_path, "none", 2)
    config = compose_config(*COMMON, "moe.balance=seq_aux", "nproc=2", "parallel.cp=2")
    assert config.moe.balance == BalanceLoss.seq_aux and config.moe.aux_coeff > 0
    layers = config.model.n_layers
    planned = sum(payload for _, payload, _ in moe_balance_moves(config, layers, layers))
    assert planned == 4 * layers * 3 * config.micro_batch * config.model.n_experts  # 768 B at tiny-moe
    for rank in (0, 1):
        key = f"comm/rank{rank}/all_reduce_bytes_per_step"
        more = [a[key] - b[key] for a, b in zip(with_balance.records, without.records) if a["step"] >= 2]
        assert more == [planned] * (STEPS - 1), more


@pytest.mark.slow  # three 4-rank jobs, ~22 s on 2 cores
def test_on_four_ranks_every_ep_group_over_dp_and_cp_trains_alike(tmp_path: Path) -> None:
    """dp=2 x cp=2 on 4 ranks, zero=stage3: ZeRO's group is all 4 (dp_shard x cp flattened), and parallel.ep=4 is
    that group, ep=2 a group of 2 consecutive ranks inside it (one sample's cp ranks; trainer/rank/mesh.py
    `expert_mesh`, FSDP2 sharding each rank's experts over the 2 ranks holding the same ones). The losses and the
    gradient norms are ep=1's on the same ranks."""
    runs = {}
    for ep in (1, 2, 4):
        result = run_trainer(
            tmp_path / f"ep{ep}",
            *COMMON,
            "nproc=4",
            "parallel.cp=2",
            f"parallel.ep={ep}",
            "zero=stage3",
            "steps=4",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[ep] = result
    norms = {
        ep: [r["optim/grad_norm"] for r in run.records if "optim/grad_norm" in r] for ep, run in runs.items()
    }
    for ep in (2, 4):
        assert len(runs[ep].losses) == 4 and runs[ep].losses == pytest.approx(runs[1].losses, rel=1e-5)
        assert len(norms[ep]) == 4 and norms[ep] == pytest.approx(norms[1], rel=1e-5)
