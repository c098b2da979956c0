"""Telemetry of real 2-rank jobs on CPU: per-rank memory, the loss-scale history and the W&B run.

The W&B runs are offline and read back with the wandb library's own reader
(`wandb leet inspect --json`), then compared with metrics.jsonl value for value.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from tests.helpers import Run, run_sweep, run_trainer, sweep_runs, wandb_file, wandb_records, wandb_summary
from trainer.config import ModelConfig, PlanConfig, PrecisionConfig
from trainer.model.decoder import build_model, num_params

FAKE_KEY = "f00dfacecafe" * 3 + "beef"  # 40 characters, the shape of a W&B API key
SMALL = ("model=tiny", "device=cpu", "nproc=2", "seq_len=64", "micro_batch=2", "log_every=1")

# Acceptance 1 and 2 in one job: fp16 under stage3 with W&B, an overflow injected on rank 1.
OVERFLOW_STEP, GROWTH_INTERVAL, INIT_SCALE = 7, 4, 1024.0
FP16_JOB = (
    *SMALL, "precision=fp16", "zero=stage3", "steps=20", "logger=wandb", "telemetry.memory_every=5",
    "fault.kind=inf_grad", f"fault.step={OVERFLOW_STEP}", "fault.rank=1",
    f"precision.growth_interval={GROWTH_INTERVAL}", f"precision.loss_scale_init={INIT_SCALE}",
)  # fmt: skip


def run_with_env(out_dir: Path, *overrides: str, env: dict[str, str], check: bool = True) -> Run:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return run_trainer(out_dir, *overrides, check=check)


def wandb_history(out_dir: Path) -> dict[int, dict[str, Any]]:
    history = [r["history"] for r in wandb_records(wandb_file(out_dir)) if r["type"] == "history"]
    return {int(h["step"]["num"]): h["item"] for h in history}


def same_value(wandb_value: Any, jsonl_value: Any) -> bool:
    if isinstance(jsonl_value, float) and math.isnan(jsonl_value):
        return wandb_value == "NaN"
    return wandb_value == jsonl_value


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    env = {"WANDB_API_KEY": FAKE_KEY, "WANDB_MODE": "offline"}
    return run_with_env(tmp_path_factory.mktemp("fp16"), *FP16_JOB, env=env)


def test_wandb_history_holds_every_record_of_metrics_jsonl_value_for_value(fp16_run: Run) -> None:
    history = wandb_history(fp16_run.out_dir)
    records = fp16_run.records
    assert sorted(history) == [r["step"] for r in records] == list(range(1, 21))
    for record in records:
        item = history[record["step"]]
        differing = {
            k: (item.get(k), v) for k, v in record.items() if k != "step" and not same_value(item.get(k), v)
        }
        assert not differing, f"step {record['step']}: W&B vs metrics.jsonl {differing}"
        for key in ("precision/loss_scale", "precision/overflow", "throughput/tokens_per_s"):
            assert key in item
        for rank in (0, 1):
            assert {
                f"memory/rank{rank}/params_gib",
                f"memory/rank{rank}/peak_rss_gib",
                f"comm/rank{rank}/bytes_per_step",
            } <= item.keys()


def test_communication_is_measured_every_window_and_its_exposed_share_on_profiled_steps(
    fp16_run: Run,
) -> None:
    """Each window's bytes exceed the plan's by the loop's own small collectives only (the
    non-finite agreement, clipping's norms, the fp16 scaler's flag) and, from step 2, the previous
    log's gather (world x the row's float64 columns: 848 B for 53 columns here, growing with the
    metrics): the same excess on both ranks and every later step, under 2 KiB; gloo times no
    collective; the step after each memory-tracked step (2, 7, 12, 17) is profiled; summary.json
    and the W&B summary carry the figures."""
    predicted = fp16_run.records[0]["comm/predicted_bytes_per_step"]
    excess = [
        {record[f"comm/rank{rank}/bytes_per_step"] - predicted for rank in (0, 1)}
        for record in fp16_run.records
    ]
    (first,), (steady,) = excess[0], excess[1]
    assert 0 < first < steady < 2048 and excess[1:] == [{steady}] * (len(excess) - 1)
    for record in fp16_run.records:
        for rank in (0, 1):
            assert f"comm/rank{rank}/time_s_per_step" not in record  # gloo records no durations
        assert ("comm/exposed_pct" in record) == (record["step"] in (3, 8, 13, 18))
        assert 0 <= record.get("comm/exposed_pct", 0) <= 100
    summary, logged = fp16_run.summary, wandb_summary(wandb_file(fp16_run.out_dir))["summary"]
    for key in (
        "comm/predicted_bytes_per_step",
        "comm/prediction_error_pct",
        "comm/rank1/all_gather_bytes_per_step",
        "comm/exposed_pct",
    ):
        assert key in summary and key in logged, key
    assert summary["comm/predicted_bytes_per_step"] == predicted


def test_each_rank_reports_its_peak_on_the_tracked_steps_with_the_worst_rank(fp16_run: Run) -> None:
    tracked = [r for r in fp16_run.records if "memory/max_rank_peak_gib" in r]
    assert [r["step"] for r in tracked] == [2, 7, 12, 17]  # the anchor (step 2), then every memory_every=5
    for record in tracked:
        peaks = [record[f"memory/rank{rank}/peak_allocated_gib"] for rank in (0, 1)]
        assert record["memory/max_rank_peak_gib"] == max(peaks)
        assert record["memory/argmax_rank"] == peaks.index(max(peaks))
        assert record["memory/imbalance"] == pytest.approx(max(peaks) / (sum(peaks) / 2))
        predicted = record["memory/predicted_peak_gib"]
        assert record["memory/prediction_error_pct"] == pytest.approx(
            100 * (predicted - max(peaks)) / max(peaks)
        )


def expected_scales(steps: int, precision: PrecisionConfig, overflow_step: int) -> list[float]:
    """GradScaler's documented rule: back off on an overflow, grow after growth_interval clean steps."""
    scale, clean, scales = precision.loss_scale_init, 0, []
    for step in range(1, steps + 1):
        if step == overflow_step:
            scale, clean = scale * precision.backoff_factor, 0
        else:
            clean += 1
            if clean == precision.growth_interval:
                scale, clean = scale * precision.growth_factor, 0
        scales.append(scale)
    return scales


def test_injected_overflow_halves_the_scale_and_growth_resumes_after_the_interval(fp16_run: Run) -> None:
    precision = PrecisionConfig(loss_scale_init=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    history = wandb_history(fp16_run.out_dir)
    for source in (fp16_run.records, [{"step": s, **history[s]} for s in sorted(history)]):
        scales = [r["precision/loss_scale"] for r in source]
        assert scales == expected_scales(20, precision, OVERFLOW_STEP)
        assert [r["precision/overflow"] for r in source] == [int(r["step"] == OVERFLOW_STEP) for r in source]
        assert [r["precision/skipped_steps"] for r in source] == [
            int(r["step"] >= OVERFLOW_STEP) for r in source
        ]
        k, g = OVERFLOW_STEP - 1, GROWTH_INTERVAL  # list index of the overflow step
        assert scales[k] == scales[k - 1] * precision.backoff_factor
        assert scales[k : k + g] == [scales[k]] * g  # held for growth_interval - 1 clean steps ...
        assert scales[k + g] == scales[k] * precision.growth_factor  # ... and grown on the interval's last
    assert fp16_run.summary["precision/skipped_steps"] == 1


def test_wandb_run_is_named_grouped_and_configured_from_the_job(fp16_run: Run) -> None:
    run = next(r["run"] for r in wandb_records(wandb_file(fp16_run.out_dir)) if r["type"] == "run")
    summary = fp16_run.summary
    hydra = OmegaConf.load(fp16_run.out_dir / ".hydra" / "hydra.yaml").hydra
    assert run["display_name"] == hydra.job.override_dirname  # the overrides, as Hydra names the job
    assert "zero=stage3" in run["display_name"] and "precision=fp16" in run["display_name"]
    assert run["job_type"] == "stage3"
    assert len(run["run_group"]) == len("YYYY-MM-DD")  # a single run is grouped by its date
    config = {
        k: v
        for k, v in run["config"]["update"].items()
        if k not in ("_wandb", "overrides", "provenance", "swept")
    }
    assert config == summary["config"]
    # A single run's `swept`: the keys its command line set, typed as the config has them.
    swept = run["config"]["update"]["swept"]
    assert {k: swept[k] for k in ("micro_batch", "precision", "zero", "steps", "precision/loss_scale_init")} == {
        "micro_batch": 2, "precision": "fp16", "zero": "stage3", "steps": 20, "precision/loss_scale_init": INIT_SCALE,
    }  # fmt: skip
    assert "logger" not in swept  # keys that do not change what a run measures stay out, as from its name
    assert sorted(run["tags"]) == [
        "checkpointing=none",
        "model=tiny",
        "offload=none",
        "precision=fp16",
        "zero=stage3",
    ]
    assert run["config"]["update"]["overrides"] == summary["overrides"]
    provenance = run["config"]["update"]["provenance"]
    assert provenance == {k: summary[k] for k in ("world_size", "device", "torch_version", "git_revision")}
    assert provenance["world_size"] == 2
    wandb_end = wandb_summary(wandb_file(fp16_run.out_dir))
    assert wandb_end["state"] == "finished"
    for key in (
        "status",
        "throughput/tokens_per_s",
        "memory/max_rank_peak_gib",
        "precision/skipped_steps",
        "loss/final",
    ):
        assert wandb_end["summary"][key] == summary[key]


def test_no_api_key_in_any_output_or_wandb_file(fp16_run: Run) -> None:
    files = [p for p in fp16_run.out_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix == ".wandb" for p in files) and any(p.name == "summary.json" for p in files)
    leaking = [str(p) for p in files if FAKE_KEY.encode() in p.read_bytes()]
    assert leaking == []
    assert FAKE_KEY not in fp16_run.stdout + fp16_run.stderr


@pytest.mark.slow  # the default tier's time (README)
def test_killed_rank_leaves_a_crashed_summary_and_wandb_run_naming_the_rank(tmp_path: Path) -> None:
    killed_at = 4
    job = (*SMALL, "steps=8", "logger=wandb", "fault.kind=kill", f"fault.step={killed_at}", "fault.rank=1")
    run = run_with_env(tmp_path, *job, env={"WANDB_MODE": "offline"}, check=False)
    assert run.returncode == 1
    assert (run.summary["status"], run.summary["failed_rank"]) == ("crashed", 1)
    wandb_end = wandb_summary(wandb_file(run.out_dir))
    assert (wandb_end["state"], wandb_end["exit_code"]) == ("failed", 1)
    assert (wandb_end["summary"]["status"], wandb_end["summary"]["failed_rank"]) == ("crashed", 1)
    assert "SIGKILL" in wandb_end["summary"]["error"]
    # What rank 0 logged before the kill reached W&B too.
    assert sorted(wandb_history(run.out_dir)) == [r["step"] for r in run.records] == list(range(1, killed_at))


@pytest.mark.slow  # the default tier's time (README)
def test_sweep_jobs_in_one_process_get_one_wandb_run_each_in_one_group(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = run_sweep(
        sweep_dir,
        *SMALL,
        "nproc=1",
        "steps=1",
        "logger=wandb",
        "zero=stage0,stage1",
        timeout=300,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [
        next(r["run"] for r in wandb_records(wandb_file(job)) if r["type"] == "run")
        for job in sorted(sweep_dir.glob("[0-9]_*"))
    ]
    assert [r["job_type"] for r in runs] == ["stage0", "stage1"]
    assert len({r["run_id"] for r in runs}) == 2
    assert {r["run_group"] for r in runs} == {f"{sweep_dir.parent.name}/{sweep_dir.name}"}
    assert all(f"zero={r['job_type']}" in r["display_name"] for r in runs)


# --------------------------------------------------------------------------- ZeRO in measured memory

STAGE_JOB = (*SMALL, "precision=fp32", "steps=2", "logger=none", "telemetry.memory_every=1")


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """stage0, stage1 and stage3 with tensor tracking on every step, and stage0 with telemetry off."""
    stages = sweep_runs(
        tmp_path_factory.mktemp("stages"), *STAGE_JOB, "zero=stage0,stage1,stage3", by=("zero",)
    )
    runs = {stage: run for (stage,), run in stages.items()}
    runs["stage0_off"] = run_trainer(
        tmp_path_factory.mktemp("off"), *STAGE_JOB, "zero=stage0", "telemetry.enabled=false"
    )
    return runs


@pytest.fixture(scope="module")
def stage_peaks(stage_runs: dict[str, Run]) -> dict[str, dict[str, Any]]:
    """Step 2's record: the first step that starts with Adam's state (step 1 creates it)."""
    return {stage: run.records[-1] for stage, run in stage_runs.items()}


def test_tracking_memory_leaves_training_bitwise_unchanged(stage_runs: dict[str, Run]) -> None:
    tracked, untracked = stage_runs["stage0"], stage_runs["stage0_off"]
    assert all("memory/max_rank_peak_gib" in r for r in tracked.records)
    assert not any("memory/max_rank_peak_gib" in r for r in untracked.records)
    assert tracked.losses == untracked.losses
    assert [r["optim/grad_norm"] for r in tracked.records] == [
        r["optim/grad_norm"] for r in untracked.records
    ]


def peak_bytes(record: dict[str, Any], rank: int, key: str = "peak_allocated_gib") -> float:
    return record[f"memory/rank{rank}/{key}"] * 2**30


def test_stage1_saves_each_rank_exactly_the_optimizer_state_it_no_longer_holds(stage_peaks) -> None:
    stage0, stage1 = stage_peaks["stage0"], stage_peaks["stage1"]
    model = build_model(ModelConfig(), device="meta")
    adam_bytes = 8 * num_params(ModelConfig())  # two fp32 moments per parameter, on every rank at stage0
    assert [peak_bytes(stage0, rank, "optimizer_gib") for rank in (0, 1)] == [adam_bytes] * 2
    # ZeroRedundancyOptimizer partitions whole tensors, so the ranks' shares differ; together they hold it all.
    shares = [peak_bytes(stage1, rank, "optimizer_gib") for rank in (0, 1)]
    assert sum(shares) == adam_bytes and shares[0] != shares[1]
    # At the peak, MemTracker's optimizer figure also holds Adam's 4-byte step counter per tensor
    # (partitioned with its tensor at stage1).
    at_peak = {
        name: [peak_bytes(stage, rank, "at_peak/optimizer_gib") for rank in (0, 1)]
        for name, stage in (("stage0", stage0), ("stage1", stage1))
    }
    with_steps = adam_bytes + 4 * len(list(model.parameters()))
    assert at_peak["stage0"] == [with_steps] * 2 and sum(at_peak["stage1"]) == with_steps
    for rank in (0, 1):
        # The ZeRO arithmetic, to the byte: stage1's peak is stage0's less the state this rank gave away.
        assert peak_bytes(stage0, rank) - peak_bytes(stage1, rank) == with_steps - at_peak["stage1"][rank]


def test_a_cpu_rank_holds_no_more_than_the_plan_budgets_for_it(stage_peaks) -> None:
    """The host check budgets plan.cpu_rank_runtime_gib (0.4 GiB) of process runtime per CPU rank on
    top of its tensors (docs/faults.md): a rank's peak RSS must stay within that budget."""
    runtime_gib = PlanConfig().cpu_rank_runtime_gib
    for stage in ("stage0", "stage1", "stage3"):
        record = stage_peaks[stage]
        for rank in (0, 1):
            rss = record[f"memory/rank{rank}/peak_rss_gib"]
            assert rss <= runtime_gib + record["memory/predicted_peak_gib"], (stage, rank, rss)


def test_stage3_saves_the_sharded_model_states_less_the_transient_full_copies(stage_peaks) -> None:
    stage0, stage3 = stage_peaks["stage0"], stage_peaks["stage3"]
    model = build_model(ModelConfig(), device="meta")
    params = num_params(ModelConfig())
    at_rest = 16 * params // 2  # fp32 params + grads + Adam moments, halved on 2 ranks
    # FSDP2 holds full copies while computing: the root (embeddings, norm, head: never resharded
    # after forward) and up to two blocks at a time (one computing, one prefetched), parameters
    # and their unsharded gradients. The bound: the saving lies between at_rest minus those and at_rest.
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layers."))
    block = sum(p.numel() for p in model.layers[0].parameters())
    transient = 4 * (root + 2 * 2 * block)
    for rank in (0, 1):
        saving = peak_bytes(stage0, rank) - peak_bytes(stage3, rank)
        assert at_rest - transient <= saving <= at_rest * 1.01
    assert peak_bytes(stage3, 0) < peak_bytes(stage_peaks["stage1"], 0) < peak_bytes(stage0, 0)
