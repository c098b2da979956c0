"""The tokenizer of `data.tokenizer`: a tokenizer.json (Hugging Face `tokenizers`), or a model directory
holding one, with the BOS and EOS tokens its tokenizer_config.json names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import ConfigError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class TokenizerFiles:
    """Where a tokenizer's two files are (the config may be absent)."""

    tokenizer: Path
    config: Path | None

    @classmethod
    def of(cls, path: str) -> TokenizerFiles:
        """A tokenizer.json, or a directory holding one; ConfigError naming data.tokenizer otherwise."""
        given = Path(path).expanduser()
        tokenizer = given / TOKENIZER_FILE if given.is_dir() else given
        if not tokenizer.is_file():
            raise ConfigError(
                f"data.tokenizer: {path} is neither a tokenizer.json nor a directory holding one"
            )
        config = tokenizer.parent / CONFIG_FILE
        return cls(tokenizer, config if config.is_file() else None)


def special_token(config: dict[str, Any], name: str) -> str | None:
    """`bos_token`/`eos_token` of a tokenizer_config.json: a string, or an AddedToken dict's content."""
    value = config.get(name)
    return value.get("content") if isinstance(value, dict) else value


@dataclass(frozen=True)
class Specials:
    """The ids the packing needs, and the vocabulary they live in."""

    vocab_size: int
    eos_id: int
    bos_id: int | None


def load_tokenizer(files: TokenizerFiles) -> Any:
    """The `tokenizers.Tokenizer` (imported here: only the job process and make-tokens tokenise)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(files.tokenizer))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"data.tokenizer: {files.tokenizer} is not a tokenizer.json ({err})") from None


def specials(tokenizer: Any, files: TokenizerFiles) -> Specials:
    """BOS and EOS as tokenizer_config.json names them; ConfigError when it names no EOS in the vocabulary."""
    config = json.loads(files.config.read_text()) if files.config is not None else {}
    ids = {}
    for name in ("bos_token", "eos_token"):
        token = special_token(config, name)
        ids[name] = tokenizer.token_to_id(token) if token is not None else None
    if ids["eos_token"] is None:
        raise ConfigError(
            f"data.tokenizer: {files.config or files.tokenizer.parent / CONFIG_FILE} names no eos_token "
            "of the tokenizer's vocabulary; packing puts EOS between documents"
        )
    return Specials(tokenizer.get_vocab_size(with_added_tokens=True), ids["eos_token"], ids["bos_token"])
