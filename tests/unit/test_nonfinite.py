"""trainer/nonfinite.py: every rank agrees whether a step is finite; raise or skip, and when to stop."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.fakes import WORLD, tiny_config
from trainer.nonfinite import NonFinite, NonFiniteError, NonFiniteGuard, find_nonfinite


def test_raise_names_step_rank_and_loss() -> None:
    config = tiny_config()
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, WORLD)
    with pytest.raises(NonFiniteError, match=r"^non-finite loss at step 3 on rank 1 \(nonfinite=raise"):
        guard.check(NonFinite(step=3, loss_ranks=(1,), gradient=True))


def test_skip_counts_and_stops_after_max_in_a_row() -> None:
    config = tiny_config(nonfinite="skip", max_nonfinite_skips=3)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, WORLD)
    bad = NonFinite(step=5, loss_ranks=(), gradient=True)
    assert [guard.check(bad), guard.check(None), guard.check(bad), guard.check(bad)] == [False, True, False, False]
    assert guard.skipped == 3
    with pytest.raises(NonFiniteError, match=r"non-finite gradient at step 5 .*: 3 non-finite steps in a row"):
        guard.check(bad)


def test_find_nonfinite_tells_loss_from_gradient_and_leaves_fp16_overflow_to_the_scaler() -> None:
    nan, inf, one = torch.tensor(math.nan), torch.tensor(math.inf), torch.tensor(1.0)
    assert find_nonfinite(nan, inf, 3, WORLD, scaler_enabled=False) == NonFinite(3, (0,), True)
    assert find_nonfinite(one, inf, 3, WORLD, scaler_enabled=False) == NonFinite(3, (), True)
    assert find_nonfinite(one, inf, 3, WORLD, scaler_enabled=True) is None  # an overflow: GradScaler skips it
    assert find_nonfinite(nan, inf, 3, WORLD, scaler_enabled=True) == NonFinite(3, (0,), True)
    assert find_nonfinite(one, one, 3, WORLD, scaler_enabled=False) is None
