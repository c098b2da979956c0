"""One prepared check of zerolab on a GPU: what the CPU tests cannot prove, in one command.

    python benchmarks/gpu_check.py [--out DIR] [--dry-run]

Made for one H200 (world size 1: NCCL refuses two ranks on one device) and about 8 minutes.
Every row runs `python -m trainer` as a user would (W&B off, nothing saved unless the row is
about saving) and is written to DIR/results.md and DIR/results.json as soon as it is known, so
a run cut short still reports what it reached. Rows:

  environment      device, torch, CUDA, NCCL, cuDNN
  gpu tests        pytest -m gpu tests/gpu
  throughput       125m and 1b in bf16 at stage0 and stage3: tokens/s, MFU, peak allocated and
                   reserved against the plan's predicted allocated and reserved (trainer/plan)
  fp32 vs bf16     the 125m stage0 losses of both precisions, step by step
  fp16 overflow    an injected inf gradient at step 3: the scale halves, one step skipped
  oom              a run over `device_memory_gib` ends `oom`, recorded, not a crash of the check
  resume           a save made on CPU resumed on the GPU
  sync-free step   the fused AdamW whose non-finite skip stays on the device against the
                   per-tensor AdamW read on the host every step (trainer/rank/nonfinite.py)
  compile          compile=true against eager: tokens/s and losses
  headroom         the CUDA context, NCCL and cuBLAS figures the plan assumes, measured

--dry-run runs the same sequence on CPU with the tiny model (the same rows and table shape),
to prove the script before GPU time is spent on it. docs/gpu.md says how to run it on the GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the environment and headroom rows read trainer's tables
LOSS_TOLERANCE = 0.02
"""fp32 vs bf16 (and compile vs eager in bf16): largest relative difference of the per-step losses."""
PLAN_TOLERANCE_PCT = 15.0
"""Peak allocated against the plan: the row passes within this error."""


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
    work: Path

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def model(self, name: str) -> str:
        return "tiny" if self.dry_run else name

    def shape(self) -> list[str]:
        """Micro-batch, sequence and steps: a real load on the GPU, seconds on CPU."""
        if self.dry_run:
            return ["micro_batch=1", "seq_len=32", "steps=4", "log_every=2", "telemetry.warmup_steps=2"]
        return ["micro_batch=8", "seq_len=1024", "steps=30", "log_every=5", "telemetry.warmup_steps=10"]


@dataclass
class Job:
    status: str
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    out: Path
    console: str

    @property
    def losses(self) -> list[float]:
        return [r["loss/train"] for r in self.records]

    def last(self, key: str) -> Any:
        values = [r[key] for r in self.records if key in r]
        return values[-1] if values else None

    def most(self, key: str) -> float | None:
        values = [r[key] for r in self.records if key in r]
        return max(values) if values else None


def run_job(setup: Setup, name: str, *overrides: str, timeout: float = 240) -> Job:
    """`python -m trainer` with one rank on the check's device; never raises for a failed job."""
    out = setup.work / name
    args = [sys.executable, "-m", "trainer", f"device={setup.device}", "nproc=1", "logger=none", "save=off",
            *setup.shape(), *overrides, f"hydra.run.dir={out}"]  # fmt: skip
    env = {
        **os.environ,
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    summary_path, metrics_path = out / "summary.json", out / "metrics.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    records = (
        [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    )
    status = summary.get("status", f"exit {proc.returncode}")
    return Job(status, summary, records, out, (proc.stdout + proc.stderr)[-2000:])


class Jobs:
    """Every job of the check, submitted up front in table order and awaited by the rows.

    On the GPU one at a time (timings must not share the device), so rows finish in order; a dry
    run runs a few at once: on a shared CPU most of a job is process start-up, not compute.
    """

    def __init__(self, setup: Setup, workers: int) -> None:
        self.setup, self.pool, self.futures = setup, ThreadPoolExecutor(max_workers=workers), {}
        self.by_overrides: dict[tuple[str, ...], Any] = {}

    def submit(self, name: str, *overrides: str, timeout: float = 240) -> None:
        """A job; one the check already submitted with the same overrides is shared (a dry run
        gives 125m and 1b the same tiny model, so their rows read the same job)."""
        if overrides not in self.by_overrides:
            self.by_overrides[overrides] = self.pool.submit(
                run_job, self.setup, name, *overrides, timeout=timeout
            )
        self.futures[name] = self.by_overrides[overrides]

    def submit_call(self, name: str, call: Callable[[], Any]) -> None:
        self.futures[name] = self.pool.submit(call)

    def get(self, name: str) -> Any:
        return self.futures[name].result()


def failed(job: Job) -> str:
    """The job's own error line, for a row whose job did not end as the row expects."""
    lines = [line for line in job.console.splitlines() if line.strip()]
    return f"status {job.status}: {job.summary.get('error') or (lines[-1] if lines else 'no output')}"


# ----------------------------------------------------------------------------- the rows


def check_environment(setup: Setup) -> Row:
    import torch

    figures: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    if setup.dry_run:
        figures["device"] = f"cpu ({platform.machine()})"
        return Row("environment", "info", figures, "dry run: CPU")
    figures.update(
        device=torch.cuda.get_device_name(0),
        gpus=torch.cuda.device_count(),
        memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2),
        cuda=torch.version.cuda,
        nccl=".".join(map(str, torch.cuda.nccl.version())),
        cudnn=torch.backends.cudnn.version(),
    )
    from trainer.devices import find_device

    known = find_device(figures["device"])
    figures["table"] = known.short if known else "unknown"
    return Row("environment", "info", figures, "" if known else "device not in trainer/devices.py: no MFU")


def run_gpu_tests() -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"]
    return subprocess.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )


def check_gpu_tests(setup: Setup, jobs: Jobs) -> Row:
    proc = jobs.get("gpu_tests")
    tail = [line for line in proc.stdout.splitlines() if line.strip()]
    outcome = tail[-1].strip("= ") if tail else proc.stderr[-300:]
    if setup.dry_run:  # no CUDA: every test is skipped, which is the point of the marker
        ok = proc.returncode == 0 and "skipped" in outcome and "failed" not in outcome
        return Row(
            "gpu tests", "pass" if ok else "fail", {"pytest": outcome}, "dry run: skipped without CUDA"
        )
    return Row("gpu tests", "pass" if proc.returncode == 0 else "fail", {"pytest": outcome})


def bf16_job(setup: Setup, model: str, stage: str, *extra: str) -> tuple[str, ...]:
    return (f"model={setup.model(model)}", "precision=bf16", f"zero={stage}", *extra)


def check_throughput(setup: Setup, jobs: Jobs, model: str, stage: str) -> Row:
    job: Job = jobs.get(f"{model}_{stage}")
    name = f"throughput {model} bf16 {stage}"
    if job.status != "ok":
        return Row(name, "fail", {}, failed(job))
    s = job.summary
    reserved = job.most("memory/rank0/peak_reserved_gib")
    mfu = job.last("throughput/mfu_pct")
    figures = {
        "tokens_per_s": round(s["throughput/tokens_per_s"], 1),
        "mfu_pct": round(mfu, 1) if mfu is not None else None,
        "peak_allocated_gib": round(s.get("memory/max_rank_peak_gib", float("nan")), 3),
        "predicted_allocated_gib": round(s["memory/predicted_peak_gib"], 3),
        "allocated_error_pct": round(s.get("memory/prediction_error_pct", float("nan")), 1),
        "peak_reserved_gib": round(reserved, 3) if reserved is not None else None,
        "predicted_reserved_gib": s.get("plan", {}).get("predicted_reserved_gib"),
    }
    within = abs(figures["allocated_error_pct"]) <= PLAN_TOLERANCE_PCT
    return Row(
        name, "pass" if within else "fail", figures, f"plan within ±{PLAN_TOLERANCE_PCT:g}% of peak allocated"
    )


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def check_loss_agreement(setup: Setup, jobs: Jobs) -> Row:
    bf16, fp32 = jobs.get("125m_stage0"), jobs.get("125m_stage0_fp32")
    if bf16.status != "ok" or fp32.status != "ok":
        return Row("fp32 vs bf16 losses", "fail", {}, failed(fp32 if fp32.status != "ok" else bf16))
    diff = largest_relative_difference(bf16.losses, fp32.losses)
    figures = {
        "steps": len(fp32.losses),
        "max_rel_diff": round(diff, 5),
        "fp32_final": round(fp32.losses[-1], 4),
        "bf16_final": round(bf16.losses[-1], 4),
    }
    return Row(
        "fp32 vs bf16 losses",
        "pass" if diff <= LOSS_TOLERANCE else "fail",
        figures,
        f"per logged step, within {LOSS_TOLERANCE:g} relative",
    )


def check_fp16_overflow(setup: Setup, jobs: Jobs) -> Row:
    job: Job = jobs.get("fp16_overflow")
    if job.status != "ok":
        return Row("fp16 injected overflow", "fail", {}, failed(job))
    scales = [r["precision/loss_scale"] for r in job.records]
    figures = {"scales": scales, "skipped_steps": job.summary.get("precision/skipped_steps")}
    ok = scales[2] == scales[1] / 2 and figures["skipped_steps"] == 1
    return Row(
        "fp16 injected overflow",
        "pass" if ok else "fail",
        figures,
        "scale halves at step 3, one step skipped",
    )


def oom_overrides(setup: Setup) -> tuple[str, ...]:
    """A cap the job cannot fit under, with the plan's refusal waived: GPU, 1b's 16 GiB of states
    in 2 GiB; dry run, the tiny model's activations at a long sequence in 0.1 GiB."""
    shape = (
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
        *shape,
    )


def check_oom(setup: Setup, jobs: Jobs) -> Row:
    job: Job = jobs.get("oom")
    figures = {"status": job.status, "failed_phase": job.summary.get("failed_phase")}
    cap = next(o for o in oom_overrides(setup) if o.startswith("device_memory_gib"))
    note = f"{cap}, plan.enforce=false: status oom recorded" if job.status == "oom" else failed(job)
    return Row("oom under device_memory_gib", "pass" if job.status == "oom" else "fail", figures, note)


RESUME_SHAPE = ("model=tiny", "precision=fp32", "zero=stage0", "micro_batch=2", "seq_len=64", "log_every=1")


def run_resume(setup: Setup) -> Job:
    """Save on CPU at step 4, then resume on the check's device to step 6."""
    cpu = setup.work / "resume_cpu"
    args = [
        sys.executable,
        "-m",
        "trainer",
        "device=cpu",
        "nproc=1",
        "logger=none",
        "steps=4",
        "save.every=2",
        *RESUME_SHAPE,
        f"hydra.run.dir={cpu}",
    ]
    subprocess.run(
        args,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    return run_job(
        setup, "resume_device", *RESUME_SHAPE, "steps=6", f"resume={cpu / 'checkpoints' / 'step_00000004'}"
    )


def check_resume(setup: Setup, jobs: Jobs) -> Row:
    job: Job = jobs.get("resume")
    figures = {
        "status": job.status,
        "first_step": job.records[0]["step"] if job.records else None,
        "steps_done": job.summary.get("steps_done"),
    }
    ok = job.status == "ok" and figures["first_step"] == 5 and figures["steps_done"] == 6
    return Row("cpu save resumed on the device", "pass" if ok else "fail", figures, "" if ok else failed(job))


def check_sync_free(setup: Setup, jobs: Jobs) -> Row:
    fused, loop = jobs.get("125m_stage0"), jobs.get("125m_stage0_loop")
    if fused.status != "ok" or loop.status != "ok":
        return Row("sync-free step", "fail", {}, failed(loop if loop.status != "ok" else fused))
    a, b = fused.summary["throughput/tokens_per_s"], loop.summary["throughput/tokens_per_s"]
    figures = {
        "fused_deferred_tokens_per_s": round(a, 1),
        "loop_host_read_tokens_per_s": round(b, 1),
        "ratio": round(a / b, 3),
    }
    note = "fused AdamW + device-side skip over per-tensor AdamW + a host read every step"
    return Row(
        "sync-free step",
        "info",
        figures,
        note + ("; dry run: jobs ran side by side, not a timing" if setup.dry_run else ""),
    )


def check_compile(setup: Setup, jobs: Jobs) -> Row:
    eager, compiled = jobs.get("125m_stage0"), jobs.get("125m_stage0_compile")
    if eager.status != "ok" or compiled.status != "ok":
        return Row("compile", "fail", {}, failed(compiled if compiled.status != "ok" else eager))
    diff = largest_relative_difference(compiled.losses, eager.losses)
    a, b = compiled.summary["throughput/tokens_per_s"], eager.summary["throughput/tokens_per_s"]
    figures = {
        "compiled_tokens_per_s": round(a, 1),
        "eager_tokens_per_s": round(b, 1),
        "ratio": round(a / b, 3),
        "max_rel_loss_diff": round(diff, 5),
    }
    return Row(
        "compile",
        "pass" if diff <= LOSS_TOLERANCE else "fail",
        figures,
        "steady tokens/s (compilation in warm-up)",
    )


HEADROOM_PROBE = """
import json, os, torch, torch.distributed as dist
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
torch.cuda.init(); torch.empty(1, device="cuda")
free, total = torch.cuda.mem_get_info(); context = total - free - torch.cuda.memory_reserved()
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); before = torch.cuda.memory_reserved()
(a @ a).sum().item(); cublas = torch.cuda.memory_reserved() - before - a.numel() * a.element_size()
free0, _ = torch.cuda.mem_get_info(); reserved0 = torch.cuda.memory_reserved()
dist.init_process_group("nccl", init_method="tcp://localhost:29581", rank=0, world_size=1, device_id=torch.device("cuda", 0))
t = torch.ones(2**20, device="cuda"); dist.all_reduce(t); torch.cuda.synchronize()
free1, _ = torch.cuda.mem_get_info(); nccl = free0 - free1 - (torch.cuda.memory_reserved() - reserved0)
dist.destroy_process_group()
print(json.dumps({"context_gib": context / 2**30, "cublas_workspace_gib": max(cublas, 0) / 2**30, "nccl_gib": max(nccl, 0) / 2**30}))
"""


def run_headroom_probe() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HEADROOM_PROBE], capture_output=True, text=True, timeout=120)


def check_headroom(setup: Setup, jobs: Jobs) -> Row:
    from trainer.plan.headroom import HEADROOM

    assumed = {f"assumed_{k}": v for k, v in asdict(HEADROOM).items()}
    if setup.dry_run:
        return Row("headroom", "skip", assumed, "dry run: CPU has no CUDA context")
    proc = jobs.get("headroom")
    if proc.returncode != 0:
        return Row(
            "headroom",
            "error",
            assumed,
            proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "probe failed",
        )
    measured = {
        f"measured_{k}": round(v, 3) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()
    }
    return Row(
        "headroom",
        "info",
        {**assumed, **measured},
        "fragmentation: see peak reserved / allocated above; update trainer/plan/headroom.py",
    )


def submit_all(setup: Setup, jobs: Jobs) -> None:
    """Every job, in the order the rows need them."""
    jobs.submit_call("gpu_tests", run_gpu_tests)
    for model in ("125m", "1b"):
        for stage in ("stage0", "stage3"):
            jobs.submit(f"{model}_{stage}", *bf16_job(setup, model, stage))
    jobs.submit("125m_stage0_fp32", f"model={setup.model('125m')}", "precision=fp32", "zero=stage0")
    jobs.submit("fp16_overflow", f"model={setup.model('125m')}", "precision=fp16", "zero=stage0",
                "fault.kind=inf_grad", "fault.step=3", "steps=5", "log_every=1")  # fmt: skip
    jobs.submit("oom", *oom_overrides(setup))
    jobs.submit_call("resume", lambda: run_resume(setup))
    jobs.submit("125m_stage0_loop", *bf16_job(setup, "125m", "stage0", "optim.fused=false"))
    # The dry run compiles with aot_eager: the composition is checked, without inductor's C++ builds.
    backend = "compile_backend=aot_eager" if setup.dry_run else "compile_backend=inductor"
    jobs.submit(
        "125m_stage0_compile", *bf16_job(setup, "125m", "stage0", "compile=true", backend), timeout=420
    )
    if not setup.dry_run:
        jobs.submit_call("headroom", run_headroom_probe)


def rows(setup: Setup, jobs: Jobs) -> list[Callable[[], Row]]:
    """The table, in order; each row waits for its jobs."""
    sequence: list[Callable[[], Row]] = [
        lambda: check_environment(setup),
        lambda: check_gpu_tests(setup, jobs),
    ]
    for model in ("125m", "1b"):
        for stage in ("stage0", "stage3"):
            sequence.append(lambda model=model, stage=stage: check_throughput(setup, jobs, model, stage))
    for check in (
        check_loss_agreement,
        check_fp16_overflow,
        check_oom,
        check_resume,
        check_sync_free,
        check_compile,
        check_headroom,
    ):
        sequence.append(lambda check=check: check(setup, jobs))
    return sequence


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


def timed(report: Report, make: Callable[[], Row]) -> None:
    """Run one row; an exception in the check itself is recorded as that row's error, and the check goes on."""
    start = time.perf_counter()
    try:
        row = make()
    except Exception as err:  # noqa: BLE001 - a broken row must not cost the rows after it
        row = Row(f"row {len(report.rows) + 1}", "error", {}, f"{type(err).__name__}: {err}")
    row.seconds = time.perf_counter() - start
    report.add(row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO / "outputs" / "gpu_check" / time.strftime("%Y-%m-%d_%H-%M-%S")
    )
    parser.add_argument("--dry-run", action="store_true", help="the same sequence on CPU with the tiny model")
    parser.add_argument(
        "--jobs", type=int, default=None, help="jobs at once (default: 1 on the GPU, 2 in a dry run)"
    )
    args = parser.parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device visible; --dry-run runs the sequence on CPU", file=sys.stderr)
            return 2
    report = Report(args.out, args.dry_run)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        setup = Setup(args.dry_run, Path(work))
        jobs = Jobs(setup, args.jobs or (2 if args.dry_run else 1))
        submit_all(setup, jobs)
        for make in rows(setup, jobs):
            timed(report, make)
        jobs.pool.shutdown(wait=True)
    print(f"results: {args.out / 'results.md'}", flush=True)
    return 0 if all(r.status in ("pass", "info", "skip") for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
