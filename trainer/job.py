"""One job, in the Hydra job process: check, plan, launch the ranks, record how it ended."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from trainer.config import ConfigError, Mode, TrainConfig, to_plain, validate
from trainer.launch import RankFailure, launch_local, rank_main
from trainer.plan import preflight
from trainer.summary import build_summary, provenance, read_metrics, write_summary
from trainer.world import init_world, is_under_torchrun, resolve_device_kind, resolve_nproc


def run_job(cfg: DictConfig) -> None:
    """The Hydra task: everything a job does, and the exit status it ends with."""
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        config = validate(cfg)
        device_kind = resolve_device_kind(config.device)
        world_size = resolve_nproc(config.nproc, device_kind)
    except ConfigError as err:
        fail(f"error: {err}", code=2)
        return
    if is_under_torchrun():
        run_under_torchrun(config, device_kind)
        return
    meta = provenance(to_plain(config), list(HydraConfig.get().overrides.task), world_size, device_kind)
    refusal = preflight(config, device_kind, world_size)
    if refusal is not None:
        write_summary(out_dir, build_summary("refused", [], config.steps, reason=refusal, **meta))
        fail(f"error: {refusal}", code=2)
        return
    if config.mode == Mode.plan:
        print(f"fits: model states of model={config.model.name} fit on {world_size} {device_kind} ranks")
        return
    status, extra = train_ranks(config, out_dir, device_kind, world_size)
    summary = build_summary(status, read_metrics(out_dir), config.steps, **extra, **meta)
    write_summary(out_dir, summary)
    report_end(summary, out_dir)
    if status != "ok":
        fail(f"error: {extra['error']}", code=1)


def train_ranks(config: TrainConfig, out_dir: Path, device_kind: str, world_size: int) -> tuple[str, dict[str, Any]]:
    """Run the ranks; a rank's death is a status to record, not an exception to propagate."""
    try:
        launch_local(to_plain(config), out_dir, device_kind, world_size, config.max_restarts)
    except RankFailure as failure:
        return "crashed", {"error": str(failure), "failed_rank": failure.rank}
    return "ok", {}


def run_under_torchrun(config: TrainConfig, device_kind: str) -> None:
    """torchrun started every rank and each ran Hydra: take rank 0's config and output directory.

    `${now:}` and sweep order can differ between ranks, so rank 0's choice is broadcast.
    """
    import torch.distributed as dist

    world = init_world(device_kind)
    shared = [to_plain(config), str(HydraConfig.get().runtime.output_dir)]
    dist.broadcast_object_list(shared, src=0)
    plain, out_dir = shared
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    rank_main(plain, out_dir, device_kind)
    if world.is_main:
        summary = build_summary("ok", read_metrics(Path(out_dir)), config.steps, world_size=world.world_size)
        write_summary(Path(out_dir), summary)
        report_end(summary, Path(out_dir))


def report_end(summary: dict[str, Any], out_dir: Path) -> None:
    """A short end-of-run account on the console."""
    lines = [f"status: {summary['status']}"]
    if "loss/first" in summary:
        lines.append(f"loss: {summary['loss/first']:.4f} -> {summary['loss/final']:.4f} over {summary['steps_done']} steps")
    if summary.get("throughput/tokens_per_s"):
        lines.append(f"throughput (steady): {summary['throughput/tokens_per_s']:,.0f} tokens/s")
    lines.append(f"outputs: {out_dir}")
    print("\n".join(lines), flush=True)


def fail(message: str, code: int) -> None:
    """One line on stderr; a single job exits with `code`, a sweep goes on to its next point."""
    print(message, file=sys.stderr, flush=True)
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        raise SystemExit(code)
