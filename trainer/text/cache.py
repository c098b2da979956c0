"""The token stream of a corpus, tokenised once and kept on disk.

An entry is a directory `<cache_dir>/<key>/` with
- tokens.npy: every document's ids (`Tokenizer.encode_batch`, special tokens as the tokenizer's
  post-processor adds them) each followed by EOS, uint16 where the vocabulary fits, else uint32;
- starts.npy: int64, where each document starts in tokens.npy, and its length last;
- meta.json: the vocabulary size, EOS/BOS ids and counts.
The key hashes the files' bytes, the text field and the tokenizer's two files, so a sweep's points,
a resumed job and `make-tokens` share an entry, and editing any of them makes a new one.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import ConfigError
from trainer.text.corpus import documents
from trainer.text.tokenizer import Specials, TokenizerFiles, load_tokenizer, specials

FORMAT = "zerolab-tokens-1"
"""Bumped whenever what an entry holds for the same inputs changes (e.g. how .txt splits documents)."""
BATCH_DOCUMENTS = 1024
"""Documents per `encode_batch` call (and per task handed to a worker)."""


@dataclass(frozen=True)
class Meta:
    """meta.json of an entry."""

    vocab_size: int
    eos_id: int
    bos_id: int | None
    documents: int
    tokens: int


def cache_key(paths: list[Path], text_field: str, files: TokenizerFiles) -> str:
    """A hash of everything the stream depends on."""
    digest = hashlib.blake2b(FORMAT.encode(), digest_size=16)
    inputs = [*paths, files.tokenizer, *([files.config] if files.config else [])]
    for path in inputs:
        digest.update(f"\0{path.suffix}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    digest.update(f"\0field={text_field}".encode())
    return digest.hexdigest()


def entry_dir(cache_dir: str, paths: list[Path], text_field: str, files: TokenizerFiles) -> Path:
    """Where the stream of these inputs is (or would be) kept."""
    return Path(cache_dir).expanduser() / cache_key(paths, text_field, files)


def read_meta(entry: Path) -> Meta:
    return Meta(**json.loads((entry / "meta.json").read_text()))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits in it, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# Each worker process loads the tokenizer once (a Tokenizer is not shared across processes).
_WORKER_TOKENIZER: Any = None


def _init_worker(tokenizer_path: str) -> None:
    global _WORKER_TOKENIZER
    from tokenizers import Tokenizer

    # A forked worker inherits its parent's handlers; Pool.terminate ends idle workers with SIGTERM,
    # and a worker that only noted it (a parent that handles stops, trainer/faults/stop.py) would
    # never end, and the pool's exit would wait for it forever.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    _WORKER_TOKENIZER = Tokenizer.from_file(tokenizer_path)


def _encode_in_worker(texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in _WORKER_TOKENIZER.encode_batch(texts)]


def batches(texts: Iterator[str]) -> Iterator[list[str]]:
    while batch := list(islice(texts, BATCH_DOCUMENTS)):
        yield batch


def encoded(
    texts: Iterator[str], files: TokenizerFiles, tokenizer: Any, workers: int
) -> Iterator[list[list[int]]]:
    """Each batch's ids, in order: in this process (tokenizers' own threads), or over `workers`
    processes. They fork before this process has encoded anything: tokenizers turns its thread pool
    off in a child forked after the parent used it."""
    if workers == 0:
        for batch in batches(texts):
            yield [encoding.ids for encoding in tokenizer.encode_batch(batch)]
        return
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, initializer=_init_worker, initargs=(str(files.tokenizer),)) as pool:
        yield from pool.imap(_encode_in_worker, batches(texts))


def tokenize(
    paths: list[Path],
    text_field: str,
    files: TokenizerFiles,
    key: str,
    workers: int = 0,
    progress: bool | None = None,
) -> tuple[np.ndarray, np.ndarray, Meta]:
    """The stream of `paths`: ids with EOS after each document, document starts, meta; ConfigError
    naming `key` for a corpus without text."""
    from tqdm import tqdm

    tokenizer = load_tokenizer(files)
    ids = specials(tokenizer, files)
    dtype = token_dtype(ids.vocab_size)
    chunks, lengths = [], []
    # tqdm's default (progress=None) draws the bar only on a terminal.
    with tqdm(desc="tokenizing", unit=" docs", disable=None if progress is None else not progress) as bar:
        for batch in encoded(
            documents(paths, text_field, key), files, tokenizer if workers == 0 else None, workers
        ):
            for doc in batch:
                chunks.append(np.asarray([*doc, ids.eos_id], dtype=dtype))
                lengths.append(len(doc) + 1)
            bar.update(len(batch))
    if not chunks:
        verb = "holds" if len(paths) == 1 else "hold"
        raise ConfigError(f"{key}: {', '.join(map(str, paths))} {verb} no text (every document is empty)")
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    tokens = np.concatenate(chunks)
    return tokens, starts, Meta(ids.vocab_size, ids.eos_id, ids.bos_id, len(lengths), int(tokens.shape[0]))


def write_entry(entry: Path, tokens: np.ndarray, starts: np.ndarray, meta: Meta) -> None:
    """Write the entry beside its place, then rename it into place: a reader never sees half of one,
    and of two processes making the same entry the first to finish keeps it."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    np.save(staging / "tokens.npy", tokens)
    np.save(staging / "starts.npy", starts)
    (staging / "meta.json").write_text(json.dumps(asdict(meta), indent=1) + "\n")
    try:
        os.rename(staging, entry)
    except OSError:  # another process made it first: the same content
        shutil.rmtree(staging)


def ensure_entry(
    cache_dir: str,
    paths: list[Path],
    text_field: str,
    files: TokenizerFiles,
    key: str,
    workers: int = 0,
    progress: bool | None = None,
) -> tuple[Path, bool]:
    """The entry of these inputs, tokenised now unless it exists; and whether it existed."""
    entry = entry_dir(cache_dir, paths, text_field, files)
    if (entry / "meta.json").is_file():
        return entry, True
    write_entry(entry, *tokenize(paths, text_field, files, key, workers, progress))
    return entry, False


def vocab_of(files: TokenizerFiles) -> Specials:
    """The tokenizer's vocabulary size and special ids, without tokenising anything."""
    return specials(load_tokenizer(files), files)
