"""Bad input ends in one line naming the key and what is allowed, before any rank starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CASES = [
    (["zero=stage5"], "zero=stage5", "stage0, stage1, stage2, stage3"),
    (["precision=fp17"], "precision=fp17", "bf16, fp16, fp32"),
    (["micro_batch=0"], "micro_batch", ">= 1"),
    (["steps=-1"], "steps", ">= 1"),
    (["seq_len=1024"], "seq_len", "model.max_seq_len (512)"),
    (["offload=cpu", "zero=stage1"], "offload=cpu", "zero=stage2 or zero=stage3"),
    (["nproc=0"], "nproc", "auto or an integer >= 1"),
    (["zero=stage2", "zero.bucket_cap_mb=10"], "zero.bucket_cap_mb", "zero=stage0 or stage1"),
    (["zero.reduce_dtype=fp8"], "zero.reduce_dtype=fp8", "fp32, bf16"),
    (["zero=stage1", "zero.reduce_dtype=bf16"], "zero.reduce_dtype=bf16", "zero=stage2 or stage3"),
    (["model=13b"], "model=13b", "a smaller model"),
    (["mode=advise", "global_batch=0"], "global_batch", ">= 1"),
    (["mode=advise", "global_batch=15", "nproc=2"], "global_batch (15)", "divisible by the 2 ranks"),
    (["mode=advise"], "mode=advise needs global_batch", "global_batch=N"),
    (["global_batch=16"], "global_batch is read by mode=advise only", "micro_batch and grad_accum"),
    (["precision=bf16", "zero=stage3", "model=13b"], "model=13b", "a smaller model"),
    # Mistakes Hydra and OmegaConf catch while composing (trainer/cli.py one_line_config_errors)
    (["micro_batch=abc"], "micro_batch=abc", "converted to Integer"),
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
]


@pytest.mark.parametrize("overrides,key,allowed", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_naming_the_key(tmp_path: Path, overrides: list[str], key: str, allowed: str) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer", "device=cpu", "logger=none", *overrides, f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and key in lines[0] and allowed in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (out / "metrics.jsonl").exists()  # no rank ever started
