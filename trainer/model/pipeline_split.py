"""Pipeline parallelism's split of the decoder into stages (parallel.pp): which blocks each stage holds,
and one stage's module.

`stage_blocks` is the one place the split is decided: the ranks build their stages from it
(trainer/rank/pipeline.py) and the plan sizes each stage by it. A stage is the decoder with what it does
not hold removed (torchtitan's way, pytorch/torchtitan torchtitan/distributed/pipeline_parallel.py
`pipeline_module_split`): the embedding stays on the first stage, the final norm and the output head on the
last, and the blocks keep their index in the whole model, so every parameter keeps its name
(`layers.{i}.…`): weights are drawn from the name (decoder.init_weights) as on one rank, and a save
(DCP, by name) resumes at another pp.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.config import ModelConfig
from trainer.model.decoder import NoInitOnMeta, Transformer
from trainer.model.loss import chunked_cross_entropy


def stage_blocks(n_layers: int, stages: int) -> list[range]:
    """The blocks of each stage, as evenly as they divide: the earlier stages take one more when uneven
    (10 blocks over 4 stages: 3, 3, 2, 2)."""
    base, extra = divmod(n_layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        count = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


def split_line(n_layers: int, stages: int, pp: int) -> str:
    """The split as the job prints it at start: each stage's blocks, and what else it holds."""
    parts = []
    for stage, blocks in enumerate(stage_blocks(n_layers, stages)):
        extras = ["embedding"] * (stage == 0) + ["norm, head, loss"] * (stage == stages - 1)
        held = f"blocks {blocks.start}-{blocks.stop - 1}" + "".join(f" + {e}" for e in extras)
        parts.append(f"stage {stage} (rank {stage % pp}): {held}")
    return f"pipeline: {stages} stages over parallel.pp={pp} ranks; " + "; ".join(parts)


class StageBlocks(nn.ModuleDict):
    """A stage's blocks keyed by their index in the whole model; iterated, like the decoder's ModuleList,
    block by block (a ModuleDict iterates its keys)."""

    def __iter__(self):  # type: ignore[override]
        return iter(self.values())


class StageModel(Transformer):
    """One pipeline stage: the decoder without the blocks (and embedding, norm, head) of other stages.

    Input: token ids on the first stage, else the previous stage's hidden states; output: logits on the
    last stage, else hidden states. Rotary tables are computed from the config as the decoder does."""

    def __init__(self, config: ModelConfig, stage: int, stages: int) -> None:
        super().__init__(config)  # on the meta device (build_stage): the whole decoder costs nothing there
        blocks = stage_blocks(config.n_layers, stages)[stage]
        self.stage, self.stages = stage, stages
        self.sequence_shards = 1
        """How many TP ranks share the sequence a stage receives (parallel.tp under SP; set by the rank)."""
        self.layers = StageBlocks({str(i): self.layers[i] for i in blocks})
        if stage > 0:
            self.tok_embeddings = None
        if stage < stages - 1:
            self.norm = None
            self.output = None

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        documents_BT: torch.Tensor | None = None,
        targets_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`documents_BT` (data.packing=document): every stage gets the micro-batch's document ids from the
        schedule's kwargs (each rank hands them to its own step) and makes the block-causal mask itself.
        `targets_BT` (loss=chunked, the last stage only): the output is the chunked loss, as the decoder's
        forward given targets (the schedule's loss_fn passes it on)."""
        # Beyond the first stage under sequence parallelism the stage receives its TP rank's T / tp positions;
        # the rotary table is of the whole sequence (attention all-gathers it first). Under parallel.cp every
        # stage holds its cp rank's positions of each row, as the decoder does (`rotary_and_mask`): the
        # angles of those positions, and the mask of the whole rows' documents.
        T = x.shape[1] * (self.sequence_shards if self.tok_embeddings is None else 1)
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        cis_TF, mask_B1TT = self.rotary_and_mask(T, documents_BT, x.device)
        # a mixture of experts' routing is recorded by the stage around this forward (trainer/rank/pipeline.py)
        for layer in self.layers:
            x = layer(x, cis_TF, mask_B1TT)
        if self.output is None:
            return x
        if targets_BT is None:
            return self.output(self.norm(x))
        return chunked_cross_entropy(
            self.norm(x), self.output.weight, targets_BT, self.loss_chunk_tokens, self.loss_z_weight
        )


def build_stage(config: ModelConfig, stage: int, stages: int) -> StageModel:
    """Stage `stage` of `stages` on the meta device (materialise it as the decoder: decoder.materialize)."""
    with torch.device("meta"), NoInitOnMeta():
        return StageModel(config, stage, stages)
