"""trainer/nonfinite.py's deferred agreement on CPU: a fused AdamW skips on the device, the host reads later.

One process, a one-rank gloo group (tests/unit/test_checkpoint.py's fixture); the 2-rank policy
runs are in tests/integration/test_resume.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_checkpoint import WORLD, process_group, tiny_config  # noqa: F401 (fixture)
from trainer.data import build_batches
from trainer.loop import build_trainee, train_step
from trainer.nonfinite import NonFiniteError, NonFiniteGuard, agree, decode
from trainer.optim import rewind_scheduler

NAN_AT_2 = dict(fault__kind="nan_loss", fault__step=2)


def weights(trainee) -> dict[str, torch.Tensor]:
    state = trainee.model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def run_deferred(config, steps: int) -> tuple[NonFiniteGuard, list[dict[str, torch.Tensor]], object]:
    torch.manual_seed(config.seed)
    trainee = build_trainee(config, WORLD)
    guard = NonFiniteGuard(config, WORLD, defer=True)
    batches = build_batches(config, 0, 1, start_step=0)
    snapshots = [weights(trainee)]
    for step in range(1, steps + 1):
        train_step(trainee, batches, config, WORLD, step, guard)
        snapshots.append(weights(trainee))
    return guard, snapshots, trainee


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_flags_carry_extra_decisions_after_the_loss_and_gradient_flags() -> None:
    flags = agree(torch.tensor(1.0), torch.tensor(float("inf")), WORLD, extra=(torch.tensor(1.0), 0.0))
    assert flags.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert decode(flags.tolist(), 7, 1, scaler_enabled=False).gradient


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage3"])
def test_skip_on_the_device_holds_the_weights_and_is_counted_at_the_read(process_group: None, stage: str) -> None:
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
    with pytest.raises(NonFiniteError, match=r"^non-finite loss at step 2 on rank 0 \(nonfinite=raise") as err:
        guard.settle()
    assert err.value.step == 2
    assert same(snapshots[1], snapshots[4])  # steps 2-4 all held: halted on the device at step 2
    lr_after_1 = trainee.scheduler.lr_lambdas[0](1) * config.optim.lr
    rewind_scheduler(trainee.scheduler, err.value.step - 1)
    assert trainee.scheduler.last_epoch == 1 and trainee.scheduler.get_last_lr() == [lr_after_1]
    assert trainee.optimizer.param_groups[0]["lr"] == lr_after_1


def test_skip_stops_at_max_in_a_row_read_later(process_group: None) -> None:
    config = tiny_config(optim__fused=True, nonfinite="skip", max_nonfinite_skips=2, fault__kind="nan_loss", fault__step=2)
    guard = NonFiniteGuard(config, WORLD, defer=True)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    skips = [guard.record(step, agree(loss, one, WORLD)).item() for step, loss in ((1, one), (2, nan), (3, nan), (4, one))]
    assert skips == [0.0, 1.0, 1.0, 1.0]  # the 2nd bad step in a row halts: step 4 is held too
    with pytest.raises(NonFiniteError, match=r"^non-finite loss at step 3 on rank 0: 2 non-finite steps in a row"):
        guard.settle()
    assert guard.skipped == 1


def test_deferred_and_immediate_reads_train_the_same_weights(process_group: None) -> None:
    config = tiny_config(optim__fused=True, nonfinite="skip", **NAN_AT_2)
    _, deferred, _ = run_deferred(config, 3)
    torch.manual_seed(config.seed)
    trainee = build_trainee(config, WORLD)
    guard = NonFiniteGuard(config, WORLD, defer=False)
    batches = build_batches(config, 0, 1, start_step=0)
    for step in range(1, 4):
        train_step(trainee, batches, config, WORLD, step, guard)
    assert guard.skipped == 1 and same(weights(trainee), deferred[3])


def test_a_stop_request_rides_the_deferred_agreement_and_is_agreed_at_the_read(tmp_path) -> None:
    import signal

    from trainer.nonfinite import stop_request
    from trainer.stop import RankStop

    stop = RankStop(tmp_path, watches_request=False)
    guard = NonFiniteGuard(tiny_config(optim__fused=True), WORLD, defer=True)
    one = torch.tensor(1.0)
    guard.record(1, agree(one, one, WORLD, extra=(stop_request(stop),)))
    stop.requested = signal.SIGUSR1  # as its signal handler notes it
    guard.record(2, agree(one, one, WORLD, extra=(stop_request(stop),)))
    assert stop.agreed == 0  # nothing read on the host yet
    guard.settle(stop)
    assert stop.agreed == signal.SIGUSR1 and guard.skipped == 0
