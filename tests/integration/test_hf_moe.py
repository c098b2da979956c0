"""Mixtral and Qwen3-MoE checkpoints loaded by two ranks at stage3 (FSDP2 shards each stacked expert weight on
its expert dim) and under expert parallelism (parallel.ep=2's sharding, trainer/rank/experts.py): each rank
reads only the experts it holds, and the logits equal transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers import HF_SEQUENCES, free_port, hf_logits, zero_over_world
from tests.unit.model.test_hf_moe import CHECKPOINTS, TOLERANCE, moe_checkpoint
from trainer.config import ModelConfig, Stage, ZeroConfig
from trainer.model import hf_weights
from trainer.model.decoder import build_model, materialize
from trainer.rank.experts import apply_expert_parallel
from trainer.world import World

pytestmark = pytest.mark.torch_versions
transformers = pytest.importorskip("transformers")


def rank_moe_logits(rank: int, port: int, configs: dict[str, ModelConfig], out: Path) -> None:
    """One of two ranks (forked): each checkpoint loaded at stage3, then under parallel.ep=2 alone (experts
    sharded on dim 0 over the two ranks, the rest whole), recording the experts each expert weight read on
    this rank; rank 0 saves the logits and both ranks' records."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    world = World(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    held: list[list[int] | None] = []
    find = hf_weights.held_experts

    def recorded(param: torch.Tensor, count: int) -> list[int] | None:
        held.append(found := find(param, count))
        return found

    hf_weights.held_experts = recorded  # this forked rank's own module
    logits = {}
    for name, config in configs.items():
        model = zero_over_world(build_model(config), ZeroConfig(stage=Stage.stage3), world, config.weights)
        with torch.no_grad():
            logits[name] = model(HF_SEQUENCES)
    # Expert parallelism alone: the experts on the ep mesh, the rest whole on each rank.
    ep_mesh = init_device_mesh("cpu", (2,))
    for name, config in configs.items():
        model = build_model(config, device="meta")
        apply_expert_parallel(model, ep_mesh)
        weights = Path(config.weights or "")
        materialize(model, "cpu", seed=0, load=lambda m, weights=weights: hf_weights.load_weights(m, weights))
        with torch.no_grad():
            logits[name, "ep"] = model(HF_SEQUENCES)
    records: list[list[list[int] | None] | None] = [None, None]
    dist.all_gather_object(records, held)
    if rank == 0:
        torch.save(logits, out)
        out.with_suffix(".json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list]:
    """transformers' logits of each checkpoint, the two ranks' logits, and the experts each rank read."""
    root = tmp_path_factory.mktemp("moe")
    paths = {name: moe_checkpoint(root / name, *CHECKPOINTS[name]) for name in CHECKPOINTS}
    expected = {name: hf_logits(path) for name, path in paths.items()}
    configs = {name: ModelConfig(name="hf", weights=str(path)) for name, path in paths.items()}
    out = root / "logits.pt"
    # Forked, as tests/integration/test_hf_weights.py's ranks: no process group in this process.
    mp.start_processes(rank_moe_logits, args=(free_port(), configs, out), nprocs=2, start_method="fork")
    return expected, torch.load(out), json.loads(out.with_suffix(".json").read_text())


@pytest.mark.parametrize("parallel", ["stage3", "ep"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_two_ranks_give_transformers_logits(two_ranks: tuple, name: str, parallel: str) -> None:
    expected, logits, _ = two_ranks
    got = logits[name] if parallel == "stage3" else logits[name, "ep"]
    assert (got - expected[name]).abs().max().item() < TOLERANCE


def test_each_rank_reads_only_the_experts_it_holds(two_ranks: tuple) -> None:
    """4 experts on 2 ranks: experts 0-1 on rank 0, 2-3 on rank 1, for each of the 3 checkpoints' 2 layers'
    3 expert weights, at stage3 and again under expert parallelism."""
    _, _, records = two_ranks
    assert records == [[[0, 1]] * 36, [[2, 3]] * 36]
