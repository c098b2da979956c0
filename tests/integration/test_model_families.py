"""Llama-3.x / Qwen / Mistral shapes as real 2-rank CPU jobs: a config.json of each supported family
plans and trains, another architecture is refused in one line, the chunked loss matches the full one
step for step, and the plan's peak is within 0.005% of what the ranks measure for tied embeddings,
q/k norms with a separate head width, and the chunked loss, at every ZeRO stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import Run, run_trainer, sweep_runs

JOB = ("nproc=2", "device=cpu", "logger=none", "save=off", "log_every=1", "telemetry.memory_every=0")
# Small shapes of each family (tiny widths, a 4096 vocabulary so the loss matters as it does at 128k).
TIED = (
    "model.dim=256",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=4096",
    "model.ffn_dim=512",
    "model.max_seq_len=256",
    "model.tie_embeddings=true",
)
QK_NORM = (
    "model.dim=192",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.head_dim=64",
    "model.qk_norm=true",
    "model.vocab_size=4096",
    "model.ffn_dim=512",
    "model.max_seq_len=256",
)
UNTIED = TIED[:-1]
BATCH = ("seq_len=64", "micro_batch=2")
# docs/memory_plan.md states 0.002% for these shapes and the runs measure 0.000-0.002%; 0.005% leaves room
# for the allocator's rounding and still fails a term as small as the q/k norms' rstd per head (0.012%).
PLAN_TOLERANCE = 0.00005
FAMILIES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "MistralForCausalLM": {"sliding_window": 64, "max_position_embeddings": 4096},
    "Qwen2ForCausalLM": {"tie_word_embeddings": True},
    "Qwen3ForCausalLM": {"head_dim": 48, "tie_word_embeddings": False},
}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A token file: unlike synthetic data it has no transition tables, which the plan counts and a
    tracked step never touches (docs/memory_plan.md), so the comparison is of the step alone."""
    path = tmp_path_factory.mktemp("tokens") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 256, 100_000).astype(np.uint16))
    return str(path)


def measured_peaks(run: Run) -> list[float]:
    plan = json.loads((run.out_dir / "plan.json").read_text())
    records = run.records
    return [
        min(  # the lower of the two tracked steps (shape_runs says why)
            r[f"memory/rank{rank}/peak_allocated_gib"]
            for r in records
            if f"memory/rank{rank}/peak_allocated_gib" in r
        )
        for rank in range(plan["world_size"])
    ]


def assert_plan_within(run: Run) -> None:
    plan = json.loads((run.out_dir / "plan.json").read_text())
    for rank, measured in zip(plan["ranks"], measured_peaks(run)):
        error = (rank["peak_gib"] - measured) / measured
        assert abs(error) < PLAN_TOLERANCE, (
            f"rank {rank['rank']}: planned {rank['peak_gib']}, measured {measured} ({100 * error:+.3f}%) at {rank['peak_moment']}"
        )


# ----------------------------------------------------------------------------- model=hf


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Run]]:
    """A 2-step job on a config.json of each family (its directory, its run): the points of one sweep
    over model.config."""
    pytest.importorskip("transformers")
    directories = {}
    for architecture, extra in FAMILIES.items():
        directory = directories[architecture] = tmp_path_factory.mktemp(architecture)
        fields = {
            "architectures": [architecture],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": 256,
            "max_position_embeddings": 128,
            **extra,
        }
        (directory / "config.json").write_text(json.dumps(fields))
    runs = sweep_runs(
        tmp_path_factory.mktemp("families"),
        "model=hf",
        "model.config=" + ",".join(str(directory) for directory in directories.values()),
        *JOB,
        "seq_len=32",
        "micro_batch=2",
        "steps=2",
        by=("model.config",),
    )
    return {
        architecture: (directory, runs[(str(directory),)]) for architecture, directory in directories.items()
    }


@pytest.mark.parametrize("architecture", FAMILIES)
def test_a_config_json_of_each_family_plans_and_trains(
    family_runs: dict[str, tuple[Path, Run]], architecture: str
) -> None:
    directory, run = family_runs[architecture]
    plan = json.loads((run.out_dir / "plan.json").read_text())
    assert plan["model"] == f"hf:{(directory / 'config.json').resolve()}"
    assert run.summary["status"] == "ok" and len(run.losses) == 2
    assert all(np.isfinite(run.losses)) and run.losses[0] == pytest.approx(np.log(256), rel=0.05)
    # Embedding 256 x 64, two blocks, the final norm, and the head unless tied.
    fields = json.loads((directory / "config.json").read_text())
    head_dim = fields.get("head_dim", 16)
    attention = 64 * 4 * head_dim * 2 + 64 * 2 * head_dim * 2
    block = attention + 3 * 64 * 128 + 2 * 64
    block += (4 + 2 * 2) * head_dim if architecture == "Qwen2ForCausalLM" else 0  # q, k, v biases
    block += 2 * head_dim if architecture == "Qwen3ForCausalLM" else 0  # q and k norms
    tied = fields.get("tie_word_embeddings", False)
    assert plan["num_params"] == 256 * 64 * (1 if tied else 2) + 2 * block + 64


def test_another_architecture_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256})
    )
    run = run_trainer(
        tmp_path / "run", "model=hf", f"model.config={tmp_path / 'config.json'}", *JOB, check=False
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"error: model.config={tmp_path / 'config.json'}: architecture DeepseekV3ForCausalLM is not supported; "
        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
        "Qwen3MoeForCausalLM"
    ]


# ----------------------------------------------------------------------------- the chunked loss


@pytest.fixture(scope="module")
def loss_runs(tmp_path_factory: pytest.TempPathFactory, tokens: str) -> dict[tuple[str, str], Run]:
    """fp32, 8 steps, full and chunked (chunks of 48 of the 128 tokens: three, the last short), at
    stages 0 and 3: the points of one sweep."""
    return sweep_runs(
        tmp_path_factory.mktemp("loss"),
        *JOB,
        *UNTIED,
        *BATCH,
        "zero=stage0,stage3",
        "loss=full,chunked",
        "loss.chunk_tokens=48",
        "steps=8",
        "data=tokens",
        f"data.path={tokens}",
        by=("zero", "loss"),
    )


@pytest.mark.parametrize("stage", ["stage0", "stage3"])
def test_chunked_losses_equal_the_full_loss_step_for_step(
    loss_runs: dict[tuple[str, str], Run], stage: str
) -> None:
    full, chunked = loss_runs[(stage, "full")].losses, loss_runs[(stage, "chunked")].losses
    assert len(full) == len(chunked) == 8
    assert max(abs(a - b) for a, b in zip(full, chunked)) < 1e-6
    assert full[-1] < full[0]  # it trains


@pytest.mark.parametrize(("stage", "precision"), [("stage0", "fp32"), ("stage3", "fp32"), ("stage3", "bf16")])
def test_chunked_loss_plan_is_what_the_ranks_hold(
    loss_runs: dict[tuple[str, str], Run], tmp_path: Path, tokens: str, stage: str, precision: str
) -> None:
    """fp32: the 8-step runs above (stage3's peak is the head gradient's addition, next to the last
    block's all-gather that the root prefetched as backward began); bf16: a 2-step run."""
    if precision == "fp32":
        run = loss_runs[(stage, "chunked")]
    else:
        run = run_trainer(
            tmp_path,
            *JOB,
            *UNTIED,
            *BATCH,
            f"zero={stage}",
            f"precision={precision}",
            "loss=chunked",
            "loss.chunk_tokens=48",
            "steps=2",
            "data=tokens",
            f"data.path={tokens}",
        )
    assert_plan_within(run)


def test_chunked_loss_plans_fewer_activations_than_the_full_loss(
    loss_runs: dict[tuple[str, str], Run],
) -> None:
    """At this vocabulary the log-softmax the full loss saves outweighs the chunks' saved input."""
    full = json.loads((loss_runs[("stage0", "full")].out_dir / "plan.json").read_text())
    chunked = json.loads((loss_runs[("stage0", "chunked")].out_dir / "plan.json").read_text())
    assert chunked["ranks"][0]["activations_gib"] < full["ranks"][0]["activations_gib"]


# ----------------------------------------------------------------------------- the plan of tied and q/k-norm shapes


SHAPES = {"tied": TIED, "qk_norm": QK_NORM}


@pytest.fixture(scope="module")
def shape_runs(tmp_path_factory: pytest.TempPathFactory, tokens: str) -> dict[tuple[str, str], Run]:
    """3 steps of each shape at every stage, steps 2 and 3 tracked: one sweep over the stages per shape."""
    runs = {}
    for shape, overrides in SHAPES.items():
        points = sweep_runs(
            tmp_path_factory.mktemp(shape),
            *JOB,
            *overrides,
            *BATCH,
            "zero=stage0,stage1,stage2,stage3",
            # steps 2 and 3 tracked alike (plan_sweep's way): gloo's worker thread now and then frees a
            # reduce-scatter input late at stages 2-3, so the lower of the two is held to the plan
            "steps=3",
            "memory.snapshot=steps",
            "memory.snapshot_steps=[3]",
            "data=tokens",
            f"data.path={tokens}",
            by=("zero",),
        )
        runs.update({(shape, stage): run for (stage,), run in points.items()})
    return runs


@pytest.mark.parametrize("stage", ["stage0", "stage1", "stage2", "stage3"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_plan_is_within_the_stated_accuracy(
    shape_runs: dict[tuple[str, str], Run], shape: str, stage: str
) -> None:
    assert_plan_within(shape_runs[(shape, stage)])
