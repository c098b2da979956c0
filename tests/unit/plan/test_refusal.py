"""The refusal's words (trainer/plan/refusal.py) under a pipeline (issue 60, item 7): what binds is the stage's
unsharded parameters and gradient, and the ways out are more stages or tensor parallelism of valid sizes."""

from __future__ import annotations

import re

from tests.helpers import compose_config
from trainer.plan import build_plan, refusal

H100 = ("mode=plan", "model=llama3-70b", "plan.accelerator=h100", "zero=stage3", "grad_accum=8")


def nothing_fits(*overrides: str, world: int) -> str:
    line = refusal(build_plan(compose_config(*H100, *overrides), "cuda", world))
    assert line is not None and "\n" not in line
    return line.split("Nothing simple fits ", 1)[1]


def test_the_pipelines_binding_cause_is_the_stages_unsharded_gradient_and_offers_valid_splits() -> None:
    """70b in 4 stages of 2 ranks: each stage's 17.6B parameters and their gradient unsharded within the
    step; pp=8 or tp=2 (the only valid sizes: 8 ranks, one node) split the stage but do not fit alone."""
    line = nothing_fits("nproc=8", "parallel.pp=4", world=8)
    assert line.startswith("(what binds: the stage's unsharded parameters and gradient (")
    assert line.endswith(
        "GiB of buffers: PipelineStage gathers the stage's parameters and accumulates its whole gradient unsharded "
        "within the step, which more data-parallel ranks do not shrink: more pipeline stages or tensor parallelism "
        "split the stage)): a smaller model, more ranks for more pipeline stages or tensor parallelism "
        "(parallel.pp=8 or parallel.tp=2 on these ranks do not fit alone), or more memory per rank, or "
        "plan.enforce=false to try anyway."
    )
    assert "per-block buffers" not in line


def test_a_pipeline_with_no_valid_split_left_names_none() -> None:
    """pp=8 on 8 ranks: no larger pp divides the world, and a tp would need 16 ranks."""
    line = nothing_fits("nproc=8", "parallel.pp=8", world=8)
    assert line.endswith(
        "a smaller model, more ranks for more pipeline stages or tensor parallelism, or more memory per rank, or "
        "plan.enforce=false to try anyway."
    )


def test_a_pipeline_split_that_fits_is_offered() -> None:
    """4 nodes of 8 in 4 stages: tensor parallelism inside each node fits, and is the way out offered."""
    line = refusal(build_plan(compose_config(*H100, "nodes=4", "nproc=8", "parallel.pp=4"), "cuda", 32))
    assert line is not None
    assert re.search(
        r"\. Try parallel\.tp=8 \([\d.]+ GiB reserved\), or plan\.enforce=false to try anyway\.$", line
    ), line
