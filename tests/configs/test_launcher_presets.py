"""conf/hydra/launcher/{slurm,local}.yaml compose into the submitit parameters a cluster job needs.

SLURM is not on the test machine: the slurm preset is instantiated as Hydra would, the launcher
builds its submitit executor (submitit's own `mocked_slurm` stands in for `srun` on the PATH),
and the sbatch script submitit would submit is rendered by submitit itself, then read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import submitit
from hydra.utils import instantiate
from omegaconf import DictConfig
from submitit.slurm.test_slurm import mocked_slurm

from tests.helpers import compose

pytestmark = pytest.mark.timeout(60)


class Captured(Exception):
    """Raised in place of submitting: carries the executor the launcher built."""


def compose_with_hydra(tmp_path: Path, *overrides: str) -> DictConfig:
    return compose(*overrides, f"hydra.sweep.dir={tmp_path}", hydra=True)


def class_name(obj: Any) -> str:
    # By name: Hydra's plugin scan loads hydra_plugins modules afresh, so their classes are not the imported ones.
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def built_executor(cfg: DictConfig, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The submitit executor the launcher builds for one sweep point, stopped before submission."""
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg

    def capture(executor: Any, *args: Any, **kwargs: Any) -> None:
        raise Captured(executor)

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", capture)
    with pytest.raises(Captured) as captured:
        launcher.launch([["micro_batch=1"]], initial_job_idx=0)
    return captured.value.args[0]._executor


def test_slurm_preset_asks_for_one_task_and_nproc_gpus_on_each_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = compose_with_hydra(tmp_path, "hydra/launcher=slurm", "nodes=2", "nproc=8")
    assert class_name(instantiate(cfg.hydra.launcher)) == "hydra_plugins.zerolab_launchers.SlurmLauncher"
    with mocked_slurm():
        executor = built_executor(cfg, monkeypatch)
        assert isinstance(executor, submitit.SlurmExecutor)
        params = executor.parameters
        assert (params["nodes"], params["ntasks_per_node"], params["gpus_per_node"]) == (2, 1, 8)
        assert (params["cpus_per_task"], params["time"], params["signal_delay_s"]) == (64, 240, 120)
        assert executor.max_num_timeout == 3
        sbatch = executor._make_submission_file_text(
            "python -u -m submitit.core._submit folder", "uid"
        ).splitlines()
    for line in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=64", "--time=240"):
        assert f"#SBATCH {line}" in sbatch
    assert f"#SBATCH --signal={submitit.JobEnvironment.USR_SIG}@120" in sbatch  # submitit's preemption signal
    assert any(
        line.startswith("srun ") and line.endswith("submitit.core._submit folder") for line in sbatch
    )  # one task per node


@pytest.mark.parametrize(
    "overrides,gpus",
    [(["nproc=auto"], 8), (["nproc=4"], 4), (["nproc=2", "device=cpu"], 0)],
    ids=["auto-is-an-8-gpu-node", "nproc", "cpu"],
)
def test_slurm_preset_gpus_follow_nproc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], gpus: int
) -> None:
    cfg = compose_with_hydra(tmp_path, "hydra/launcher=slurm", *overrides)
    with mocked_slurm():
        assert built_executor(cfg, monkeypatch).parameters["gpus_per_node"] == gpus


def test_local_preset_runs_one_task_on_this_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose_with_hydra(tmp_path, "hydra/launcher=local", "nproc=2", "device=cpu")
    assert class_name(instantiate(cfg.hydra.launcher)) == "hydra_plugins.zerolab_launchers.LocalLauncher"
    executor = built_executor(cfg, monkeypatch)
    assert isinstance(executor, submitit.LocalExecutor)
    assert (executor.parameters["tasks_per_node"], executor.parameters["gpus_per_node"]) == (1, 0)
