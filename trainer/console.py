"""What zerolab says on the console when something is wrong: one line, `error: ...` or
`warning: ...` (the whole story goes to a file or a traceback).

Every module reports through `error` and `warn` here, so that the prefixes, the stream and the
exit status of bad input (2, before any rank starts) are the same everywhere.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn, TextIO

BAD_INPUT = 2
"""The exit status of a mistake in the command line or the config, reported before any rank starts."""


def say(kind: str, line: str) -> None:
    """`kind: line` on stderr: `error`, or the status of a job a signal stopped (`interrupted`, `preempted`)."""
    print(f"{kind}: {line}", file=sys.stderr, flush=True)


def error_line(line: str) -> None:
    """`error: line` on stderr, without exiting (a sweep goes on to its next point)."""
    say("error", line)


def error(line: str, code: int = BAD_INPUT) -> NoReturn:
    """`error: line` on stderr, then exit with `code`."""
    error_line(line)
    raise SystemExit(code)


def warn(line: str, file: TextIO | None = None) -> None:
    """`warning: line` on stderr, or on `file` (the plan's warnings go with the plan, on stdout)."""
    print(f"warning: {line}", file=file or sys.stderr, flush=True)


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
