"""Command-line mistakes reported in one line, where Hydra would print many."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from trainer.config import TrainConfig
from trainer.console import error, first_line
from trainer.overrides import split_override

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def register_configs() -> None:
    """Register the root schema (trainer/config/train.py) so Hydra validates every composed config
    against it. Here, not in trainer/config/: a rank rebuilds its config from plain data and never
    imports Hydra."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


# Groups of Hydra's own config whose options zerolab adds to (conf/hydra/<group>/).
HYDRA_GROUPS = ("hydra/launcher",)


def group_options(group: str) -> list[str]:
    """The options of a group: conf/<group>/*.yaml, and for a Hydra group also Hydra's and its plugins'."""
    options = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
    if group in HYDRA_GROUPS:
        from hydra.core.config_store import ConfigStore
        from hydra.core.plugins import Plugins

        Plugins.instance()  # imports the installed plugins, which register their options
        options |= {name.removesuffix(".yaml") for name in ConfigStore.instance().list(group)}
    return sorted(options)


def check_group_overrides(args: list[str]) -> None:
    """Exit with one line when `group=option` names an option that does not exist.

    Hydra's own message spans a dozen lines (search path, defaults tree); a user mistyping
    `zero=stage5` needs the key and the allowed values, nothing more.
    """
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = split_override(arg)
        if (
            "." in key
            or ("/" in key and key not in HYDRA_GROUPS)
            or not (CONF_DIR / key).is_dir()
            or "(" in value
        ):
            continue
        allowed = group_options(key)
        for option in value.split(","):
            if option not in allowed:
                error(f"{key}={option} is not an option; allowed: {', '.join(allowed)}")


@contextlib.contextmanager
def one_line_config_errors() -> Iterator[None]:
    """Turn Hydra's and OmegaConf's composition errors (`micro_batch=abc`, `foo=1`, `steps=[1`) into
    `error: <key>...` on one line and exit status 2, like every other bad input.

    Hydra prints these itself over several lines and exits 1 unless HYDRA_FULL_ERROR is set, in
    which case it re-raises them: that is the only hook it offers, so it is set here. A user who
    sets HYDRA_FULL_ERROR gets Hydra's full traceback, as Hydra documents.
    """
    if os.environ.get("HYDRA_FULL_ERROR"):
        yield
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except (HydraException, OmegaConfBaseException) as err:
        error(config_error_line(err))
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)


def config_error_line(err: Exception) -> str:
    """One line naming the key and what went wrong."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and key:
        return f"{key} is not a config key; `python -m trainer --cfg job` shows them all"
    if key:
        override = first_line(err).removeprefix("Error merging override ")
        reason = first_line(getattr(cause, "msg", cause))
        if "is not a valid bool" in reason:  # OmegaConf names enums' values, not a bool's
            reason += "; allowed: true, false"
        return f"{override if '=' in override else key}: {reason}"
    lines = [
        line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("See https://")
    ]
    return "; ".join(lines)
