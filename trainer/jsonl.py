"""Reading JSON-lines files (metrics.jsonl, restarts.jsonl) with one policy for torn lines.

Rank 0 appends one JSON object per line. A rank killed while writing leaves half a line, and
a restarted rank appends after it: a line that does not parse is therefore not a record, and
is passed over wherever it stands (blank lines likewise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def parse_line(line: str | bytes) -> dict[str, Any] | None:
    """The record on one line, or None for a blank or torn line."""
    try:
        return json.loads(line)
    except ValueError:  # json.JSONDecodeError, or bytes that are not UTF-8
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file, in order; [] when there is no file."""
    if not path.exists():
        return []
    return [record for line in path.read_text().splitlines() if (record := parse_line(line)) is not None]
