"""Training tokens: datasets indexed by a global sample index, and the per-rank batch stream.

A sample is `seq_len + 1` token ids; a batch splits it into inputs `[:-1]` and targets `[1:]`.
Samples are addressed by a GLOBAL index so the global batch of a step is the same whatever
the world size, and a resumed run continues at any step. With G = micro_batch * grad_accum *
world_size, optimizer step s (0-based) uses global samples [s*G, (s+1)*G), and micro-step m of
rank r takes

    s*G + (m*world_size + r)*micro_batch + [0, micro_batch)

Any partition of the step's samples gives the same loss (it is a mean over the global batch);
this one keeps each micro-batch contiguous and is what `StepSampler` yields.

Data kinds (conf/data/*.yaml):
- synthetic: `SyntheticTokens`, a fixed random Markov chain over the model's vocabulary. Its
  entropy rate (`SyntheticTokens.entropy_rate`, nats per token) is the loss floor.
- tokens: `TokenFile`, a memory-mapped .npy of token ids, made from text with
  `python -m trainer.data make-tokens INPUT.txt OUTPUT.npy` (byte-level, vocab 256).
- text: `PackedText` (trainer/text/), local files through a model's tokenizer, tokenised once into a
  cache (`python -m trainer.data make-tokens --tokenizer T FILES... CACHE_DIR` fills it by hand).

Held-out data (eval.every, trainer/rank/evaluate.py) is read the same way, from its own stream:
text's validation files or set-apart documents, synthetic's samples from VALIDATION_SHIFT on.
"""

from __future__ import annotations

import argparse
import array
import bisect
import hashlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer.config import (
    ConfigError,
    DataConfig,
    DataKind,
    DataloaderConfig,
    DeviceKind,
    Packing,
    TrainConfig,
    global_batch,
)
from trainer.text.cache import ensure_entry, entry_dir, read_meta, vocab_of
from trainer.text.corpus import check_files
from trainer.text.packed import PackedText, document_batch, held_out
from trainer.text.tokenizer import TokenizerFiles

BYTE_VOCAB = 256
"""Vocabulary of `make_tokens`: one token per byte value."""

# Files up to this many tokens are scanned whole at open time for out-of-vocab ids (~0.1 s);
# larger ones have their head scanned at open time and every window checked as it is read.
FULL_SCAN_TOKENS = 1 << 26


def sample_seed(data_seed: int, seed: int, index: int) -> int:
    """A 63-bit generator seed for one sample, a hash of (data_seed, seed, index)."""
    # A hash rather than arithmetic so nearby indices and seeds give unrelated streams.
    digest = hashlib.blake2b(f"{data_seed}:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def build_transitions(vocab_size: int, branching: int, data_seed: int) -> tuple[Tensor, Tensor]:
    """A random transition table: successors_VB (int64, distinct per row) and probs_VB (float64).

    Successor 0 of each token follows one random cycle through the whole vocabulary, so the
    chain is irreducible (every token occurs and the stationary distribution is unique).
    """
    if not 1 <= branching <= vocab_size:
        raise ConfigError(f"data.branching must be in [1, model.vocab_size={vocab_size}], got {branching}")
    g = torch.Generator().manual_seed(data_seed)
    order_V = torch.randperm(vocab_size, generator=g)  # the cycle: order[q] -> order[q + 1]
    position_V = torch.argsort(order_V)
    # b-1 distinct offsets in [1, V-1] per row: sorted draws from [0, V-b] plus 1, 2, ..., b-1.
    draws = torch.randint(vocab_size - branching + 1, (vocab_size, branching - 1), generator=g)
    offsets_VB = torch.cat(
        [torch.zeros(vocab_size, 1, dtype=torch.long), draws.sort(dim=1).values + torch.arange(1, branching)],
        dim=1,
    )
    successors_VB = order_V[(position_V[:, None] + 1 + offsets_VB) % vocab_size]
    weights_VB = torch.empty(vocab_size, branching, dtype=torch.float64).exponential_(generator=g)
    return successors_VB, weights_VB / weights_VB.sum(dim=1, keepdim=True)  # Dirichlet(1) rows


def stationary_distribution(successors_VB: Tensor, probs_VB: Tensor, tol: float = 1e-13) -> Tensor:
    """The chain's stationary distribution (float64), by power iteration of the lazy chain."""
    vocab_size = successors_VB.shape[0]
    pi_V = torch.full((vocab_size,), 1.0 / vocab_size, dtype=torch.float64)
    for _ in range(100_000):
        flow_V = torch.zeros_like(pi_V).index_add_(
            0, successors_VB.flatten(), (pi_V[:, None] * probs_VB).flatten()
        )
        # The lazy chain (I + P) / 2 has the same fixed point and converges even if P is periodic.
        nxt_V = 0.5 * (pi_V + flow_V)
        if (nxt_V - pi_V).abs().sum().item() < tol:
            return nxt_V
        pi_V = nxt_V
    return pi_V


def _cumulative(probs: Tensor) -> array.array:
    """Row-wise cumulative probabilities, flattened, each row ending at exactly 1.0."""
    cum = probs.cumsum(dim=-1)
    cum[..., -1] = 1.0  # a uniform draw in [0, 1) then never falls past the last entry
    return array.array("d", cum.flatten().tolist())


class SyntheticTokens(Dataset[Tensor]):
    """A fixed random Markov chain over `vocab_size` tokens; sample i is a walk of seq_len + 1.

    The transition table comes from `data_seed` only, so every run with that seed learns the
    same language. Sample i is drawn from a generator seeded by (data_seed, seed, i): the same
    tokens whichever rank or worker asks. Its first token is drawn from the stationary
    distribution, so every position is stationary and the expected next-token loss of the
    true table is exactly `entropy_rate`.
    """

    def __init__(
        self, vocab_size: int, seq_len: int, branching: int = 4, data_seed: int = 1234, seed: int = 0
    ) -> None:
        self.vocab_size, self.seq_len, self.branching = vocab_size, seq_len, branching
        self.data_seed, self.seed = data_seed, seed
        self.successors_VB, self.probs_VB = build_transitions(vocab_size, branching, data_seed)
        self.stationary_V = stationary_distribution(self.successors_VB, self.probs_VB)
        # The walk is sequential, and bisect over flat arrays beats per-step torch ops ~50x;
        # array.array rather than list keeps large vocabularies cache-friendly (2x at 128k).
        self._successors = array.array("q", self.successors_VB.flatten().tolist())
        self._cum_probs = _cumulative(self.probs_VB)
        self._cum_stationary = _cumulative(self.stationary_V)

    @property
    def entropy_rate(self) -> float:
        """Nats per token of the chain: sum_v pi(v) * H(next | v); the loss floor."""
        row_entropy_V = -torch.special.xlogy(self.probs_VB, self.probs_VB).sum(dim=1)  # 0 log 0 = 0
        return float((self.stationary_V * row_entropy_V).sum())

    def __len__(self) -> int:
        return sys.maxsize  # unbounded: StepSampler decides which indices are read

    def __getitem__(self, index: int) -> Tensor:
        g = torch.Generator().manual_seed(sample_seed(self.data_seed, self.seed, index))
        uniforms = torch.rand(self.seq_len + 1, generator=g, dtype=torch.float64).tolist()
        return torch.tensor(self._walk(uniforms), dtype=torch.int64)

    def _walk(self, uniforms: list[float]) -> list[int]:
        """Inverse-CDF sampling from the precomputed cumulative tables (~0.2-0.4 us per token)."""
        b, cum, successors = self.branching, self._cum_probs, self._successors
        token = bisect.bisect_right(self._cum_stationary, uniforms[0])
        tokens = [token]
        for u in uniforms[1:]:
            token = successors[bisect.bisect_right(cum, u, token * b, token * b + b)]
            tokens.append(token)
        return tokens


class TokenFile(Dataset[Tensor]):
    """A .npy of token ids, memory-mapped; sample i is the window of seq_len + 1 tokens at
    (i * seq_len) % (num_tokens - seq_len - 1).

    Out-of-vocabulary ids are checked at open time over the whole file when it holds at most
    FULL_SCAN_TOKENS tokens; for larger files over the first FULL_SCAN_TOKENS, and then each
    window as it is read (a max over seq_len + 1 ids), so a bad id never reaches the model.
    """

    def __init__(self, path: str, seq_len: int, vocab_size: int) -> None:
        self.path, self.seq_len, self.vocab_size = path, seq_len, vocab_size
        tokens = open_token_file(path, seq_len)
        self.num_tokens = int(tokens.shape[0])
        self.fully_checked = self.num_tokens <= FULL_SCAN_TOKENS
        check_vocab(tokens[:FULL_SCAN_TOKENS], vocab_size, path)
        self._tokens: np.ndarray | None = tokens

    def __getstate__(self) -> dict[str, Any]:
        # Pickling a memmap copies its data; spawned workers re-open the file instead.
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return sys.maxsize  # windows wrap around the file

    def __getitem__(self, index: int) -> Tensor:
        if self._tokens is None:
            self._tokens = np.load(self.path, mmap_mode="r")
        start = (index * self.seq_len) % (self.num_tokens - self.seq_len - 1)
        window = np.asarray(self._tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if not self.fully_checked:
            check_vocab(window, self.vocab_size, self.path)
        return torch.from_numpy(window)


def open_token_file(path: str, seq_len: int) -> np.ndarray:
    """The 1-D integer array in `path`, memory-mapped; ConfigError naming data.path otherwise."""
    if not os.path.isfile(path):
        raise ConfigError(
            f"data.path: token file {path} does not exist; make one with "
            "`python -m trainer.data make-tokens INPUT.txt OUTPUT.npy`"
        )
    with open(path, "rb") as f:
        # np.load reads anything else as a pickle and says so, which misleads: name the format instead.
        if f.read(len(np.lib.format.MAGIC_PREFIX)) != np.lib.format.MAGIC_PREFIX:
            raise ConfigError(
                f"data.path: {path} is not a .npy file of token ids; make one with "
                "`python -m trainer.data make-tokens INPUT.txt OUTPUT.npy`"
            )
    try:
        tokens = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as err:
        raise ConfigError(f"data.path: {path} is not a .npy file ({err})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(
            f"data.path: {path} must hold a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}"
        )
    if tokens.shape[0] < seq_len + 2:
        raise ConfigError(
            f"data.path: {path} holds {tokens.shape[0]} tokens; seq_len={seq_len} needs >= {seq_len + 2}"
        )
    return tokens


def check_vocab(tokens: np.ndarray, vocab_size: int, path: str) -> None:
    """Raise ConfigError if any id in `tokens` is outside [0, vocab_size)."""
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise ConfigError(
            f"data.path: {path} holds token id {high if high >= vocab_size else low}, outside "
            f"[0, model.vocab_size={vocab_size}); pick a model with vocab_size > {high}"
        )


def make_tokens(text_path: str, out_path: str) -> int:
    """Byte-level tokenization (token = byte value, vocab 256) of a text file into a uint16
    .npy at exactly `out_path`; returns the number of tokens."""
    with open(text_path, "rb") as f:
        tokens = np.frombuffer(f.read(), dtype=np.uint8).astype(np.uint16)
    with open(out_path, "wb") as f:  # a file object, so np.save does not append ".npy"
        np.save(f, tokens)
    return int(tokens.shape[0])


class StepSampler(Sampler[int]):
    """This rank's global sample indices for steps start_step .. num_steps - 1, in order.

    Step s, micro-step m, rank r reads s*G + (m*world_size + r)*micro_batch + [0, micro_batch),
    with G = micro_batch * grad_accum * world_size. Resuming after k optimizer steps is
    start_step=k: the exact tail of the uninterrupted stream.
    """

    def __init__(
        self, micro_batch: int, grad_accum: int, world_size: int, rank: int, start_step: int, num_steps: int
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if not 0 <= start_step <= num_steps:
            raise ValueError(f"start_step must be in [0, num_steps={num_steps}], got {start_step}")
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.world_size, self.rank = world_size, rank
        self.start_step, self.num_steps = start_step, num_steps

    def __iter__(self) -> Iterator[int]:
        per_step = global_batch(self.micro_batch, self.grad_accum, self.world_size)
        for step in range(self.start_step, self.num_steps):
            for micro_step in range(self.grad_accum):
                first = step * per_step + (micro_step * self.world_size + self.rank) * self.micro_batch
                yield from range(first, first + self.micro_batch)

    def __len__(self) -> int:
        return (self.num_steps - self.start_step) * self.grad_accum * self.micro_batch


def split_inputs_targets(samples: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """collate_fn: samples of seq_len + 1 -> (inputs_BT, targets_BT), both contiguous; samples of
    packing=document (2 x seq_len + 1, document numbers below the tokens) -> (inputs_BT, targets_BT,
    documents_BT)."""
    # Split in the worker so pin_memory pins two contiguous tensors the caller can copy
    # to the device with non_blocking=True (a strided view would be copied synchronously).
    tokens_BT1 = torch.stack(list(samples))
    if tokens_BT1.dim() == 3:
        return document_batch(tokens_BT1)
    return tokens_BT1[:, :-1].contiguous(), tokens_BT1[:, 1:].contiguous()


VALIDATION_SHIFT = 1 << 62
"""Synthetic held-out samples are indices from here on: a training run never reads that far."""


class Shifted(Dataset[Tensor]):
    """Sample i of `base` is sample i + shift: a stream's far part, held out."""

    def __init__(self, base: Dataset[Tensor], shift: int) -> None:
        self.base, self.shift = base, shift

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> Tensor:
        return self.base[index + self.shift]


def text_entries(data: DataConfig) -> tuple[Path, Path | None]:
    """The cache entries of data.files and data.validation_files (None without)."""
    files = TokenizerFiles.of(data.tokenizer or "")
    train = entry_dir(data.cache_dir, check_files(data.files, "data.files"), data.text_field, files)
    if not data.validation_files:
        return train, None
    paths = check_files(data.validation_files, "data.validation_files")
    return train, entry_dir(data.cache_dir, paths, data.text_field, files)


def text_dataset(data: DataConfig, seq_len: int, validation: bool) -> PackedText:
    """The training or held-out stream of data=text, from the cache the job process filled."""
    train, held = text_entries(data)
    for entry in (train, held):
        if entry is not None and not (entry / "meta.json").is_file():
            raise ConfigError(f"data.cache_dir: no cached tokens at {entry}; the job process makes them")
    document = data.packing == Packing.document
    if validation and held is not None:
        return PackedText(held, seq_len, document, key="data.validation_files")
    keep = None
    if data.validation_fraction > 0:  # documents set apart: the same ones every run
        apart = held_out(read_meta(train).documents, data.validation_fraction, data.data_seed)
        keep = apart if validation else ~apart
    if validation:  # evaluation reads the same sequences every time, in stream order
        return PackedText(train, seq_len, document, keep, key="data.validation_fraction")
    shuffle_seed = data.data_seed if data.shuffle else None
    return PackedText(train, seq_len, document, keep, key="data.files", shuffle_seed=shuffle_seed)


def corpus_line(config: TrainConfig, world_size: int) -> str | None:
    """data=text in words before training: the tokens and documents it trains on, the share of an epoch
    the run reads, and in what order (None for other data)."""
    data = config.data
    if data.kind != DataKind.text:
        return None
    train = text_dataset(data, config.seq_len, validation=False)
    documents = len(train.stream()[1]) - 1
    read = config.steps * config.sequences_per_step(world_size) * config.seq_len
    epochs = read / train.num_tokens
    order = (
        f"each epoch's {train.windows:,} windows shuffled (data.shuffle, data_seed={data.data_seed})"
        if data.shuffle
        else "in stream order, wrapping to the start each epoch (data.shuffle=false)"
    )
    return (
        f"data=text: {train.num_tokens:,} training tokens in {documents:,} documents; {config.steps} steps read "
        f"{read:,} tokens, {epochs:.2f} epochs, {order}"
    )


def build_dataset(
    data: DataConfig, vocab_size: int, seq_len: int, seed: int, validation: bool = False
) -> Dataset[Tensor]:
    """SyntheticTokens over the model's vocabulary, the TokenFile at data.path, or data=text's
    PackedText; `validation`: the held-out stream instead."""
    if data.kind == DataKind.tokens:
        assert data.path is not None  # DataConfig.__post_init__ requires it
        return TokenFile(data.path, seq_len, vocab_size)
    if data.kind == DataKind.text:
        return text_dataset(data, seq_len, validation)
    synthetic = SyntheticTokens(vocab_size, seq_len, data.branching, data.data_seed, seed)
    return Shifted(synthetic, VALIDATION_SHIFT) if validation else synthetic


def check_data(data: DataConfig, vocab_size: int, seq_len: int, seed: int) -> None:
    """In the job process, before any rank starts: the token file is a 1-D integer .npy whose ids fit
    the model's vocabulary (the checks TokenFile makes when a rank opens it); data=text's tokenizer
    fits the model's vocabulary, its files are tokenised (once: the cache) and hold enough tokens.
    ConfigError otherwise."""
    if data.kind == DataKind.tokens:
        build_dataset(data, vocab_size, seq_len, seed)
    if data.kind != DataKind.text:
        return
    files = TokenizerFiles.of(data.tokenizer or "")
    paths = check_files(data.files, "data.files")
    held = check_files(data.validation_files, "data.validation_files")
    tokenizer_vocab = vocab_of(files).vocab_size
    if tokenizer_vocab > vocab_size:
        raise ConfigError(
            f"data.tokenizer: {files.tokenizer} has {tokenizer_vocab} tokens, more than model.vocab_size="
            f"{vocab_size}; pick a model with vocab_size >= {tokenizer_vocab}"
        )
    ensure_entry(data.cache_dir, paths, data.text_field, files, "data.files")
    if held:
        ensure_entry(data.cache_dir, held, data.text_field, files, "data.validation_files")
    text_dataset(data, seq_len, validation=False)  # enough tokens, after the held-out documents too
    if data.has_validation:
        text_dataset(data, seq_len, validation=True)


def should_pin_memory(dataloader: DataloaderConfig, device: DeviceKind) -> bool:
    """dataloader.pin_memory, only where batches go to a GPU (DataLoader warns and ignores it otherwise)."""
    return dataloader.pin_memory and device != DeviceKind.cpu and torch.cuda.is_available()


def build_loader(config: TrainConfig, rank: int, world_size: int, start_step: int = 0) -> DataLoader[Tensor]:
    """A DataLoader of this rank's micro-batches for steps start_step .. config.steps - 1."""
    options = config.dataloader
    sampler = StepSampler(config.micro_batch, config.grad_accum, world_size, rank, start_step, config.steps)
    return DataLoader(
        build_dataset(config.data, config.model.vocab_size, config.seq_len, config.seed),
        batch_size=config.micro_batch,
        sampler=sampler,
        collate_fn=split_inputs_targets,
        num_workers=options.num_workers,
        prefetch_factor=options.prefetch_factor,
        pin_memory=should_pin_memory(options, config.device),
        persistent_workers=options.persistent_workers,
        # Each iterator draws a worker base seed from its generator; without one it would
        # consume the global torch RNG and shift every later random draw of the rank.
        generator=torch.Generator().manual_seed(config.seed),
    )


def validation_batches(config: TrainConfig, rank: int, world_size: int) -> list[tuple[Tensor, ...]]:
    """This rank's held-out micro-batches: `eval.batches` global batches, partitioned as training's
    steps 0 .. eval.batches - 1 are, so every evaluation and every world size reads the same
    sequences. Read once and kept (eval.batches * micro_batch * grad_accum sequences of ids)."""
    dataset = build_dataset(
        config.data, config.model.vocab_size, config.seq_len, config.seed, validation=True
    )
    sampler = StepSampler(config.micro_batch, config.grad_accum, world_size, rank, 0, config.eval.batches)
    loader = DataLoader(
        dataset, batch_size=config.micro_batch, sampler=sampler, collate_fn=split_inputs_targets
    )
    return list(loader)


def to_device(batch: Tensor, device: torch.device) -> Tensor:
    """A micro-batch on the rank's device, without the host waiting for the device.

    CUDA copies from pageable memory synchronously with the host, whatever `non_blocking` says, so
    the copy would wait for the GPU's queue and `time/data_s` would include GPU time. From
    page-locked memory the copy is only enqueued and the host runs ahead. A batch the loader
    pinned (dataloader.pin_memory) is copied as it is; any other is pinned first (torch's caching
    host allocator reuses the page-locked block once its copy has completed).
    """
    if device.type != "cuda":
        return batch.to(device)
    return (batch if batch.is_pinned() else batch.pin_memory()).to(device, non_blocking=True)


def build_batches(
    config: TrainConfig, rank: int, world_size: int, start_step: int = 0
) -> Iterator[tuple[Tensor, Tensor]]:
    """This rank's (inputs_BT, targets_BT) int64 CPU micro-batches, grad_accum per step, from
    step start_step (= optimizer steps already taken) to config.steps; the caller moves them."""
    yield from build_loader(config, rank, world_size, start_step)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.data make-tokens INPUT.txt OUTPUT.npy`, or with `--tokenizer T FILES... CACHE_DIR`."""
    parser = argparse.ArgumentParser(prog="python -m trainer.data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser(
        "make-tokens",
        help="byte-level tokenize a text file into a uint16 .npy (vocab 256); with --tokenizer, "
        "tokenize FILES into data=text's cache at CACHE_DIR",
    )
    make.add_argument(
        "input", nargs="+", help="text file to read (with --tokenizer: txt, json, jsonl, parquet files)"
    )
    make.add_argument(
        "output", help=".npy file to write (with --tokenizer: the cache directory, data.cache_dir)"
    )
    make.add_argument("--tokenizer", help="a tokenizer.json or a model directory (data.tokenizer)")
    make.add_argument(
        "--text-field", default="text", help="json/jsonl/parquet field of the text (data.text_field)"
    )
    make.add_argument(
        "--workers", type=int, default=0, help="tokenizing processes (0: this one, tokenizers' threads)"
    )
    args = parser.parse_args(argv)
    if args.tokenizer is not None:
        return make_text_tokens(parser, args)
    if len(args.input) != 1:
        parser.error("byte-level make-tokens reads one INPUT.txt; give --tokenizer for several files")
    if not os.path.isfile(args.input[0]):
        parser.error(f"input text file {args.input[0]} does not exist")
    count = make_tokens(args.input[0], args.output)
    print(f"wrote {count} tokens (byte-level, vocab {BYTE_VOCAB}) to {args.output}")
    return 0


def make_text_tokens(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """make-tokens --tokenizer: fill data=text's cache (the entry a job with these files would use)."""
    try:
        files = TokenizerFiles.of(args.tokenizer)
        paths = check_files(args.input, "FILES")
        start = time.perf_counter()
        entry, existed = ensure_entry(args.output, paths, args.text_field, files, "FILES", args.workers)
    except ConfigError as err:
        parser.error(str(err))
    meta = read_meta(entry)
    seconds = time.perf_counter() - start
    verb = "reused" if existed else f"wrote ({meta.tokens / seconds:,.0f} tokens/s)"
    print(f"{verb} {meta.tokens} tokens of {meta.documents} documents (vocab {meta.vocab_size}) at {entry}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
