"""The one module of helpers the tests share (test modules import from here, never from each other):
running `python -m trainer` as a user would and reading back what it wrote, composing conf/ as the
command does, W&B's offline files read with W&B's own reader, and stand-ins for unit tests (a tiny
config and a one-rank World, fake saves, an allocator's out-of-memory message)."""

from __future__ import annotations

import contextlib
import csv
import functools
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

import trainer.faults.stop
from tests.job_zygote import JobZygote
from trainer.config import ModelConfig, TrainConfig, from_plain, to_plain, validate
from trainer.faults.leftovers import JOB_MARKER, describe, marked
from trainer.jsonl import read_jsonl
from trainer.model.decoder import Transformer, build_model, materialize, rope_cache
from trainer.world import World

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
WANDB = Path(sys.executable).parent / "wandb"

# Small and fast: tiny model, short sequences, every step logged.
TINY = ("model=tiny", "device=cpu", "logger=none", "seq_len=64", "micro_batch=2", "log_every=1")


# ----------------------------------------------------------------------------- running the command


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out_dir: Path
    marker: str = ""
    """The job's ZEROLAB_JOB_ID, which every process it started inherits (assert_nothing_left)."""

    @property
    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.out_dir / "metrics.jsonl")

    @property
    def losses(self) -> list[float]:
        return [r["loss/train"] for r in self.records]

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out_dir / "summary.json").read_text())


def trainer_args(*overrides: str, multirun: bool = False) -> list[str]:
    """`python -m trainer [-m] OVERRIDES` in this interpreter: the command line a user types."""
    return [sys.executable, "-m", "trainer", *(["-m"] if multirun else []), *overrides]


def run_trainer(
    out_dir: Path,
    *overrides: str,
    check: bool = True,
    timeout: float = 300,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
) -> Run:
    """`python -m trainer OVERRIDES hydra.run.dir=out_dir` in a fresh process, marked (job_env)."""
    args = trainer_args(*overrides, f"hydra.run.dir={out_dir}")
    env = job_env(env)
    proc = run_command(args, cwd=cwd, env=env, timeout=timeout)
    run = Run(proc.returncode, proc.stdout, proc.stderr, out_dir, env[JOB_MARKER])
    if check and proc.returncode != 0:
        raise AssertionError(
            f"trainer exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
    return run


def run_command(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(args, capture_output=True, text=True, ...)` for a `python -m trainer` command:
    forked from this worker's warm job server where it can be (tests/job_zygote.py says when), else
    a fresh process. Either way the job runs the same code on the same command line."""
    zygote = job_zygote()
    if zygote is None or args[:3] != trainer_args() or not zygote.takes(env):
        return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    return zygote.run(args, cwd=cwd, env=env, timeout=timeout)


@functools.cache
def job_zygote() -> JobZygote | None:
    """This worker's job server, started on first use (None where it failed to start)."""
    return JobZygote.start()


@contextlib.contextmanager
def keeping_stop_handlers() -> Iterator[None]:
    """Put this process's handlers of the stop signals back after the body. A RankStop installs its
    own for a rank's whole life; left in a test worker, they would be inherited by every process it
    later forks (a multiprocessing pool's workers then note the SIGTERM that should end them)."""
    saved = {signum: signal.getsignal(signum) for signum in trainer.faults.stop.STOPS}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        trainer.faults.stop.LAST = None  # a later test's sweep must not see this test's signal


def job_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this one) with a fresh ZEROLAB_JOB_ID: the mark of every process the job starts."""
    return {**(os.environ if env is None else env), JOB_MARKER: uuid.uuid4().hex}


@contextlib.contextmanager
def short_tmpdir() -> Iterator[Path]:
    """A job's TMPDIR directly under /tmp: multiprocessing's fork server binds an AF_UNIX socket at
    TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and such a path may hold 107 bytes. Under a pytest tmp_path
    (/tmp/pytest-of-USER/pytest-NNN/popen-gwN/<test name, 30 characters>0/tmp) it has 109 once pytest's
    session counter reaches three digits: `OSError: AF_UNIX path too long`."""
    with tempfile.TemporaryDirectory(prefix="zl-", dir="/tmp") as scratch:
        yield Path(scratch)


def left_in(tmp: Path) -> list[str]:
    """What a job left in its TMPDIR, but torch's compile cache (torchinductor_USER, kept across runs)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


def assert_nothing_left(marker: str, within_s: float = 30) -> None:
    """No process carrying the job's mark (/proc/*/environ) is alive `within_s` seconds from now
    (call it once the job process has ended)."""
    deadline = time.monotonic() + within_s
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running {within_s:g} s after the job: " + ", ".join(
        f"{describe(p)} (pid {p.pid})" for p in left
    )


def run_sweep(
    sweep_dir: Path, *overrides: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m trainer -m OVERRIDES hydra.sweep.dir=sweep_dir` in a fresh process; the caller
    asserts on its exit status (a sweep with a failed point exits 1 by design)."""
    args = trainer_args(*overrides, f"hydra.sweep.dir={sweep_dir}", multirun=True)
    return run_command(args, cwd=REPO, env=os.environ.copy() if env is None else env, timeout=timeout)


FP8_EXCLUDED = ("sweeps", "fail_fast", "logger", "logger.project", "logger.entity", "resume", "data.path")


def fp8_sweep(sweep_dir: Path, steps: int, *overrides: str) -> subprocess.CompletedProcess[str]:
    """precision=bf16,fp8 as the points of one sweep of 2-rank jobs (fp8_filter=all: tiny shapes are all below
    torchao's small-GEMM filter) over a token file, not the synthetic data, whose tables the plan counts and a
    tracked step never touches; steps 2, 4 and 6 tracked."""
    tokens = sweep_dir.parent / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    return run_sweep(
        sweep_dir,
        *TINY,
        "nproc=2",
        "save=off",
        f"steps={steps}",
        "optim.warmup_steps=2",
        "telemetry.memory_every=2",
        "data=tokens",
        f"data.path={tokens}",
        "precision=bf16,fp8",
        "precision.fp8_filter=all",
        *overrides,
        # the token file's path stays out of the points' directory names (it holds slashes)
        f"hydra.job.config.override_dirname.exclude_keys=[{','.join(FP8_EXCLUDED)}]",
    )


def sweep_runs(
    sweep_dir: Path, *overrides: str, by: tuple[str, ...], timeout: float = 900
) -> dict[tuple, Run]:
    """Several jobs as the points of one sweep, `python -m trainer -m OVERRIDES` (comma lists sweep):
    one job process and one fork server serve every point, where a job each has one of each (even
    forked from the job server, about a third of a tiny 2-rank job's CPU: benchmarks/job_server.py);
    each point still launches ranks of its own, as its job would. Each point's Run, keyed by its
    values of the keys in `by`; fails with the sweep's output unless every point ended ok."""
    # Points numbered only: conf/train.yaml names each after its overrides, which nest at a path's
    # slashes and pass a file name's 255 bytes with a model's shape among them.
    numbered = "hydra.sweep.subdir=${hydra.job.num}"
    proc = run_sweep(sweep_dir, *overrides, numbered, timeout=timeout, env=job_env())
    assert proc.returncode == 0, (
        f"sweep exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    runs = {}
    for point in point_dirs(sweep_dir):
        run = Run(proc.returncode, "", "", point)
        assert run.summary["status"] == "ok", f"{point.name}: {run.summary['status']}"
        runs[tuple(settings(point)[key] for key in by)] = run
    return runs


def point_dirs(sweep_dir: Path) -> list[Path]:
    """A sweep's point directories in point order."""
    return sorted(
        (d for d in sweep_dir.iterdir() if (d / ".hydra").is_dir()), key=lambda d: int(d.name.split("_")[0])
    )


def settings(point: Path) -> dict[str, str]:
    """A point's swept overrides, as Hydra recorded them."""
    overrides = OmegaConf.to_container(OmegaConf.load(point / ".hydra" / "overrides.yaml"))
    return dict(o.lstrip("+").split("=", 1) for o in overrides)  # type: ignore[union-attr]


PLAN_SWEEP_EXCLUDED = (
    "sweeps",
    "fail_fast",
    "logger",
    "logger.project",
    "logger.entity",
    "resume",
    "data.path",
)


def plan_sweep_point(tokens: Path) -> tuple[str, ...]:
    """The overrides every point of plan_sweep shares (its docstring says why each), on the token file `tokens`."""
    return (
        *TINY,
        "save=off",
        "steps=3",
        "telemetry.memory_every=0",
        "memory.snapshot=steps",
        "memory.snapshot_steps=[3]",
        "data=tokens",
        f"data.path={tokens}",
    )


def plan_sweep(
    sweep_dir: Path, keys: tuple[str, ...], *overrides: str, timeout: float = 1800
) -> dict[tuple[str, ...], dict[str, Any]]:
    """A plan-against-measured sweep of tiny 3-step jobs on a token file (no synthetic-data tables: the plan
    counts them, a tracked step never touches them), every step's tensors tracked: the swept values of `keys`
    (lower-cased) -> the point's plan.json and its records of steps 2 and 3 (Adam's state exists from step 2).
    Two identical steps, because at stages 2-3 gloo's worker thread now and then frees its copy of a
    reduce-scatter input late (docs/memory_plan.md; tests/integration/test_accumulation.py measures it):
    assert_plan_holds_peaks holds the lower of the two to the plan. Those two alone are tracked: step 2 as
    `telemetry.memory_every=0` chooses it, step 3 as `memory.snapshot=steps` names it (on CPU a named step
    is tracked and its figures by category written, trainer/telemetry/snapshot.py); step 1 under the
    tracker would cost a third more CPU and be read by no test."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    tokens = sweep_dir / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    proc = run_sweep(
        sweep_dir / "sweep",
        *plan_sweep_point(tokens),
        *overrides,
        # the token file's path stays out of the points' directory names (it holds slashes)
        f"hydra.job.config.override_dirname.exclude_keys=[{','.join(PLAN_SWEEP_EXCLUDED)}]",
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for point in point_dirs(sweep_dir / "sweep"):
        s = settings(point)
        out[tuple(s[key].lower() for key in keys)] = {
            "plan": json.loads((point / "plan.json").read_text()),
            "records": [r for r in read_jsonl(point / "metrics.jsonl") if r["step"] >= 2],
        }
    return out


def tracked_peaks(config: TrainConfig, world: World, steps: Sequence[int] = (2, 3)) -> list[float]:
    """This rank's peak tensor bytes in each of `steps`, trained as a job's rank trains (trainer/rank/loop.py
    `train`: seeded, the trainee, its data-parallel rank's batches, train_step): step 1 untracked, then each
    step under the MemoryProbe a job's Meter uses, which tracks that step alone."""
    from trainer.data import build_batches
    from trainer.layout import Layout
    from trainer.rank.loop import build_trainee, train_step
    from trainer.rank.nonfinite import NonFiniteGuard
    from trainer.telemetry.memory import MemoryProbe

    torch.manual_seed(config.seed)
    trainee = build_trainee(config, world)
    layout = Layout.from_config(config, world.world_size)
    batches = build_batches(config, layout.dp_index(world.rank), layout.dp, start_step=0)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, world, fp16=False)
    train_step(trainee, batches, config, world, 1, guard)
    peaks = []
    for step in steps:
        probe = MemoryProbe(world.device, memory_every=0, last_step=step)
        with probe.measure(step, trainee.model, trainee.optimizer):
            train_step(trainee, batches, config, world, step, guard)
        peaks.append(probe.read()[probe.fields.index("peak_allocated")])
    del trainee
    gc.collect()
    return peaks


def biased_trainee(config: TrainConfig, world: World, biased: tuple[int, ...]) -> tuple[Any, Any, Any]:
    """A mixture of experts' trainee, its batches and its guard after step 1, trained as `tracked_peaks` trains,
    with a bias of 1 on each of the `biased` experts of every router (softmax scores never outweigh it: every
    token takes them), so that its routing is known exactly."""
    from trainer.data import build_batches
    from trainer.layout import Layout
    from trainer.model.moe import moe_layers
    from trainer.rank.loop import build_trainee, train_step
    from trainer.rank.nonfinite import NonFiniteGuard

    torch.manual_seed(config.seed)
    trainee = build_trainee(config, world)
    for layer in moe_layers(trainee.model):
        for expert in biased:
            layer.router.expert_bias[expert] = 1.0
    layout = Layout.from_config(config, world.world_size)
    batches = build_batches(config, layout.dp_index(world.rank), layout.dp, start_step=0)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, world, fp16=config.precision.is_fp16)
    train_step(trainee, batches, config, world, 1, guard)
    return trainee, batches, guard


def layer_norms_bytes(model: ModelConfig | None = None) -> int:
    """telemetry.layer_norms' all-reduce on a log step (trainer/telemetry/layer_norms.py): 2 x layers float64
    over every rank, on the default group (a loop collective the plan leaves out, docs/communication.md)."""
    from trainer.telemetry.layer_norms import layer_names

    return 2 * 8 * len(layer_names(model or ModelConfig()))


def assert_plan_holds_peaks(point: dict[str, Any], bound: float) -> None:
    """Every rank's measured peak (MemTracker's, the lower of steps 2 and 3: plan_sweep says why) within
    `bound` of the plan's, relative. A miss of the plan is in both steps and still fails."""
    assert [r["step"] for r in point["records"]] == [2, 3]
    for rank in point["plan"]["ranks"]:
        peaks = [r[f"memory/rank{rank['rank']}/peak_allocated_gib"] for r in point["records"]]
        measured = min(peaks)
        assert abs(rank["peak_gib"] - measured) / measured < bound, (
            rank["peak_moment"],
            rank["peak_gib"],
            peaks,
        )


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def table_rows(report_md: Path) -> list[str]:
    """The point rows of a sweep report's first markdown table (the points; later tables, such as where
    the memory went, have rows per point and rank)."""
    rows: list[str] = []
    for line in report_md.read_text().splitlines():
        if line.startswith("| ") and line[2].isdigit():
            rows.append(line)
        elif rows and not line.startswith("|"):
            break
    return rows


def error_lines(stderr: str) -> list[str]:
    """Every non-blank stderr line (the profiler's kineto lines are silenced at the source, trainer/telemetry/comm.py)."""
    return [line for line in stderr.splitlines() if line.strip()]


def free_port() -> int:
    """A TCP port free on this host now: the rendezvous of a test's own process group."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def freeze_imports() -> None:
    """In a rank a test spawns itself, once its process group is up: import what a rank's training
    imports, then freeze every object so far (gc.freeze), as the trainer's fork server does before
    it forks the ranks (trainer/rank/preload.py). The test's own `gc.collect()` between cases, and
    every automatic collection, then walk only the objects made since: unfrozen, the millions of
    objects torch's import makes cost each collection about a CPU-second (measured in
    tests/integration/test_accumulation.py's ranks, one per case)."""
    import trainer.rank.preload  # noqa: F401  (it freezes what it imports; this freezes the rest too)

    gc.freeze()


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives a rank on this host, for a process a test starts itself."""
    return {
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


IN_ONE_PROCESS = """
import contextlib, io, json, runpy, sys
from hydra.core.global_hydra import GlobalHydra

cases, results_path, results = json.loads(sys.argv[1]), sys.argv[2], []
for argv in cases:
    GlobalHydra.instance().clear()
    sys.argv = ["trainer", *argv]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("trainer", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
with open(results_path, "w") as f:
    json.dump(results, f)
"""


def run_in_one_process(
    argvs: list[list[str]],
    results: Path,
    timeout: float,
    env: dict[str, str] | None = None,
    prelude: str = "",
) -> list[dict[str, Any]]:
    """`python -m trainer ARGV` for each argv, one after another in one fresh process (its imports paid
    once): each one's exit status, stdout and stderr, as a command line would give them. `prelude`: code
    the process runs first (a fake device, say)."""
    proc = subprocess.run(
        [sys.executable, "-c", prelude + IN_ONE_PROCESS, json.dumps(argvs), str(results)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(results.read_text())


# ----------------------------------------------------------------------------- W&B's offline files


def wandb_file(out_dir: Path) -> Path:
    """The one offline W&B transaction log a job wrote under its directory."""
    files = sorted(out_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one W&B run in {out_dir}, found {files}"
    return files[0]


def wandb_records(run_file: Path) -> list[dict[str, Any]]:
    """Every record of a .wandb transaction log, as W&B's own reader (`wandb leet inspect`) prints it."""
    cmd = [str(WANDB), "leet", "inspect", "--json", str(run_file)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def wandb_summary(run_file: Path) -> dict[str, Any]:
    """The run's end as W&B's reader sums it up: state, exit code and the summary."""
    cmd = [str(WANDB), "leet", "inspect", "--summary", "--json", str(run_file)]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout)


def wandb_run(run_file: Path) -> dict[str, Any]:
    """The run record: its id, group, tags and config."""
    return next(r["run"] for r in wandb_records(run_file) if r["type"] == "run")


# ----------------------------------------------------------------------------- configs


def compose(*overrides: str, hydra: bool = False) -> DictConfig:
    """conf/train.yaml with OVERRIDES, composed in this process as `python -m trainer` composes it
    (with the `hydra` node, the launcher's and the sweeper's settings, when asked)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from trainer.cli import register_configs
    from trainer.cluster import register_resolvers

    GlobalHydra.instance().clear()
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("train", overrides=list(overrides), return_hydra_config=hydra)


def compose_config(*overrides: str) -> TrainConfig:
    """The checked TrainConfig `python -m trainer OVERRIDES` would run."""
    return validate(compose(*overrides))


def load_preset(name: str) -> ModelConfig:
    """conf/model/<name>.yaml merged into the schema and checked, as Hydra would."""
    merged = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / f"{name}.yaml")
    )
    config = OmegaConf.to_object(merged)
    assert isinstance(config, ModelConfig)
    return config


# ----------------------------------------------------------------------------- stand-ins for unit tests

# What torch's CPU allocator says when an allocation fails (trainer/faults/failures.py OOM_MARKERS).
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 8388608 bytes. Error code 12 (Cannot allocate memory)"
)

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def tiny_config(**overrides: object) -> TrainConfig:
    plain = to_plain(TrainConfig())
    plain.update(seq_len=32, micro_batch=2, steps=6, nproc="1", device="cpu", log_every=1)
    plain["model"].update(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=64, max_seq_len=64
    )
    plain["optim"].update(warmup_steps=2)
    plain["logger"]["backend"] = "none"
    for dotted, value in overrides.items():
        *path, key = dotted.split("__")
        node = plain
        for part in path:
            node = node[part]
        node[key] = value
    return from_plain(plain)


def fake_save(run_dir: Path, step: int, complete: bool = True, tmp: bool = False) -> Path:
    name = f"{'.tmp_' if tmp else ''}step_{step:08d}"
    path = run_dir / "checkpoints" / name
    path.mkdir(parents=True)
    if complete:  # a real, whole DCP save: resume checks a save's files against its metadata
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # no process group: intended
            dcp.save({"x": torch.zeros(1)}, checkpoint_id=path, no_dist=True)
    return path


def materialized(config: ModelConfig, seed: int = 0) -> Transformer:
    """The model built on meta and initialised on CPU, as a rank does."""
    model = build_model(config)
    materialize(model, torch.device("cpu"), seed=seed)
    return model


def saved_storage_bytes(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, regime: str
) -> int:
    """What autograd saves in one forward + loss of `model` on `inputs`'s device, in the plan's
    precision `regime`, parameters and rotary tables excluded (unit/plan on CPU, tests/gpu on CUDA)."""
    if regime == "fsdp_mp":
        model.to(torch.bfloat16)  # what FSDP2's MixedPrecisionPolicy(param_dtype=bf16) computes with
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    autocast = torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=regime == "autocast")
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    # The rotary tables, cached on the model per device (counted under `other`).
    excluded |= {t.untyped_storage().data_ptr() for t in rope_cache(model)}
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in excluded)


def run_steps(trainee: Any, config: Any, first: int, last: int) -> list[float]:
    """Train steps `first`..`last` in this process (a one-rank group), their losses: a unit test's
    training, and benchmarks/save_time.py's."""
    from trainer.data import build_batches
    from trainer.rank.loop import train_step
    from trainer.rank.nonfinite import NonFiniteGuard

    batches = build_batches(config, 0, 1, start_step=first - 1)
    guard = NonFiniteGuard(config.nonfinite, config.max_nonfinite_skips, WORLD, fp16=config.precision.is_fp16)
    return [
        train_step(trainee, batches, config, WORLD, step, guard).loss.item()
        for step in range(first, last + 1)
    ]


# ----------------------------------------------------------------------------- Hugging Face checkpoints

HF_FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "MistralForCausalLM": {"sliding_window": 64},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {"head_dim": 32, "tie_word_embeddings": True},
}
"""Tiny random checkpoints of each family model=hf reads: what sets each apart beside the shapes below."""
HF_SHAPES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=128,
    max_position_embeddings=64,
)
HF_SEQUENCES = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
"""The 4 fixed sequences zerolab's logits are compared on."""


def hf_checkpoint(directory: Path, architecture: str, seed: int = 0, **shapes: int) -> Path:
    """A tiny random `architecture` (HF_SHAPES, or `shapes` over them) saved by transformers'
    save_pretrained in `directory`. Every parameter drawn at random (norm weights about 1, biases
    non-zero) so that none of them, q/k norms and biases included, could be loaded wrongly and go unseen."""
    import transformers

    config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(
        **(HF_SHAPES | shapes), **HF_FAMILIES[architecture]
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2 if param.ndim == 1 else 0.1)
    model.save_pretrained(directory)
    return directory


def hf_logits(directory: Path, tokens: torch.Tensor = HF_SEQUENCES) -> torch.Tensor:
    """transformers' own fp32 logits of the checkpoint in `directory` (AutoModelForCausalLM.from_pretrained)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def zero_over_world(model: torch.nn.Module, zero: Any, world: World, weights: str | None) -> torch.nn.Module:
    """`zero` applied to a meta model over every rank of `world`, as a plain data-parallel job's
    parallelize applies it (its layout, its mesh's data-parallel dims), materialised or loaded."""
    from trainer.config import OffloadConfig, PrecisionConfig
    from trainer.layout import Layout, data_parallel_degrees
    from trainer.rank.mesh import build_mesh, data_parallel_mesh
    from trainer.rank.sharding import apply_zero

    replicate, shard, hpz = data_parallel_degrees(zero, world.world_size)
    layout = Layout(dp_replicate=replicate, dp_shard=shard, hpz=hpz)
    dp_mesh = data_parallel_mesh(build_mesh(layout, world.device.type, zero), layout, zero)
    return apply_zero(
        model, zero, PrecisionConfig(), OffloadConfig(), world, 0, weights, dp_mesh=dp_mesh, replicas=True
    )


def rank_logits(
    rank: int, port: int, configs: dict[str, ModelConfig], stages: tuple[str, ...], out: Path
) -> None:
    """One of two ranks (torch.multiprocessing's entry: importable, and without transformers): each
    checkpoint of `configs` loaded at each stage, rank 0 saves the logits of HF_SEQUENCES to `out`."""
    from trainer.config import Stage, ZeroConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    world = World(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    logits = {}
    for family, config in configs.items():
        for stage in stages:
            model = zero_over_world(
                build_model(config), ZeroConfig(stage=Stage(stage)), world, config.weights
            )
            with torch.no_grad():
                logits[family, stage] = model(HF_SEQUENCES)
    if rank == 0:
        torch.save(logits, out)
    dist.barrier()
    dist.destroy_process_group()


def rank_load_memory(rank: int, port: int, config: ModelConfig, stage: str, out: Path) -> None:
    """One of two ranks (torch.multiprocessing's entry): `config`'s weights loaded at `stage` as a job's
    rank loads them (apply_zero, measured there: trainer/telemetry/memory.py measure_load); rank 0
    writes every rank's figures (LOADED, bytes) to `out` as JSON."""
    from trainer.config import Stage, ZeroConfig
    from trainer.telemetry.memory import LOADED

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    world = World(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    zero_over_world(build_model(config), ZeroConfig(stage=Stage(stage)), world, config.weights)
    figures: list[dict[str, float] | None] = [None, None]
    dist.all_gather_object(figures, dict(LOADED))
    if rank == 0:
        out.write_text(json.dumps(figures))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- text corpora (data=text)
WORDS = ("the", "a", "cat", "dog", "runs", "sleeps", "over", "under", "red", "blue", "and", "quickly")


def write_documents(path: Path, count: int, seed: int = 0) -> list[str]:
    """`count` documents of 5-60 random words written as jsonl ({"text": ...} per line); returns them."""
    g = torch.Generator().manual_seed(seed)
    documents = []
    for _ in range(count):
        length = int(torch.randint(5, 61, (), generator=g))
        documents.append(" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (length,), generator=g)))
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    return documents


def train_tokenizer(
    directory: Path, texts: list[str], vocab_size: int = 64, word_level: bool = False
) -> Path:
    """A tokenizer trained here by tokenizers' own trainer (BPE, or WordLevel: one id per distinct
    word), saved as `directory`/tokenizer.json beside a tokenizer_config.json naming <s> and </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    if word_level:
        tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
        trainer: Any = trainers.WordLevelTrainer(
            vocab_size=vocab_size, special_tokens=specials, show_progress=False
        )
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}  # both forms tokenizer_config.json uses
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
