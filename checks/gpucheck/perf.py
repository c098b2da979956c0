"""The performance run's rows (issue 59, item 7): the kernel rates, the profiled step's kernel
breakdown, the CUPTI A/B, a larger micro-batch against a smaller, the text-data row; and the
helper that makes the text row's corpus, tokenizer and token cache."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Any

from checks.gpucheck.catalog import KERNEL_RATES_FILE, Setup, job_dir
from checks.gpucheck.memory import memory_figures, memory_verdict
from checks.gpucheck.rates import SIZES, gemm_shapes
from checks.gpucheck.report import Row
from checks.gpucheck.scheduler import Job, failed

GEMM_FLOOR = 0.4
"""A bf16 GEMM of at least GEMM_FLOOR_FLOP below this share of the device's dense bf16 peak fails the
kernel-rates row. A floor, not a target: large bf16 GEMMs are expected at 60-75% of the peak on
Hopper (a guess until the first run measures it); under 40% says the GEMM is not on bf16 tensor cores
at their rate (TF32 is half the bf16 peak)."""
GEMM_FLOOR_FLOP = 1e11
"""The GEMMs the floor applies to: 1b's w13, w2 and output head at 8,192 tokens (2.7e11-1.1e12 FLOP);
smaller ones (125m's, 1b's attention projections) are launch- and tail-bound, reported only."""
TIMING_NOISE = 0.03
"""Two timed runs of one job on one idle GPU are taken as equal within 3% of tokens/s (a guess: the
first run timed each job once; its steady windows' spread is what the next run should measure)."""
STEP_TRACE = "traces/rank0_step3.json"
"""The profiled step's chrome trace (telemetry.trace_steps=[3]: the communication probe's step)."""
CATEGORIES = (
    ("communication", r"nccl"),
    ("attention", r"flash|fmha|attention|sdpa|_attn|mha"),
    ("optimizer", r"adam|multi_tensor_apply"),
    ("gemm", r"gemm|nvjet|xmma|cutlass|cublas|scaled_mm|matmul|triton_tem|splitk"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|triton_(poi|red|per)|softmax|norm|"
                    r"copy|cat_|index|fill|cross_entropy|nll|embedding|scatter|gather|where|sort|segment|"
                    r"grad_weight|arange"),
)  # fmt: skip
"""Kernel name patterns, the first that matches naming its category; the rest is `other`. `optimizer`
holds every multi_tensor_apply kernel: fused AdamW's and clipping's foreach norms (the step's fixed
costs); `elementwise` every other non-GEMM kernel that eager or inductor launches (the embedding's
backward sorts and segments included)."""
OTHER_LIMIT = 0.2
"""The breakdown fails when `other` holds more than this share of the kernel time: the patterns
no longer name the step's kernels."""
SPAN_TOLERANCE = 0.05
"""Kernel time by category may exceed the step's span by this share (kernels overlapping on two
streams); more says kernels outside the step were counted, or counted twice."""


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, name)), "other")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The union of [start, end) intervals: time when any kernel ran."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def breakdown(trace: dict[str, Any]) -> dict[str, Any]:
    """Kernel ms by category, kernel count, the step's span (its first host op to its last kernel)
    and the GPU-busy share of it, from a chrome trace of one step."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    ms = {cat: 0.0 for cat, _ in CATEGORIES} | {"other": 0.0}
    for k in kernels:
        ms[category(k["name"])] += k["dur"] / 1e3
    figures: dict[str, Any] = {
        "kernel_count": len(kernels),
        "kernel_ms": {c: round(v, 3) for c, v in ms.items()},
    }
    if kernels:
        start = min(e["ts"] for e in events)
        end = max(e["ts"] + e["dur"] for e in kernels)
        busy = busy_us([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
        figures |= {"step_ms": round((end - start) / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
                    "gpu_busy_pct": round(100 * busy / (end - start), 1)}  # fmt: skip
    return figures


def breakdown_verdict(figures: dict[str, Any]) -> list[str]:
    kernel_ms = sum(figures["kernel_ms"].values())
    if not figures["kernel_count"]:
        return ["no CUDA kernel in the profiled step"]
    wrong = []
    if kernel_ms > figures["step_ms"] * (1 + SPAN_TOLERANCE):
        wrong.append(f"kernels sum to {kernel_ms:.1f} ms, over the step's {figures['step_ms']:.1f} ms "
                     f"(allowed +{SPAN_TOLERANCE:.0%})")  # fmt: skip
    if figures["kernel_ms"]["other"] > OTHER_LIMIT * kernel_ms:
        share = figures["kernel_ms"]["other"] / kernel_ms
        wrong.append(f"'other' holds {share:.0%} of kernel time (allowed {OTHER_LIMIT:.0%}): unnamed kernels")
    return wrong


def check_breakdown(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The profiled step of the 1b eager baseline: kernel ms by category, count, GPU-busy share."""
    (job,) = jobs.values()
    path = job_dir(setup, job.name) / STEP_TRACE
    if job.status != "ok" or not path.is_file():
        return Row("", "fail", {}, failed(job) if job.status != "ok" else f"no trace at {path}")
    trace = json.loads(path.read_text())
    figures = breakdown(trace)
    if setup.dry_run:  # a CPU trace has host ops only
        ops = sum(1 for e in trace.get("traceEvents", []) if e.get("cat") == "cpu_op")
        return Row("", "info", {**figures, "cpu_ops": ops}, "dry run: a CPU trace, no kernels to break down")
    wrong = breakdown_verdict(figures)
    return Row("", "fail" if wrong else "pass", figures, "; ".join(wrong) or "kernel time by category")


def kernel_rates_verdict(rates: dict[str, Any], dry_run: bool) -> list[str]:
    """What the rates file lacks (a GEMM shape, fp8 on a GPU that has it, an SDPA backend, a figure),
    and on the GPU the large bf16 GEMMs under GEMM_FLOOR of the device's peak."""
    models, tokens = SIZES["dry" if dry_run else "gpu"][:2]
    expected = gemm_shapes(models, tokens)
    gemm = rates.get("gemm", {})
    wrong = [f"bf16 GEMM {n} not measured" for n in expected if n not in gemm.get("bf16", {})]
    if not gemm.get("fp8_unavailable"):
        wrong += [f"fp8 GEMM {n} not measured" for n in expected if n not in gemm.get("fp8", {})]
    wrong += [f"{key} not measured" for key in ("copy_gbps", "adamw_params_per_s", "dispatch_us")
              if not rates.get(key)]  # fmt: skip
    sdpa = rates.get("sdpa", {})
    wrong += [
        f"sdpa {b} neither measured nor refused"
        for b in ("flash", "efficient", "cudnn", "math")
        if b not in sdpa
    ]
    peak = rates.get("peak_bf16_tflops")
    if dry_run or peak is None:
        return wrong
    for name, (m, k, n) in expected.items():
        rate = gemm.get("bf16", {}).get(name)
        if rate is not None and 2 * m * k * n >= GEMM_FLOOR_FLOP and rate < GEMM_FLOOR * peak:
            wrong.append(
                f"bf16 GEMM {name} at {rate:.0f} TFLOPS, under {GEMM_FLOOR:.0%} of the {peak:g} peak"
            )
    return wrong


def check_kernel_rates(setup: Setup, jobs: dict[str, Job]) -> Row:
    (job,) = jobs.values()
    path = setup.out / "jobs" / KERNEL_RATES_FILE
    if job.status != "ok" or not path.is_file():
        return Row("", "fail", {}, failed(job) if job.status != "ok" else f"no {path}")
    rates = json.loads(path.read_text())
    wrong = kernel_rates_verdict(rates, setup.dry_run)
    figures = rates_summary(rates)
    note = "; ".join(wrong[:4]) + (f" (+{len(wrong) - 4} more)" if len(wrong) > 4 else "")
    if not wrong:
        note = f"every rate measured, in {path.name}" + (
            "; dry run: CPU, floors not judged" if setup.dry_run else ""
        )
    return Row("", "fail" if wrong else "pass", figures, note)


def rates_summary(rates: dict[str, Any]) -> dict[str, Any]:
    """The row's figures: the best and worst GEMM rate per dtype, SDPA fwd+bwd per backend, the rest."""
    figures: dict[str, Any] = {"device": rates.get("device")}
    for dtype in ("bf16", "fp8"):
        values = rates.get("gemm", {}).get(dtype) or {}
        if values:
            figures[f"{dtype}_gemm_tflops"] = [sig(min(values.values())), sig(max(values.values()))]
    figures["sdpa_fwd_bwd_tflops"] = {b: sig(v["fwd_bwd_tflops"]) for b, v in rates.get("sdpa", {}).items()
                                      if isinstance(v, dict) and "fwd_bwd_tflops" in v}  # fmt: skip
    for key in ("copy_gbps", "adamw_params_per_s", "dispatch_us"):
        figures[key] = sig(rates[key]) if rates.get(key) else None
    return figures


def sig(x: float) -> float:
    """Four significant digits: a GPU's hundreds of TFLOPS and a dry run's CPU thousandths alike."""
    return float(f"{x:.4g}")


def tokens_per_s(job: Job) -> float | None:
    return job.summary.get("throughput/tokens_per_s")


def check_cupti(setup: Setup, jobs: dict[str, Job]) -> Row:
    """The 1b baseline (TEARDOWN_CUPTI=1: the ranks' default, trainer/cuda.py) against the same job
    with CUPTI left attached after its profiled step (TEARDOWN_CUPTI=0: libkineto tears CUPTI down
    only when the variable is "1", its `cuptiTearDown_`; a user's value wins over the ranks'
    default). The ratio is reported; the row fails only when a measurement is missing or the
    torn-down job is slower beyond TIMING_NOISE."""
    torn_down, attached = jobs.values()
    for job in (torn_down, attached):
        if job.status != "ok" or tokens_per_s(job) is None:
            return Row("", "fail", {}, failed(job) if job.status != "ok" else f"{job.name}: no tokens/s")
        if not (job_dir(setup, job.name) / STEP_TRACE).is_file():
            return Row("", "fail", {}, f"{job.name}: no profiled step ({STEP_TRACE}): nothing to tear down")
    ratio = tokens_per_s(torn_down) / tokens_per_s(attached)
    figures = {"torn_down_tokens_per_s": round(tokens_per_s(torn_down), 1),
               "attached_tokens_per_s": round(tokens_per_s(attached), 1), "ratio": round(ratio, 3)}  # fmt: skip
    if setup.dry_run:
        return Row("", "info", figures, "dry run: CPU has no CUPTI; one job stands for both arms")
    if ratio < 1 - TIMING_NOISE:
        return Row(
            "", "fail", figures, f"torn down {ratio:.3f}x attached: slower beyond {TIMING_NOISE:.0%} noise"
        )
    return Row("", "pass", figures, "tokens/s with CUPTI torn down over attached (pytorch/pytorch#146604)")


def check_batch_scaling(setup: Setup, jobs: dict[str, Job]) -> Row:
    """A larger micro-batch of the same job: tokens/s not below the smaller's beyond TIMING_NOISE; an
    eager job's memory also against its plan (compile's is not planned: trainer/plan COMPILE_NOTE)."""
    small, large = jobs.values()
    for job in (small, large):
        if job.status != "ok" or tokens_per_s(job) is None:
            return Row("", "fail", {}, failed(job) if job.status != "ok" else f"{job.name}: no tokens/s")
    ratio = tokens_per_s(large) / tokens_per_s(small)
    mfu = large.summary.get("throughput/mfu_pct")
    figures: dict[str, Any] = {"tokens_per_s": round(tokens_per_s(large), 1), "mfu_pct": round(mfu, 1) if mfu else None,
                               f"over_{small.name}": round(ratio, 3)}  # fmt: skip
    wrong = []
    if "compile=true" not in large.overrides:
        figures.update(memory_figures(large))
        wrong += memory_verdict(setup, figures)
    if setup.dry_run:
        return Row("", "fail" if wrong else "info", figures, "; ".join(wrong) or "dry run: not a timing")
    if ratio < 1 - TIMING_NOISE:
        wrong.append(f"{ratio:.3f}x the tokens/s of {small.name}: a larger micro-batch slower beyond noise")
    return Row(
        "", "fail" if wrong else "pass", figures, "; ".join(wrong) or f"{ratio:.3f}x {small.name}'s tokens/s"
    )


def check_text(setup: Setup, jobs: dict[str, Job]) -> Row:
    """data=text with packing=document: the job trains on the corpus the helper made (its tokens
    cached, so only `tokenizers` is needed on the host), every loss finite and the last below the
    first; tokens/s against the synthetic job reported (it shared the device: not judged)."""
    corpus, synthetic, text = jobs.values()
    for job in (corpus, text):
        if job.status != "ok":
            return Row("", "fail", {}, failed(job))
    losses = text.losses
    figures = {"steps": len(losses), "first_loss": round(losses[0], 4) if losses else None,
               "last_loss": round(losses[-1], 4) if losses else None,
               "tokens_per_s": round(tokens_per_s(text) or 0.0, 1),
               "over_synthetic": round((tokens_per_s(text) or 0) / tokens_per_s(synthetic), 3)
               if synthetic.status == "ok" and tokens_per_s(synthetic) else None}  # fmt: skip
    if not losses or not all(map(math.isfinite, losses)):
        return Row("", "fail", figures, "a loss is not finite (or none was logged)")
    if not losses[-1] < losses[0]:
        return Row("", "fail", figures, "the loss did not fall on a corpus of repeated words")
    return Row(
        "", "pass", figures, "document packing trained: losses finite and falling; tokens/s not judged"
    )


# ----------------------------------------------------------------------------- the text row's helper

WORDS = 200
"""The corpus's vocabulary: a word-level tokenizer of 200 words and 3 specials fits every preset."""
DOCUMENTS = 1500
"""~1,500 documents of 20-400 words: ~300k tokens, above the 30 x 8 x 1,025 one 125m job reads."""


def make_text_corpus(folder: Path, cache_dir: Path) -> Path:
    """A corpus of generated documents (corpus.txt, one blank line between documents: datasets' text
    builder by paragraph), a word-level tokenizer trained on it by `tokenizers`, and its token cache
    entry, written with trainer/text/cache.py's own writer from the same documents, so that a job on
    a host without `datasets` finds its tokens cached (the job still loads the tokenizer). Returns
    the corpus file."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(59)
    vocabulary = [f"w{i}" for i in range(WORDS)]
    docs = [" ".join(rng.choices(vocabulary, k=rng.randint(20, 400))) for _ in range(DOCUMENTS)]
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n\n".join(docs) + "\n")
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"],
                                                                   show_progress=False))  # fmt: skip
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    write_cache(corpus, docs, folder, cache_dir, tokenizer)
    return corpus


def write_cache(corpus: Path, docs: list[str], folder: Path, cache_dir: Path, tokenizer: Any) -> None:
    """The cache entry of `corpus` as trainer/text/cache.py's `tokenize` lays it out: each document's
    ids and EOS, the documents' starts, the meta."""
    import numpy as np

    from trainer.text.cache import Meta, entry_dir, token_dtype, write_entry
    from trainer.text.tokenizer import TokenizerFiles, specials

    files = TokenizerFiles.of(str(folder))
    ids = specials(tokenizer, files)
    dtype = token_dtype(ids.vocab_size)
    chunks = [np.asarray([*e.ids, ids.eos_id], dtype=dtype) for e in tokenizer.encode_batch(docs)]
    starts = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in chunks], out=starts[1:])
    tokens = np.concatenate(chunks)
    entry = entry_dir(str(cache_dir), [corpus], "text", files)
    write_entry(
        entry, tokens, starts, Meta(ids.vocab_size, ids.eos_id, ids.bos_id, len(chunks), int(tokens.shape[0]))
    )
