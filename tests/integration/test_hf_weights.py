"""Issue 35 on two ranks: a Hugging Face checkpoint of each family loaded at stages 0 and 3 gives
transformers' logits; each rank's host memory while loading stays below its shard and the largest
tensor, the plan's figure; `model=hf model.weights=DIR` starts from transformers' loss; after 5 steps
at stage3 the run's export (save.hf=last) loads in transformers with zerolab's logits, and
`python -m trainer.export --dtype bf16` halves the tensors; bad weights are one line, exit 2.

Issue 58: the same start from transformers' loss at tp=2 x dp=2 (stage3, 4 ranks), whose save exports with
zerolab's logits and resumes at tp=1, and at pp=2 (2 ranks), whose save resumes at tp=2."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.helpers import (
    HF_FAMILIES,
    HF_SEQUENCES,
    Run,
    compose_config,
    free_port,
    hf_checkpoint,
    hf_logits,
    rank_load_memory,
    rank_logits,
    run_trainer,
)
from trainer.config import ModelConfig, from_plain
from trainer.data import build_batches
from trainer.model.decoder import build_model, materialize
from trainer.plan import build_plan
from trainer.units import GIB

transformers = pytest.importorskip("transformers")

STAGES = ("stage0", "stage3")
JOB = ("nproc=2", "device=cpu", "zero=stage3", "seq_len=32", "micro_batch=2", "logger=none", "log_every=1")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: hf_checkpoint(root / name, name) for name in HF_FAMILIES}


@pytest.fixture(scope="module")
def expected_logits(checkpoints: dict[str, Path]) -> dict[str, torch.Tensor]:
    return {name: hf_logits(path) for name, path in checkpoints.items()}


# ----------------------------------------------------------------------------- two ranks, every family


@pytest.fixture(scope="module")
def two_rank_logits(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], torch.Tensor]:
    """Every family at both stages in one two-rank process group (one start of two processes)."""
    out = tmp_path_factory.mktemp("logits") / "logits.pt"
    configs = {family: ModelConfig(name="hf", weights=str(path)) for family, path in checkpoints.items()}
    # Forked, not spawned: the two ranks share this process's imports (about 50 s less on 2 busy cores).
    # Safe here: no process group or CUDA in this process, and each rank computes on one thread
    # (rank_logits), so no OpenMP pool is used across the fork.
    mp.start_processes(rank_logits, args=(free_port(), configs, STAGES, out), nprocs=2, start_method="fork")
    return torch.load(out)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_two_ranks_give_transformers_logits(
    expected_logits: dict[str, torch.Tensor],
    two_rank_logits: dict[tuple[str, str], torch.Tensor],
    family: str,
    stage: str,
) -> None:
    difference = (two_rank_logits[family, stage] - expected_logits[family]).abs().max().item()
    assert difference < 1e-5


# ----------------------------------------------------------------------------- host memory while loading

LOADED_SHAPES = dict(hidden_size=256, intermediate_size=2048)
"""A Llama of 14 MiB of fp32 tensors, the largest 2 MiB (each MLP matrix), so that what a rank holds
while loading stands out from what the runtime takes meanwhile (DCP's planning: about 1 MiB
measured); the tiny shapes' 0.3 MiB would not."""


def shard_and_largest(weights: Path) -> tuple[int, int, int]:
    """Bytes of one rank's stage3 shard of 2 (dim 0 halved, padded), of the largest tensor and of all
    (fp32, as saved), from the file's shapes."""
    from safetensors import safe_open

    with safe_open(str(weights / "model.safetensors"), framework="pt") as f:
        shapes = [f.get_slice(key).get_shape() for key in f.keys()]
    tensors = [4 * math.prod(shape) for shape in shapes]
    shard = sum(4 * -(-shape[0] // 2) * math.prod(shape[1:]) for shape in shapes)
    return shard, max(tensors), sum(tensors)


def test_each_ranks_host_memory_while_loading_is_below_its_shard_and_the_largest_tensor(
    tmp_path: Path,
) -> None:
    """Acceptance 4: loaded at stage3 on 2 ranks (forked, as the logits above), each rank's measured
    host memory while loading stays below its shard plus the largest tensor, which is the plan's load
    figure; a rank holding the whole state dict would exceed it."""
    weights = hf_checkpoint(tmp_path / "llama", "LlamaForCausalLM", **LOADED_SHAPES)
    out = tmp_path / "loaded.json"
    config = ModelConfig(name="hf", weights=str(weights))
    mp.start_processes(
        rank_load_memory, args=(free_port(), config, "stage3", out), nprocs=2, start_method="fork"
    )
    shard, largest, whole = shard_and_largest(weights)
    plan = build_plan(compose_config("model=hf", f"model.weights={weights}", *JOB), "cpu", 2)
    assert [rank.loading for rank in plan.host.ranks] == [shard + largest] * 2 and whole > shard + largest
    for rank, figures in enumerate(json.loads(out.read_text())):
        assert figures["load_host_peak"] < shard + largest, (rank, figures, shard, largest)


# ----------------------------------------------------------------------------- a run from the weights


@pytest.fixture(scope="module")
def run(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    """5 steps at stage3 on 2 ranks from the Llama checkpoint, its last save exported (save.hf=last)."""
    weights = checkpoints["LlamaForCausalLM"]
    out = tmp_path_factory.mktemp("run") / "run"
    return run_trainer(
        out, "model=hf", f"model.weights={weights}", *JOB, "steps=5", "save.every=5", "save.hf=last"
    )


def test_the_first_loss_is_transformers_loss_on_the_same_batch(
    checkpoints: dict[str, Path], run: Run
) -> None:
    weights = checkpoints["LlamaForCausalLM"]
    config = compose_config("model=hf", f"model.weights={weights}", *JOB)
    model = transformers.AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    losses = []
    for rank in range(2):  # the logged loss is the mean of the ranks' losses
        inputs, targets = next(build_batches(config, rank, 2))
        with torch.no_grad():
            losses.append(F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item())
    assert abs(run.losses[0] - sum(losses) / 2) < 1e-5


def test_the_run_names_its_weights_and_their_fingerprint(checkpoints: dict[str, Path], run: Run) -> None:
    import hashlib

    weights = checkpoints["LlamaForCausalLM"]
    sha256 = hashlib.sha256((weights / "model.safetensors").read_bytes()).hexdigest()[:16]
    model = run.summary["config"]["model"]
    assert (model["weights"], model["weights_sha256"]) == (str(weights), sha256)
    assert f"weights              {weights} (sha256 {sha256})" in run.stdout


def test_the_run_reports_each_ranks_host_memory_while_loading_and_the_plan_its_own(
    checkpoints: dict[str, Path], run: Run
) -> None:
    """summary.json carries both ranks' figures (from their first record) and plan.json the plan's:
    the tiny checkpoint's shard and largest tensor (too small for the bound to say more than the
    runtime's own growth: the test above holds a larger one to it)."""
    shard, largest, _ = shard_and_largest(checkpoints["LlamaForCausalLM"])
    plan = json.loads((run.out_dir / "plan.json").read_text())["host"]
    assert plan["loading_gib"] * GIB == shard + largest
    for rank in range(2):
        for figure in ("load_host_peak_gib", "load_rss_peak_gib"):
            assert math.isfinite(run.summary[f"memory/rank{rank}/{figure}"])


def trained_logits(run: Run, step: int = 5) -> torch.Tensor:
    """zerolab's logits of the run's step-`step` save (its model entry, loaded in this process)."""
    model = build_model(from_plain(run.summary["config"]).model)
    materialize(model, "cpu", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: intended
        dcp.load(
            {"model": model.state_dict()},
            checkpoint_id=run.out_dir / "checkpoints" / f"step_{step:08d}",
            no_dist=True,
        )
    with torch.no_grad():
        return model(HF_SEQUENCES)


def test_the_export_loads_in_transformers_with_zerolabs_logits(run: Run) -> None:
    assert sorted(p.name for p in (run.out_dir / "hf").iterdir()) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert (hf_logits(run.out_dir / "hf") - trained_logits(run)).abs().max().item() < 1e-5


def tensor_bytes(path: Path) -> int:
    """A safetensors file's size less its header (an 8-byte length, then the JSON header)."""
    with path.open("rb") as f:
        return path.stat().st_size - 8 - int.from_bytes(f.read(8), "little")


def test_a_bf16_export_halves_the_tensors(run: Run, tmp_path: Path) -> None:
    from trainer.export import main  # the command's own entry, in this process (transformers imported once)

    main([str(run.out_dir), str(tmp_path), "--dtype", "bf16"])
    name = "model-00001-of-00001.safetensors"
    assert 2 * tensor_bytes(tmp_path / name) == tensor_bytes(run.out_dir / "hf" / name)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert exported.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- tensor parallelism inside FSDP2

TP_BASE = ("model=hf", *(setting for setting in JOB if not setting.startswith("nproc=")), "precision=fp32")
TP_STEPS = ("steps=4", "optim.warmup_steps=2")
TP_JOB = (*TP_BASE, *TP_STEPS, "nproc=4", "parallel.tp=2")
"""tp=2 x dp=2 at stage3 (JOB's), fp32: every parameter a DTensor over the 2-D (dp_shard, tp) mesh, each rank
holding a tensor-parallel slice of an FSDP2 shard, or an FSDP2 shard of a replicated norm."""


@pytest.fixture(scope="module")
def tp_run(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    """4 steps of tp=2 x dp=2 at stage3 from the Llama checkpoint, saved at steps 2 and 4."""
    weights = checkpoints["LlamaForCausalLM"]
    out = tmp_path_factory.mktemp("tp") / "run"
    return run_trainer(out, *TP_JOB, f"model.weights={weights}", "save.every=2")


def test_a_tensor_parallel_run_from_weights_peaks_within_half_a_percent_of_its_plan(tp_run: Run) -> None:
    """Loading model.weights changes what each rank starts from, not what a step holds: every rank's measured
    peak (the tracked step 2) within 0.5% of plan.json's, as for tp=2 x dp=2 stage3 from random weights."""
    plan = json.loads((tp_run.out_dir / "plan.json").read_text())
    assert len(plan["ranks"]) == 4
    for rank in plan["ranks"]:
        key = f"memory/rank{rank['rank']}/peak_allocated_gib"
        measured = max(r[key] for r in tp_run.records if key in r)
        assert abs(rank["peak_gib"] - measured) / measured < 0.005, (rank["rank"], rank["peak_gib"], measured)


def test_tensor_parallel_ranks_start_from_transformers_loss(
    checkpoints: dict[str, Path], tp_run: Run
) -> None:
    """Each rank read its 2-D slice of every tensor: the first loss is transformers' on the two data-parallel
    replicas' batches (a TP group's two ranks read the same one)."""
    weights = checkpoints["LlamaForCausalLM"]
    config = compose_config(*TP_JOB, f"model.weights={weights}")
    model = transformers.AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    losses = []
    for replica in range(2):
        inputs, targets = next(build_batches(config, replica, 2))
        with torch.no_grad():
            losses.append(F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item())
    assert (tp_run.summary["config"]["nproc"], tp_run.summary["config"]["parallel"]["tp"]) == ("4", 2)
    assert abs(tp_run.losses[0] - sum(losses) / 2) < 1e-5, (tp_run.losses[0], losses)


def test_a_tensor_parallel_save_exports_to_transformers_with_zerolabs_logits(
    checkpoints: dict[str, Path], tp_run: Run, tmp_path: Path
) -> None:
    """`python -m trainer.export` of the run (its step-4 save, DTensors over the 2-D mesh) loads in
    transformers with the logits zerolab's model has from the same save, which 4 steps moved from the start."""
    from trainer.export import main

    main([str(tp_run.out_dir), str(tmp_path)])
    exported = hf_logits(tmp_path)
    assert (exported - trained_logits(tp_run, step=4)).abs().max().item() < 1e-5
    assert (exported - hf_logits(checkpoints["LlamaForCausalLM"])).abs().max().item() > 1e-3


def test_a_tensor_parallel_save_resumes_at_tp1(
    checkpoints: dict[str, Path], tp_run: Run, tmp_path: Path
) -> None:
    """The step-2 save goes on at tp=1 on 2 ranks at stage3, the same global batch: DCP reshards the 2-D
    shards (weights and optimizer state) into 1-D ones; steps 3-4 as the uninterrupted run's, within
    test_resume.py's reshard tolerance (rel 1e-5)."""
    save = tp_run.out_dir / "checkpoints" / "step_00000002"
    weights = checkpoints["LlamaForCausalLM"]
    resumed = run_trainer(
        tmp_path / "run",
        *TP_BASE,
        *TP_STEPS,
        "nproc=2",
        f"model.weights={weights}",
        "save=off",
        f"resume={save}",
    )
    config = resumed.summary["config"]
    assert (config["nproc"], config["parallel"]["tp"]) == ("2", 1)
    assert [r["step"] for r in resumed.records] == [3, 4]
    for record, expected in zip(resumed.records, tp_run.records[2:]):
        assert math.isclose(record["loss/train"], expected["loss/train"], rel_tol=1e-5), (record, expected)


# ----------------------------------------------------------------------------- pipeline stages

PP_JOB = (*TP_BASE, *TP_STEPS, "nproc=2", "grad_accum=2")
"""2 ranks, dp 1, stage3, fp32: a step of 2 micro-batches of 2 sequences, under pp=2 (1F1B) or tp=2."""


@pytest.fixture(scope="module")
def pp_run(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    """4 steps of pp=2 from the Llama checkpoint, each stage loading its own blocks; saved at steps 2 and 4."""
    weights = checkpoints["LlamaForCausalLM"]
    out = tmp_path_factory.mktemp("pp") / "run"
    return run_trainer(
        out, *PP_JOB, "parallel.pp=2", "zero.reduce_every=step", f"model.weights={weights}", "save.every=2"
    )


def test_pipeline_stages_start_from_transformers_loss(checkpoints: dict[str, Path], pp_run: Run) -> None:
    """Each stage read its blocks' tensors (stage 0 the embedding and block 0, stage 1 block 1, the norm and
    the head): the first loss is transformers' mean over the step's two micro-batches."""
    weights = checkpoints["LlamaForCausalLM"]
    config = compose_config(*PP_JOB, "parallel.pp=2", "zero.reduce_every=step", f"model.weights={weights}")
    model = transformers.AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    batches, losses = build_batches(config, 0, 1), []
    for _ in range(2):
        inputs, targets = next(batches)
        with torch.no_grad():
            losses.append(F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item())
    assert pp_run.summary["config"]["parallel"]["pp"] == 2
    assert abs(pp_run.losses[0] - sum(losses) / 2) < 1e-5, (pp_run.losses[0], losses)


def test_a_pipelined_save_resumes_under_tensor_parallelism(
    checkpoints: dict[str, Path], pp_run: Run, tmp_path: Path
) -> None:
    """The step-2 save (each stage wrote its blocks' parameters and optimizer state under the whole decoder's
    names) goes on at tp=2 on the same 2 ranks and global batch, DCP resharding into tensor-parallel
    DTensors: steps 3-4 as the pipelined run's, within test_resume.py's reshard tolerance (rel 1e-5)."""
    save = pp_run.out_dir / "checkpoints" / "step_00000002"
    weights = checkpoints["LlamaForCausalLM"]
    resumed = run_trainer(
        tmp_path / "run", *PP_JOB, "parallel.tp=2", f"model.weights={weights}", "save=off", f"resume={save}"
    )
    parallel = resumed.summary["config"]["parallel"]
    assert (parallel["pp"], parallel["tp"]) == (1, 2)
    assert [r["step"] for r in resumed.records] == [3, 4]
    for record, expected in zip(resumed.records, pp_run.records[2:]):
        assert math.isclose(record["loss/train"], expected["loss/train"], rel_tol=1e-5), (record, expected)


# ----------------------------------------------------------------------------- bad weights, before any rank


def test_bad_weights_are_one_line_exit_2_before_the_plan(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """One job; the other refusals take the same path (their lines: tests/unit/model/test_hf_weights.py)."""
    from safetensors.torch import load_file, save_file

    source, weights = checkpoints["MistralForCausalLM"], tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors") | {"model.norm.weight": torch.ones(63)}
    save_file(tensors, weights / "model.safetensors", metadata={"format": "pt"})
    run = run_trainer(
        tmp_path / "run", "model=hf", f"model.weights={weights}", *JOB, "mode=plan", check=False
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"error: model.weights={weights}: tensor model.norm.weight has shape [63] in model.safetensors, "
        "the model needs [64]"
    ]
    assert not (tmp_path / "run" / "plan.json").exists()
