"""The tests' power to catch bugs: one-line bugs put into the code one at a time, the tests run on each.

Each bug (BUGS) replaces one exact piece of source with a wrong one, runs the tests named for it
(`pytest -n 0 -x`, the unit tier unless stated), records which failed, and puts the file
back byte for byte before the next; the tree is as it was at the end (`git diff` empty), also when
the run is interrupted. Exit 1 when a bug survives its tests, or a piece of source is no longer
found (the code moved: update the bug).

    python benchmarks/bug_sweep.py                 # every bug; a few minutes of CPU
    python benchmarks/bug_sweep.py --only hpz      # the bugs whose name contains 'hpz'

The bugs are the ones issue 41 found surviving (the plan's terms, the host plan, hpZ groups, the
published fit, config.json's rope fields, the benchmarks' and the GPU check's rules, dynamic imports).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    name: str
    path: str  # relative to the repository
    right: str  # the source as it is: found exactly once
    wrong: str  # what the bug puts in its place
    tests: tuple[str, ...]  # pytest node ids or files that must fail


PLAN_UNIT = ("tests/unit/plan/test_fsdp_terms.py",)
BUGS = [
    Bug("stage3 copy-out without its flat all-gather output", "trainer/plan/fsdp_buffers.py",
        "    return f.block + f.secondary\n", "    return f.secondary\n", PLAN_UNIT),
    Bug("head's new weight gradient freed in place", "trainer/plan/fsdp_walk.py",
        "head = prec.compute * n * (m.vocab_size + m.dim) + f.output_grad",
        "head = prec.compute * n * (m.vocab_size + m.dim) + accumulation(ctx, f).fresh(f.output_grad)", PLAN_UNIT),
    Bug("RMSNorm's CPU backward as CUDA's", "trainer/plan/moments.py",
        "    return incoming + 6 * 4 * ctx.tokens * ctx.config.model.dim\n", "    return 2 * incoming\n",
        PLAN_UNIT),
    Bug("chunked loss without stage3's prefetched block", "trainer/plan/fsdp_walk.py",
        "prefetched = f.block if ctx.config.zero.stage == Stage.stage3 else 0", "prefetched = 0", PLAN_UNIT),
    Bug("q/k norm as wide as dim", "trainer/plan/activations.py",
        "qk_norm = 8 * (HQ + KQ) + ", "qk_norm = 8 * (D + KQ) + ", PLAN_UNIT),
    Bug("q/k norm without its rstd per head", "trainer/plan/activations.py",
        "qk_norm = 8 * (HQ + KQ) + 4 * (H + m.n_kv_heads) if", "qk_norm = 8 * (HQ + KQ) if", PLAN_UNIT),
    Bug("accumulation never in place", "trainer/plan/fsdp_buffers.py",
        "        full > 0 and width == ctx.prec.param,\n", "        False,\n", PLAN_UNIT),
    Bug("offloaded states sized over the world, not HSDP's shard group", "trainer/plan/build.py",
        "ranks, shard_size=sharded_over)", "ranks, shard_size=world_size)", ("tests/unit/plan/test_host.py",)),
    Bug("gradient shards padded like parameter shards", "trainer/plan/host.py",
        "    grads = [4 * shard_rows(s[0], shard_size, place) * math.prod(s[1:]) for s in shape.order]\n",
        "    grads = [4 * padded_numel(s, shard_size) // shard_size for s in shape.order]\n",
        ("tests/unit/plan/test_host.py",)),
    Bug("hpZ group as shard // hpz_ranks", "trainer/plan/groups.py",
        "    return ShardGroups(world_size, per_node, shard, hpz, tp)\n",
        "    return ShardGroups(world_size, per_node, shard, shard // hpz if hpz else None, tp)\n",
        ("tests/unit/plan/test_groups.py",)),
    Bug("hpZ secondary shard as 1/(shard // hpz)", "trainer/plan/fsdp_buffers.py",
        "secondary=p * block_padded // ctx.config.zero.hpz_ranks if",
        "secondary=p * block_padded // (w // ctx.config.zero.hpz_ranks) if", ("tests/unit/plan/test_groups.py",)),
    Bug("the layout's axes with pp inside dp (the old pipeline mesh's order)", "trainer/layout.py",
        'AXES = ("pp", "dp_replicate", "dp_shard", "tp")', 'AXES = ("dp_replicate", "dp_shard", "pp", "tp")',
        ("tests/unit/test_layout.py",)),
    Bug("plan_vs_published exits 0 always", "checks/plan_vs_published.py",
        "    return 0 if report.passed else 1\n", "    return 0\n", ("tests/unit/test_benchmarks.py",)),
    Bug("flash SDPA op dropped from the save list", "trainer/config/checkpointing.py",
        '    "aten._scaled_dot_product_flash_attention",\n', "", ("tests/unit/test_config.py",)),
    Bug("a second save list, without the flash SDPA op, in conf/checkpointing/op.yaml", "conf/checkpointing/op.yaml",
        "mode: op\n", "mode: op\nsave_ops: [aten.mm, aten._scaled_dot_product_flash_attention_for_cpu]\n",
        ("tests/unit/test_config.py",)),
    Bug("original context from max_position_embeddings", "trainer/model/hf_config.py",
        'int(params["original_max_position_embeddings"])', "int(hf.max_position_embeddings)",
        ("tests/unit/model/test_families.py",)),
    Bug("plan_accuracy's measured states are the predicted ones", "checks/plan_accuracy.py",
        '"states_measured": {kind: measured[kind] for kind in STATES},', '"states_measured": predicted,',
        ("tests/unit/test_benchmarks.py",)),
    Bug("GPU check without its peak-allocated verdict", "checks/gpucheck/memory.py",
        '    if not abs(figures["allocated_error_pct"]) <= bound:', "    if False:",
        ("tests/unit/test_gpu_check_rows.py",)),
    Bug("loss rows without their peak-allocated verdict", "checks/gpucheck/numerics.py",
        "    wrong += memory_verdict(setup, figures)\n", "", ("tests/unit/test_gpu_check_rows.py",)),
    Bug("wandb imported on the rank path by importlib", "trainer/rank/loop.py",
        "\nfrom __future__ import annotations\n",
        '\nfrom __future__ import annotations\n\nimport importlib\n\nimportlib.import_module("wandb")\n',
        ("tests/unit/test_imports.py::test_the_rank_path_never_imports_wandb_or_hydra",)),
]  # fmt: skip


def failing(tests: tuple[str, ...]) -> list[str]:
    """The tests that fail (pytest's FAILED and ERROR lines; a run that failed naming none: its exit status)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *tests],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    named = [
        line.split(" - ")[0] for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))
    ]
    return named or ([f"pytest exited {proc.returncode}"] if proc.returncode else [])


def caught(bug: Bug) -> list[str]:
    """The tests that fail with the bug in place; the file restored after, byte for byte."""
    path = REPO / bug.path
    original = path.read_bytes()
    source = original.decode()
    if source.count(bug.right) != 1:
        raise LookupError(f"{bug.path}: the source of '{bug.name}' is not there once: {bug.right!r}")
    try:
        path.write_text(source.replace(bug.right, bug.wrong))
        return failing(bug.tests)
    finally:
        path.write_bytes(original)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default="", help="run the bugs whose name contains this")
    args = parser.parse_args(argv)
    bugs = [b for b in BUGS if args.only in b.name]
    # A bug is caught only by tests that pass without it.
    broken = {t: f for t in dict.fromkeys(b.tests for b in bugs) if (f := failing(t))}
    if broken:
        print(f"the tests fail without any bug: {broken}")
        return 1
    survived = []
    for bug in bugs:
        start = time.perf_counter()
        try:
            found = caught(bug)
        except LookupError as err:
            print(f"MOVED  {err}")
            survived.append(bug.name)
            continue
        print(
            f"{'caught' if found else 'MISSED'}  {bug.name} ({bug.path}): "
            f"{', '.join(found) or 'no test failed'} ({time.perf_counter() - start:.0f} s)"
        )
        if not found:
            survived.append(bug.name)
    print(f"{len(survived)} bug(s) not caught" if survived else "every bug caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
