"""micro_batch=auto's console (trainer/autobatch.py): what it changes is said (issue 60)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers import compose_config
from trainer import autobatch
from trainer.advise.fit import AutoProposal
from trainer.autobatch import choose_micro_batch
from trainer.config import ConfigError, TrainConfig

CAP = (
    "model=tiny",
    "device=cpu",
    "seq_len=256",
    "device_memory_gib=0.15",
    "advise.headroom=0.45",
    "mode=plan",
)


def test_auto_without_global_batch_says_the_global_batch_it_chose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without global_batch the global batch follows memory: one warning names it and how to hold it."""
    config, record = choose_micro_batch(
        compose_config(*CAP, "micro_batch=auto", "grad_accum=3"), tmp_path, "cpu", 2, 2
    )
    m = record["chosen"]
    assert (config.micro_batch, config.grad_accum) == (m, 3)
    assert capsys.readouterr().err.splitlines() == [
        f"warning: micro_batch=auto without global_batch: the global batch follows memory: micro_batch={m} x "
        f"grad_accum=3 x 2 data-parallel ranks = {6 * m} sequences per step; global_batch={6 * m} keeps it on "
        "other devices"
    ]


def test_auto_with_global_batch_says_nothing_more(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, _ = choose_micro_batch(
        compose_config(*CAP, "micro_batch=auto", "global_batch=48"), tmp_path, "cpu", 2, 2
    )
    assert config.sequences_per_step(2) == 48 and capsys.readouterr().err == ""


def fake_probes(monkeypatch: pytest.MonkeyPatch, candidates: list[int], runs_out_from: int) -> list[int]:
    """Probes without ranks, of a proposal without planning (trainer/advise/fit.py's is tested there):
    `candidates` planned at 0.01 GiB per sequence against a 0.055 GiB budget (1..5 fit); every micro-batch
    from `runs_out_from` up runs out, smaller ones run. Returns the micro-batches probed, in order."""
    peaks = {mb: 0.01 * mb for mb in candidates}
    fitting = max(mb for mb, peak in peaks.items() if peak <= 0.055)
    proposal = AutoProposal(peaks, 0.055, fitting, 1)
    monkeypatch.setattr(autobatch, "propose_micro_batch", lambda config, device_kind, world_size: proposal)
    probed: list[int] = []

    def probe(config, proposal, micro_batch, out_dir, device_kind, nproc, world_size):  # type: ignore[no-untyped-def]
        probed.append(micro_batch)
        status = "oom" if micro_batch >= runs_out_from else "ok"
        return {"micro_batch": micro_batch, "status": status, "planned_peak_gib": proposal.peaks_gib[micro_batch],
                "measured_peak_gib": None, "dir": str(out_dir)}  # fmt: skip

    monkeypatch.setattr(autobatch, "probe", probe)
    return probed


@pytest.fixture(scope="module")
def train_auto() -> TrainConfig:
    """CAP's job in mode=train (composed once: the probes are fakes, nothing launches)."""
    return compose_config(*CAP[:-1], "mode=train", "micro_batch=auto")


ONE_TO_32 = list(range(1, 33))
# global_batch=40 on 2 ranks: the micro-batches dividing its 20 sequences a rank
DIVIDING_20 = [1, 2, 4, 5, 10, 20]


@pytest.mark.parametrize(
    ("extra", "candidates", "runs_out_from", "probed", "chosen", "accum"),
    [
        # the plan proposes 5 (1..5 fit): 5 runs out, 4 runs, and 5 is not probed again as "the next larger"
        ({"grad_accum": 3}, ONE_TO_32, 5, [5, 4], 4, 3),
        ({"grad_accum": 3}, ONE_TO_32, 4, [5, 4, 3], 3, 3),  # 3 runs; 4, its next larger, failed already
        ({"global_batch": 40}, DIVIDING_20, 5, [5, 4], 4, 5),  # 4 runs, at grad_accum 20 / 4
    ],
)
def test_auto_chooses_below_a_proposal_that_ran_out_and_never_suggests_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    train_auto: TrainConfig,
    extra: dict[str, int],
    candidates: list[int],
    runs_out_from: int,
    probed: list[int],
    chosen: int,
    accum: int,
) -> None:
    seen = fake_probes(monkeypatch, candidates, runs_out_from)
    trained, record = choose_micro_batch(dataclasses.replace(train_auto, **extra), tmp_path, "cpu", 2, 2)
    assert record["proposed"] == 5 and seen == probed
    assert [(t["micro_batch"], t["status"]) for t in record["tried"]] == [
        (mb, "oom" if mb >= runs_out_from else "ok") for mb in probed
    ]
    assert (record["chosen"], trained.micro_batch, trained.grad_accum) == (chosen, chosen, accum)
    assert record["chosen"] < runs_out_from
    out, err = capsys.readouterr()
    assert (
        f"micro_batch=auto: chose micro_batch={chosen} grad_accum={accum} (the plan proposed 5 of 1.." in out
    )
    # what the console suggests keeping is the chosen micro-batch's batch, never the one that ran out
    failed = {mb for mb in probed if mb >= runs_out_from}
    if "grad_accum" in extra:
        assert err.splitlines() == [
            f"warning: micro_batch=auto without global_batch: the global batch follows memory: micro_batch={chosen} "
            f"x grad_accum=3 x 2 data-parallel ranks = {6 * chosen} sequences per step; global_batch={6 * chosen} "
            "keeps it on other devices"
        ]
    else:
        assert err == ""
    assert not any(f"chose micro_batch={mb} " in out for mb in failed)


def test_auto_whose_every_probe_runs_out_names_them_and_suggests_no_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, train_auto: TrainConfig
) -> None:
    seen = fake_probes(monkeypatch, ONE_TO_32, 1)
    with pytest.raises(ConfigError) as raised:
        choose_micro_batch(train_auto, tmp_path, "cpu", 2, 2)
    assert seen == [5, 4, 3, 2]  # MAX_PROBES: the proposal and three smaller ones
    assert str(raised.value) == (
        "micro_batch=auto: no probe ran (micro_batch=5: oom, micro_batch=4: oom, micro_batch=3: oom, "
        "micro_batch=2: oom); set micro_batch=N, or give each rank more memory"
    )
