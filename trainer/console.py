"""The one line of an error that zerolab reports (the whole story goes to a file or a traceback)."""

from __future__ import annotations

from typing import Any


def first_line(message: Any) -> str:
    """The first non-blank line of `message`, stripped; "" when it has none.

    A failure record's message is a dict or a string depending on the torch version, so a
    dict's "message" entry is read.
    """
    if isinstance(message, dict):
        message = message.get("message", "")
    return next((line.strip() for line in str(message).splitlines() if line.strip()), "")


def one_line(err: BaseException) -> str:
    """`Type: first line` of an exception."""
    line = first_line(err)
    return f"{type(err).__name__}: {line}" if line else type(err).__name__
