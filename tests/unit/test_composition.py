"""The composition table (trainer/config/composition.py): each row refuses its pair in its own one line, the
advisor offers nothing the table refuses, and docs/design.md holds the table as it renders."""

from __future__ import annotations

import difflib
import re

import pytest

from tests.helpers import REPO, compose_config
from trainer.advise.advisor import choices
from trainer.config import REFUSALS, ConfigError, Refusal, first_refusal, refusals_markdown
from trainer.layout import check_world

DESIGN = REPO / "docs" / "design.md"
BEGIN = "<!-- composition table: rendered from trainer/config/composition.py by tests/unit/test_composition.py -->"
END = "<!-- end composition table -->"

TP = ("parallel.tp=2",)
CP = ("parallel.cp=2",)
PP = ("parallel.pp=2", "grad_accum=2")  # 1F1B streams a micro-batch per stage at least
STAGE3 = ("zero=stage3", "zero.reduce_every=step")  # stage3's file reduces every micro-batch: pp refuses that
EP = ("model=tiny-moe", "parallel.ep=2", "zero=stage3")
MOE = ("model=tiny-moe",)
TEXT = ("data=text", "data.files=[a.txt]", "data.tokenizer=tokenizer.json")

# Each row: (a config that composes, what makes the row refuse it, the message, word for word).
ROWS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "parallel.tp x model.tie_embeddings=true": (
        TP,
        ("model=qwen3-0.6b",),
        "parallel.tp=2 with model.tie_embeddings=true is not supported: the embedding (row-wise) and the "
        "output head (column-wise) shard the one tied weight two ways; use parallel.tp=1",
    ),
    "parallel.pp x zero.reduce_every=micro_batch": (
        PP,
        ("zero.reduce_every=micro_batch",),
        "parallel.pp=2 with zero.reduce_every=micro_batch is not supported; use zero.reduce_every=step or "
        "parallel.pp=1",
    ),
    "parallel.pp x zero.reshard_after_backward=false": (
        (*PP, *STAGE3),
        ("zero.reshard_after_backward=false",),
        "parallel.pp=2 with zero.reshard_after_backward=false is not supported; use "
        "zero.reshard_after_backward=true or parallel.pp=1",
    ),
    "parallel.pp x model.tie_embeddings=true": (
        PP,
        ("model=qwen3-0.6b",),
        "parallel.pp=2 with model.tie_embeddings=true is not supported; the embedding (first stage) and the "
        "head (last stage) cannot share one weight; use a model without tied embeddings or parallel.pp=1",
    ),
    "parallel.tp x zero=stage1": (
        TP,
        ("zero=stage1",),
        "parallel.tp=2 with zero=stage1 is not supported; use zero=stage0, stage2 or stage3 or parallel.tp=1",
    ),
    "parallel.tp x zero.hpz_ranks": (
        (*TP, "zero=stage3"),
        ("zero.hpz_ranks=2",),
        "parallel.tp=2 with zero.hpz_ranks is not supported; use zero.hpz_ranks=null or parallel.tp=1",
    ),
    "parallel.tp x zero.compression": (
        TP,
        ("zero.compression=powersgd",),
        "parallel.tp=2 with zero.compression is not supported; use zero.compression=none or parallel.tp=1",
    ),
    "parallel.tp x zero.sync_every": (
        TP,
        ("zero.sync_every=2",),
        "parallel.tp=2 with zero.sync_every is not supported; use zero.sync_every=1 or parallel.tp=1",
    ),
    "parallel.ep x zero=stage1": (
        EP,
        ("zero=stage1",),
        "parallel.ep=2 with zero=stage1 is not supported; use zero=stage0, stage2 or stage3 or parallel.ep=1",
    ),
    "parallel.ep x zero.compression": (
        EP,
        ("zero=stage0", "zero.compression=powersgd"),
        "parallel.ep=2 with zero.compression is not supported; use zero.compression=none or parallel.ep=1",
    ),
    "parallel.ep x zero.sync_every": (
        EP,
        ("zero=stage0", "zero.sync_every=2"),
        "parallel.ep=2 with zero.sync_every is not supported; use zero.sync_every=1 or parallel.ep=1",
    ),
    "parallel.ep x zero.shard_ranks": (
        EP,
        ("zero.shard_ranks=2",),
        "parallel.ep=2 with zero.shard_ranks is not supported; use zero.shard_ranks=null or parallel.ep=1",
    ),
    "parallel.ep x zero.hpz_ranks where ep is all of ZeRO's ranks": (
        (*EP, "nproc=4"),  # ep=2 of 4 ranks composes; ep=4 is all of them
        ("parallel.ep=4", "zero.hpz_ranks=2"),
        "parallel.ep=4 with zero.hpz_ranks where ep is all of ZeRO's ranks is not supported; use a parallel.ep "
        "dividing ZeRO's ranks (dp x cp) below them, or zero.hpz_ranks=null or parallel.ep=1",
    ),
    "parallel.ep x offload where ep is all of ZeRO's ranks": (
        (*EP, "nproc=2"),
        ("offload=cpu",),
        "parallel.ep=2 with offload where ep is all of ZeRO's ranks is not supported; use a parallel.ep "
        "dividing ZeRO's ranks (dp x cp) below them, or offload=none or parallel.ep=1",
    ),
    "parallel.ep x parallel.pp > 1": (
        (*EP, "nproc=4"),
        PP,
        "parallel.ep=2 with parallel.pp > 1 is not supported; use parallel.pp=1 or parallel.ep=1",
    ),
    "model.n_experts x parallel.tp > 1": (
        MOE,
        TP,
        "model.n_experts=8 with parallel.tp > 1 is not supported; use parallel.tp=1 (parallel.ep shards the "
        "experts) or model.n_experts=0",
    ),
}


def row_id(row: Refusal) -> str:
    return f"{row.first} x {row.second}"


def test_every_row_has_its_case() -> None:
    assert [row_id(row) for row in REFUSALS] == list(ROWS)  # one case per row, in the table's order


@pytest.mark.parametrize("name", list(ROWS))
def test_each_row_refuses_in_its_one_line(name: str) -> None:
    """The pair is the config's only trouble: without the row's setting it composes; with it, the row's
    message (the words users and scripts have seen) is the error."""
    composes, setting, message = ROWS[name]
    compose_config(*composes)
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        compose_config(*composes, *setting)


@pytest.mark.parametrize("setting", ["compile=true", "precision=fp8", "parallel.tp=2", "eval.every=2"])
def test_the_pipeline_takes_what_parallelize_applies_per_stage(setting: str) -> None:
    """No row for parallel.pp with compile=true, precision=fp8 or parallel.tp: each stage goes through the same
    parallelize as a whole model (trainer/rank/parallelize.py); tests/integration/test_pipeline.py trains the
    first two, tests/integration/test_3d.py tensor-parallel stages and their held-out loss (eval.every, through
    the schedule's forward)."""
    config = compose_config(*PP, setting, "nproc=4")
    assert config.parallel.pp == 2
    assert config.compile or config.precision.is_fp8 or config.parallel.tp == 2 or config.eval.every == 2
    assert first_refusal(config) is None


def test_ep_offloads_where_fsdp2_shards_the_experts_and_the_world_decides_under_nproc_auto() -> None:
    """offload composes with an ep group inside the data-parallel ranks (FSDP2 shards and offloads the experts,
    tests/integration/test_moe_ep_inside.py trains it under cpu and nvme), not with ep equal to them; under nproc=auto the config
    cannot tell, and the job's world check (trainer/layout.py `check_world`) asks the table again."""
    assert first_refusal(compose_config(*EP, "nproc=4", "offload=cpu")) is None
    assert first_refusal(compose_config(*EP, "nproc=4", "offload=nvme", "offload.path=.")) is None
    auto = compose_config(*EP, "offload=cpu")
    assert auto.nproc == "auto" and first_refusal(auto) is None
    check_world(auto, 4, 1)
    with pytest.raises(ConfigError, match="^parallel.ep=2 with offload where ep is all of ZeRO's ranks"):
        check_world(auto, 2, 1)
    with pytest.raises(ConfigError, match="^parallel.ep=2 with offload where ep is all of ZeRO's ranks"):
        compose_config(*EP, "nproc=1", "nodes=2", "offload=cpu")  # 2 nodes of 1 rank: ep=2 is all of them


def test_under_cp_ep_is_counted_in_zeros_ranks() -> None:
    """Under parallel.cp ZeRO works over dp x cp ranks, and the ep group is carved from them: on 2 ranks at cp=2,
    ep=2 is all of them (offload refused), on 4 an ep group inside them; ep must divide dp x cp, not dp."""
    assert first_refusal(compose_config(*EP, "nproc=4", *CP, "offload=cpu")) is None
    with pytest.raises(ConfigError, match="^parallel.ep=2 with offload where ep is all of ZeRO's ranks"):
        compose_config(*EP, "nproc=2", *CP, "offload=cpu")
    check_world(compose_config(*EP, "nproc=2", *CP), 2, 1)  # dp = 1: the ep group is the cp ranks
    check_world(compose_config(*EP, "parallel.ep=4", "nproc=4", *CP), 4, 1)
    with pytest.raises(
        ConfigError, match="^parallel.ep=8 must divide the 4 data-parallel x context-parallel ranks"
    ):
        check_world(compose_config(*EP, "model.n_experts=16", "parallel.ep=8", "nproc=4", *CP), 4, 1)


def test_the_advisor_offers_nothing_the_table_refuses() -> None:
    """On two nodes the advisor offers tp and pp; with local SGD (zero.sync_every), which tp does not compose
    with, it offers pp alone (each stage averages over its own replicas)."""
    job = ("mode=advise", "global_batch=64", "nproc=4", "nodes=2")
    plain = choices(compose_config(*job), 8, "cuda")
    local_sgd = choices(compose_config(*job, "zero.sync_every=2"), 8, "cuda")
    assert {row["parallel.tp"] for row in plain} == {None, 2}
    assert {row["parallel.pp"] for row in plain} == {None, 2, 4}
    assert local_sgd and {row["parallel.tp"] for row in local_sgd} == {None}
    assert {row["parallel.pp"] for row in local_sgd} == {None, 2, 4}


def test_docs_hold_the_rendered_table() -> None:
    """docs/design.md, between its two markers, is `refusals_markdown()`: a row's change shows in the docs."""
    text = DESIGN.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"docs/design.md needs one {BEGIN} and one {END}"
    held = text.split(BEGIN)[1].split(END)[0].strip("\n")
    expected = refusals_markdown()
    diff = "\n".join(
        difflib.unified_diff(
            held.splitlines(), expected.splitlines(), "docs/design.md", "refusals_markdown()", lineterm=""
        )
    )
    assert held == expected, (
        f"docs/design.md's composition table differs from trainer/config/composition.py:\n{diff}\n\n"
        f"Put this between the markers:\n{expected}"
    )
