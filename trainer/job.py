"""One job, in the Hydra job process: check, plan, launch the ranks, record how it ended."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.api import SignalException

from trainer.advise import check_advice_inputs, run_advice
from trainer.checkpoint import check_global_batch, count_restarts, read_progress, resolve_resume, rewind_metrics
from trainer.attention import run_choice
from trainer.cluster import job_failure, place_node
from trainer.config import ConfigError, Mode, OffloadTarget, TrainConfig, to_plain, validate
from trainer.cuda import check_local_ranks
from trainer.data import check_data
from trainer.host import cores_warning, host_budget, host_refusal
from trainer.launch import RankFailure, launch_local, rank_main
from trainer.loggers import open_logger, run_group, run_name
from trainer.nonfinite import summarize as nonfinite_summary
from trainer.oom import failure_path
from trainer.plan import build_plan, planned_device_kind, planned_world_size, write_plan
from trainer.plan import refusal as plan_refusal
from trainer.plan import summary_fields as plan_summary_fields
from trainer.plan_table import format_plan
from trainer.sharding import check_device_support
from trainer.stop import STOP_STATUSES, JobStop, exit_code_for, handling_stops, stopped, stopped_at_once
from trainer.summary import build_summary, provenance, read_metrics, summary_table, write_summary
from trainer.sweep import finished_ok
from trainer.world import init_world, is_under_torchrun, resolve_device_kind, resolve_nproc


def run_job(cfg: DictConfig) -> None:
    """The Hydra task: everything a job does, and the exit status it ends with."""
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    if finished_ok(out_dir):  # a sweep re-run into the same directory: this point is done
        print(f"skipped: {out_dir} already finished with status ok", flush=True)
        return
    try:
        config = validate(cfg)
        if config.mode in (Mode.plan, Mode.advise):  # any device and world size: nothing checked against this host
            device_kind = planned_device_kind(config)
            nproc = planned_world_size(config, device_kind)
        else:
            device_kind = resolve_device_kind(config.device)
            nproc = resolve_nproc(config.nproc, device_kind)
            check_device_support(config, device_kind)
            check_data(config)  # a bad token file is a config error, found before any rank starts
            config = place_node(config)  # node_rank and rdzv_endpoint, from the allocation under SLURM
        world_size = config.nodes * nproc
        if config.mode == Mode.advise:
            check_advice_inputs(config, world_size)
        if config.mode == Mode.train and not is_under_torchrun():
            config, out_dir = prepare_resume(config, out_dir, world_size)
        run_choice(config, device_kind)  # an attention kernel this device cannot run: one line, exit 2
        if config.mode == Mode.train and is_under_torchrun() and device_kind == "cuda":
            check_local_ranks(int(os.environ["LOCAL_WORLD_SIZE"]))  # one line, not CUDA's invalid device ordinal
    except ConfigError as err:
        fail(f"error: {err}", code=2)
        return
    if config.mode == Mode.advise:  # trainer/advise.py: rank configurations, run none unless advise.verify
        run_advice(config, out_dir, device_kind, world_size, list(HydraConfig.get().overrides.task))
        return
    if is_under_torchrun():
        run_under_torchrun(config, device_kind)
        return
    # Plan before launching (trainer/plan.py): the table and plan.json for every job, and a
    # refusal of what cannot fit, recorded as status `refused` without starting a rank.
    refusal, meta = plan_job(config, out_dir, device_kind, world_size)
    if config.mode == Mode.plan:
        return
    if refusal is not None:  # every node plans and refuses alike: none waits at the rendezvous for another
        if config.node_rank == 0:
            write_summary(out_dir, build_summary("refused", [], config.steps, reason=refusal, **meta))
        fail(f"error: {refusal}", code=2)
        return
    if config.node_rank != 0:  # another node of a multi-node job: its ranks; node 0 records the job
        with handling_stops(out_dir, owner=False) as job_stop:
            status, extra = train_ranks(config, out_dir, device_kind, nproc, job_stop)
        if status != "ok":
            fail(f"{status}: {extra['error']}" if status in STOP_STATUSES else f"error: {extra['error']}", code=exit_code_for(status))
        return
    # The job process owns the W&B run: it streams metrics.jsonl while the ranks train and ends
    # with the job's status, also when a rank died. From here a signal stops the job at a step
    # boundary (trainer/stop.py).
    with handling_stops(out_dir) as job_stop, open_logger(config, out_dir, meta, name=run_name(), group=run_group()) as logger:
        with logger.follow(out_dir / "metrics.jsonl"):
            status, extra = train_ranks(config, out_dir, device_kind, nproc, job_stop)
        records = read_metrics(out_dir)
        summary = build_summary(
            status, records, config.steps, warmup_steps=config.telemetry.warmup_steps, **extra, **nonfinite_summary(records), **meta
        )
        write_summary(out_dir, summary)
        logger.finish(summary)
    report_end(summary, out_dir)
    if status != "ok":
        fail(f"{status}: {extra['error']}" if status in STOP_STATUSES else f"error: {extra['error']}", code=exit_code_for(status))


def train_ranks(config: TrainConfig, out_dir: Path, device_kind: str, nproc: int, job_stop: JobStop) -> tuple[str, dict[str, Any]]:
    """Run this node's ranks; a rank's death or a stop is a status to record, not an exception to propagate."""
    restarts_before = count_restarts(out_dir)
    if job_stop.stop is not None:  # a signal came before the ranks started: start none
        return job_stop.stop.status, {"error": f"{job_stop.signal_name} before any rank started", "stop_signal": job_stop.signal_name}
    try:
        with job_stop.ranks_running():
            result = launch_local(to_plain(config), out_dir, device_kind, nproc, config.max_restarts)
    except RankFailure as own:
        failure = job_failure(out_dir, own, config.nodes)  # in a multi-node job: the node where it began
        where = {"failed_rank": failure.rank, "failed_step": failure.step, "failed_phase": failure.phase}
        where.update({"failed_node": failure.node} if failure.node is not None else {})
        details = failure_path(out_dir, failure.rank)
        error = f"{failure} (traceback: {details})" if details.exists() else str(failure)
        return "oom" if failure.oom else "crashed", {"error": error, **where}
    except SignalException:  # a second signal: the agent killed the ranks (trainer/stop.py)
        return stopped_at_once(job_stop)
    status, extra = ranks_ending(result, config)
    return status, {**extra, "restarts": count_restarts(out_dir) - restarts_before}


def ranks_ending(result: dict[str, Any] | None, config: TrainConfig) -> tuple[str, dict[str, Any]]:
    """The status the ranks ended with, from rank 0's result: ok, or they stopped together on purpose."""
    if result is not None and result.get("status") == "diverged":  # the non-finite policy stopped it
        return "diverged", {"error": result["error"]}
    if result is not None and result.get("status") in STOP_STATUSES:  # a signal: every rank stopped after one step
        return result["status"], stopped(result, saving=config.save.every > 0)
    return "ok", {}


def prepare_resume(config: TrainConfig, out_dir: Path, world_size: int) -> tuple[TrainConfig, Path]:
    """Resolve `resume` to a save and the directory to write to (checkpoint.resolve_resume); refuse,
    before any rank starts, a save whose global batch differs from this run's."""
    resume, run_dir = resolve_resume(config, out_dir)
    if resume != "false":
        saved = read_progress(Path(resume))
        check_global_batch(saved["global_batch"], config, world_size, Path(resume))
        rewind_metrics(run_dir, saved["step"])  # before the W&B feeder starts reading it
        where = f"; continuing in {run_dir}" if run_dir != out_dir else ""
        print(f"resume: from step {saved['step']} of {resume}{where}", flush=True)
    return dataclasses.replace(config, resume=resume), run_dir


def run_under_torchrun(config: TrainConfig, device_kind: str) -> None:
    """torchrun started every rank and each ran Hydra: take rank 0's config and output directory.

    `${now:}` and sweep order can differ between ranks, so rank 0's choices are broadcast:
    the config, the directory, and the plan's verdict (free host memory differs between hosts,
    so only rank 0 plans and every rank follows it).
    """
    import torch.distributed as dist

    from trainer.comm import enable_recording

    enable_recording(config, int(os.environ["WORLD_SIZE"]), device_kind)  # before the process group exists
    world = init_world(device_kind, offload_to_cpu=config.offload.target == OffloadTarget.cpu)
    resume, run_dir = resolve_resume(config, Path(HydraConfig.get().runtime.output_dir))
    shared = [to_plain(dataclasses.replace(config, resume=resume)), str(run_dir), None, {}]
    if world.is_main:
        shared[2:] = plan_job(config, Path(run_dir), device_kind, world.world_size)
    dist.broadcast_object_list(shared, src=0)
    plain, out_dir, refusal, meta = shared
    Path(out_dir).mkdir(parents=True, exist_ok=True)  # other hosts may not share rank 0's file system
    if refusal is not None:
        if world.is_main:
            write_summary(Path(out_dir), build_summary("refused", [], config.steps, reason=refusal, **meta))
        fail(f"error: {refusal}" if world.is_main else "", code=2)
        return
    if not world.is_main:  # only global rank 0's process owns the W&B run: the other ranks never import wandb
        rank_main(plain, out_dir, device_kind)
        return
    # Rank 0's process plays the job process's part: it feeds the W&B run from metrics.jsonl (a
    # thread beside its training) and ends it with the job's status.
    with open_logger(config, Path(out_dir), meta, name=run_name(), group=run_group()) as logger:
        with logger.follow(Path(out_dir) / "metrics.jsonl"):
            result = rank_main(plain, out_dir, device_kind)
        status, extra = ranks_ending(result, config)
        records = read_metrics(Path(out_dir))
        summary = build_summary(
            status, records, config.steps, warmup_steps=config.telemetry.warmup_steps, **extra, **nonfinite_summary(records), **meta
        )
        write_summary(Path(out_dir), summary)
        logger.finish(summary)
    report_end(summary, Path(out_dir))
    if status in STOP_STATUSES:  # torchrun itself was signalled and ends the job
        print(f"{status}: {extra['error']}", file=sys.stderr, flush=True)


def plan_job(config: TrainConfig, out_dir: Path, device_kind: str, world_size: int) -> tuple[str | None, dict[str, Any]]:
    """Write plan.json and print the plan; return the refusal to enforce (None: go) and the
    provenance and plan figures for summary.json."""
    plan = build_plan(config, device_kind, world_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.node_rank == 0:  # every node plans (and refuses alike); node 0 writes it down
        write_plan(out_dir, plan)
    print(format_plan(plan, way_out=config.mode == Mode.plan), flush=True)
    # CPU ranks are processes sharing this host: their runtime and the cores (trainer/host.py).
    budget = host_budget(config, device_kind, world_size, plan.peak_bytes) if device_kind == "cpu" else None
    for line in (budget and budget.describe(), cores_warning(budget)):
        if line:
            print(line, flush=True)
    if config.mode == Mode.plan:  # planned for a device this host may not have: no provenance
        return None, {}
    meta = provenance(to_plain(config), list(HydraConfig.get().overrides.task), world_size, device_kind)
    meta.update(plan_summary_fields(plan))
    refusal = plan_refusal(plan) or host_refusal(budget)
    if refusal is not None and not config.plan.enforce:
        print("warning: plan.enforce=false, trying anyway", flush=True)
        return None, meta
    return refusal, meta


def report_end(summary: dict[str, Any], out_dir: Path) -> None:
    """A short end-of-run account on the console."""
    print(f"{summary_table(summary)}\n  outputs: {out_dir}", flush=True)


def fail(message: str, code: int) -> None:
    """One line on stderr (none when empty); a single job exits with `code`, a sweep goes on to its next point."""
    if message:
        print(message, file=sys.stderr, flush=True)
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        raise SystemExit(code)
