"""trainer/rank/nonfinite.py: every rank agrees whether a step is finite; raise or skip, and when to stop.

The deferred agreement (a fused AdamW skips on the device, the host reads later) runs in one
process on a one-rank gloo group (tests/unit/conftest.py); the 2-rank policy runs are in
tests/integration/test_resume.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import WORLD, keeping_stop_handlers, tiny_config
from trainer.config import TrainConfig
from trainer.data import build_batches
from trainer.rank.loop import build_trainee, train_step
from trainer.rank.nonfinite import NonFinite, NonFiniteError, NonFiniteGuard, Slots, agree, decode
from trainer.rank.optim import rewind_scheduler

NAN_AT_2 = dict(fault__kind="nan_loss", fault__step=2)


def guard_of(config: TrainConfig, defer: bool = False) -> NonFiniteGuard:
    return NonFiniteGuard(
        config.nonfinite, config.max_nonfinite_skips, WORLD, fp16=config.precision.is_fp16, defer=defer
    )


def weights(trainee) -> dict[str, torch.Tensor]:
    state = trainee.model.state_dict()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()
    }


def run_deferred(config, steps: int) -> tuple[NonFiniteGuard, list[dict[str, torch.Tensor]], object]:
    torch.manual_seed(config.seed)
    trainee = build_trainee(config, WORLD)
    guard = guard_of(config, defer=True)
    batches = build_batches(config, 0, 1, start_step=0)
    snapshots = [weights(trainee)]
    for step in range(1, steps + 1):
        train_step(trainee, batches, config, WORLD, step, guard)
        snapshots.append(weights(trainee))
    return guard, snapshots, trainee


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_flags_carry_the_stop_request_after_the_loss_and_gradient_flags() -> None:
    flags = agree(torch.tensor(1.0), torch.tensor(float("inf")), WORLD, stop=torch.tensor(15.0))
    assert flags.tolist() == [0.0, 1.0, 15.0]
    slots = Slots(WORLD.world_size)
    assert (slots.losses, slots.gradient, slots.stop, slots.size) == (slice(0, 1), 1, 2, 3)
    assert decode(flags.tolist(), 7, 1, scaler_enabled=False).gradient


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage3"])
def test_skip_on_the_device_holds_the_weights_and_is_counted_at_the_read(
    process_group: None, stage: str
) -> None:
    config = tiny_config(zero__stage=stage, optim__fused=True, nonfinite="skip", **NAN_AT_2)
    guard, snapshots, _ = run_deferred(config, 3)
    assert guard.skipped == 0 and len(guard.window) == 3  # nothing read on the host yet
    guard.settle()
    assert guard.skipped == 1 and guard.window == []
    assert same(snapshots[1], snapshots[2])  # step 2 was skipped on the device
    assert not same(snapshots[2], snapshots[3])  # step 3 trained


def test_raise_read_later_names_the_step_and_kept_the_last_good_weights(process_group: None) -> None:
    config = tiny_config(optim__fused=True, **NAN_AT_2)
    guard, snapshots, trainee = run_deferred(config, 4)  # the host learns of step 2 only now
    with pytest.raises(
        NonFiniteError, match=r"^non-finite loss at step 2 on rank 0 \(nonfinite=raise"
    ) as err:
        guard.settle()
    assert err.value.step == 2
    assert same(snapshots[1], snapshots[4])  # steps 2-4 all held: halted on the device at step 2
    lr_after_1 = trainee.scheduler.lr_lambdas[0](1) * config.optim.lr
    rewind_scheduler(trainee.scheduler, err.value.step - 1)
    assert trainee.scheduler.last_epoch == 1 and trainee.scheduler.get_last_lr() == [lr_after_1]
    assert trainee.optimizer.param_groups[0]["lr"] == lr_after_1


def test_skip_stops_at_max_in_a_row_read_later(process_group: None) -> None:
    config = tiny_config(
        optim__fused=True, nonfinite="skip", max_nonfinite_skips=2, fault__kind="nan_loss", fault__step=2
    )
    guard = guard_of(config, defer=True)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    skips = [
        guard.record(step, agree(loss, one, WORLD)).item()
        for step, loss in ((1, one), (2, nan), (3, nan), (4, one))
    ]
    assert skips == [0.0, 1.0, 1.0, 1.0]  # the 2nd bad step in a row halts: step 4 is held too
    with pytest.raises(
        NonFiniteError, match=r"^non-finite loss at step 3 on rank 0: 2 non-finite steps in a row"
    ):
        guard.settle()
    assert guard.skipped == 1


def test_deferred_and_immediate_reads_train_the_same_weights(process_group: None) -> None:
    config = tiny_config(optim__fused=True, nonfinite="skip", **NAN_AT_2)
    _, deferred, _ = run_deferred(config, 3)
    torch.manual_seed(config.seed)
    trainee = build_trainee(config, WORLD)
    guard = guard_of(config, defer=False)
    batches = build_batches(config, 0, 1, start_step=0)
    for step in range(1, 4):
        train_step(trainee, batches, config, WORLD, step, guard)
    assert guard.skipped == 1 and same(weights(trainee), deferred[3])


def test_a_stop_request_rides_the_deferred_agreement_and_is_agreed_at_the_read(tmp_path) -> None:
    import signal

    from trainer.faults.stop import RankStop
    from trainer.rank.nonfinite import stop_request

    with keeping_stop_handlers():
        stop = RankStop(tmp_path, watches_request=False)
    guard = guard_of(tiny_config(optim__fused=True), defer=True)
    one = torch.tensor(1.0)
    guard.record(1, agree(one, one, WORLD, stop=stop_request(stop)))
    stop.requested = signal.SIGUSR1  # as its signal handler notes it
    guard.record(2, agree(one, one, WORLD, stop=stop_request(stop)))
    assert stop.agreed == 0  # nothing read on the host yet
    guard.settle(stop)
    assert stop.agreed == signal.SIGUSR1 and guard.skipped == 0


def test_raise_names_step_rank_and_loss() -> None:
    config = tiny_config()
    guard = guard_of(config)
    with pytest.raises(NonFiniteError, match=r"^non-finite loss at step 3 on rank 1 \(nonfinite=raise"):
        guard.check(NonFinite(step=3, loss_ranks=(1,), gradient=True))


def test_skip_counts_and_stops_after_max_in_a_row() -> None:
    config = tiny_config(nonfinite="skip", max_nonfinite_skips=3)
    guard = guard_of(config)
    bad = NonFinite(step=5, loss_ranks=(), gradient=True)
    assert [guard.check(bad), guard.check(None), guard.check(bad), guard.check(bad)] == [
        False,
        True,
        False,
        False,
    ]
    assert guard.skipped == 3
    with pytest.raises(
        NonFiniteError, match=r"non-finite gradient at step 5 .*: 3 non-finite steps in a row"
    ):
        guard.check(bad)


def test_the_agreement_tells_loss_from_gradient_and_leaves_fp16_overflow_to_the_scaler() -> None:
    nan, inf, one = torch.tensor(math.nan), torch.tensor(math.inf), torch.tensor(1.0)

    def read(loss: torch.Tensor, grad_norm: torch.Tensor, fp16: bool) -> NonFinite | None:
        return decode(agree(loss, grad_norm, WORLD).tolist(), 3, WORLD.world_size, scaler_enabled=fp16)

    assert read(nan, inf, fp16=False) == NonFinite(3, (0,), True)
    assert read(one, inf, fp16=False) == NonFinite(3, (), True)
    assert read(one, inf, fp16=True) is None  # an overflow: GradScaler skips it
    assert read(nan, inf, fp16=True) == NonFinite(3, (0,), True)
    assert read(one, one, fp16=False) is None
