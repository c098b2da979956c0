"""What does not compose: one table (REFUSALS), read by the config check (TrainConfig.__post_init__ calls
`check_composition`), the advisor's candidate search (trainer/advise/advisor.py `choices` offers nothing a
row refuses) and docs/design.md's "What does not compose" section (`refusals_markdown`, held to the docs
by tests/unit/test_composition.py).

Each row pairs a parallelism (`first`: parallel.tp, parallel.pp, parallel.cp or parallel.ep when > 1, or a mixture of
experts, model.n_experts > 0) with a setting it does not
compose with here (`second`), says why (a real limit, or what is not yet built or proven) and the way
out. A config is refused by the first row that applies, in the table's order, in one line naming both
keys. To print the docs' table (tests/unit/test_composition.py's failure shows it too):

    python -c "from trainer.config import refusals_markdown; print(refusals_markdown())"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.config.enums import (
    Compression,
    OffloadTarget,
    ReduceEvery,
    Stage,
)
from trainer.config.errors import ConfigError

if TYPE_CHECKING:  # train.py imports this module: the root config is named in annotations only
    from trainer.config.train import TrainConfig

TP, PP, CP, EP, MOE = "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "model.n_experts"
FIRSTS = (TP, PP, CP, EP, MOE)
"""The parallelisms a row may start with, in the docs table's order."""

SAYS = "{row.first}={degree} with {row.second} is not supported; {row.way_out} or {row.first}={row.off}"
"""The one-line message of most rows (a str.format template over the row, its `degree` and the `config`)."""


@dataclass(frozen=True)
class Refusal:
    """One pair that does not compose: `first` (refused only when > 1) with `second`."""

    first: str
    """parallel.tp, parallel.pp, parallel.cp, parallel.ep, or model.n_experts (a mixture of experts)."""
    second: str
    """The other setting, as the message names it."""
    applies: Callable[[TrainConfig], bool]
    """Whether the config sets `second` (`first` > 1 is checked apart)."""
    reason: str
    """Why: a real limit, or "not yet built/proven" and what is missing."""
    way_out: str
    """What to set instead (the message adds: or `first`=1)."""
    message: str = SAYS
    """The message's template; two rows keep the words their messages have always had, which say why."""

    @property
    def off(self) -> int:
        """The value of `first` that turns it off: 1 rank, or 0 experts (a dense model)."""
        return 0 if self.first == MOE else 1

    def degree(self, config: TrainConfig) -> int:
        group, key = self.first.split(".")
        return getattr(getattr(config, group), key)

    def refuses(self, config: TrainConfig) -> bool:
        return self.degree(config) > 1 and self.applies(config)

    def says(self, config: TrainConfig) -> str:
        return self.message.format(row=self, degree=self.degree(config), config=config)


# In the order they are checked: the first that applies is the message. Tensor parallelism's tied-embedding
# row comes first: it was the last of the model's shape checks (ParallelConfig.check_model), which run just
# before this table, so a config with several refusals still hears the one it always did.
REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        TP,
        "model.tie_embeddings=true",
        lambda c: c.model.tie_embeddings,
        "the embedding (row-wise) and the output head (column-wise) shard the one tied weight two ways",
        "use a model without tied embeddings",
        "{row.first}={degree} with {row.second} is not supported: {row.reason}; use {row.first}=1",
    ),
    Refusal(
        PP,
        "zero.reduce_every=micro_batch",
        lambda c: c.zero.reduce_every != ReduceEvery.step,
        "PipelineStage reduces the gradients once, after the step's last backward",
        "use zero.reduce_every=step",
    ),
    Refusal(
        PP,
        "zero.reshard_after_backward=false",
        lambda c: not c.zero.reshard_after_backward,
        "PipelineStage sets FSDP2's resharding itself: none between the step's backwards, all after the last",
        "use zero.reshard_after_backward=true",
    ),
    Refusal(
        PP,
        "model.tie_embeddings=true",
        lambda c: c.model.tie_embeddings,
        "the embedding (first stage) and the head (last stage) cannot share one weight",
        "use a model without tied embeddings",
        "{row.first}={degree} with {row.second} is not supported; {row.reason}; {row.way_out} or {row.first}=1",
    ),
    Refusal(
        TP,
        "zero=stage1",
        lambda c: c.zero.stage == Stage.stage1,
        "torch's ZeroRedundancyOptimizer partitions over DDP's replicas, and torch's DDP takes tensor-parallel "
        "parameters as local tensors (_pre_dp_module_transform), so only FSDP2 shards them (torchtitan refuses DDP "
        "beside any other parallel dim alike: 'DDP has not supported > 1D parallelism')",
        "use zero=stage0, stage2 or stage3",
    ),
    Refusal(
        TP,
        "zero.hpz_ranks",
        lambda c: c.zero.hpz_ranks is not None,
        "torch's FSDP2 keeps no secondary shard of a DTensor parameter: reshard_after_forward=<int> raises "
        "NotImplementedError at the first block's forward (FSDPParam.to_sharded_post_forward, torch 2.13; "
        "tests/unit/rank/test_tp_hpz.py), and every tensor-parallel weight is a DTensor",
        "use zero.hpz_ranks=null",
    ),
    Refusal(
        TP,
        "zero.compression",
        lambda c: c.zero.compression != Compression.none,
        "a compression hook is a DDP communication hook, and torch's DDP takes tensor-parallel parameters as local "
        "tensors (zero=stage0 is refused beside tp on several replicas; FSDP2 has no communication hooks)",
        "use zero.compression=none",
    ),
    Refusal(
        TP,
        "zero.sync_every",
        lambda c: c.zero.sync_every > 1,
        "local SGD is a DDP communication hook and torch's model averager over DDP's replicas, and torch's DDP "
        "takes tensor-parallel parameters as local tensors (zero=stage0 is refused beside tp on several replicas)",
        "use zero.sync_every=1",
    ),
    Refusal(
        EP,
        "zero=stage1",
        lambda c: c.zero.stage == Stage.stage1,
        "not yet built: ZeroRedundancyOptimizer partitions every parameter's state over DDP's ranks and broadcasts "
        "each parameter from its owner, and each rank holds different experts (trainer/rank/experts.py): the "
        "experts' state would need an optimizer of its own",
        "use zero=stage0, stage2 or stage3",
    ),
    Refusal(
        EP,
        "zero.compression",
        lambda c: c.zero.compression != Compression.none,
        "not yet proven: a compression hook on DDP's buckets, which hold no expert, and its plan's state",
        "use zero.compression=none",
    ),
    Refusal(
        EP,
        "zero.sync_every",
        lambda c: c.zero.sync_every > 1,
        "not yet built: local SGD averages every parameter over DDP's ranks, and each rank holds different experts",
        "use zero.sync_every=1",
    ),
    Refusal(
        EP,
        "zero.shard_ranks",
        lambda c: c.zero.shard_ranks is not None,
        "not yet built: an ep group inside HSDP's shard groups",
        "use zero.shard_ranks=null",
    ),
    Refusal(
        EP,
        "zero.hpz_ranks where ep is all of ZeRO's ranks",
        lambda c: c.zero.hpz_ranks is not None and ep_holds_the_experts(c),
        "not yet proven: hpZ's secondary shards beside experts FSDP2 leaves whole to each ep rank (with an ep group "
        "inside the data-parallel ranks the blocks keep them and the experts' unit reshards fully)",
        "use a parallel.ep dividing ZeRO's ranks (dp x cp) below them, or zero.hpz_ranks=null",
    ),
    Refusal(
        EP,
        "offload where ep is all of ZeRO's ranks",
        lambda c: c.offload.target != OffloadTarget.none and ep_holds_the_experts(c),
        "not yet built: FSDP2 leaves the experts whole to each ep rank there (trainer/rank/experts.py), so under "
        "offload=cpu or nvme they would stay in host memory while the device computes; with an ep group inside the "
        "data-parallel ranks FSDP2 shards each rank's experts over the rest, and offloads them like any unit",
        "use a parallel.ep dividing ZeRO's ranks (dp x cp) below them, or offload=none",
    ),
    Refusal(
        EP,
        "parallel.pp > 1",
        lambda c: c.parallel.pp > 1,
        "not yet built: the ep group is carved from the ranks ZeRO works over, and its mesh (trainer/rank/mesh.py "
        "`expert_mesh`) and plan assume they are the whole world; a stage's are one pp-th of it",
        "use parallel.pp=1",
    ),
    Refusal(
        MOE,
        "parallel.tp > 1",
        lambda c: c.parallel.tp > 1,
        "not yet built: the experts and the router are not sharded over the tensor-parallel group",
        "use parallel.tp=1 (parallel.ep shards the experts)",
    ),
)


def ep_holds_the_experts(config: TrainConfig) -> bool:
    """Whether parallel.ep is every data-parallel rank (times parallel.cp: ZeRO's ranks, trainer/layout.py), so
    that each ep rank holds its experts whole and FSDP2 leaves them alone (below that, FSDP2 shards them over the
    ranks holding the same ones: trainer/rank/mesh.py `expert_mesh`). Unknown under nproc=auto until a job
    resolves it: False here, and trainer/layout.py `check_world` asks the table again with the world it knows."""
    if not config.nproc.isdigit():
        return False
    p = config.parallel
    return p.ep == p.dp(config.nodes * int(config.nproc)) * p.cp


def first_refusal(config: TrainConfig) -> str | None:
    """The one-line message of the first row that refuses `config`; None where everything composes."""
    return next((row.says(config) for row in REFUSALS if row.refuses(config)), None)


def check_composition(config: TrainConfig) -> None:
    """Raise ConfigError with the first refusal's message (TrainConfig.__post_init__, after the model's shape
    checks)."""
    message = first_refusal(config)
    if message is not None:
        raise ConfigError(message)


def refusals_markdown() -> str:
    """The table as docs/design.md holds it: tensor parallelism's rows, then the pipeline's, context
    parallelism's, expert parallelism's and the mixture of experts'."""
    lines = ["| with | refused | why | way out |", "|---|---|---|---|"]
    for row in sorted(REFUSALS, key=lambda row: FIRSTS.index(row.first)):  # stable: keeps the table's order
        way_out = f"{row.way_out} or {row.first}={row.off}"
        lines.append(f"| `{row.first} > 1` | `{row.second}` | {row.reason} | {way_out} |")
    return "\n".join(lines)
