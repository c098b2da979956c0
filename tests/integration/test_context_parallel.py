"""Context parallelism (parallel.cp=2) on CPU ranks: each rank holds half of every sequence (head-tail chunks),
and attention sees the whole of it through Ulysses' all-to-alls or the K/V all-gather.

Against one rank of the same global batch (4 sequences of 64 tokens), fp32, 3 steps: every step's loss within
1e-5, and the first step's gradients (the whole model's norm and every layer's, before an optimizer step can
carry a rounding difference forward) within 1e-5 relative. Each implementation with causal attention and with
data.packing=document (the block-causal mask over the whole row); cp=2 x dp=2 on 4 ranks at zero=stage3;
and cp=2 x tp=2 on 4 ranks (the all-gather: the tiny model's 2 kv heads cannot split over tp x cp = 4
under Ulysses). The cp 2 x dp 2 run's save resumes on one rank without cp. Run under every torch the project claims (CI's 2.11 tier too).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers import TINY, Run, run_trainer, train_tokenizer, write_documents

pytestmark = pytest.mark.torch_versions  # torch's autograd functional collectives and DeviceMesh._flatten

STEPS = ("steps=3", "precision=fp32", "optim.warmup_steps=2")
POINTS = {
    "ulysses causal": ("nproc=2", "micro_batch=4", "parallel.cp_impl=ulysses"),
    "allgather causal": ("nproc=2", "micro_batch=4", "parallel.cp_impl=allgather"),
    "ulysses document": ("nproc=2", "micro_batch=4", "parallel.cp_impl=ulysses", "document"),
    "allgather document": ("nproc=2", "micro_batch=4", "parallel.cp_impl=allgather", "document"),
    "ulysses cp2 dp2 stage3": (
        "nproc=4",
        "micro_batch=2",
        "parallel.cp_impl=ulysses",
        "zero=stage3",
        "save.every=2",
    ),
    "allgather cp2 tp2 stage3": (
        "nproc=4",
        "micro_batch=4",
        "parallel.cp_impl=allgather",
        "parallel.tp=2",
        "zero=stage3",
    ),
}


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    """data=text with data.packing=document over a small corpus and a tokenizer trained on it."""
    pytest.importorskip("tokenizers")  # the `data` extra
    pytest.importorskip("datasets")
    tmp = tmp_path_factory.mktemp("text")
    texts = write_documents(tmp / "corpus.jsonl", 300)
    tokenizer = train_tokenizer(tmp / "tokenizer", texts)
    return (
        "data=text", f"data.files=[{tmp / 'corpus.jsonl'}]", f"data.tokenizer={tokenizer}",
        f"data.cache_dir={tmp / 'cache'}", "data.packing=document",
    )  # fmt: skip


def job(out_dir: Path, *overrides: str) -> Run:
    return run_trainer(out_dir, *TINY, *STEPS, *overrides, timeout=900)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, text: tuple[str, ...]) -> dict[str, Run]:
    """One rank, the same global batch: causal (synthetic tokens) and document-packed text."""
    out = tmp_path_factory.mktemp("reference")
    one = ("nproc=1", "micro_batch=4", "save=off")
    return {"causal": job(out / "causal", *one), "document": job(out / "document", *one, *text)}


@pytest.fixture(scope="module", params=list(POINTS))
def cp_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, text: tuple[str, ...]
) -> tuple[str, Run]:
    overrides = [o for o in POINTS[request.param] if o != "document"]
    if not any(o.startswith("save.") for o in overrides):
        overrides.append("save=off")
    data = text if "document" in POINTS[request.param] else ()
    return request.param, job(tmp_path_factory.mktemp("cp") / "run", "parallel.cp=2", *overrides, *data)


def test_losses_equal_one_rank_of_the_same_global_batch(
    cp_run: tuple[str, Run], references: dict[str, Run]
) -> None:
    name, run = cp_run
    reference = references["document" if "document" in name else "causal"]
    assert len(run.losses) == len(reference.losses) == 3
    worst = max(abs(a - b) for a, b in zip(run.losses, reference.losses))
    assert worst < 1e-5, (name, run.losses, reference.losses)


def test_first_step_gradients_equal_one_rank(cp_run: tuple[str, Run], references: dict[str, Run]) -> None:
    """The gradient norm of the whole model and of every layer (telemetry.layer_norms) at step 1."""
    name, run = cp_run
    reference = references["document" if "document" in name else "causal"].records[0]
    keys = [key for key in reference if key.startswith("grad_norm/") or key == "optim/grad_norm"]
    assert len(keys) >= 6, keys  # the whole model's, and the embedding's, 4 blocks' and the head's at least
    for key in keys:
        assert math.isclose(run.records[0][key], reference[key], rel_tol=1e-5), (name, key)


def test_a_cp_save_resumes_on_one_rank(
    tmp_path: Path, cp_run: tuple[str, Run], references: dict[str, Run]
) -> None:
    """The step-2 save of cp 2 x dp 2 (FSDP2's shards over the flattened dp x cp dim) goes on at one rank
    without cp, the same global batch: DCP reshards; step 3 as the uninterrupted run's, within
    test_resume.py's reshard tolerance (rel 1e-5)."""
    name, run = cp_run
    if "save.every=2" not in POINTS[name]:
        pytest.skip("the cp2 dp2 run saves")
    save = run.out_dir / "checkpoints" / "step_00000002"
    resumed = job(tmp_path / "run", "nproc=1", "micro_batch=4", "zero=stage3", "save=off", f"resume={save}")
    assert [r["step"] for r in resumed.records] == [3]
    expected = references["causal"].records[2]["loss/train"]
    assert math.isclose(resumed.records[0]["loss/train"], expected, rel_tol=1e-5), (resumed.records, expected)
