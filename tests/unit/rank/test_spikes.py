"""trainer/rank/spikes.py: the running median and its flag, the agreed slots, the actions and their
limit, and stability.spike's config checks (no process: the 2-rank agreement is tests/integration/test_spikes.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import WORLD, compose_config, tiny_config
from trainer.config import ConfigError, NonFinitePolicy, SpikeAction, SpikeConfig, StabilityConfig
from trainer.rank.nonfinite import NonFiniteGuard, Slots, agree, summarize
from trainer.rank.spikes import (
    SPIKES_FILE,
    SpikeDetector,
    SpikeError,
    SpikeGuard,
    decode_spike,
    past_spikes,
    untrained_steps,
)

LOG = SpikeConfig(action=SpikeAction.log, factor=10.0, window=3)


def ratios(detector: SpikeDetector, losses: list[float], grad_norm: float = 1.0) -> list[float]:
    return [detector.observe(torch.tensor(loss), torch.tensor(grad_norm))[0].item() for loss in losses]


def test_a_loss_above_factor_times_the_median_of_the_window_is_flagged_with_its_ratio() -> None:
    detector = SpikeDetector(LOG, torch.device("cpu"))
    # Nothing before the window is full; 35 is 8.75 x the median 4 of (5, 4, 3): kept; 50 is 50 / 4 = 12.5.
    assert ratios(detector, [5.0, 4.0, 3.0, 35.0, 50.0]) == [0.0, 0.0, 0.0, 0.0, 12.5]
    # The spike (50) and a NaN never enter the history: the median stays that of the finite ordinary losses.
    assert ratios(detector, [float("nan")]) == [0.0]
    assert sorted(detector.history.tolist()) == [3.0, 4.0, 35.0]
    assert ratios(detector, [41.0]) == [41.0 / 4.0]


def test_an_even_window_takes_the_mean_of_the_middle_two_and_a_gradient_norm_has_its_own_bound() -> None:
    detector = SpikeDetector(
        SpikeConfig(action=SpikeAction.skip, window=2, grad_norm=5.0), torch.device("cpu")
    )
    # The median of (2, 4) is 3: 29 is 9.67 x (kept, the median becomes 16.5), 31 was 10.33 x.
    assert ratios(detector, [2.0, 4.0, 31.0, 29.0]) == pytest.approx([0.0, 0.0, 31.0 / 3.0, 0.0])
    ratio, grad = detector.observe(torch.tensor(3.0), torch.tensor(7.5))
    assert (ratio.item(), grad.item()) == (0.0, 7.5)
    assert detector.observe(torch.tensor(3.0), torch.tensor(float("inf")))[1].item() == 0.0  # non-finite's


def test_the_spike_slots_follow_the_non_finite_ones_and_exist_only_when_on() -> None:
    assert Slots(4).size == 6 and Slots(4, spikes=True).size == 11
    assert Slots(4, spikes=True).spike_losses == slice(6, 10) and Slots(4, spikes=True).spike_grad == 10
    flags = agree(torch.tensor(1.0), torch.tensor(2.0), WORLD, spike=(torch.tensor(12.5), torch.tensor(0.0)))
    assert flags.tolist() == [0.0, 0.0, 0.0, 12.5, 0.0]
    assert agree(torch.tensor(1.0), torch.tensor(2.0), WORLD).tolist() == [0.0, 0.0, 0.0]


def test_decode_names_the_flagging_ranks() -> None:
    assert decode_spike([0.0, 0.0], 0.0, 4) is None
    spike = decode_spike([0.0, 97.4], 0.0, 4)
    assert spike is not None and spike.ratios == {1: 97.4}
    assert spike.describe(LOG) == (
        "loss spike at step 4 on rank 1 (97.4 x the median of its last 3 losses; stability.spike.factor=10)"
    )
    grad = decode_spike([0.0], 7.5, 2)
    assert grad is not None and grad.describe(SpikeConfig(grad_norm=5.0)) == (
        "gradient norm spike at step 2 (7.5 > stability.spike.grad_norm=5)"
    )


@pytest.mark.parametrize(("action", "steps"), [("log", True), ("skip", False), ("rollback", False)])
def test_each_action_counts_records_and_says_whether_the_optimizer_steps(
    tmp_path: Path, action: str, steps: bool
) -> None:
    guard = SpikeGuard(SpikeConfig(action=SpikeAction[action], window=3), WORLD, tmp_path)
    assert guard.check_flags([0.0], 0.0, 3) is True
    assert guard.check_flags([20.0], 0.0, 4) is steps
    assert guard.count == 1 and guard.fields() == {"stability/loss_spikes": 1}
    assert guard.rollback_at == (4 if action == "rollback" else None)
    events = [json.loads(line) for line in (tmp_path / SPIKES_FILE).read_text().splitlines()]
    assert events == [{"step": 4, "action": action, "ratios": {"0": 20.0}, "grad_norm": None}]


def test_max_in_a_row_stops_in_one_line_and_a_clean_step_resets_the_count(tmp_path: Path) -> None:
    guard = SpikeGuard(SpikeConfig(action=SpikeAction.skip, window=3, max_in_a_row=2), WORLD, tmp_path)
    assert not guard.check_flags([20.0], 0.0, 4)
    assert guard.check_flags([0.0], 0.0, 5)  # resets
    assert not guard.check_flags([20.0], 0.0, 6)
    with pytest.raises(SpikeError) as err:
        guard.check_flags([30.0], 0.0, 7)
    assert err.value.step == 7 and str(err.value) == (
        "loss spike at step 7 on rank 0 (30.0 x the median of its last 3 losses; stability.spike.factor=10): "
        "2 spikes in a row (stability.spike.action=skip stops at stability.spike.max_in_a_row=2)"
    )


def test_a_non_finite_step_is_the_non_finite_policys_not_a_spike(tmp_path: Path) -> None:
    spikes = SpikeGuard(SpikeConfig(action=SpikeAction.skip, window=3), WORLD, tmp_path)
    guard = NonFiniteGuard(NonFinitePolicy["skip"], 3, WORLD, fp16=False, spikes=spikes)
    nan = agree(
        torch.tensor(float("nan")), torch.tensor(1.0), WORLD, spike=(torch.tensor(0.0), torch.tensor(0.0))
    )
    assert guard.check_now(3, nan) is False and guard.skipped == 1 and spikes.count == 0
    spiked = agree(torch.tensor(9.0), torch.tensor(1.0), WORLD, spike=(torch.tensor(30.0), torch.tensor(0.0)))
    assert guard.check_now(4, spiked) is False and guard.skipped == 1 and spikes.count == 1


def test_the_summary_takes_the_last_count_and_a_resume_counts_the_recorded_spikes(tmp_path: Path) -> None:
    records = [{"step": 1, "train/nonfinite_skipped": 0}, {"step": 2, "stability/loss_spikes": 2}]
    assert summarize(records) == {"train/nonfinite_skipped": 0, "stability/loss_spikes": 2}
    assert summarize(records[:1]) == {"train/nonfinite_skipped": 0}
    lines = [
        {"step": 4, "action": "rollback", "ratios": {"1": 90.0}, "grad_norm": None},
        {"step": 4, "rolled_back": [3, 4], "save": "x"},
        {"step": 9, "action": "log", "ratios": {"0": 12.0}, "grad_norm": None},
    ]
    (tmp_path / SPIKES_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [event["step"] for event in past_spikes(tmp_path, 8)] == [4]
    config = tiny_config(stability__skip_steps=[7])
    assert untrained_steps(config, tmp_path, 2) == {3, 4, 7}  # resumed before the rollback: its window too
    assert untrained_steps(config, tmp_path, 3) == {4, 7}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"factor": 1.0}, "stability.spike.factor must be > 1, got 1.0"),
        ({"window": 0}, "stability.spike.window must be >= 1, got 0"),
        ({"grad_norm": 0.0}, "stability.spike.grad_norm must be > 0 or null, got 0.0"),
        ({"max_in_a_row": 0}, "stability.spike.max_in_a_row must be >= 1, got 0"),
    ],
)
def test_bad_values_are_refused_naming_the_key(values: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        SpikeConfig(**values)  # type: ignore[arg-type]
    assert str(err.value) == message


def test_rollback_needs_saves_and_off_is_the_default() -> None:
    with pytest.raises(ConfigError) as err:
        compose_config("stability.spike.action=rollback", "save=off")
    assert str(err.value) == (
        "stability.spike.action=rollback reloads the last save: needs save.every >= 1 (save=default), got save.every=0"
    )
    assert compose_config().stability.spike.action == SpikeAction.none
    with pytest.raises(ConfigError) as err:
        StabilityConfig(skip_steps=[0])
    assert str(err.value) == "stability.skip_steps must be steps >= 1, got [0]"
