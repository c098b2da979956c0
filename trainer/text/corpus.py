"""The documents of `data.files`, in the files' order, read by `datasets`' own builders (streaming,
offline: nothing is converted to Arrow on disk)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.config import ConfigError

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
"""File suffix -> `datasets` builder. A .txt file's documents are its blank-line-separated paragraphs."""


def check_files(files: list[str], key: str) -> list[Path]:
    """The files as paths; ConfigError naming `key` for a missing or empty (0-byte) file or an unknown
    suffix (an empty json file is a StopIteration traceback in `datasets`' builder)."""
    paths = []
    for name in files:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"{key}: {name} does not exist")
        if path.suffix not in BUILDERS:
            raise ConfigError(f"{key}: {name} has suffix {path.suffix!r}; allowed: {', '.join(BUILDERS)}")
        if path.stat().st_size == 0:
            raise ConfigError(f"{key}: {name} is empty (0 bytes); list files that hold documents")
        paths.append(path)
    return paths


def read_file(path: Path) -> Any:
    """One file as a streaming `datasets.IterableDataset` of records."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask the Hub
    import datasets

    builder = BUILDERS[path.suffix]
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True, **options)


def documents(paths: list[Path], text_field: str, key: str) -> Iterator[str]:
    """Every non-empty document of `paths`; ConfigError naming data.text_field where a record lacks it."""
    for path in paths:
        field = "text" if BUILDERS[path.suffix] == "text" else text_field
        for record in read_file(path):
            if field not in record:
                raise ConfigError(
                    f"data.text_field: {path} has a record without field {field!r} (its fields: "
                    f"{', '.join(record)}); set data.text_field"
                )
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(
                    f"data.text_field: {path} field {field!r} holds {type(text).__name__}, not text"
                )
            if text.strip():
                yield text
