"""Command-line overrides (`key=value`) read back: a leaf module (it imports nothing from trainer/),
so the entry (trainer/cli.py) and the modules that read a job's overrides from its directory
(cluster.py, telemetry, report, advise) share it without importing the entry."""


def split_override(override: str) -> tuple[str, str]:
    """A command-line override's key and value: `+a.b=1` -> (`a.b`, `1`) (Hydra's `+`, `++` and
    `~` prefixes dropped); the value is "" where none is given."""
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value
