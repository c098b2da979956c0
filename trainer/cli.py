"""Command-line checks that Hydra would otherwise report over many lines."""

from __future__ import annotations

import sys
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_group_overrides(args: list[str]) -> None:
    """Exit with one line when `group=option` names an option that does not exist.

    Hydra's own message spans a dozen lines (search path, defaults tree); a user mistyping
    `zero=stage5` needs the key and the allowed values, nothing more.
    """
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.lstrip("+~").partition("=")
        if "." in key or "/" in key or not (CONF_DIR / key).is_dir() or "(" in value:
            continue
        allowed = group_options(key)
        for option in value.split(","):
            if option not in allowed:
                sys.stderr.write(f"error: {key}={option} is not an option; allowed: {', '.join(allowed)}\n")
                raise SystemExit(2)
