"""One job, in the Hydra job process: check, plan, launch the ranks, record how it ended."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from trainer.config import (
    AUTO,
    ConfigError,
    HfExport,
    Mode,
    TrainConfig,
    to_plain,
    validate,
)
from trainer.console import BAD_INPUT, error_line, one_line, say, warn
from trainer.cuda import check_capability, check_local_ranks
from trainer.data import check_data, corpus_line
from trainer.faults.stop import (
    STOP_STATUSES,
    JobStop,
    exit_code_for,
    handling_stops,
    stopped,
    stopped_at_once,
)
from trainer.files import set_aside_metrics
from trainer.layout import Layout, check_world
from trainer.model.attention import check_document_mask, config_choice, takes_mask
from trainer.model.hf_weights import fingerprint
from trainer.plan import (
    RANK_FIGURES,
    Plan,
    build_plan,
    check_offload_path,
    cores_warning,
    format_plan,
    host_refusal,
    planned_device_kind,
    planned_world_size,
    write_plan,
)
from trainer.plan import refusal as plan_refusal
from trainer.plan import summary_fields as plan_summary_fields
from trainer.rank.nonfinite import summarize as nonfinite_summary
from trainer.sweep import finished_ok
from trainer.telemetry import keys
from trainer.telemetry.creep import creep_line, find_creep
from trainer.telemetry.keys import MEMORY_CREEP, MICRO_BATCH_AUTO, PREDICTED_PEAK, WARMUP_STEPS, Status
from trainer.telemetry.summary import (
    build_summary,
    provenance,
    read_metrics,
    save_means,
    summary_table,
    write_summary,
)
from trainer.telemetry.wandb_logger import open_logger, run_group, run_name
from trainer.units import GIB
from trainer.world import init_world, is_under_torchrun, resolve_device_kind, resolve_nproc

# A job that trains imports more: the elastic launcher (trainer/launch.py), and the save format
# (trainer/saves/resume.py, torch.distributed.checkpoint) only when it resumes. They are imported
# where a job starts training, so that mode=plan, which plans for any cluster and starts no rank,
# does not pay for them. What only the ranks use (FSDP2, DTensor, DCP, the compiler) this process
# never imports for a job that does not resume: the ranks' refusals it checks are in
# trainer/rank/refusals.py, apart from the sharding they guard (tests/unit/test_imports.py checks both).


@dataclass(frozen=True)
class Job:
    """A checked job: its config and where it runs (or, for mode=plan and advise, is planned for)."""

    config: TrainConfig
    out_dir: Path
    device_kind: str
    nproc: int
    """Ranks per node."""
    world_size: int
    auto: dict[str, Any] | None = None
    """micro_batch=auto: how the micro-batch was chosen (trainer/autobatch.py)."""


class EndRole(Enum):
    """What this process does when the job ends, besides exiting with the job's status."""

    recorder = "recorder"
    """summary.json, the end-of-run account and the error line: a one-node job, node 0, torchrun's rank 0."""
    node = "node"
    """The error line only: another node of a multi-node job (node 0 records the job)."""
    silent = "silent"
    """Nothing: a torchrun rank but 0 (its ranks share rank 0's console)."""


def run_job(cfg: DictConfig) -> None:
    """The Hydra task: check the job, plan it, do what its mode says; exit with its status."""
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    if finished_ok(out_dir):  # a sweep re-run into the same directory: this point is done
        print(f"skipped: {out_dir} already finished with status ok", flush=True)
        return
    job = check_job(cfg, out_dir)
    if job is not None and job.config.micro_batch == AUTO:
        job = with_chosen_micro_batch(job)
    if job is None:  # bad input, reported in one line
        return
    if job.config.mode == Mode.advise:  # plans every candidate itself (trainer/advise/advisor.py)
        advise_job(job)
    elif is_under_torchrun():  # rank 0 plans once the ranks have joined
        run_under_torchrun(job.config, job.device_kind)
    else:
        # Plan before launching (trainer/plan): the table and plan.json for every job, and a
        # refusal of what cannot fit, recorded as status `refused` without starting a rank.
        refusal, meta = plan_job(job.config, job.out_dir, job.device_kind, job.world_size)
        if job.auto is not None and meta:
            meta[MICRO_BATCH_AUTO] = job.auto
        if job.config.mode == Mode.train:
            train_job(job, refusal, meta)


def check_job(cfg: DictConfig, out_dir: Path) -> Job | None:
    """The typed config checked against what it runs on: any device and world size for mode=plan
    and advise, this host (and node) for a job that trains. None after one `error:` line."""
    from trainer.rank.refusals import check_pipeline_fault

    try:
        config = validate(cfg)
        if config.mode in (Mode.plan, Mode.advise):  # nothing checked against this host
            device_kind = planned_device_kind(config.plan, config.device)
            nproc = planned_world_size(config.nproc, device_kind)
        else:
            config, device_kind, nproc = check_this_host(config)
        weights = check_model_weights(config)  # model.weights: the files' headers against the model
        world_size = config.nodes * nproc
        check_world(config, nproc, config.nodes)  # a tensor-parallel group inside one node
        config.telemetry.check_traces(config.steps, world_size)  # traced steps and ranks that exist
        layout = Layout.from_config(
            config, world_size
        )  # zero.shard_ranks / zero.hpz_ranks against the dp ranks
        check_pipeline_fault(
            config, layout
        )  # a fault in the loss: on a rank that takes one (trainer/rank/refusals.py)
        check_offload_path(config, world_size)  # offload=nvme training here: offload.path and its free space
        if config.mode == Mode.advise:
            from trainer.advise.accelerators import check_accelerators
            from trainer.advise.advisor import check_advice_inputs

            check_advice_inputs(config, world_size)
            if config.advise.accelerators:
                check_accelerators(config)
        if config.mode == Mode.train and not is_under_torchrun() and config.resume != "false":
            from trainer.saves.resume import prepare_resume  # DCP: only for a job that resumes

            config, out_dir = prepare_resume(config, out_dir, world_size)
        if config.mode == Mode.train and not is_under_torchrun() and config.resume == "false":
            if (kept := set_aside_metrics(out_dir)) is not None:
                print(f"{out_dir} holds an earlier run's metrics.jsonl: kept as {kept.name}", flush=True)
        if config.mode == Mode.train and weights:
            # After resume=true matched this run to its earlier one: Hydra's stored config has no fingerprint.
            config.model.weights_sha256 = fingerprint(weights)
        choice = config_choice(
            config, device_kind
        )  # an attention kernel this device cannot run: one line, exit 2
        if takes_mask(config):
            masked_by = (
                "data.packing=document" if config.data.masks_documents else "parallel.cp_impl=allgather"
            )
            check_document_mask(choice, device_kind, masked_by)
        if config.mode == Mode.train and device_kind == "cuda":
            check_capability(config.precision)  # fp8 or bf16 the GPU lacks: one line, not a rank's crash
        if config.mode == Mode.train and is_under_torchrun() and device_kind == "cuda":
            check_local_ranks(
                int(os.environ["LOCAL_WORLD_SIZE"])
            )  # one line, not CUDA's invalid device ordinal
    except ConfigError as err:
        error_line(str(err))
        exit_unless_sweep(BAD_INPUT)
        return None
    return Job(config, out_dir, device_kind, nproc, world_size)


def with_chosen_micro_batch(job: Job) -> Job | None:
    """micro_batch=auto replaced by the micro-batch the plan proposes and probe runs confirm
    (trainer/autobatch.py); None after one `error:` line."""
    from trainer.autobatch import choose_micro_batch

    try:
        if is_under_torchrun():
            raise ConfigError("micro_batch=auto launches probe runs itself: under torchrun set micro_batch=N")
        config, record = choose_micro_batch(
            job.config, job.out_dir, job.device_kind, job.nproc, job.world_size
        )
    except ConfigError as err:
        error_line(str(err))
        exit_unless_sweep(BAD_INPUT)
        return None
    return dataclasses.replace(job, config=config, auto=record)


def check_this_host(config: TrainConfig) -> tuple[TrainConfig, str, int]:
    """A job that trains here: its device and ranks as this host has them, the stage on that
    device, the data, and this node's place in a multi-node job."""
    from trainer.cluster import place_node
    from trainer.rank.refusals import check_device_support, check_fp8_support

    device_kind = resolve_device_kind(config.device)
    nproc = resolve_nproc(config.nproc, device_kind)
    check_device_support(config.zero, device_kind)
    check_fp8_support(config.precision, config.zero, device_kind)  # torchao, fp8 all-gather's backend
    check_data(
        config.data, config.model.vocab_size, config.seq_len, config.seed
    )  # a bad token file: before any rank starts
    if (line := corpus_line(config, nproc * config.nodes)) is not None:
        print(line, flush=True)
    config = place_node(config)  # node_rank and rdzv_endpoint, from the allocation under SLURM
    return config, device_kind, nproc


def check_model_weights(config: TrainConfig) -> list[Path]:
    """model.weights before any rank starts: one line for what does not fit the model
    (trainer/model/hf_weights.py); the checkpoint's files (none without model.weights)."""
    if config.model.weights is None:
        return []
    from trainer.model.hf_weights import check_weights

    return check_weights(config.model)


def advise_job(job: Job) -> None:
    """mode=advise (trainer/advise/advisor.py): rank configurations, run none unless advise.verify;
    advise.accelerators: the best of each accelerator, across them (trainer/advise/accelerators.py)."""
    from trainer.advise.accelerators import run_across_accelerators
    from trainer.advise.advisor import run_advice

    overrides = list(HydraConfig.get().overrides.task)
    if job.config.advise.accelerators:
        run_across_accelerators(job.config, job.out_dir, job.world_size, overrides)
        return
    run_advice(job.config, job.out_dir, job.device_kind, job.world_size, overrides)


def train_job(job: Job, refusal: str | None, meta: dict[str, Any]) -> None:
    """Launch this node's ranks, unless the plan refused the job, and end it."""
    config, out_dir = job.config, job.out_dir
    predicted = rank_predictions(meta)
    if refusal is not None:  # every node plans and refuses alike: none waits at the rendezvous for another
        role = EndRole.recorder if config.node_rank == 0 else EndRole.node
        end_job(config, out_dir, Status.refused, {"reason": refusal}, meta, role=role)
        return
    if config.node_rank != 0:  # another node of a multi-node job: its ranks; node 0 records the job
        with handling_stops(out_dir, owner=False) as job_stop:
            status, extra = train_ranks(config, out_dir, job.device_kind, job.nproc, predicted, job_stop)
        end_job(config, out_dir, status, extra, meta, role=EndRole.node)
        return
    # From here a signal stops the job at a step boundary (trainer/faults/stop.py).
    with handling_stops(out_dir) as job_stop:
        status, extra, summary = owning_the_wandb_run(
            config,
            out_dir,
            meta,
            lambda: export_if_asked(
                config, out_dir, train_ranks(config, out_dir, job.device_kind, job.nproc, predicted, job_stop)
            ),
        )
    end_job(config, out_dir, status, extra, meta, summary)


def owning_the_wandb_run(
    config: TrainConfig,
    out_dir: Path,
    meta: dict[str, Any],
    train: Callable[[], tuple[Status, dict[str, Any]]],
) -> tuple[Status, dict[str, Any], dict[str, Any]]:
    """`train()` while this process owns the job's W&B run: it streams metrics.jsonl as the ranks
    write it and ends the run with the job's status and summary.json, also when a rank died."""
    with open_logger(
        config.logger, out_dir, meta, run_name(), run_group(), config.zero.stage.value, config.resume
    ) as logger:
        with logger.follow(out_dir / "metrics.jsonl"):
            status, extra = train()
        summary = end_summary(config, out_dir, status, extra, meta)
        logger.finish(summary, exit_code_for(summary["status"]))
    return status, extra, summary


def train_ranks(
    config: TrainConfig,
    out_dir: Path,
    device_kind: str,
    nproc: int,
    predicted: dict[str, float],
    job_stop: JobStop,
) -> tuple[Status, dict[str, Any]]:
    """Run this node's ranks; a rank's death or a stop is a status to record, not an exception to propagate."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from trainer.cluster import job_failure
    from trainer.faults.failures import failure_path
    from trainer.launch import RankFailure, launch_local
    from trainer.saves.restarts import count_restarts

    restarts_before = count_restarts(out_dir)
    if job_stop.stop is not None:  # a signal came before the ranks started: start none
        return job_stop.stop.status, {
            "error": f"{job_stop.signal_name} before any rank started",
            "stop_signal": job_stop.signal_name,
        }
    try:
        with job_stop.ranks_running():
            result = launch_local(
                to_plain(config), out_dir, device_kind, nproc, config.max_restarts, predicted
            )
    except RankFailure as own:
        failure = job_failure(out_dir, own, config.nodes)  # in a multi-node job: the node where it began
        where = {"failed_rank": failure.rank, "failed_step": failure.step, "failed_phase": failure.phase}
        where.update({"failed_node": failure.node} if failure.node is not None else {})
        if failure.who is not None:  # not a rank: the ranks' fork server (trainer/launch.py)
            del where["failed_rank"]
            where["failed_process"] = failure.who
        details = failure_path(out_dir, failure.rank)
        error = f"{failure} (traceback: {details})" if details.exists() else str(failure)
        if failure.oom and details.exists():
            try:
                where["oom"] = explain_out_of_memory(config, device_kind, config.nodes * nproc, details)
            except Exception as err:  # the job still ends `oom`: its explanation is an addition
                warn(f"the out-of-memory failure could not be explained: {one_line(err)}")
        return Status.oom if failure.oom else Status.crashed, {"error": error, **where}
    except SignalException:  # a second signal: the agent killed the ranks (trainer/faults/stop.py)
        return stopped_at_once(job_stop)
    status, extra = ranks_outcome(result, config.save.every > 0)
    return status, {**extra, "restarts": count_restarts(out_dir) - restarts_before}


def export_if_asked(
    config: TrainConfig, out_dir: Path, outcome: tuple[Status, dict[str, Any]]
) -> tuple[Status, dict[str, Any]]:
    """save.hf=last: a run that ended ok has its last save exported to <run>/hf (trainer/saves/hf_export.py)."""
    status, extra = outcome
    if status != Status.ok or config.save.hf != HfExport.last:
        return outcome
    from trainer.saves.hf_export import export_save, find_save

    exported = export_save(find_save(out_dir), out_dir / "hf", config.model)
    print(f"exported the last save as a Hugging Face checkpoint: {exported}", flush=True)
    return status, {**extra, "hf_export": str(exported)}


def explain_out_of_memory(
    config: TrainConfig, device_kind: str, world_size: int, record_path: Path
) -> dict[str, Any]:
    """The rank's moment, plan beside measured by category (trainer/faults/oom.py) and the remedies that
    fit (trainer/advise/fit.py): printed, added to the rank's failure record, returned for summary.json."""
    from trainer.advise.fit import remedies
    from trainer.faults.oom import explain_oom, explanation_lines

    record = json.loads(record_path.read_text())
    plan = build_plan(config, device_kind, world_size)
    explained = explain_oom(plan, record)
    overrides = list(HydraConfig.get().overrides.task)
    found = remedies(config, device_kind, world_size, overrides, ran_out_bytes=plan.peak_bytes)
    explained["remedies"] = [dataclasses.asdict(r) for r in found]
    lines = explanation_lines(explained)
    lines.append(
        "fits, as the plan says (nearest first; run as printed):" if found else "nothing nearby fits the plan"
    )
    lines += [f"  {r.command}    # {r.changes}: peak {r.peak_gib:.4f} GiB" for r in found]
    print("\n".join(lines), flush=True)
    record_path.write_text(json.dumps({**record, "explained": explained}) + "\n")
    return explained


def rank_predictions(meta: dict[str, Any]) -> dict[str, float]:
    """The plan's figures the ranks write beside their measurements (plan.RANK_FIGURES), and the routing a
    mixture of experts' plan runs out of memory at: handed to them, so that no rank plans again."""
    figures = (*RANK_FIGURES, keys.MOE_OOM_IMBALANCE, keys.MOE_OOM_LIMIT_GIB)
    return {key: meta[key] for key in figures if key in meta}


def routing_limit(config: TrainConfig, plan: Plan, device_kind: str, world_size: int) -> dict[str, float]:
    """A mixture of experts whose plan fits at moe.imbalance r0 but not when one expert takes every token
    (r = n_experts / top_k, the most one can take): the imbalance where the worst rank's planned peak reaches
    its memory, between the two plans (the peak grows with the busiest expert's rows, linearly in the plan's
    walk: trainer/plan/moe.py). Nothing where no routing can run a rank out of memory, or none fits anyway."""
    m, limit = config.model, plan.memory.per_rank_bytes
    # Under parallel.ep the plan's imbalance is a rank's experts' rows over the mean rank's, which the layers'
    # counts (their own tokens' choices) do not give before the dispatch: not yet watched there.
    if not m.is_moe or config.parallel.ep > 1 or limit is None or plan.peak_bytes >= limit:
        return {}
    r0, r_max = config.moe.imbalance, m.n_experts / m.top_k
    if r0 >= r_max:
        return {}
    skewed = dataclasses.replace(config, moe=dataclasses.replace(config.moe, imbalance=r_max))
    peak_max = build_plan(skewed, device_kind, world_size).peak_bytes
    if peak_max <= limit:
        return {}
    at = r0 + (limit - plan.peak_bytes) / (peak_max - plan.peak_bytes) * (r_max - r0)
    return {keys.MOE_OOM_IMBALANCE: at, keys.MOE_OOM_LIMIT_GIB: limit / GIB}


def ranks_outcome(result: dict[str, Any] | None, saving: bool) -> tuple[Status, dict[str, Any]]:
    """The status the ranks ended with, from rank 0's result (trainer/rank/main.py rank_main): ok,
    diverged with its line when the non-finite policy stopped them, or the stop they agreed on
    after a signal (trainer/faults/stop.py)."""
    if result is not None and result.get("status") == Status.diverged:
        return Status.diverged, {"error": result["error"]}
    # Every save's figures (trainer/saves/background.py): the last one's come after the last record.
    saves = save_means(result) if result is not None and result.get(keys.SAVES) else {}
    if result is not None and result.get("status") in STOP_STATUSES:  # every rank stopped after one step
        return Status(result["status"]), {**stopped(result, saving), **saves}
    return Status.ok, saves


def run_under_torchrun(config: TrainConfig, device_kind: str) -> None:
    """torchrun started every rank and each ran Hydra: take rank 0's config and output directory.

    `${now:}` and sweep order can differ between ranks, so rank 0's choices are broadcast:
    the config, the directory, and the plan's verdict (free host memory differs between hosts,
    so only rank 0 plans and every rank follows it). The job then ends as a launched one does
    (end_job): rank 0's process writes summary.json and owns the W&B run, every rank exits with
    the job's status.
    """
    import torch.distributed as dist

    from trainer.rank.main import rank_main
    from trainer.saves.resume import resolve_resume
    from trainer.telemetry.comm import enable_recording

    enable_recording(config, int(os.environ["WORLD_SIZE"]), device_kind)  # before the process group exists
    world = init_world(device_kind, offload_to_cpu=config.offload.on_host)
    resume, run_dir = resolve_resume(config, Path(HydraConfig.get().runtime.output_dir))
    shared = [to_plain(dataclasses.replace(config, resume=resume)), str(run_dir), None, {}]
    if world.is_main:
        shared[2:] = plan_job(config, Path(run_dir), device_kind, world.world_size)
    dist.broadcast_object_list(shared, src=0)
    plain, out_dir, refusal, meta = shared
    Path(out_dir).mkdir(parents=True, exist_ok=True)  # other hosts may not share rank 0's file system
    role = EndRole.recorder if world.is_main else EndRole.silent
    if refusal is not None:
        end_job(config, Path(out_dir), Status.refused, {"reason": refusal}, meta, role=role)
        return
    predicted = rank_predictions(meta)

    def train() -> tuple[Status, dict[str, Any]]:
        return ranks_outcome(rank_main(plain, out_dir, device_kind, predicted), config.save.every > 0)

    if not world.is_main:  # only global rank 0's process owns the W&B run: the other ranks never import wandb
        status, extra = train()
        end_job(config, Path(out_dir), status, extra, meta, role=role)
        return
    # Rank 0's process plays the job process's part: it feeds the W&B run from metrics.jsonl (a
    # thread beside its training) and ends it with the job's status.
    status, extra, summary = owning_the_wandb_run(config, Path(out_dir), meta, train)
    end_job(config, Path(out_dir), status, extra, meta, summary)


def plan_job(
    config: TrainConfig, out_dir: Path, device_kind: str, world_size: int
) -> tuple[str | None, dict[str, Any]]:
    """Write plan.json and print the plan; return the refusal to enforce (None: go) and the
    provenance and plan figures for summary.json."""
    plan = build_plan(config, device_kind, world_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.node_rank == 0:  # every node plans (and refuses alike); node 0 writes it down
        write_plan(out_dir, plan)
    print(format_plan(plan, way_out=config.mode == Mode.plan), flush=True)
    if config.mode == Mode.plan and device_kind == "cuda" and config.plan.accelerator is not None:
        from trainer.advise.advisor import throughput_line  # a plan for a named GPU: its predicted speed too

        print(throughput_line(config, plan, world_size), flush=True)
    if warning := cores_warning(plan.host):  # CPU ranks beyond this host's cores take turns
        warn(warning, file=sys.stdout)
    if config.mode == Mode.plan:  # planned for a device this host may not have: no provenance
        return None, {}
    meta = provenance(to_plain(config), list(HydraConfig.get().overrides.task), world_size, device_kind)
    meta.update(plan_summary_fields(plan))
    meta.update(routing_limit(config, plan, device_kind, world_size))
    refusal = plan_refusal(plan) or host_refusal(plan)
    if refusal is not None and not config.plan.enforce:
        warn("plan.enforce=false, trying anyway", file=sys.stdout)  # with the plan it overrides
        return None, meta
    return refusal, meta


# ----------------------------------------------------------------------------- how a job ends


def end_summary(
    config: TrainConfig, out_dir: Path, status: Status, extra: dict[str, Any], meta: dict[str, Any]
) -> dict[str, Any]:
    """Write summary.json: the status, the figures of metrics.jsonl (none when refused), `extra`
    (the error or the refusal, where a rank failed, restarts) and the provenance and plan."""
    records = [] if status == Status.refused else read_metrics(out_dir)
    summary = build_summary(
        status,
        records,
        config.steps,
        warmup_steps=config.telemetry.warmup_steps,
        **extra,
        **nonfinite_summary(records),
        **meta,
    )
    if config.precision.is_fp8 and keys.MFU_PCT in summary:
        # Its fp8 GEMMs run at up to twice the bf16 rate, so the figure is not an fp8 utilisation: say so.
        summary[keys.MFU_BASIS] = keys.FP8_MFU_BASIS
    if records and config.telemetry.enabled:
        # Absent where memory did not creep: W&B's summary keeps no null, and the run's summary is summary.json's.
        creep = find_creep(
            records,
            summary.get(WARMUP_STEPS, 0),
            meta.get("plan", {}).get("device_memory_gib"),
            meta.get(PREDICTED_PEAK),
            resolve_device_kind(config.device, must_be_visible=False),
        )
        if creep is not None:
            summary[MEMORY_CREEP] = creep
    write_summary(out_dir, summary)
    return summary


def end_job(
    config: TrainConfig,
    out_dir: Path,
    status: Status,
    extra: dict[str, Any],
    meta: dict[str, Any],
    summary: dict[str, Any] | None = None,
    role: EndRole = EndRole.recorder,
) -> None:
    """How every job ends, launched here, on another node of a multi-node job, or joined under
    torchrun: what its `role` says (summary.json unless the W&B run's end wrote it already, the
    end-of-run account, one line on what went wrong), and the exit status everywhere (0 ok,
    2 refused before any rank started, a stop its signal's, 1 any other ending)."""
    if role == EndRole.recorder:
        summary = summary or end_summary(config, out_dir, status, extra, meta)
        if status != Status.refused:
            report_end(summary, out_dir)
    if status == Status.ok:
        return
    if role != EndRole.silent:
        if status in STOP_STATUSES:  # a stop the user or the scheduler asked for: not an error
            say(status, extra["error"])
        else:
            error_line(extra["reason"] if status == Status.refused else extra["error"])
    exit_unless_sweep(BAD_INPUT if status == Status.refused else exit_code_for(status))


def report_end(summary: dict[str, Any], out_dir: Path) -> None:
    """A short end-of-run account on the console (and a line where memory crept: trainer/telemetry/creep.py)."""
    creep = f"\n{creep_line(summary[MEMORY_CREEP])}" if summary.get(MEMORY_CREEP) else ""
    print(f"{summary_table(summary)}\n  outputs: {out_dir}{creep}", flush=True)


def exit_unless_sweep(code: int) -> None:
    """A single job exits with `code`; a sweep goes on to its next point."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        raise SystemExit(code)
