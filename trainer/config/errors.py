"""`ConfigError`, a user mistake in the composed config, and `_require`, which raises it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in the composed config; its message names the dotted key."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
