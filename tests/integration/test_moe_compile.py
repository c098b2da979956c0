"""A mixture of experts with compiled blocks (model=tiny-moe compile=true), against one eager rank.

Each block is compiled whole; inside it the router's log writes and the experts (their host-side counts, the
loop over them, expert parallelism's all-to-alls) stay eager (`torch.compiler.disable` in trainer/model/moe.py).
One compiled rank, and two at parallel.ep=2 zero=stage3, each against one eager rank with the same global batch:
every step's loss within 1e-5 (aot_eager traces what inductor would compile and runs the traced ops as they
are, as tests/integration/test_tp_compile.py checks TP), the routing metrics (each layer's tokens per expert,
max over mean) equal, and the aux-loss-free biases in the step-3 save bitwise equal (tests/integration/test_moe.py
checks eager ep=2 against one rank the same way). Slow tier: compiling on CPU costs ~30 s a job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import Run
from tests.integration.test_moe import EP2, ONE_RANK, job

COMMON = ("steps=3", "moe.bias_rate=0.001", "save.every=3")
COMPILED = ("compile=true", "compile_backend=aot_eager")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = tmp_path_factory.mktemp("moe_compile")
    return {
        "eager": job(out / "eager", *ONE_RANK, *COMMON),
        "compiled": job(out / "compiled", *ONE_RANK, *COMMON, *COMPILED),
        "compiled_ep2": job(out / "compiled_ep2", *EP2, *COMMON, *COMPILED),
    }


def expert_biases(run: Run, scratch: Path) -> dict[str, torch.Tensor]:
    """Every router's expert_bias in the run's step-3 save, through DCP's own converter."""
    target = scratch / f"{run.out_dir.name}.pt"
    dcp_to_torch_save(run.out_dir / "checkpoints" / "step_00000003", target)
    state: dict[str, Any] = torch.load(target, weights_only=False)
    flat = {f"{k}.{name}": v for k, d in state.items() if isinstance(d, dict) for name, v in d.items()}
    return {key: value for key, value in flat.items() if key.endswith("expert_bias")}


def routing(run: Run) -> list[dict[str, float]]:
    return [{k: v for k, v in record.items() if k.startswith("moe/imbalance/")} for record in run.records]


@pytest.mark.slow  # 35-75 s (measured) of three jobs, two of them compiling on CPU
@pytest.mark.parametrize("name", ["compiled", "compiled_ep2"])
def test_compiled_moe_blocks_train_as_one_eager_rank(runs: dict[str, Run], name: str, tmp_path: Path) -> None:
    eager, compiled = runs["eager"], runs[name]
    assert len(compiled.losses) == len(eager.losses) == 3
    assert max(abs(a - b) for a, b in zip(compiled.losses, eager.losses)) < 1e-5, (
        compiled.losses,
        eager.losses,
    )
    assert routing(compiled) == routing(eager)
    assert len(routing(eager)[0]) == 4  # one per block
    ours, theirs = (expert_biases(run, tmp_path) for run in (compiled, eager))
    assert len(ours) == 4 and ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
        assert ours[key].abs().max() > 0  # they moved
