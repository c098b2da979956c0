"""Every named sweep in sweeps/ composes, every one of its points validates, and each is documented."""

from __future__ import annotations

import itertools
import math

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from tests.helpers import CONF, REPO, compose
from trainer.cli import check_group_overrides
from trainer.config import to_plain, validate

SWEEPS = sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))
REQUIRED = {"micro_batch_x_stage", "precision_x_stage", "checkpointing_x_micro_batch", "comm_x_stage"}


def compose_sweep(name: str, overrides: list[str]) -> DictConfig:
    return compose(f"+sweeps={name}", *overrides, hydra=True)


def sweep_points(params: DictConfig) -> list[list[str]]:
    """The points Hydra's basic sweeper makes of `hydra.sweeper.params`: the product of each key's values."""
    parsed = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [list(point) for point in itertools.product(*axes)]


def test_the_required_sweeps_exist_and_conf_sweeps_is_the_same_folder() -> None:
    assert REQUIRED <= set(SWEEPS)
    assert (CONF / "sweeps").resolve() == (REPO / "sweeps").resolve()


@pytest.mark.parametrize("name", SWEEPS)
def test_every_point_of_the_sweep_composes_and_validates(name: str) -> None:
    params = compose_sweep(name, []).hydra.sweeper.params
    points = sweep_points(params)
    sizes = [len(str(value).split(",")) for value in params.values()]
    assert len(points) == math.prod(sizes) >= 4
    for point in points:
        cfg = compose_sweep(name, point)
        choices = cfg.hydra.runtime.choices
        with open_dict(cfg):
            del cfg["hydra"]  # the job's config, as the task function receives it
        # The schema takes every value as the sweep file and the point set it.
        assert to_plain(validate(cfg)) == OmegaConf.to_container(cfg, resolve=True)
        for override in point:  # a group's option was chosen, a key's value set
            key, value = override.split("=")
            got = (
                choices[key] if key in choices else OmegaConf.select(cfg, key)
            )  # a dotted key: zero.compression
            assert str(getattr(got, "value", got)) == value  # an enum key's value is its member


@pytest.mark.parametrize("name", SWEEPS)
def test_the_command_line_wins_over_the_sweep_file(name: str) -> None:
    """`+sweeps=NAME steps=5 log_every=1`: keys the file sets give way to the command line."""
    cfg = compose_sweep(name, ["steps=5", "log_every=1"])
    assert (cfg.steps, cfg.log_every) == (5, 1)


@pytest.mark.parametrize("name", SWEEPS)
def test_the_sweep_file_documents_itself(name: str) -> None:
    lines = (REPO / "sweeps" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith("# ") and len(lines[1]) > 30  # the question it answers
    assert f"# Run: python -m trainer -m +sweeps={name}" in lines
    assert f"`{name}`" in (REPO / "docs" / "sweeps.md").read_text()


def test_the_command_line_check_knows_the_sweeps(capsys: pytest.CaptureFixture[str]) -> None:
    check_group_overrides([f"+sweeps={name}" for name in SWEEPS])  # no error
    with pytest.raises(SystemExit) as exit_info:
        check_group_overrides(["+sweeps=stage_x_nothing"])
    assert exit_info.value.code == 2
    assert f"allowed: {', '.join(SWEEPS)}" in capsys.readouterr().err
