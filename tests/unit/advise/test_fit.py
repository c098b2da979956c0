"""micro_batch=auto's proposal (trainer/advise/fit.py) and its record (trainer/autobatch.py): plan arithmetic only."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import compose_config
from trainer.advise.fit import propose_micro_batch
from trainer.autobatch import check_auto, summary_line
from trainer.config import ConfigError
from trainer.plan import build_plan
from trainer.telemetry.keys import MICRO_BATCH_AUTO
from trainer.telemetry.wandb_logger import wandb_config
from trainer.units import GIB

CAP = ("model=tiny", "device=cpu", "seq_len=256", "device_memory_gib=0.15", "advise.headroom=0.45")


def test_global_batch_gives_grad_accum_and_only_dividing_micro_batches() -> None:
    config = compose_config(*CAP, "micro_batch=auto", "global_batch=48")
    proposal = propose_micro_batch(config, "cpu", 2)
    assert list(proposal.peaks_gib) == [1, 2, 3, 4, 6, 8, 12, 24]  # the divisors of 24 sequences per rank
    assert (proposal.micro_batch, proposal.grad_accum) == (4, 6)  # 5 fits too but does not divide 24
    fixed = dataclasses.replace(config, micro_batch=4, grad_accum=6, global_batch=None)
    assert proposal.peaks_gib[4] == build_plan(fixed, "cpu", 2).peak_bytes / GIB
    assert proposal.fitting_below(4) == [3, 2, 1] and proposal.next_above(4) == 6


def test_what_auto_cannot_do_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="global_batch \\(47\\) must be divisible by the 2 ranks"):
        check_auto(compose_config(*CAP, "micro_batch=auto", "global_batch=47"), 2)
    with pytest.raises(ConfigError, match="mode=advise chooses micro_batch itself"):
        compose_config(*CAP, "micro_batch=auto", "mode=advise", "global_batch=48")
    with pytest.raises(ConfigError, match="micro_batch must be an integer >= 1 or auto, got fast"):
        compose_config("micro_batch=fast")


def test_the_record_is_in_the_console_line_and_the_wandb_config() -> None:
    record = {
        "proposed": 5, "budget_gib": 0.0825, "planned_peak_gib": {str(mb): 0.01 * mb for mb in range(1, 33)},
        "tried": [{"micro_batch": 5, "status": "ok", "planned_peak_gib": 0.0743, "measured_peak_gib": 0.0742},
                  {"micro_batch": 6, "status": "oom", "planned_peak_gib": 0.0865, "measured_peak_gib": None}],
        "chosen": 5, "grad_accum": 1,
    }  # fmt: skip
    assert summary_line(record) == (
        "chose micro_batch=5 grad_accum=1 (the plan proposed 5 of 1..32 within 0.0825 GiB; probes: "
        "5: ok (planned 0.0743 GiB, measured peak 0.0742 GiB); 6: oom (planned 0.0865 GiB))"
    )
    meta = {"config": {"micro_batch": 5}, "overrides": ["micro_batch=auto"], MICRO_BATCH_AUTO: record}
    assert wandb_config(meta)[MICRO_BATCH_AUTO] == record and wandb_config(meta)["micro_batch"] == 5
