"""One prepared check of zerolab on a GPU: what the CPU tests cannot prove, in one command.

    python benchmarks/gpu_check.py [--out DIR] [--deadline S] [--dry-run]

Made for one H200 (world size 1: NCCL refuses two ranks on one device) and 8 minutes. Every row
runs `python -m trainer` as a user would (W&B off, nothing saved unless the row is about saving)
and is written to DIR/results.md and DIR/results.json as soon as it is known, so a run cut short
still reports what it reached. Each job runs in its own process group under a timeout that fits
the deadline; at its timeout the whole group (the job, its fork server, its ranks) is killed, so
no rank holds GPU memory into the rows after it. Rows whose jobs the deadline leaves unstarted are
`skip`. What explains each job stays under DIR/jobs/<job>/ (summary.json, metrics.jsonl, failures/,
plan.json) and DIR/logs/<job>.log (the console).

The rows, most valuable first, their jobs and budgets: ROWS and JOBS below; docs/gpu.md
tabulates them with the time estimate. --dry-run runs the same sequence on CPU with the tiny
model (rows that need CUDA say `skip`), to prove the script before GPU time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the environment, headroom and limit rows read trainer's tables
LOSS_TOLERANCE = 0.02
"""Largest relative difference of per-step losses between runs that differ in precision or in
how they compute the same step (fp32 vs bf16, compile, checkpointing, grad_accum, stage2)."""
PLAN_TOLERANCE_PCT = 15.0
"""Peak allocated against the plan: a throughput row passes within this error."""
HOST_TOLERANCE_PCT = 10.0
"""An offloaded rank's host RSS may exceed the plan's host figure for it by at most this much."""
DEADLINE_S = 480.0
"""The whole check on the GPU: 8 minutes (docs/gpu.md has the estimate)."""
DRY_DEADLINE_S = 600.0
"""A dry run's deadline; its jobs have no budgets of their own (CPU timings on a shared machine say
nothing of the GPU's), so only the deadline cuts them."""
KILL_WAIT_S = 10.0
"""How long a killed job's processes get to disappear before they are reported as survivors."""
TAIL_LINES = 15
NOT_REACHED = "not reached by the deadline"


@dataclass
class Row:
    check: str
    status: str  # pass | fail | info | skip | error
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    seconds: float = 0.0


@dataclass
class Setup:
    """Where the check runs: the GPU (world size 1) or, for --dry-run, CPU with the tiny model."""

    dry_run: bool
    out: Path
    deadline: float
    """time.monotonic() after which no job starts and running ones are killed."""
    hang: str | None = None
    """--inject-hang: the job that runs far past any deadline (tests prove the kill with it)."""

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def model(self, name: str) -> str:
        return "tiny" if self.dry_run else name

    def shape(self) -> tuple[str, ...]:
        """Micro-batch, sequence and steps of the throughput rows: a real load on the GPU, seconds on CPU."""
        if self.dry_run:
            return ("micro_batch=2", "seq_len=32", "steps=4", "log_every=2", "telemetry.warmup_steps=2")
        return ("micro_batch=8", "seq_len=1024", "steps=30", "log_every=5", "telemetry.warmup_steps=10")


@dataclass(frozen=True)
class JobSpec:
    """One process the check runs: a trainer job (overrides) or a command (argv)."""

    name: str
    overrides: tuple[str, ...] = ()
    budget_s: float = 60.0
    """Its timeout on the GPU (the deadline may cut it shorter)."""
    estimate_s: float = 20.0
    """What it is expected to take on one H200 (docs/gpu.md adds these up)."""
    exclusive: bool = False
    """Timings or device-wide memory figures: the GPU to itself, no other job beside it."""
    command: tuple[str, ...] | None = None
    after: str | None = None
    """A job that must have ended first (a resume needs its save)."""
    device: str | None = None
    """The trainer's device when not the check's (the CPU half of the cpu-save row)."""
    unique: bool = False
    """Run even where an earlier job has the same overrides (the second of two identical runs)."""
    resolve: Callable[[Setup], tuple[str, ...]] | None = None
    """Overrides known only once `after` has ended (the limit rows' micro-batch), instead of `overrides`."""


@dataclass
class Job:
    """What one process left: its status, its files' contents, the tail of its console."""

    name: str
    status: str
    summary: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    console: str = ""
    seconds: float = 0.0
    killed: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    overrides: tuple[str, ...] = ()

    @property
    def losses(self) -> list[float]:
        return [r["loss/train"] for r in self.records if "loss/train" in r]

    def last(self, key: str) -> Any:
        values = [r[key] for r in self.records if key in r]
        return values[-1] if values else None

    def most(self, key: str) -> float | None:
        values = [r[key] for r in self.records if key in r]
        return max(values) if values else None


# ----------------------------------------------------------------------------- running one job


def job_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": path}


def trainer_args(setup: Setup, spec: JobSpec, overrides: list[str]) -> list[str]:
    if spec.name == setup.hang:  # a job that does not end by itself: only the kill ends it
        overrides += ["steps=1000000", "log_every=1"]
    saves = ["save=off"] if not any(o.startswith("save.") for o in overrides) else []
    return [sys.executable, "-m", "trainer", f"device={spec.device or setup.device}", "nproc=1",
            "logger=none", *saves, *overrides, f"hydra.run.dir={job_dir(setup, spec.name)}"]  # fmt: skip


def job_dir(setup: Setup, name: str) -> Path:
    return setup.out / "jobs" / name


def kill_group(proc: subprocess.Popen) -> tuple[list[int], list[int]]:
    """SIGKILL the job's process group and every descendant (one that left the group too);
    returns the pids killed and those still alive after KILL_WAIT_S (zombies count as gone)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the job is its group's leader: start_new_session
    except ProcessLookupError:
        pass
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    _, alive = psutil.wait_procs(descendants, timeout=KILL_WAIT_S)
    survivors = []
    for child in alive:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                survivors.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return [proc.pid, *(child.pid for child in descendants)], survivors


def run_process(args: list[str], log: Path, timeout: float) -> tuple[int | None, list[int], list[int]]:
    """Run in a new session (its own process group), console into `log`; (exit code or None
    when killed at the timeout, pids killed, survivors)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as console:
        proc = subprocess.Popen(args, cwd=REPO, env=job_env(), stdout=console, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=max(timeout, 0.1)), [], []
        except subprocess.TimeoutExpired:
            return None, *kill_group(proc)


def read_job(setup: Setup, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    out = job_dir(setup, name)
    summary_path, metrics_path = out / "summary.json", out / "metrics.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    return summary, [json.loads(line) for line in lines if line.strip()]


def tail(log: Path) -> str:
    lines = (
        [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        if log.exists()
        else []
    )
    return "\n".join(lines[-TAIL_LINES:])


def run_job(setup: Setup, spec: JobSpec) -> Job:
    """One job under its budget, cut at the deadline; never raises for a failed job."""
    remaining = setup.deadline - time.monotonic()
    timeout = remaining if setup.dry_run else min(spec.budget_s, remaining)
    if timeout <= 0:
        return Job(spec.name, "skipped")
    overrides = spec.resolve(setup) if spec.resolve is not None else spec.overrides
    args = list(spec.command) if spec.command else trainer_args(setup, spec, list(overrides))
    log = setup.out / "logs" / f"{spec.name}.log"
    start = time.perf_counter()
    code, killed, survivors = run_process(args, log, timeout)
    summary, records = read_job(setup, spec.name) if not spec.command else ({}, [])
    if code is None:
        status = "timeout"
    elif spec.command:
        status = "ok" if code == 0 else f"exit {code}"
    else:
        status = summary.get("status", f"exit {code}")
    seconds = time.perf_counter() - start
    return Job(spec.name, status, summary, records, tail(log), seconds, killed, survivors, tuple(overrides))


class Scheduler:
    """Runs the jobs in order on a thread of its own; rows wait for theirs with `get`.

    On the GPU up to `workers` jobs run at once, but an exclusive job (a timing, a device-wide
    memory figure) runs alone. A dry run ignores exclusivity: on a shared CPU nothing is a timing.
    """

    def __init__(self, setup: Setup, specs: list[JobSpec], workers: int) -> None:
        self.setup, self.workers = setup, workers
        self.futures: dict[str, Future[Job]] = {spec.name: Future() for spec in specs}
        # A dry run gives 125m and 1b the same tiny model: a job equal to an earlier one is run once.
        first: dict[Any, str] = {}
        self.specs, self.aliases = [], {}
        for spec in specs:
            key = (
                (spec.command, spec.overrides, spec.device)
                if not spec.unique and spec.resolve is None
                else spec.name
            )
            if key in first:
                self.aliases[spec.name] = first[key]
            else:
                first[key] = spec.name
                self.specs.append(spec)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def get(self, name: str) -> Job:
        return self.futures[self.aliases.get(name, name)].result()

    def _run(self) -> None:
        running: dict[Future[Job], bool] = {}  # future -> exclusive
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for spec in self.specs:
                exclusive = spec.exclusive and not self.setup.dry_run
                while running and (exclusive or any(running.values()) or len(running) >= self.workers):
                    done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                    for future in done:
                        running.pop(future)
                if spec.after is not None:
                    self.get(spec.after)
                future = pool.submit(run_job, self.setup, spec)
                future.add_done_callback(lambda f, name=spec.name: self._settle(name, f))
                running[future] = exclusive

    def _settle(self, name: str, future: Future[Job]) -> None:
        error = future.exception()
        if error is not None:
            self.futures[name].set_result(Job(name, f"error: {type(error).__name__}: {error}"))
        else:
            self.futures[name].set_result(future.result())


def failed(job: Job) -> str:
    """The job's own error line, for a row whose job did not end as the row expects."""
    lines = job.console.splitlines()
    return f"{job.name}: status {job.status}: {job.summary.get('error') or (lines[-1] if lines else 'no output')}"


# ----------------------------------------------------------------------------- the jobs


def throughput_jobs(setup: Setup) -> list[JobSpec]:
    jobs = []
    for model, estimate in (("125m", 20.0), ("1b", 30.0)):
        for stage in ("stage0", "stage3"):
            jobs.append(JobSpec(f"{model}_{stage}", bf16(setup, model, stage), budget_s=3 * estimate,
                                estimate_s=estimate, exclusive=True))  # fmt: skip
    return jobs


def bf16(setup: Setup, model: str, stage: str, *extra: str) -> tuple[str, ...]:
    return (f"model={setup.model(model)}", "precision=bf16", f"zero={stage}", *setup.shape(), *extra)


def short(setup: Setup) -> tuple[str, ...]:
    """The functional rows' shape: every step logged, a few steps."""
    if setup.dry_run:
        return ("micro_batch=2", "seq_len=32", "steps=6", "log_every=1", "telemetry.warmup_steps=2")
    return ("micro_batch=4", "seq_len=512", "steps=6", "log_every=1", "telemetry.warmup_steps=2")


SAVE_SHAPE = ("model=tiny", "precision=fp32", "zero=stage0", "micro_batch=2", "seq_len=64", "log_every=1")


def save_jobs(setup: Setup) -> list[JobSpec]:
    """A CPU save resumed on the device (per-tensor AdamW's save under the fused one), and a device
    save resumed on the device: each saves at step 4 and resumes to step 6. Both saves first, so
    that neither resume holds the other save back."""
    saves, resumes = [], []
    for name, device in (("cpu_save", "cpu"), ("device_save", setup.device)):
        save = (*SAVE_SHAPE, "steps=4", "save.every=2", "save.keep=1")
        resume_from = job_dir(setup, name) / "checkpoints" / "step_00000004"
        saves.append(JobSpec(name, save, budget_s=60, estimate_s=15, device=device, unique=True))
        resumes.append(JobSpec(f"{name}_resumed", (*SAVE_SHAPE, "steps=6", f"resume={resume_from}"),
                               budget_s=60, estimate_s=15, after=name))  # fmt: skip
    return saves + resumes


def limit_jobs(setup: Setup) -> list[JobSpec]:
    """The largest micro-batch the plan says fits the device, and the next one up (plan waived).

    The plan is made in a process of its own (`--largest-micro-batch`): planning for the GPU reads
    its properties, which creates a CUDA context, and this process must hold none while jobs run.
    """
    found = setup.out / "jobs" / "limit_plan.json"
    plan = (sys.executable, str(Path(__file__).resolve()), "--largest-micro-batch", str(found),
            *(["--dry-run"] if setup.dry_run else []))  # fmt: skip

    def micro_batch(extra: int) -> Callable[[Setup], tuple[str, ...]]:
        return lambda setup: (
            *limit_base(setup),
            f"micro_batch={json.loads(found.read_text())['micro_batch'] + extra}",
        )

    return [
        JobSpec("limit_plan", command=plan, budget_s=45, estimate_s=8),
        JobSpec("limit_fits", resolve=micro_batch(0), budget_s=90, estimate_s=30, exclusive=True, after="limit_plan"),
        JobSpec("limit_next", resolve=lambda s: (*micro_batch(1)(s), "plan.enforce=false"), budget_s=90,
                estimate_s=25, exclusive=True),
    ]  # fmt: skip


def limit_base(setup: Setup) -> tuple[str, ...]:
    if setup.dry_run:  # CPU has no device limit: a cap stands in for one
        return (
            "model=tiny",
            "precision=bf16",
            "zero=stage0",
            "seq_len=256",
            "steps=2",
            "device_memory_gib=0.1",
        )
    return ("model=1b", "precision=bf16", "zero=stage0", "seq_len=1024", "steps=3", "log_every=1",
            "telemetry.warmup_steps=1")  # fmt: skip


def largest_fitting_micro_batch(setup: Setup, base: tuple[str, ...], limit: int = 4096) -> int:
    """Doubling, then bisection, on the plan's `fits` (trainer/plan/build.py) for this device."""
    from hydra import compose, initialize_config_dir

    from trainer.cli import register_configs
    from trainer.config import validate
    from trainer.plan.build import build_plan

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):

        def fits(micro_batch: int) -> bool:
            overrides = [
                "logger=none",
                f"device={setup.device}",
                "nproc=1",
                *base,
                f"micro_batch={micro_batch}",
            ]
            return bool(build_plan(validate(compose("train", overrides=overrides)), setup.device, 1).fits)

        low, high = 0, 1
        while high <= limit and fits(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
    return max(low, 1)


def all_jobs(setup: Setup) -> list[JobSpec]:
    """Every job, in the order they start: the rows' order (most valuable first), but for the gpu tests."""
    model = setup.model("125m")
    fault = ("fault.kind=inf_grad", "fault.step=3")
    environment = (
        sys.executable,
        str(Path(__file__).resolve()),
        "--environment",
        str(setup.out / "jobs" / "environment.json"),
        *(["--dry-run"] if setup.dry_run else []),
    )
    gpu_tests = (sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider",
                 "-p", "no:xdist", "-o", "addopts=-ra")  # fmt: skip
    probe = (sys.executable, str(REPO / "benchmarks" / "headroom_probe.py"))
    backend = "compile_backend=aot_eager" if setup.dry_run else "compile_backend=inductor"
    jobs = [JobSpec("environment", command=environment, budget_s=30, estimate_s=5), *throughput_jobs(setup)]
    if not setup.dry_run:
        jobs.append(JobSpec("headroom", command=probe, budget_s=45, estimate_s=10, exclusive=True))
    first_save, *saves = save_jobs(setup)
    # The gpu tests (the second row) run beside the shared jobs rather than hold the exclusive
    # throughput jobs back: their row waits, the table's order stays.
    jobs += [
        first_save,
        JobSpec("gpu_tests", command=gpu_tests, budget_s=120, estimate_s=60),
        *saves,
        JobSpec("fp16_overflow", (f"model={model}", "precision=fp16", "zero=stage0", *short(setup), *fault)),
        JobSpec("fp16_sharded", (f"model={model}", "precision=fp16", "zero=stage3", *short(setup), *fault)),
        JobSpec("offload", (f"model={model}", "precision=bf16", "zero=stage3", "offload=cpu", "nonfinite=skip",
                            "fault.kind=nan_loss", "fault.step=3", *short(setup)), budget_s=90, estimate_s=25),
        *limit_jobs(setup),
        JobSpec("oom", oom_overrides(setup)),
        JobSpec("125m_stage0_fp32", (f"model={model}", "precision=fp32", "zero=stage0", *setup.shape())),
        JobSpec("125m_stage0_again", bf16(setup, "125m", "stage0"), unique=True),
        JobSpec("ckpt_full", bf16(setup, "125m", "stage0", "checkpointing=full")),
        JobSpec("ckpt_selective", bf16(setup, "125m", "stage0", "checkpointing=selective")),
        JobSpec("grad_accum", bf16(setup, "125m", "stage0", *half_micro_batch(setup), "grad_accum=2")),
        JobSpec("stage2", bf16(setup, "125m", "stage2")),
        JobSpec("125m_stage0_loop", bf16(setup, "125m", "stage0", "optim.fused=false"), exclusive=True),
        JobSpec("125m_stage0_compile", bf16(setup, "125m", "stage0", "compile=true", backend), budget_s=150,
                estimate_s=90, exclusive=True),
    ]  # fmt: skip
    return jobs


def half_micro_batch(setup: Setup) -> tuple[str, ...]:
    """The throughput shape's micro-batch halved: with grad_accum=2, the same global batch."""
    (micro,) = [o for o in setup.shape() if o.startswith("micro_batch=")]
    return (f"micro_batch={int(micro.split('=')[1]) // 2}",)


def oom_overrides(setup: Setup) -> tuple[str, ...]:
    """A cap the job cannot fit under, with the plan's refusal waived: GPU, 1b's 16 GiB of states
    in 2 GiB; dry run, the tiny model's activations at a long sequence in 0.1 GiB."""
    cap = (
        ("device_memory_gib=0.1", "micro_batch=32", "seq_len=256")
        if setup.dry_run
        else ("device_memory_gib=2",)
    )
    return (
        f"model={setup.model('1b')}",
        "precision=bf16",
        "zero=stage0",
        "plan.enforce=false",
        "steps=2",
        *cap,
    )


# ----------------------------------------------------------------------------- helpers run as processes


def environment(setup: Setup) -> dict[str, Any]:
    """Device, torch, CUDA, NCCL, cuDNN, and what the compile row needs: a C compiler, Python's
    headers, triton (inductor builds C++ on CPU and triton kernels on GPU)."""
    import importlib.util

    import torch

    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    triton = importlib.util.find_spec("triton")
    figures: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "c_compiler": shutil.which(cc.split()[0]) or shutil.which("gcc") or shutil.which("cc"),
        "python_headers": headers.exists(),
        "triton": __import__("triton").__version__ if triton is not None else None,
    }
    if setup.dry_run:
        return {**figures, "device": f"cpu ({platform.machine()})"}
    from trainer.devices import find_device

    name = torch.cuda.get_device_name(0)
    known = find_device(name)
    return {
        **figures,
        "device": name,
        "gpus": torch.cuda.device_count(),
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2),
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "cudnn": torch.backends.cudnn.version(),
        "table": known.short if known else "unknown",
    }


# ----------------------------------------------------------------------------- the rows


def plan_error_pct(job: Job) -> float:
    return job.summary.get("memory/prediction_error_pct", float("nan"))


def memory_figures(job: Job) -> dict[str, Any]:
    """Peak allocated and reserved against the plan's predicted allocated and reserved."""
    reserved = job.most("memory/rank0/peak_reserved_gib")
    predicted_reserved = job.summary.get("plan", {}).get("predicted_reserved_gib")
    return {
        "peak_allocated_gib": round(job.summary.get("memory/max_rank_peak_gib", float("nan")), 3),
        "predicted_allocated_gib": round(job.summary.get("memory/predicted_peak_gib", float("nan")), 3),
        "allocated_error_pct": round(plan_error_pct(job), 1),
        "peak_reserved_gib": round(reserved, 3) if reserved is not None else None,
        "predicted_reserved_gib": round(predicted_reserved, 3) if predicted_reserved is not None else None,
    }


def memory_verdict(figures: dict[str, Any]) -> list[str]:
    """What is wrong with a job's memory against its plan (empty: nothing)."""
    wrong = []
    if not abs(figures["allocated_error_pct"]) <= PLAN_TOLERANCE_PCT:  # NaN: not measured, wrong too
        wrong.append(f"peak allocated off the plan by {figures['allocated_error_pct']}%")
    reserved, predicted = figures["peak_reserved_gib"], figures["predicted_reserved_gib"]
    if predicted is not None and (reserved is None or reserved > predicted):
        wrong.append(f"peak reserved {reserved} GiB over the plan's predicted_reserved_gib {predicted}")
    return wrong


def check_environment(setup: Setup, jobs: dict[str, Job]) -> Row:
    job = jobs["environment"]
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    figures = json.loads((setup.out / "jobs" / "environment.json").read_text())
    needs = ("c_compiler", "python_headers") + (
        () if setup.dry_run else ("triton",)
    )  # inductor on CPU: C++ only
    missing = [k for k in needs if not figures[k]]
    note = f"compile needs {', '.join(missing)}" if missing else ""
    if not setup.dry_run and figures["table"] == "unknown":
        note = "; ".join(filter(None, [note, "device not in trainer/devices.py: no MFU"]))
    return Row("", "info", figures, note or ("dry run: CPU" if setup.dry_run else ""))


def check_gpu_tests(setup: Setup, jobs: dict[str, Job]) -> Row:
    job = jobs["gpu_tests"]
    lines = job.console.splitlines()
    outcome = lines[-1].strip("= ") if lines else "no output"
    if setup.dry_run:  # no CUDA: every test is skipped, which is the point of the marker
        ok = job.status == "ok" and "skipped" in outcome and "failed" not in outcome
        return Row("", "pass" if ok else "fail", {"pytest": outcome}, "dry run: skipped without CUDA")
    return Row("", "pass" if job.status == "ok" else "fail", {"pytest": outcome})


def check_throughput(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    mfu = job.last("throughput/mfu_pct")
    figures = {
        "tokens_per_s": round(job.summary["throughput/tokens_per_s"], 1),
        "mfu_pct": round(mfu, 1) if mfu is not None else None,
        **memory_figures(job),
    }
    wrong = memory_verdict(figures)
    note = (
        "; ".join(wrong)
        or f"plan within ±{PLAN_TOLERANCE_PCT:g}% of peak allocated, reserved within the plan's"
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def reserved_over_model(job: Job) -> float | None:
    """GiB of peak reserved beyond what trainer/plan/headroom.py predicts for the job's peak allocated
    (reserved = (1 + fragmentation) x allocated + workspace + stream cache); > 0: the model is short."""
    from trainer.plan import HEADROOM
    from trainer.units import GIB

    reserved, allocated = (
        job.most("memory/rank0/peak_reserved_gib"),
        job.most("memory/rank0/peak_allocated_gib"),
    )
    if not reserved or not allocated:
        return None
    return reserved - HEADROOM.reserved(int(allocated * GIB)) / GIB


def check_headroom(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The measured headroom against trainer/plan/headroom.py: fails when a figure exceeds its
    assumption, reserved memory exceeds the fitted model's, or a figure could not be measured."""
    from trainer.plan import HEADROOM

    probe = jobs.pop("headroom")
    if probe.status != "ok":
        return Row("", "fail", asdict(HEADROOM), failed(probe))
    measured = json.loads(probe.console.splitlines()[-1])
    over = [f for f in (reserved_over_model(job) for job in jobs.values()) if f is not None]
    measured["reserved_over_model_gib"] = max(over) if len(over) == len(jobs) else None
    compared = {"context_gib": "context_gib", "nccl_world1_gib": "nccl_gib",
                "cublas_workspace_gib": "cublas_workspace_gib"}  # fmt: skip
    wrong = []
    for key, assumed_key in compared.items():
        value, assumed = measured[key], getattr(HEADROOM, assumed_key)
        if value is None or value > assumed:
            wrong.append(f"{key} {'not measured' if value is None else f'{value:.3f} > assumed {assumed:g}'}")
    over_model = measured["reserved_over_model_gib"]
    if over_model is None or over_model > 0:
        wrong.append(
            "reserved_over_model_gib "
            + (
                "not measured"
                if over_model is None
                else f"{over_model:.3f} > 0: reserved above the fitted model"
            )
        )
    figures = {**{k: round(v, 3) if isinstance(v, float) else v for k, v in measured.items()},
               **{f"assumed_{k}": v for k, v in asdict(HEADROOM).items()}}  # fmt: skip
    note = "; ".join(wrong) or "every figure within trainer/plan/headroom.py's assumptions and fit"
    return Row(
        "", "fail" if wrong else "pass", figures, note + f"; nccl at 8 ranks: {measured['nccl_8_ranks']}"
    )


def check_expandable(setup: Setup, jobs: dict[str, Job]) -> Row:
    probe = jobs["headroom"]
    if probe.status != "ok":
        return Row("", "fail", {}, failed(probe))
    active = json.loads(probe.console.splitlines()[-1])["expandable_segments"]
    note = "every allocator segment expandable under the rank's environment (trainer/rank/cuda.py)"
    return Row("", "pass" if active else "fail", {"expandable_segments": active}, note)


def check_resumed(setup: Setup, jobs: dict[str, Job]) -> Row:
    save, resumed = jobs.values()
    if save.status != "ok":
        return Row("", "fail", {}, failed(save))
    figures = {
        "status": resumed.status,
        "first_step": resumed.records[0]["step"] if resumed.records else None,
        "steps_done": resumed.summary.get("steps_done"),
        "final_loss": round(resumed.losses[-1], 4) if resumed.losses else None,
    }
    ok = resumed.status == "ok" and figures["first_step"] == 5 and figures["steps_done"] == 6
    return Row(
        "", "pass" if ok else "fail", figures, "resumed at step 5, ended ok" if ok else failed(resumed)
    )


def check_fp16_overflow(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    scales = [r["precision/loss_scale"] for r in job.records]
    figures = {"scales": scales, "skipped_steps": job.summary.get("precision/skipped_steps")}
    ok = scales[2] == scales[1] / 2 and figures["skipped_steps"] == 1
    return Row("", "pass" if ok else "fail", figures, "scale halves at step 3, one step skipped")


def check_offload_host(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The offloaded rank's host RSS against the plan's host figure for it (trainer/plan/host.py):
    its runtime (plan.cuda_rank_runtime_gib, an assumption this row measures) and its offloaded states."""
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    host = json.loads((job_dir(setup, job.name) / "plan.json").read_text())["host"]
    parts = host["per_rank_gib"]
    planned = sum(parts.values())
    measured = job.summary.get("memory/max_rank_peak_rss_gib")
    figures = {
        "peak_rss_gib": measured,
        "planned_host_gib": round(planned, 3),
        "planned_parts_gib": {k: round(v, 3) for k, v in parts.items()},
        "measured_runtime_gib": None if measured is None else round(measured - planned + parts["runtime"], 3),
    }
    if measured is None:
        return Row("", "fail", figures, "no host RSS was measured")
    error = 100 * (measured - planned) / planned
    figures["error_pct"] = round(error, 1)
    if setup.dry_run:  # a CPU rank offloads nothing: its figures are recorded, not judged
        return Row("", "info", figures, "dry run: CPU, nothing offloaded")
    note = "measured_runtime_gib replaces plan.cuda_rank_runtime_gib's assumption"
    return Row("", "pass" if error <= HOST_TOLERANCE_PCT else "fail", figures, note)


def check_offload(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    if job.status != "ok":
        return Row("", "fail", {}, failed(job))
    losses = job.losses
    figures = {
        "nonfinite_skipped": job.summary.get("train/nonfinite_skipped"),
        "losses": [round(x, 4) for x in losses],
    }
    ok = figures["nonfinite_skipped"] == 1 and all(x == x for i, x in enumerate(losses) if i != 2)
    note = "offload=cpu: the NaN step 3 skipped on the CPU AdamW, every other loss finite"
    return Row("", "pass" if ok else "fail", figures, note)


def check_limit(setup: Setup, jobs: dict[str, Job]) -> Row:
    fits, above = jobs["limit_fits"], jobs["limit_next"]
    micro_batch = next(o for o in fits.overrides if o.startswith("micro_batch="))
    figures = {
        "micro_batch": int(micro_batch.split("=")[1]),
        "status": fits.status,
        "next_status": above.status,
    }
    if fits.status == "ok":
        figures.update(memory_figures(fits))
    if setup.dry_run:  # a cap stands in for the device, which the CPU allocator does not meet exactly
        return Row(
            "", "info", figures, "dry run: CPU has no device limit (device_memory_gib=0.1 in its place)"
        )
    wrong = [failed(fits)] if fits.status != "ok" else memory_verdict(figures)
    if above.status != "oom":
        wrong.append(
            f"micro_batch+1 ended {above.status}, not oom: the plan leaves more than a micro-batch unused"
        )
    note = (
        "; ".join(wrong)
        or "the plan's largest micro-batch runs within its reserved figure; one more ends oom"
    )
    return Row("", "fail" if wrong else "pass", figures, note)


def check_oom(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    figures = {"status": job.status, "failed_phase": job.summary.get("failed_phase")}
    cap = next(o for o in oom_overrides(setup) if o.startswith("device_memory_gib"))
    note = f"{cap}, plan.enforce=false: status oom recorded" if job.status == "oom" else failed(job)
    return Row("", "pass" if job.status == "oom" else "fail", figures, note)


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def check_same_losses(setup: Setup, jobs: dict[str, Job], tolerance: float = LOSS_TOLERANCE) -> Row:
    """The second job's per-step losses against the first's (the reference), and its memory
    against its plan where it is a different configuration (tolerance > 0)."""
    reference, job = jobs.values()
    if reference.status != "ok" or job.status != "ok":
        return Row("", "fail", {}, failed(job if job.status != "ok" else reference))
    diff = largest_relative_difference(job.losses, reference.losses)
    figures: dict[str, Any] = {
        "steps": len(job.losses),
        "max_rel_diff": diff,
        "final": round(job.losses[-1], 4),
    }
    wrong = [] if diff <= tolerance else [f"losses differ by {diff:.3g} relative (allowed {tolerance:g})"]
    if tolerance > 0:
        figures.update(memory_figures(job))
        wrong += memory_verdict(figures)
    return Row(
        "",
        "fail" if wrong else "pass",
        figures,
        "; ".join(wrong) or f"per-step losses within {tolerance:g} of {reference.name}",
    )


def check_checkpointing(setup: Setup, jobs: dict[str, Job]) -> Row:
    row = check_same_losses(setup, jobs)
    reference, job = jobs.values()
    if (
        row.status == "pass"
        and not job.summary["memory/max_rank_peak_gib"] < reference.summary["memory/max_rank_peak_gib"]
    ):
        return Row("", "fail", row.figures, "checkpointing did not lower the peak")
    return row


def check_sync_free(setup: Setup, jobs: dict[str, Job]) -> Row:
    fused, loop = jobs.values()
    if fused.status != "ok" or loop.status != "ok":
        return Row("", "fail", {}, failed(loop if loop.status != "ok" else fused))
    a, b = fused.summary["throughput/tokens_per_s"], loop.summary["throughput/tokens_per_s"]
    figures = {"fused_deferred_tokens_per_s": round(a, 1), "loop_host_read_tokens_per_s": round(b, 1),
               "ratio": round(a / b, 3)}  # fmt: skip
    note = "fused AdamW + device-side skip over per-tensor AdamW + a host read every step"
    return Row(
        "",
        "info",
        figures,
        note + ("; dry run: jobs ran side by side, not a timing" if setup.dry_run else ""),
    )


def check_compile(setup: Setup, jobs: dict[str, Job]) -> Row:
    eager, compiled = jobs.values()
    row = check_same_losses(setup, {"eager": eager, "compiled": compiled}, tolerance=LOSS_TOLERANCE)
    if compiled.status == "ok" and eager.status == "ok":
        a, b = compiled.summary["throughput/tokens_per_s"], eager.summary["throughput/tokens_per_s"]
        row.figures = {"compiled_tokens_per_s": round(a, 1), "eager_tokens_per_s": round(b, 1),
                       "ratio": round(a / b, 3), **row.figures}  # fmt: skip
    return row


@dataclass(frozen=True)
class RowSpec:
    name: str
    jobs: tuple[str, ...]
    check: Callable[[Setup, dict[str, Job]], Row]
    gpu_only: bool = False


def row_specs() -> list[RowSpec]:
    """The table, most valuable first (docs/gpu.md says why this order)."""
    throughput = [RowSpec(f"throughput {m} bf16 {s}", (f"{m}_{s}",), check_throughput)
                  for m in ("125m", "1b") for s in ("stage0", "stage3")]  # fmt: skip
    return [
        RowSpec("environment", ("environment",), check_environment),
        RowSpec("gpu tests", ("gpu_tests",), check_gpu_tests),
        *throughput,
        RowSpec("headroom", ("headroom", "125m_stage0", "125m_stage3", "1b_stage0", "1b_stage3"), check_headroom, True),
        RowSpec("expandable segments", ("headroom",), check_expandable, True),
        RowSpec("cpu save resumed on the device", ("cpu_save", "cpu_save_resumed"), check_resumed),
        RowSpec("device save resumed on the device", ("device_save", "device_save_resumed"), check_resumed),
        RowSpec("fp16 injected overflow", ("fp16_overflow",), check_fp16_overflow),
        RowSpec("fp16 sharded scaler (stage3)", ("fp16_sharded",), check_fp16_overflow),
        RowSpec("offload=cpu skips a NaN step", ("offload",), check_offload),
        RowSpec("offload host memory", ("offload",), check_offload_host),
        RowSpec("plan at the device limit", ("limit_fits", "limit_next"), check_limit),
        RowSpec("oom under device_memory_gib", ("oom",), check_oom),
        RowSpec("fp32 vs bf16 losses", ("125m_stage0", "125m_stage0_fp32"), check_same_losses),
        RowSpec("bf16 runs identical", ("125m_stage0", "125m_stage0_again"), lambda s, j: check_same_losses(s, j, 0.0)),
        RowSpec("checkpointing full", ("125m_stage0", "ckpt_full"), check_checkpointing),
        RowSpec("checkpointing selective", ("125m_stage0", "ckpt_selective"), check_checkpointing),
        RowSpec("grad_accum 2", ("125m_stage0", "grad_accum"), check_same_losses),
        RowSpec("stage2 on one GPU", ("125m_stage0", "stage2"), check_same_losses),
        RowSpec("sync-free step", ("125m_stage0", "125m_stage0_loop"), check_sync_free),
        RowSpec("compile", ("125m_stage0", "125m_stage0_compile"), check_compile),
    ]  # fmt: skip


def evaluate(setup: Setup, scheduler: Scheduler, spec: RowSpec) -> Row:
    """One row: skipped when the deadline left a job unstarted, failed with what was killed when a
    job ran out of time, else the row's own check."""
    if spec.gpu_only and setup.dry_run:
        return Row(spec.name, "skip", {}, "dry run: needs CUDA")
    jobs = {name: scheduler.get(name) for name in spec.jobs}
    unstarted = [job.name for job in jobs.values() if job.status == "skipped"]
    if unstarted:
        return Row(spec.name, "skip", {}, f"{NOT_REACHED}: {', '.join(unstarted)}")
    for job in jobs.values():
        if job.status == "timeout":
            figures = {"job": job.name, "seconds": round(job.seconds, 1), "killed_pids": job.killed,
                       "survivors": job.survivors}  # fmt: skip
            last = " / ".join(job.console.splitlines()[-3:])
            return Row(spec.name, "fail", figures, f"{job.name} killed at its timeout with its {len(job.killed) - 1} "
                       f"descendants ({len(job.survivors)} survived); last lines: {last}")  # fmt: skip
    row = spec.check(setup, jobs)
    row.check = spec.name
    return row


# ----------------------------------------------------------------------------- the report


class Report:
    """results.json and results.md, rewritten after every row."""

    def __init__(self, out: Path, dry_run: bool) -> None:
        self.out, self.dry_run, self.rows = out, dry_run, []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"{row.check:34s} {row.status:5s} {json.dumps(row.figures)} {row.note}", flush=True)
        (self.out / "results.json").write_text(
            json.dumps({"dry_run": self.dry_run, "rows": [asdict(r) for r in self.rows]}, indent=2) + "\n"
        )
        (self.out / "results.md").write_text(self.markdown())

    def markdown(self) -> str:
        lines = [f"# GPU check{' (dry run on CPU, tiny model)' if self.dry_run else ''}", "",
                 "| check | status | figures | note | s |", "|---|---|---|---|---|"]  # fmt: skip
        for r in self.rows:
            figures = ", ".join(f"{k}={v}" for k, v in r.figures.items())
            lines.append(
                f"| {r.check} | {r.status} | {figures} | {r.note.replace('|', '/')} | {r.seconds:.0f} |"
            )
        return "\n".join(lines) + "\n"


def timed(report: Report, spec: RowSpec, make: Callable[[], Row]) -> None:
    """Run one row; an exception in the check itself is that row's error (under its own name),
    and the check goes on."""
    start = time.perf_counter()
    try:
        row = make()
    except Exception as err:  # noqa: BLE001 - a broken row must not cost the rows after it
        row = Row(spec.name, "error", {}, f"{type(err).__name__}: {err}")
    row.seconds = time.perf_counter() - start
    report.add(row)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = REPO / "outputs" / "gpu_check" / time.strftime("%Y-%m-%d_%H-%M-%S")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--dry-run", action="store_true", help="the same sequence on CPU with the tiny model")
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help=f"seconds for the whole check (default {DEADLINE_S:g}, dry run {DRY_DEADLINE_S:g})",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="jobs at once (default 3 on the GPU, exclusive ones alone; 2 in a dry run)",
    )
    parser.add_argument(
        "--inject-hang", metavar="JOB", help="tests only: JOB runs until the deadline kills it"
    )
    parser.add_argument("--environment", type=Path, help=argparse.SUPPRESS)  # the environment job
    parser.add_argument("--largest-micro-batch", type=Path, help=argparse.SUPPRESS)  # the limit_plan job
    return parser.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup = Setup(args.dry_run, args.out.resolve(), 0.0, args.inject_hang)
    if args.environment is not None:
        args.environment.write_text(json.dumps(environment(setup)))
        return 0
    if args.largest_micro_batch is not None:
        micro_batch = largest_fitting_micro_batch(setup, limit_base(setup))
        args.largest_micro_batch.write_text(json.dumps({"micro_batch": micro_batch}))
        return 0
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():  # NVML's count: no CUDA context in this process
            print("error: no CUDA device visible; --dry-run runs the sequence on CPU", file=sys.stderr)
            return 2
    deadline = (
        args.deadline if args.deadline is not None else (DRY_DEADLINE_S if args.dry_run else DEADLINE_S)
    )
    setup.deadline = time.monotonic() + deadline
    report = Report(setup.out, args.dry_run)
    (setup.out / "jobs").mkdir(exist_ok=True)
    scheduler = Scheduler(setup, all_jobs(setup), args.jobs or (2 if args.dry_run else 3))
    for spec in row_specs():
        timed(report, spec, lambda spec=spec: evaluate(setup, scheduler, spec))
    scheduler.thread.join()
    print(f"results: {setup.out / 'results.md'}", flush=True)
    cut = [r.check for r in report.rows if r.note.startswith(NOT_REACHED)]
    if cut:
        print(f"the deadline cut {len(cut)} rows: {', '.join(cut)}", flush=True)
    return 0 if not cut and all(r.status in ("pass", "info", "skip") for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
