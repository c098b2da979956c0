"""trainer/data.py: global sample indexing, determinism, the Markov stream, token files, loaders."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from trainer import data
from trainer.config import ConfigError, DataConfig, DataKind, DataloaderConfig, DeviceKind, TrainConfig
from trainer.data import (
    StepSampler,
    SyntheticTokens,
    TokenFile,
    build_batches,
    build_dataset,
    build_loader,
    make_tokens,
)


def make_config(**overrides: object) -> TrainConfig:
    """A tiny job: 2 sequences of 16 tokens per micro-batch, 3 steps, synthetic data."""
    return TrainConfig(**{"micro_batch": 2, "grad_accum": 1, "seq_len": 16, "steps": 3, **overrides})  # type: ignore[arg-type]


def step_rows(batches: list[tuple[Tensor, Tensor]], step: int, grad_accum: int) -> list[list[int]]:
    """The full samples (inputs + last target) of one step's micro-batches, sorted."""
    rows = []
    for inputs_BT, targets_BT in batches[step * grad_accum : (step + 1) * grad_accum]:
        rows += torch.cat([inputs_BT, targets_BT[:, -1:]], dim=1).tolist()
    return sorted(rows)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_ranks_together_read_the_one_rank_global_batch(world_size: int, grad_accum: int) -> None:
    config = make_config(grad_accum=grad_accum)
    per_rank = [list(build_batches(config, rank, world_size)) for rank in range(world_size)]
    # One rank with grad_accum * world_size micro-batches has the same global batch.
    single = list(build_batches(make_config(grad_accum=grad_accum * world_size), 0, 1))
    for step in range(config.steps):
        union = sorted(row for batches in per_rank for row in step_rows(batches, step, grad_accum))
        assert union == step_rows(single, step, grad_accum * world_size)
        assert len(union) == config.sequences_per_step(world_size)


def test_sampler_follows_the_documented_partition() -> None:
    # G = 2 * 2 * 2 = 8; step 1, micro-step m, rank 1 reads 8 + (2m + 1) * 2 + [0, 2).
    sampler = StepSampler(micro_batch=2, grad_accum=2, world_size=2, rank=1, start_step=1, num_steps=2)
    assert list(sampler) == [10, 11, 14, 15]
    assert len(sampler) == 4


def test_resumed_sampler_yields_the_tail_of_the_uninterrupted_one() -> None:
    full = list(StepSampler(micro_batch=3, grad_accum=2, world_size=4, rank=2, start_step=0, num_steps=7))
    per_step = 3 * 2
    for k in (0, 1, 4, 7):
        resumed = list(
            StepSampler(micro_batch=3, grad_accum=2, world_size=4, rank=2, start_step=k, num_steps=7)
        )
        assert resumed == full[k * per_step :]


def test_resumed_batches_are_the_tail_of_the_uninterrupted_ones() -> None:
    config = make_config(grad_accum=2, steps=4)
    full = list(build_batches(config, rank=1, world_size=2))
    resumed = list(build_batches(config, rank=1, world_size=2, start_step=3))
    assert len(full) == 8 and len(resumed) == 2
    for (x_full, y_full), (x_res, y_res) in zip(full[6:], resumed):
        assert torch.equal(x_full, x_res) and torch.equal(y_full, y_res)


def test_batches_are_shifted_int64_pairs() -> None:
    config = make_config(grad_accum=2)
    batches = list(build_batches(config, rank=0, world_size=1))
    assert len(batches) == config.steps * config.grad_accum
    for inputs_BT, targets_BT in batches:
        assert inputs_BT.shape == targets_BT.shape == (2, 16)
        assert inputs_BT.dtype == targets_BT.dtype == torch.int64
        assert torch.equal(inputs_BT[:, 1:], targets_BT[:, :-1])


def test_same_index_gives_same_tokens_across_calls_and_instances() -> None:
    first = SyntheticTokens(vocab_size=512, seq_len=64, seed=3)
    again = SyntheticTokens(vocab_size=512, seq_len=64, seed=3)
    for index in (0, 17, 10**12):
        assert torch.equal(first[index], first[index])
        assert torch.equal(first[index], again[index])
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], SyntheticTokens(vocab_size=512, seq_len=64, seed=4)[0])


def test_two_workers_load_the_same_batches_as_none() -> None:
    in_process = list(build_batches(make_config(), rank=1, world_size=2))
    options = DataloaderConfig(num_workers=2, prefetch_factor=2)
    with_workers = list(build_batches(make_config(dataloader=options), rank=1, world_size=2))
    assert len(in_process) == len(with_workers) == 3
    for (x0, y0), (x2, y2) in zip(in_process, with_workers):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)


def test_loading_leaves_the_global_rng_untouched() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    list(build_batches(make_config(), rank=0, world_size=1))
    assert torch.equal(torch.get_rng_state(), before)


def test_synthetic_stream_follows_the_chain_at_its_entropy_rate() -> None:
    vocab = 512
    dataset = SyntheticTokens(vocab_size=vocab, seq_len=2048, branching=4, data_seed=1234)
    allowed_VV = torch.zeros(vocab, vocab, dtype=torch.bool)
    allowed_VV[torch.arange(vocab)[:, None], dataset.successors_VB] = True
    assert int(allowed_VV.sum()) == vocab * 4  # distinct successors
    samples = torch.stack([dataset[i] for i in range(100)])
    current, following = samples[:, :-1].flatten(), samples[:, 1:].flatten()
    assert bool(allowed_VV[current, following].all())

    counts_VV = (
        torch.bincount(current * vocab + following, minlength=vocab * vocab).view(vocab, vocab).double()
    )
    joint = counts_VV / counts_VV.sum()
    conditional = counts_VV / counts_VV.sum(dim=1, keepdim=True).clamp(min=1)
    empirical = float(-torch.special.xlogy(joint, conditional).sum())  # 0 log 0 = 0
    # ~205k pairs: plug-in bias ~ -(2048 - 512) / (2 * 205k) = -0.004 nats, noise ~0.003.
    assert abs(empirical - dataset.entropy_rate) < 0.02
    assert 0 < dataset.entropy_rate < 0.5 * math.log(vocab)


def test_entropy_rate_of_a_deterministic_cycle_is_zero() -> None:
    dataset = SyntheticTokens(vocab_size=16, seq_len=40, branching=1)
    assert dataset.entropy_rate == 0.0
    sample = dataset[0]
    assert sorted(sample[:16].tolist()) == list(range(16))  # one cycle through every token


def test_branching_above_vocab_names_the_key() -> None:
    with pytest.raises(ConfigError, match="data.branching"):
        SyntheticTokens(vocab_size=4, seq_len=8, branching=5)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "input.txt"
    path.write_bytes("zerolab: sharded, mixed-precision training — héllo\n".encode() * 3)
    return path


def test_make_tokens_round_trips_bytes(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "tokens.bin"  # no .npy suffix: the exact path is written
    count = make_tokens(str(text_file), str(out))
    tokens = np.load(out)
    assert count == len(text_file.read_bytes()) == tokens.shape[0]
    assert tokens.dtype == np.uint16
    assert bytes(tokens.astype(np.uint8)) == text_file.read_bytes()


def test_make_tokens_cli_prints_count_and_path(
    text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tokens.npy"
    assert data.main(["make-tokens", str(text_file), str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and str(len(text_file.read_bytes())) in line and str(out) in line


def test_token_file_windows_match_the_bytes(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "tokens.npy"
    make_tokens(str(text_file), str(out))
    raw = list(text_file.read_bytes())
    dataset = TokenFile(str(out), seq_len=8, vocab_size=256)
    for index in range(40):
        start = (index * 8) % (len(raw) - 8 - 1)
        assert dataset[index].tolist() == raw[start : start + 9]
        assert dataset[index].dtype == torch.int64
    reloaded = pickle.loads(pickle.dumps(dataset))  # what a spawned worker receives
    assert torch.equal(reloaded[5], dataset[5])


def test_token_file_with_ids_outside_the_vocab_is_rejected(text_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "tokens.npy"
    make_tokens(str(text_file), str(out))
    with pytest.raises(ConfigError, match="model.vocab_size=128"):
        TokenFile(str(out), seq_len=8, vocab_size=128)  # "—" and "é" are bytes >= 128


def test_large_token_file_checks_each_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.array([1] * 30 + [300] + [1] * 10, dtype=np.uint16))
    monkeypatch.setattr(data, "FULL_SCAN_TOKENS", 16)  # only the head is scanned at open
    dataset = TokenFile(str(path), seq_len=8, vocab_size=256)
    assert dataset[0].tolist() == [1] * 9
    with pytest.raises(ConfigError, match="data.path"):
        dataset[3]  # the window at (3 * 8) % (41 - 9) = 24 holds the 300 at 30


def test_missing_token_file_names_data_path(tmp_path: Path) -> None:
    config = make_config(data=DataConfig(kind=DataKind.tokens, path=str(tmp_path / "absent.npy")))
    with pytest.raises(ConfigError, match="data.path") as error:
        build_dataset(config.data, config.model.vocab_size, config.seq_len, config.seed)
    assert "\n" not in str(error.value) and "absent.npy" in str(error.value)


def test_loader_receives_the_dataloader_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    options = DataloaderConfig(num_workers=2, prefetch_factor=4, pin_memory=True, persistent_workers=True)
    loader = build_loader(
        make_config(dataloader=options, device=DeviceKind.cuda), rank=1, world_size=2, start_step=1
    )
    assert (loader.num_workers, loader.prefetch_factor, loader.pin_memory, loader.persistent_workers) == (
        2,
        4,
        True,
        True,
    )
    assert loader.batch_size == 2 and isinstance(loader.sampler, StepSampler)
    assert (loader.sampler.rank, loader.sampler.world_size, loader.sampler.start_step) == (1, 2, 1)
    # Batches bound for the CPU are not pinned (DataLoader would warn and ignore it).
    on_cpu = build_loader(make_config(dataloader=options, device=DeviceKind.cpu), rank=0, world_size=1)
    assert on_cpu.pin_memory is False
