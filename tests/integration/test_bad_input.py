"""Bad input ends in one line naming the key and what is allowed, before any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import hf_checkpoint, run_in_one_process, run_trainer, train_tokenizer, write_documents
from trainer.config.composition import CP, EP, MOE, PP, REFUSALS, TP

TEXT = ("data=text", "data.tokenizer={tmp}/tokenizer", "data.cache_dir={tmp}/cache")
CASES = [
    (["zero=stage5"], "zero=stage5", "stage0, stage1, stage2, stage3"),
    (["precision=fp17"], "precision=fp17", "bf16, fp16, fp32"),
    (["precision=fp8", "precision.fp8_all_gather=true"], "precision.fp8_all_gather=true", "gloo backend"),
    (
        ["precision=fp8", "precision.fp8_recipe=rowwise", "precision.fp8_all_gather=true"],
        "precision.fp8_all_gather=true with precision.fp8_recipe=rowwise",
        "precision.fp8_recipe=tensorwise",
    ),
    (["precision=fp8", "precision.fp8_recipe=bogus"], "precision.fp8_recipe=bogus", "tensorwise, rowwise"),
    (["precision=fp8", "precision.fp8_filter=some"], "precision.fp8_filter=some", "auto, all"),
    (
        ["precision=fp8", "precision.fp8_recipe=rowwise_with_gw_hp"],
        "precision.fp8_filter=auto with precision.fp8_recipe=rowwise_with_gw_hp",
        "use precision.fp8_filter=all",
    ),
    (
        ["precision=bf16", "precision.fp8_recipe=rowwise"],
        "precision.fp8_recipe=rowwise needs precision=fp8",
        "use precision=fp8",
    ),
    (["micro_batch=0"], "micro_batch", ">= 1"),
    (["steps=-1"], "steps", ">= 1"),
    (["seq_len=1024"], "seq_len", "model.max_seq_len (512)"),
    (["offload=cpu", "zero=stage1"], "offload=cpu", "zero=stage2 or zero=stage3"),
    (
        ["nproc=2", "parallel.pp=2", "grad_accum=2", "fault.kind=nan_loss", "fault.rank=0"],
        "fault.kind=nan_loss with parallel.pp=2",
        "use fault.rank in 1",
    ),
    (["offload=nvme", "offload.path={tmp}", "zero=stage1"], "offload=nvme", "zero=stage2 or zero=stage3"),
    (["offload=nvme", "zero=stage3"], "offload=nvme needs offload.path", "writable directory"),
    (
        ["offload=nvme", "offload.path={tmp}", "zero=stage3", "save.async_mode=thread"],
        "save.async_mode=thread with offload=nvme",
        "save.async_mode=off",
    ),
    (["nproc=0"], "nproc", "auto or an integer >= 1"),
    (["zero=stage2", "zero.bucket_cap_mb=10"], "zero.bucket_cap_mb", "zero=stage0 or stage1"),
    (["zero.reduce_dtype=fp8"], "zero.reduce_dtype=fp8", "fp32, bf16"),
    (["zero.reduce_every=sometimes"], "zero.reduce_every=sometimes", "micro_batch, step"),
    (["zero=stage1", "zero.reduce_dtype=bf16"], "zero.reduce_dtype=bf16", "zero=stage2 or stage3"),
    (["zero=stage3", "zero.shard_ranks=4", "nproc=2"], "zero.shard_ranks=4 is larger than the world", "1, 2"),
    (["zero=stage3", "zero.shard_ranks=3", "nproc=4"], "zero.shard_ranks=3 must divide", "1, 2, 4"),
    (["zero=stage2", "zero.hpz_ranks=2"], "zero.hpz_ranks", "needs zero=stage3"),
    (["zero=stage3", "zero.compression=powersgd"], "zero.compression=powersgd", "zero.compression=none"),
    (
        ["nproc=1", "zero.compression=powersgd"],
        "zero.compression=powersgd changes how",
        "zero.compression=none",
    ),
    (["nproc=1", "zero.sync_every=4"], "zero.sync_every=4 changes how", "zero.sync_every=1"),
    (["zero.topk_ratio=0"], "zero.topk_ratio", "(0, 1]"),
    (["zero.topk_ratio=2"], "zero.topk_ratio", "(0, 1]"),
    (["zero.compression=gzip"], "zero.compression=gzip", "none, powersgd, topk"),
    (
        ["zero.compression=topk", "zero.sync_every=4"],
        "zero.compression=topk and zero.sync_every=4",
        "choose one",
    ),
    (
        ["zero=stage1", "zero.reshard_after_backward=false"],
        "zero.reshard_after_backward=false",
        "zero=stage2 or stage3",
    ),
    (["zero.reshard_after_backward=sometimes"], "zero.reshard_after_backward", "true"),
    (
        ["zero=stage3", "zero.hpz_ranks=2", "nproc=2"],
        "zero.hpz_ranks=2 must divide the shard group",
        "4 or more",
    ),
    (["model=13b"], "model=13b", "a smaller model"),
    (["mode=advise", "global_batch=0"], "global_batch", ">= 1"),
    (["mode=advise", "global_batch=15", "nproc=2"], "global_batch (15)", "divisible by the 2 ranks"),
    (["mode=advise"], "mode=advise needs global_batch", "global_batch=N"),
    (["global_batch=16"], "global_batch is read by mode=advise only", "micro_batch and grad_accum"),
    (["attention=efficient"], "attention=efficient", "allowed on CPU: auto, flash, math"),
    (["attention=cudnn"], "attention=cudnn needs a CUDA GPU", "allowed on CPU: auto, flash, math"),
    (["plan.accelerator=H300"], "plan.accelerator=H300", "h100-pcie"),
    (
        ["mode=advise", "global_batch=16", "plan.accelerator=l40s"],
        "no rates for plan.accelerator=l40s",
        "missing its matmul efficiency",
    ),
    (["compile=true", "compile_backend=tvm"], "compile_backend", "inductor, aot_eager, eager"),
    (
        ["checkpointing=op", "checkpointing.save_ops=[aten.mm,aten.not_an_op]"],
        "checkpointing.save_ops: 'aten.not_an_op'",
        "is not a torch op",
    ),
    (["precision=bf16", "zero=stage3", "model=13b"], "model=13b", "a smaller model"),
    # Mistakes Hydra and OmegaConf catch while composing (trainer/cli.py one_line_config_errors)
    (["micro_batch=abc"], "micro_batch", "an integer >= 1 or auto"),
    (["zero.stage=stage9"], "zero.stage=stage9", "expected one of [stage0, stage1, stage2, stage3]"),
    (["optim.lr=fast"], "optim.lr=fast", "converted to Float"),
    (["lr=0.1"], "lr is not a config key", "--cfg job"),
    (["+optim.betas2=0.9"], "optim.betas2 is not a config key", "--cfg job"),
    (["steps=[1"], "error: ", "[1"),
    # Beyond one host (trainer/cluster.py)
    (["nodes=0"], "nodes", "an integer >= 1"),
    (["node_rank=2", "nodes=2"], "node_rank", "0..1"),
    (["nodes=2"], "nodes=2 needs rdzv_endpoint=host:port", "hydra/launcher=slurm"),
    (["nodes=2", "rdzv_endpoint=somehost"], "rdzv_endpoint", "host:port"),
    (["hydra/launcher=pbs"], "hydra/launcher=pbs", "basic, local, slurm, submitit_local, submitit_slurm"),
    # data=text (trainer/text/): the files `write_text_inputs` puts in {tmp}
    ([*TEXT, "data.files=[{tmp}/missing.jsonl]"], "data.files", "missing.jsonl does not exist"),
    ([*TEXT, "data.files=[{tmp}/empty.jsonl]"], "data.files", "empty.jsonl holds no text"),
    ([*TEXT, "data.files=[{tmp}/body.jsonl]"], "data.text_field", "without field 'text'"),
    (
        [*TEXT, "data.files=[{tmp}/corpus.jsonl]", "data.tokenizer={tmp}/wide"],
        "data.tokenizer",
        "model.vocab_size=512",
    ),
    # Issue 60: a 0-byte file, a checkpoint cut short, and what was silently changed
    (
        [*TEXT, "data.files=[{tmp}/corpus.jsonl,{tmp}/zero.jsonl]"],
        "data.files",
        "zero.jsonl is empty (0 bytes)",
    ),
    (
        [
            *TEXT,
            "data.files=[{tmp}/corpus.jsonl]",
            "data.validation_files=[{tmp}/corpus.jsonl]",
            "data.validation_fraction=0.1",
        ],
        "data.validation_files and data.validation_fraction=0.1",
        "choose one",
    ),
    (
        ["model=hf", "model.weights={tmp}/cut", "seq_len=32"],
        "model.weights=",
        "model.safetensors is truncated",
    ),
    (
        ["micro_batch=auto", "global_batch=16", "grad_accum=2"],
        "grad_accum=2 with micro_batch=auto",
        "drop grad_accum",
    ),
    # Tensor parallelism (trainer/rank/tensor_parallel.py): heads, nodes, what it does not compose with
    (
        ["mode=plan", "model=7b", "model.n_heads=8", "model.n_kv_heads=8", "parallel.tp=3"],
        "parallel.tp=3 must divide model.n_heads=8",
        "1, 2, 4",
    ),
    (
        ["mode=plan", "model=7b", "nproc=8", "parallel.tp=16"],
        "parallel.tp=16 must divide nproc=8",
        "1, 2, 4, 8",
    ),
    (["model.n_kv_heads=1", "parallel.tp=2"], "parallel.tp=2 must divide model.n_kv_heads=1", "allowed: 1"),
    (
        ["nproc=4", "parallel.tp=2"],
        "parallel.tp=2 with zero=stage0 on 2 data-parallel replicas",
        "zero=stage2 or stage3",
    ),
    (["parallel.sp=true"], "parallel.sp=true", "parallel.tp > 1"),
    # Pipeline parallelism (trainer/rank/pipeline.py): blocks per stage, 1F1B's warm-up, the schedules
    (["parallel.pp=5"], "parallel.pp=5 makes 5 pipeline stages but model=tiny has 4 blocks", "<= 4"),
    (
        ["parallel.pp=2", "parallel.pp_schedule=1f1b", "grad_accum=1"],
        "parallel.pp_schedule=1f1b streams grad_accum=1",
        "grad_accum >= 2",
    ),
    (["parallel.pp_schedule=zero_bubble"], "parallel.pp_schedule", "gpipe, 1f1b, interleaved_1f1b"),
    (
        ["parallel.pp=3", "grad_accum=3", "nproc=2"],
        "parallel.pp=3 * parallel.tp=1 must divide the world of 2",
        "1, 2",
    ),
    (
        ["parallel.cp=4", "nproc=4"],
        "model.n_kv_heads=2 of model=tiny must divide by parallel.tp=1 * parallel.cp=4",
        "allowed parallel.cp: 1, 2, or parallel.cp_impl=allgather",
    ),
    (["parallel.cp=2", "nproc=2", "seq_len=66"], "seq_len=66 must be a multiple of 4", "2 * cp = 4 chunks"),
    (
        ["parallel.cp=3", "parallel.cp_impl=allgather", "nproc=2", "seq_len=96"],
        "parallel.cp=3 must divide the 2 ranks",
        "allowed parallel.cp: 1, 2",
    ),
    (["parallel.cp=0"], "parallel.cp must be an integer >= 1", "got 0"),
    (["parallel.cp_impl=ring"], "parallel.cp_impl", "ulysses, allgather"),
    # a mixture of experts (model.n_experts > 0, trainer/model/moe.py)
    (["model=tiny-moe", "model.top_k=9"], "model.top_k must be in 1..model.n_experts (8), got 9", "1..model"),
    (["model=tiny-moe", "moe.capacity_factor=0"], "moe.capacity_factor must be > 0", "or null (dropless)"),
    (
        ["model=tiny-moe", "model.n_experts=6", "parallel.ep=4", "zero=stage3", "nproc=4"],
        "parallel.ep=4 must divide model.n_experts=6",
        "allowed: 1, 2, 3, 6",
    ),
    (
        ["model=tiny-moe", "parallel.ep=4", "zero=stage3", "nproc=2"],
        "parallel.ep=4 must divide the 2 data-parallel ranks",
        "allowed: a divisor of 2",
    ),
    (
        ["model=tiny-moe", "parallel.ep=2", "zero=stage0", "nproc=4"],
        "parallel.ep=2 must equal the 4 data-parallel ranks at zero=stage0",
        "allowed: parallel.ep=4",
    ),
    (["parallel.ep=2", "zero=stage3", "nproc=2"], "parallel.ep=2 shards the experts", "model=tiny-moe"),
]


# What does not compose (trainer/config/composition.py REFUSALS): one case per row, made from the table, so
# that a row added or dropped adds or drops its case; each row's settings (besides its parallel degree of 2)
# that make it the first row to refuse. A row without an entry here fails
# test_every_refusal_of_the_table_has_a_case.
REFUSAL_SETTINGS: dict[tuple[str, str], tuple[str, ...]] = {
    (TP, "model.tie_embeddings=true"): ("model.tie_embeddings=true",),
    (TP, "zero=stage1"): ("zero=stage1",),
    (TP, "zero.hpz_ranks"): ("nproc=8", "zero=stage3", "zero.hpz_ranks=2"),
    (TP, "zero.compression"): ("zero.compression=powersgd",),
    (TP, "zero.sync_every"): ("zero.sync_every=4",),
    (PP, "zero.reduce_every=micro_batch"): ("zero.reduce_every=micro_batch",),
    (PP, "zero.reshard_after_backward=false"): (
        "zero=stage3",
        "zero.reduce_every=step",
        "zero.reshard_after_backward=false",
    ),
    (PP, "model.tie_embeddings=true"): ("model.tie_embeddings=true",),
    (EP, "zero=stage1"): ("zero=stage1",),
    (EP, "zero.compression"): ("zero=stage0", "zero.compression=powersgd"),
    (EP, "zero.sync_every"): ("zero=stage0", "zero.sync_every=2"),
    (EP, "zero.shard_ranks"): ("zero=stage3", "zero.shard_ranks=1"),
    (EP, "zero.hpz_ranks where ep is all of ZeRO's ranks"): ("zero=stage3", "zero.hpz_ranks=2"),
    (EP, "offload where ep is all of ZeRO's ranks"): (
        "zero=stage3",
        "offload=nvme",
        "offload.path={tmp}",
    ),
    (MOE, "parallel.tp > 1"): ("parallel.tp=2",),
    (EP, "parallel.pp > 1"): ("nproc=4", "parallel.pp=2", "grad_accum=2"),
}
DEGREE = {  # 1F1B streams >= 2 micro-batches
    TP: ("parallel.tp=2",),
    PP: ("parallel.pp=2", "grad_accum=2"),
    CP: ("parallel.cp=2", "nproc=2"),
    EP: ("model=tiny-moe", "parallel.ep=2", "nproc=2"),
    MOE: ("model=tiny-moe", "model.n_experts=2", "model.top_k=1"),
}
REFUSAL_CASES = [
    (
        [*DEGREE[row.first], *REFUSAL_SETTINGS[(row.first, row.second)]],
        f"{row.first}=2 with {row.second}",
        f"{row.first}={row.off}",  # every row's way out ends in it
    )
    for row in REFUSALS
    if (row.first, row.second) in REFUSAL_SETTINGS
]
CASES += REFUSAL_CASES


# Every case through `python -m trainer`'s own entry point (trainer/__main__.py, run as __main__),
# all in one process: a fresh interpreter per case would pay torch's and Hydra's import each time.


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each case's exit status, stdout and stderr, by case id, with its output directory."""
    tmp = tmp_path_factory.mktemp("bad_input")
    write_text_inputs(tmp)
    argvs = [
        [
            "device=cpu",
            "logger=none",
            *(o.replace("{tmp}", str(tmp)) for o in overrides),
            f"hydra.run.dir={tmp / str(n)}",
        ]
        for n, (overrides, _, _) in enumerate(CASES)
    ]
    results = run_in_one_process(argvs, tmp / "results.json", timeout=600)
    return {
        case_id(case): {**result, "out": tmp / str(n)} for n, (case, result) in enumerate(zip(CASES, results))
    }


def write_text_inputs(tmp: Path) -> None:
    """A corpus and its tokenizer, a corpus without text, one without the `text` field, a 0-byte file,
    a tokenizer of 603 tokens (the tiny model has 512), and a Hugging Face checkpoint whole and cut short."""
    texts = write_documents(tmp / "corpus.jsonl", 20)
    (tmp / "zero.jsonl").write_text("")
    weights = hf_checkpoint(tmp / "cut", "LlamaForCausalLM") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    hf_checkpoint(tmp / "whole", "LlamaForCausalLM")
    train_tokenizer(tmp / "tokenizer", texts)
    (tmp / "empty.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    (tmp / "body.jsonl").write_text('{"body": "a document under another field"}\n')
    train_tokenizer(tmp / "wide", [" ".join(f"w{i}" for i in range(600))], vocab_size=603, word_level=True)


def case_id(case: tuple[list[str], str, str]) -> str:
    return " ".join(case[0])


@pytest.mark.parametrize("overrides,key,allowed", CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_one_line_naming_the_key(
    outcomes: dict[str, dict[str, Any]], overrides: list[str], key: str, allowed: str
) -> None:
    run = outcomes[" ".join(overrides)]
    lines = [line for line in run["stderr"].splitlines() if line.strip()]
    assert run["returncode"] == 2
    assert len(lines) == 1, run["stderr"]
    assert lines[0].startswith("error: ") and key in lines[0] and allowed in lines[0]
    assert "Traceback" not in run["stdout"] + run["stderr"]
    assert not (run["out"] / "metrics.jsonl").exists()  # no rank ever started


def test_every_refusal_of_the_table_has_a_case() -> None:
    """One case per row of REFUSALS, each with the settings of its row, and no settings for a row that is gone."""
    rows = {(row.first, row.second) for row in REFUSALS}
    assert rows == REFUSAL_SETTINGS.keys(), sorted(rows ^ REFUSAL_SETTINGS.keys())
    assert len(REFUSAL_CASES) == len(rows) > 0


def test_the_same_mistake_in_a_fresh_process_is_the_same_line(
    tmp_path: Path, outcomes: dict[str, dict[str, Any]]
) -> None:
    """The in-process driver is faithful: a real `python -m trainer` says exactly what it recorded."""
    for overrides in (["micro_batch=abc"], ["offload=cpu", "zero=stage1"]):  # Hydra's error; the schema's
        proc = run_trainer(
            tmp_path / "run", "device=cpu", "logger=none", *overrides, check=False, timeout=120
        )
        assert proc.returncode == 2
        assert proc.stderr.strip() == outcomes[" ".join(overrides)]["stderr"].strip()
