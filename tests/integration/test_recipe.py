"""The 70B fine-tune recipe of docs (parallel.tp=8 zero=stage3 compile=true precision=fp8 checkpointing=op
data=text data.packing=document eval.every=100 save.async_mode=thread) at tiny shapes on 4 CPU ranks:
tp=2 x dp=2, fp32 (CPU has no fp8), from a transformers-made Llama checkpoint (`model=hf model.weights=DIR`),
over a small corpus and a tokenizer trained on it, evaluated and saved asynchronously within 3 steps.

Step 1's loss is transformers' on each data-parallel replica's first batch under the same block-causal mask
(a token sees earlier tokens of its own document), with the row's positions (zerolab's rotary positions do
not restart per document: trainer/model/decoder.py block_causal_mask)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import Run, compose_config, hf_checkpoint, run_trainer, train_tokenizer, write_documents
from trainer.data import build_batches

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

RECIPE = (
    "model=hf", "nproc=4", "device=cpu", "parallel.tp=2", "zero=stage3", "compile=true", "precision=fp32",
    "checkpointing=op", "data=text", "data.packing=document", "data.validation_fraction=0.1", "eval.every=2",
    "save.async_mode=thread", "save.every=2", "steps=3", "seq_len=32", "micro_batch=2", "logger=none",
    "log_every=1",
)  # fmt: skip


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[str, ...], Run]:
    """The recipe's overrides (weights and text included) and its run."""
    pytest.importorskip("tokenizers")  # the `data` extra
    pytest.importorskip("datasets")
    tmp = tmp_path_factory.mktemp("recipe")
    texts = write_documents(tmp / "corpus.jsonl", 300)
    tokenizer = train_tokenizer(tmp / "tokenizer", texts)  # 64 tokens, within the checkpoint's 128
    weights = hf_checkpoint(tmp / "llama", "LlamaForCausalLM")
    overrides = (
        *RECIPE, f"model.weights={weights}", f"data.files=[{tmp / 'corpus.jsonl'}]",
        f"data.tokenizer={tokenizer}", f"data.cache_dir={tmp / 'cache'}",
    )  # fmt: skip
    return overrides, run_trainer(tmp / "run", *overrides, timeout=900)


def transformers_loss(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor
) -> float:
    """transformers' mean loss over the counted targets, its attention given the block-causal mask as a
    4-D additive one (0 where a token may attend, the dtype's minimum where not)."""
    T = inputs.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool).tril()
    allowed_B1TT = ((documents[:, :, None] == documents[:, None, :]) & causal_TT)[:, None]
    mask_B1TT = torch.zeros(allowed_B1TT.shape).masked_fill(~allowed_B1TT, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = model(inputs, attention_mask=mask_B1TT).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()  # ignore_index -100, as zerolab's


def test_the_recipe_starts_from_transformers_loss_on_each_replicas_batch(
    recipe: tuple[tuple[str, ...], Run],
) -> None:
    overrides, run = recipe
    config = compose_config(*overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        config.model.weights, dtype=torch.float32
    ).eval()
    losses = []
    for replica in range(2):  # a TP group's two ranks read the same batch; the logged loss is the ranks' mean
        inputs, targets, documents = next(build_batches(config, replica, 2))
        assert documents.unique().numel() > 1 and (targets == -100).any()  # the mask has documents to split
        losses.append(transformers_loss(model, inputs, targets, documents))
    assert len(run.losses) == 3
    assert abs(run.losses[0] - sum(losses) / 2) < 1e-5, (run.losses[0], losses)


def test_the_recipe_evaluates_and_saves_asynchronously(recipe: tuple[tuple[str, ...], Run]) -> None:
    _, run = recipe
    assert [r["step"] for r in run.records if "loss/val" in r] == [2, 3], run.records
    assert (run.out_dir / "checkpoints" / "step_00000002").is_dir()
    assert run.summary["config"]["save"]["async_mode"] == "thread"
