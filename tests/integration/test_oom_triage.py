"""OOM triage on 2 capped CPU ranks (docs/faults.md, "Out of memory, explained"): micro_batch=auto picks
what the plan says fits and probes confirm; twice that runs out and is explained by moment and
category with remedies, one of which, run as printed, ends ok; an OOM on one rank names that rank.

At seq_len=256, model=tiny the plan puts micro_batch 5 at 0.0743 GiB and 6 at 0.0865 GiB; the cap,
device_memory_gib=0.0804, lies midway, and counts what the plan counts (tensor bytes,
trainer/faults/tensor_cap.py), so no headroom is set aside (advise.headroom=0): the plan's largest
fitting micro-batch is 5, its probe runs, 6's runs out, and the job trains 20 steps with 5. Small
micro-batches keep the jobs short: every step of a capped CPU run up to the second is tensor-tracked,
which is several times slower.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, Run, assert_nothing_left, compose_config, job_env, run_trainer
from trainer.advise.fit import propose_micro_batch
from trainer.autobatch import PROBE_STEPS
from trainer.faults.failures import where
from trainer.faults.leftovers import JOB_MARKER

pytestmark = pytest.mark.timeout(600)

CAP = (
    "model=tiny",
    "device=cpu",
    "nproc=2",
    "seq_len=256",
    "log_every=1",
    "device_memory_gib=0.0804",
    "advise.headroom=0",
)
QUIET = ("logger=none", "save=off")
M = 5
NEAREST_MOMENT = {
    ("forward", True): "forward: last block",
    ("forward", False): "forward: loss",
    ("backward", True): "backward: last block",
    ("backward", False): "backward: loss",
    ("optimizer", False): "optimizer step",
}
"""(phase, inside a block?) -> the plan's moment an OOM there is compared with, at micro_batch=2M (stage0 on 2
ranks: each phase's largest moment, the forward's last block holding the most), written out rather than
asked of trainer/faults/oom.py plan_moment, which explain_oom calls."""


def test_the_plan_puts_the_largest_fitting_micro_batch_at_m() -> None:
    """The same choice as a sweep over 1..32 of the plan: every micro-batch up to M fits the budget, none above."""
    proposal = propose_micro_batch(compose_config(*CAP, "micro_batch=auto"), "cpu", 2)
    assert proposal.budget_gib == pytest.approx(0.0804)
    assert proposal.peaks_gib[M] < 0.0804 < proposal.peaks_gib[M + 1]  # the cap midway between M and M + 1
    assert [mb for mb, peak in proposal.peaks_gib.items() if peak <= proposal.budget_gib] == list(
        range(1, M + 1)
    )
    assert proposal.micro_batch == M


@pytest.fixture(scope="module")
def auto(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_trainer(tmp_path_factory.mktemp("auto") / "run", *CAP, *QUIET, "micro_batch=auto", "steps=20")


def test_micro_batch_auto_trains_with_m_after_at_most_four_probes(auto: Run) -> None:
    """Issue 60, acceptance 2: at a cap midway between two micro-batches' plans, auto chooses the smaller,
    whose probe ran past the tracked and profiled steps, and the job then trains 20 steps to ok; the
    larger one's probe ran out under the cap."""
    record = auto.summary["micro_batch_auto"]
    assert auto.summary["status"] == "ok" and record["chosen"] == M and record["grad_accum"] == 1
    assert len(auto.losses) == 20
    tried = record["tried"]
    assert [(t["micro_batch"], t["status"]) for t in tried] == [(M, "ok"), (M + 1, "oom")]
    assert len(Run(0, "", "", Path(tried[0]["dir"])).losses) == PROBE_STEPS == 3
    assert tried[0]["measured_peak_gib"] == max(
        r["memory/max_rank_peak_gib"]
        for r in Run(0, "", "", Path(tried[0]["dir"])).records
        if "memory/max_rank_peak_gib" in r
    )
    assert auto.summary["config"]["micro_batch"] == M  # the ranks trained with it
    assert (
        f"micro_batch=auto: chose micro_batch={M} grad_accum=1 (the plan proposed {M} of 1..32" in auto.stdout
    )


@pytest.fixture(scope="module")
def too_big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, float]:
    start = time.monotonic()
    run = run_trainer(
        tmp_path_factory.mktemp("oom") / "run",
        *CAP,
        *QUIET,
        "steps=2",
        f"micro_batch={2 * M}",
        "plan.enforce=false",
        check=False,
    )
    return run, time.monotonic() - start


def test_twice_m_runs_out_and_is_explained(too_big: tuple[Run, float]) -> None:
    run, seconds = too_big
    assert run.returncode == 1 and run.summary["status"] == "oom"
    assert (
        seconds < 60 or os.getloadavg()[0] > 4
    )  # ~42 s with a loaded neighbour; the bound holds on a quiet host
    rank = run.summary["failed_rank"]
    record = json.loads((run.out_dir / "failures" / f"rank{rank}.json").read_text())
    explained = record["explained"]
    assert explained == run.summary["oom"]
    # activations fill up in the first step's forward, or the second's, once Adam's states exist
    assert record["step"] in (1, 2) and record["micro_batch"] == 0
    assert explained["moment"] == where(record)
    assert explained["plan_moment"] == NEAREST_MOMENT[(record["phase"], record["block"] is not None)]
    assert set(explained["plan_gib"]) == set(explained["measured_gib"]) == {
        "params", "grads", "optimizer", "activations", "temporary", "other",
    }  # fmt: skip
    held = record["measured_bytes"]
    assert explained["measured_gib"]["activations"] * 2**30 == held["activations"]
    assert explained["held_gib"] * 2**30 == held["held"]
    assert explained["remedies"][0]["changes"] == f"micro_batch=2 grad_accum={M}"
    lines = run.stdout.splitlines()
    assert (
        f"out of memory on rank {rank} at {explained['moment']}; the plan's nearest moment: {explained['plan_moment']}"
        in lines
    )
    assert any(line.startswith("  activations ") for line in lines)
    assert f"  {explained['remedies'][0]['command']}    # micro_batch=2 grad_accum={M}" in run.stdout
    assert run.stderr.splitlines()[-1].startswith(
        f"error: rank {rank} ran out of memory at {explained['moment']}: "
    )


@pytest.fixture(scope="module")
def remedy(too_big: tuple[Run, float], tmp_path_factory: pytest.TempPathFactory) -> Run:
    command = shlex.split(too_big[0].summary["oom"]["remedies"][0]["command"])
    assert command[:3] == ["python", "-m", "trainer"]
    return run_trainer(tmp_path_factory.mktemp("remedy") / "run", *command[3:])


def test_the_first_remedy_run_as_printed_ends_ok(remedy: Run) -> None:
    assert remedy.summary["status"] == "ok" and remedy.summary["config"]["micro_batch"] == 2


def test_the_report_says_where_the_memory_went(
    too_big: tuple[Run, float], remedy: Run, tmp_path: Path
) -> None:
    run, _ = too_big
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(run.out_dir), str(remedy.out_dir), "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "(2 points: 1 ok, 1 oom)" in proc.stdout
    report = (tmp_path / "report.md").read_text()
    oom = run.summary["oom"]
    cells = " | ".join(f"{oom['plan_gib'][p]:.4f} / {oom['measured_gib'][p]:.4f}" for p in oom["plan_gib"])
    assert f"| 0 | {oom['rank']} | oom, {oom['moment']} | {cells} |" in report
    assert [
        line[:16] for line in report.splitlines() if line.startswith("| 1 | ") and "| peak |" in line
    ] == [
        "| 1 | 0 | peak |",
        "| 1 | 1 | peak |",
    ]  # the remedy's ranks, each at its tracked peak
    assert "![Where the memory went](where_memory.png)" in report
    assert (tmp_path / "where_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_oom_on_one_rank_ends_the_job_naming_that_rank(tmp_path: Path) -> None:
    """No hang: the launcher stops rank 0 once rank 1 fails (run_trainer's timeout would raise)."""
    args = ("model=tiny", "device=cpu", "nproc=2", "seq_len=64", "micro_batch=2", "steps=3", *QUIET)
    run = run_trainer(
        tmp_path / "run", *args, "fault.kind=oom", "fault.rank=1", "fault.step=2", check=False, timeout=300
    )
    assert run.returncode == 1
    assert (run.summary["status"], run.summary["failed_rank"], run.summary["failed_step"]) == ("oom", 1, 2)
    assert (
        "error: rank 1 ran out of memory at step 2 (forward, outside the blocks, micro-batch 0)" in run.stderr
    )


# One probe of micro_batch=auto (trainer/autobatch.py probe) in a process of its own, as the job runs it.
PROBE = """
import json, sys
from pathlib import Path
from tests.helpers import compose_config
from trainer.advise.fit import propose_micro_batch
from trainer.autobatch import PROBE_STEPS
from trainer.autobatch import probe
config = compose_config(*sys.argv[2:])
print(json.dumps(probe(config, propose_micro_batch(config, "cpu", 2), 2, Path(sys.argv[1]), "cpu", 2, 2)))
"""


def test_a_probe_in_which_one_rank_runs_out_is_an_oom_probe_and_no_rank_waits(tmp_path: Path) -> None:
    """The probe's ranks agree by construction: rank 1 runs out in step 1's forward; rank 0, in the
    backward's all-reduce, loses its peer's connection and leaves too, and the launcher ends the probe
    (subprocess.run's timeout would raise on a hang). No rank of a probe retries in process, so none
    can disagree with the others about the outcome: the launcher's is the one verdict."""
    args = ("model=tiny", "device=cpu", "nproc=2", "seq_len=64", "steps=2", "micro_batch=auto", *QUIET)
    fault = ("fault.kind=oom", "fault.rank=1", "fault.step=1")
    env = job_env()
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path), *args, *fault],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env, check=True,
    )  # fmt: skip
    result = json.loads(proc.stdout.splitlines()[-1])
    assert (result["micro_batch"], result["status"], result["measured_peak_gib"]) == (2, "oom", None)
    assert result["error"].startswith(
        "rank 1 ran out of memory at step 1 (forward, outside the blocks, micro-batch 0): "
    )
    failures = Path(result["dir"]) / "failures"
    records = {r: json.loads((failures / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert [(r["rank"], r["step"], r["oom"]) for r in records.values()] == [(0, 1, False), (1, 1, True)]
    assert_nothing_left(env[JOB_MARKER])
