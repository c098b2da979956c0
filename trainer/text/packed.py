"""A cached token stream as a dataset of seq_len + 1 windows, and its held-out split.

Sample i is the window of seq_len + 1 tokens at (i * seq_len) % (num_tokens - seq_len - 1), as
trainer/data.py's TokenFile reads a token file: a function of i alone, so the global sample order
(and a resumed run's batches) are the same on any number of ranks. Documents are packed end to
end, EOS after each, and a row may start or end inside one.

data.shuffle: the stream is cut into its `windows` whole windows (window k at k * seq_len), and
epoch e = i // windows reads them in a permutation drawn from (data_seed, e): still a function of i
alone, so shuffling keeps the order rank-count independent and a resume exact. (torch's
DistributedSampler shuffles per rank's share and per epoch set by the caller; here the sampler is
step-indexed, trainer/data.py StepSampler, so the permutation lives in the dataset.)

packing=document adds each position's document number as a second row of the sample, from which
the batch gets a block-causal mask (trainer/model/decoder.py) and targets that never cross a
document boundary (IGNORE_INDEX where they would).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from trainer.config import ConfigError

IGNORE_INDEX = -100
"""A target the loss skips (F.cross_entropy's default ignore_index)."""


def held_out(num_documents: int, fraction: float, seed: int) -> np.ndarray:
    """Which documents are set apart for validation: a fixed draw from `seed`, so the same ones every run."""
    return np.random.default_rng(seed).random(num_documents) < fraction


def select_documents(
    tokens: np.ndarray, starts: np.ndarray, keep: np.ndarray, key: str
) -> tuple[np.ndarray, np.ndarray]:
    """The stream of the kept documents only (a copy), and their starts in it."""
    if not keep.any():
        raise ConfigError(f"{key}: the split leaves no document of {keep.shape[0]} on this side")
    lengths = np.diff(starts)[keep]
    chosen = np.concatenate([tokens[a:b] for a, b in zip(starts[:-1][keep], starts[1:][keep])])
    new_starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_starts[1:])
    return chosen, new_starts


class PackedText(Dataset[Tensor]):
    """The windows of a cache entry's stream, or of the documents `keep` selects from it."""

    def __init__(
        self,
        entry: Path,
        seq_len: int,
        document: bool,
        keep: np.ndarray | None = None,
        key: str = "data.files",
        shuffle_seed: int | None = None,
    ) -> None:
        self.entry, self.seq_len, self.document, self.keep, self.key = entry, seq_len, document, keep, key
        self.shuffle_seed = shuffle_seed
        """data.shuffle: the data_seed each epoch's permutation is drawn from; None: stream order."""
        self._stream: tuple[np.ndarray, np.ndarray] | None = None
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its permutation of the windows)
        self.num_tokens = int(self.stream()[0].shape[0])
        if self.num_tokens < seq_len + 2:
            raise ConfigError(
                f"{key}: the corpus holds {self.num_tokens} tokens; seq_len={seq_len} needs >= {seq_len + 2}"
            )
        self.windows = (self.num_tokens - 1) // seq_len
        """Whole windows of seq_len + 1 tokens in the stream, seq_len apart: a shuffled epoch's samples."""

    def stream(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, starts), memory-mapped (a selection is copied into memory)."""
        if self._stream is None:
            tokens = np.load(self.entry / "tokens.npy", mmap_mode="r")
            starts = np.load(self.entry / "starts.npy")
            self._stream = (
                (tokens, starts)
                if self.keep is None
                else select_documents(tokens, starts, self.keep, self.key)
            )
        return self._stream

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers re-open the entry rather than receive a pickled copy of its stream.
        return {**self.__dict__, "_stream": None, "_order": None}

    def __len__(self) -> int:
        return sys.maxsize  # windows wrap around the stream

    def start(self, index: int) -> int:
        """Where sample `index` starts in the stream."""
        if self.shuffle_seed is None:
            return (index * self.seq_len) % (self.num_tokens - self.seq_len - 1)
        epoch, k = divmod(index, self.windows)
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.shuffle_seed, epoch])
            self._order = (epoch, rng.permutation(self.windows))
        return int(self._order[1][k]) * self.seq_len

    def __getitem__(self, index: int) -> Tensor:
        tokens, starts = self.stream()
        start = self.start(index)
        window = torch.from_numpy(np.asarray(tokens[start : start + self.seq_len + 1], dtype=np.int64))
        if not self.document:
            return window
        positions = np.arange(start, start + self.seq_len + 1)
        documents = torch.from_numpy(np.searchsorted(starts, positions, side="right").astype(np.int64))
        return torch.stack([window, documents])


def document_batch(samples_B2T1: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Samples of packing=document -> (inputs_BT, targets_BT, documents_BT): a target in another
    document than its input is IGNORE_INDEX (the first token of a document is not predicted from
    the one before it, which it cannot see)."""
    tokens_BT1, documents_BT1 = samples_B2T1[:, 0], samples_B2T1[:, 1]
    targets_BT = tokens_BT1[:, 1:].clone()
    targets_BT[documents_BT1[:, 1:] != documents_BT1[:, :-1]] = IGNORE_INDEX
    return tokens_BT1[:, :-1].contiguous(), targets_BT, documents_BT1[:, :-1].contiguous()
