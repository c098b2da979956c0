"""The GPU check's jobs: where it runs (Setup), what one job is (JobSpec), every job in the order
they start, and the two helpers the check runs as processes of their own (the environment, the
largest micro-batch the plan fits)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from checks.gpucheck.runner import REPO

SCRIPT = REPO / "checks" / "gpu_check.py"
"""The command; the environment and plans jobs run it again with hidden flags."""
ADVICE_FILE = "advice.json"
"""The plans job's output under jobs/: each throughput job's predicted tokens/s."""
LIMIT_FILE = "limit_plan.json"
"""The plans job's other output under jobs/: the largest micro-batch the plan fits for the limit rows."""
KERNEL_RATES_FILE = "kernel_rates.json"
"""The kernel-rates job's output under jobs/ (checks/gpucheck/rates.py), for the advisor."""
TEXT_DIR = "text_data"
"""Under jobs/: the text row's corpus, tokenizer and token cache (perf.make_text_corpus)."""
TRACE_STEP = "telemetry.trace_steps=[3]"
"""The throughput jobs' profiled step exported as a chrome trace: the step the communication probe
profiles (trainer/telemetry/comm.py), read by the breakdown row; in the warm-up window."""


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
    points: tuple[JobSpec, ...] = ()
    """A dry run's sweep: these trainer jobs as the points of one Hydra multirun (scheduler.run_sweep)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables the job gets beside the check's (the CUPTI A/B's attached arm)."""
    warmed_by: str | None = None
    """A job that compiles the same graphs earlier, sharing the device, so that this timed one finds
    inductor's cache filled; run with it, not waited for (a failed warm-up costs time, not the row)."""


def job_dir(setup: Setup, name: str) -> Path:
    return setup.out / "jobs" / name


def throughput_jobs(setup: Setup) -> list[JobSpec]:
    jobs = []
    # measured 17-21 s (125m) and 28-29 s (1b) on the H200 (docs/gpu.md), the trace's export added (a guess)
    for model, estimate in (("125m", 21.0), ("1b", 32.0)):
        for stage in ("stage0", "stage3"):
            jobs.append(JobSpec(f"{model}_{stage}", (*bf16(setup, model, stage), TRACE_STEP), budget_s=3 * estimate,
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
    that neither resume holds the other save back. In a dry run the device is the CPU: the device
    save and its resume are the CPU save's and its resume's, run once."""
    saves, resumes = [], []
    for name, device in (("cpu_save", "cpu"), ("device_save", setup.device)):
        save = (*SAVE_SHAPE, "steps=4", "save.every=2", "save.keep=1")
        source = "cpu_save" if setup.dry_run else name
        resume_from = job_dir(setup, source) / "checkpoints" / "step_00000004"
        saves.append(JobSpec(name, save, budget_s=60, estimate_s=15, device=device, unique=not setup.dry_run))
        resumes.append(JobSpec(f"{name}_resumed", (*SAVE_SHAPE, "steps=6", f"resume={resume_from}"),
                               budget_s=60, estimate_s=15, after=source))  # fmt: skip
    return saves + resumes


def limit_jobs(setup: Setup) -> list[JobSpec]:
    """3 steps at the largest micro-batch the plan says fits the device (the plans job found it), and
    at the next one up (plan waived)."""

    def micro_batch(extra: int) -> Callable[[Setup], tuple[str, ...]]:
        found = setup.out / "jobs" / LIMIT_FILE
        return lambda setup: (
            *limit_base(setup),
            f"micro_batch={json.loads(found.read_text())['micro_batch'] + extra}",
        )

    return [
        JobSpec("limit_fits", resolve=micro_batch(0), budget_s=90, estimate_s=30, exclusive=True, after="plans"),
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


def advisor_predictions(setup: Setup) -> dict[str, dict[str, Any]]:
    """What mode=advise predicts for each throughput job on an H200 (plan.accelerator=h200: the table's
    rates, trainer/advise/calibrate.py), its tokens/s and what limits its step; no CUDA is touched."""
    from hydra import compose, initialize_config_dir

    from trainer.advise.advisor import rates_for
    from trainer.advise.predict import predict_step_tiers
    from trainer.cli import register_configs
    from trainer.config import validate
    from trainer.model.decoder import flops_per_token
    from trainer.plan import build_plan, plan_comm, planned_device_kind

    register_configs()
    predictions = {}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for spec in advised_jobs(setup):
            overrides = [
                "logger=none",
                f"device={setup.device}",
                "nproc=1",
                *spec.overrides,
                "plan.accelerator=h200",
            ]
            config = validate(compose("train", overrides=overrides))
            kind = planned_device_kind(config.plan, config.device)
            local_numel = max(rank.states.local_numel for rank in build_plan(config, kind, 1).ranks)
            rates = rates_for(config, 1, [config.micro_batch])
            flops = flops_per_token(config.model, config.seq_len)
            step = predict_step_tiers(
                config, 1, plan_comm(config, 1, backend="nccl"), local_numel, flops, rates, kind
            )
            tokens = config.micro_batch * config.grad_accum * config.seq_len
            predictions[spec.name] = {"tokens_per_s": tokens / step.step_s, "step_s": step.step_s,
                                      "limiter": step.limiter}  # fmt: skip
    return predictions


def all_jobs(setup: Setup) -> list[JobSpec]:
    """Every job, in the order they start: the performance run first (the shared jobs and the compile
    warm-ups, then each timing alone), then the jobs of the rows run only by --rows. In a dry run the
    trainer jobs that wait for no other job, the fault, comparison and performance ones, are the
    points of one Hydra multirun: on CPU most of a short job's seconds are its start (its process and
    fork server), which a sweep's points share; the warm-ups have nothing to warm there."""
    environment, gpu_tests, probe, plans, rates, corpus = helper_jobs(setup)
    throughput = {spec.name: spec for spec in throughput_jobs(setup)}
    shared, timed = performance_jobs(setup, throughput)
    first_save, *saves = save_jobs(setup)
    faults, comparisons = fault_jobs(setup), comparison_jobs(setup)
    if setup.dry_run:
        alone = [s for s in timed if s.name in throughput or s.env]  # the throughput rows' jobs, and
        points = (*faults, *comparisons, *shared, *(s for s in timed if s not in alone))  # a job's own env
        faults, comparisons = [JobSpec("dry_run_sweep", points=points, after=corpus.name)], []
        shared, timed = [], alone
    return [
        environment, plans, corpus, *shared, rates, *timed,
        throughput["125m_stage3"], throughput["1b_stage3"],
        gpu_tests, *([probe] if not setup.dry_run else []),
        first_save, *saves, *faults, *limit_jobs(setup),
        JobSpec("oom", oom_overrides(setup)),
        JobSpec("auto_batch", auto_batch_overrides(setup), budget_s=150, estimate_s=45),
        *comparisons,
    ]  # fmt: skip


def compiled(setup: Setup, model: str, *extra: str) -> tuple[str, ...]:
    backend = "compile_backend=aot_eager" if setup.dry_run else "compile_backend=inductor"
    return bf16(setup, model, "stage0", "compile=true", backend, *extra)


def micro_batch(setup: Setup, size: int) -> str:
    """A micro-batch of the GPU's `size`; a quarter of it on CPU (the dry run's shape has 2 for 8)."""
    return f"micro_batch={size // 4 if setup.dry_run else size}"


WARMUP = ("steps=2", "log_every=1", "telemetry.warmup_steps=1")
"""A compile warm-up's steps: the first compiles forward and backward, the second runs them."""


def performance_jobs(setup: Setup, throughput: dict[str, JobSpec]) -> tuple[list[JobSpec], list[JobSpec]]:
    """The jobs that may share the device (the compile warm-ups, the text row's job), and the timings,
    each alone: 1b eager at micro-batch 8 (the baseline, with its profiled step) and again with CUPTI
    left attached after that step, 1b eager at 32, 1b compiled at 8 and 16, 1b fp8 compiled, 125m
    eager and compiled. Estimates not measured before are guesses: a compiled job once its warm-up
    filled the cache (dynamo still traces each block) 40 s at 1b, 30 s at 125m; a warm-up (inductor
    compiling beside three others) 75 s at 1b, 60 s at 125m."""
    longer = ("steps=20", "log_every=4", "telemetry.warmup_steps=8") if not setup.dry_run else ()
    timed = [
        throughput["1b_stage0"],
        replace(throughput["1b_stage0"], name="1b_stage0_cupti_attached", env=(("TEARDOWN_CUPTI", "0"),),
                unique=not setup.dry_run),  # a dry run: the same job (CPU has no CUPTI)
        JobSpec("1b_mb32", bf16(setup, "1b", "stage0", micro_batch(setup, 32), *longer), budget_s=100,
                estimate_s=36, exclusive=True),  # 20 steps of 0.58 s (4 x the 1b step) in a 1b job's 28 s
        JobSpec("1b_compiled", compiled(setup, "1b"), budget_s=120, estimate_s=40, exclusive=True),
        JobSpec("1b_compiled_mb16", compiled(setup, "1b", micro_batch(setup, 16)), budget_s=120, estimate_s=40,
                exclusive=True),
        JobSpec("1b_fp8_compiled", (*compiled(setup, "1b"), "precision=fp8"), budget_s=120, estimate_s=40,
                exclusive=True),
        throughput["125m_stage0"],
        JobSpec("125m_stage0_compile", compiled(setup, "125m"), budget_s=120, estimate_s=30, exclusive=True),
    ]  # fmt: skip
    warmups = [
        JobSpec(f"{spec.name}_warmup", (*spec.overrides, *WARMUP), budget_s=150, estimate_s=75 if "1b" in spec.name else 60)
        for spec in timed if "compile=true" in spec.overrides
    ]  # fmt: skip
    timed = [replace(s, warmed_by=f"{s.name}_warmup") if "compile=true" in s.overrides else s for s in timed]
    text = JobSpec("125m_text", (*bf16(setup, "125m", "stage0"), *text_overrides(setup)), budget_s=90,
                   estimate_s=25, after="text_corpus")  # fmt: skip
    return ([*warmups, text] if not setup.dry_run else [text]), timed


def text_overrides(setup: Setup) -> tuple[str, ...]:
    """data=text over the corpus the text_corpus job made, its documents packed one per mask block."""
    folder = setup.out / "jobs" / TEXT_DIR
    return ("data=text", f"data.files=[{folder / 'corpus.txt'}]", f"data.tokenizer={folder}",
            "data.packing=document", f"data.cache_dir={folder / 'cache'}")  # fmt: skip


ADVISED = ("125m_stage0", "1b_stage0", "1b_mb32", "1b_compiled", "1b_compiled_mb16", "125m_stage0_compile")
"""The timed jobs the advisor row sets its predictions beside."""


def advised_jobs(setup: Setup) -> list[JobSpec]:
    throughput = {spec.name: spec for spec in throughput_jobs(setup)}
    return [spec for spec in performance_jobs(setup, throughput)[1] if spec.name in ADVISED]


def helper_jobs(setup: Setup) -> list[JobSpec]:
    """The processes that are not training jobs: the environment, the gpu tests, the headroom probe,
    one process for the plans (the largest micro-batch the plan fits, the advisor's predictions), the
    kernel rates (a timing: alone), and the text row's corpus, tokenizer and token cache."""
    dry, jobs = (["--dry-run"] if setup.dry_run else []), setup.out / "jobs"
    environment = (sys.executable, str(SCRIPT), "--environment", str(jobs / "environment.json"), *dry)
    gpu_tests = (sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider",
                 "-p", "no:xdist", "-o", "addopts=-ra", "--durations=8")  # fmt: skip
    probe = (sys.executable, str(REPO / "checks" / "headroom_probe.py"))
    # Planning for the GPU reads its properties, which creates a CUDA context: the plans are made in
    # a process of their own, and the check's process holds none while jobs run.
    plans = (sys.executable, str(SCRIPT), "--largest-micro-batch", str(jobs / LIMIT_FILE), "--advise",
             str(jobs / ADVICE_FILE), *dry)  # fmt: skip
    rates = (sys.executable, str(SCRIPT), "--kernel-rates", str(jobs / KERNEL_RATES_FILE), *dry)
    corpus = (sys.executable, str(SCRIPT), "--text-corpus", str(jobs / TEXT_DIR), *dry)
    return [
        JobSpec("environment", command=environment, budget_s=30, estimate_s=5),
        JobSpec("gpu_tests", command=gpu_tests, budget_s=200, estimate_s=120),
        JobSpec("headroom", command=probe, budget_s=45, estimate_s=10, exclusive=True),
        JobSpec("plans", command=plans, budget_s=45, estimate_s=10),
        # a guess: torch's import and CUDA's start (~10 s), 36 GEMMs in 2 dtypes, 4 SDPA kernels, AdamW over
        # 134M parameters, 20 repeats each (a few seconds of GPU time)
        JobSpec("kernel_rates", command=rates, budget_s=90, estimate_s=25, exclusive=True),
        JobSpec("text_corpus", command=corpus, budget_s=60, estimate_s=10),  # a guess: one small process
    ]  # fmt: skip


def fault_jobs(setup: Setup) -> list[JobSpec]:
    """fp16's injected overflow at stage0 and stage3, and a NaN loss skipped under offload=cpu."""
    model, fault = setup.model("125m"), ("fault.kind=inf_grad", "fault.step=3")
    return [
        JobSpec("fp16_overflow", (f"model={model}", "precision=fp16", "zero=stage0", *short(setup), *fault)),
        JobSpec("fp16_sharded", (f"model={model}", "precision=fp16", "zero=stage3", *short(setup), *fault)),
        JobSpec("offload", (f"model={model}", "precision=bf16", "zero=stage3", "offload=cpu", "nonfinite=skip",
                            "fault.kind=nan_loss", "fault.step=3", *short(setup)), budget_s=90, estimate_s=25),
    ]  # fmt: skip


def comparison_jobs(setup: Setup) -> list[JobSpec]:
    """125m stage0 bf16 (the reference, a throughput job) changed in one setting each; the rows compare
    their losses with the reference's (the compiled one is a performance job: performance_jobs)."""
    model = setup.model("125m")
    return [
        JobSpec("125m_stage0_fp32", (f"model={model}", "precision=fp32", "zero=stage0", *setup.shape())),
        *fp8_jobs(setup),
        JobSpec("125m_stage0_again", bf16(setup, "125m", "stage0"), unique=True),
        JobSpec("ckpt_full", bf16(setup, "125m", "stage0", "checkpointing=full")),
        JobSpec("ckpt_selective", bf16(setup, "125m", "stage0", "checkpointing=selective")),
        JobSpec("ckpt_op", bf16(setup, "125m", "stage0", "checkpointing=op")),
        JobSpec("loss_chunked", bf16(setup, "125m", "stage0", "loss=chunked")),
        *([JobSpec("attention_efficient", bf16(setup, "125m", "stage0", "attention=efficient"))]
          if not setup.dry_run else []),  # a CUDA kernel only (trainer/model/attention.py)
        JobSpec("attention_math", bf16(setup, "125m", "stage0", "attention=math")),
        JobSpec("grad_accum", bf16(setup, "125m", "stage0", *half_micro_batch(setup), "grad_accum=2")),
        JobSpec("stage2", bf16(setup, "125m", "stage2")),
        *([JobSpec("125m_stage0_loop", bf16(setup, "125m", "stage0", "optim.fused=false"), exclusive=True)]
          if not setup.dry_run else []),  # a timing: nothing to learn from a shared CPU
    ]  # fmt: skip


def fp8_jobs(setup: Setup) -> list[JobSpec]:
    """125m compiled in fp8 (tensorwise) beside the compile row's bf16 job: fp8 pays only compiled; the
    row sets their tokens/s ratio beside the advisor's prediction (trainer/advise/fp8.py). Run by
    --rows: the performance run's 1b pair judges fp8's speed; this one shares the GPU, not a timing."""
    return [
        JobSpec("125m_fp8_compiled", (*compiled(setup, "125m"), "precision=fp8"), budget_s=150, estimate_s=90)
    ]


def schedule_estimate(specs: list[JobSpec], workers: int) -> float:
    """The check's wall time from the jobs' estimates, scheduled as Scheduler runs them: in order, up
    to `workers` at once, an exclusive job alone, a job with `after` once that one ended."""
    ends: dict[str, float] = {}
    running: list[tuple[float, bool]] = []  # (end, exclusive)
    clock = 0.0
    for spec in specs:
        while running and (spec.exclusive or any(x for _, x in running) or len(running) >= workers):
            first = min(running)
            running.remove(first)
            clock = max(clock, first[0])
        if spec.after is not None:  # the scheduler's thread waits for it, holding every later job back
            clock = max(clock, ends.get(spec.after, 0.0))
        ends[spec.name] = clock + spec.estimate_s
        running.append((ends[spec.name], spec.exclusive))
    return max(ends.values(), default=0.0)


def half_micro_batch(setup: Setup) -> tuple[str, ...]:
    """The throughput shape's micro-batch halved: with grad_accum=2, the same global batch."""
    (micro,) = [o for o in setup.shape() if o.startswith("micro_batch=")]
    return (f"micro_batch={int(micro.split('=')[1]) // 2}",)


def oom_overrides(setup: Setup) -> tuple[str, ...]:
    """A cap the job cannot fit under, with the plan's refusal waived: GPU, 1b in 10 GiB, where its
    4.1 GiB of parameters and DDP's 4.1 GiB of gradient buckets fit and the first step's activations
    do not, so it runs out inside a step (at 2 GiB the first run, 2026-12-04, ran out building the
    model: an OOM at setup, with no plan moment to explain it); dry run, the tiny model's
    activations at a long sequence in 0.1 GiB."""
    cap = (
        ("device_memory_gib=0.1", "micro_batch=32", "seq_len=256")
        if setup.dry_run
        else ("device_memory_gib=10",)
    )
    return (
        f"model={setup.model('1b')}",
        "precision=bf16",
        "zero=stage0",
        "plan.enforce=false",
        "steps=2",
        "memory.snapshot=oom",  # the allocator's history dumped when it runs out (CPU: the held split)
        *cap,
    )


def auto_batch_overrides(setup: Setup) -> tuple[str, ...]:
    """micro_batch=auto under a cap where the plan's choice is inside 1..32: GPU, 1b at seq_len 1024 in
    40 GiB (3: 30.25 GiB reserved planned, 32 GiB allowed less advise.headroom); dry run, the tiny model
    under tests/integration/test_oom_triage.py's cap and headroom (a capped CPU rank holds more than its
    tensors: at 0.5 GiB and 0.35 the chosen micro-batch ran out at step 2; here 7, measured as planned)."""
    cap = (
        ("model=tiny", "seq_len=256", "device_memory_gib=0.15", "advise.headroom=0.45")
        if setup.dry_run
        else ("model=1b", "seq_len=1024", "device_memory_gib=40")
    )
    return (*cap, "precision=bf16", "zero=stage0", "micro_batch=auto", "steps=2")


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
