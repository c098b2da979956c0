"""trainer/cuda.py and trainer/devices.py on CPU: what a CUDA rank would be given, decided by pure functions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, compose_config, free_port, torchrun_env
from trainer.config import ConfigError, TrainConfig, to_plain
from trainer.cuda import (
    ALLOC_CONF,
    apply_tf32,
    local_ranks_error,
    process_group_backend,
    set_rank_environment,
)
from trainer.devices import DEVICES, find_accelerator, find_device, tf32_enabled
from trainer.plan import device_memory
from trainer.units import GIB


def test_cpu_offload_on_cuda_gets_gloo_beside_nccl() -> None:
    assert process_group_backend("cuda", offload_to_cpu=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend("cuda", offload_to_cpu=False) == "nccl"
    assert process_group_backend("cpu", offload_to_cpu=True) == "gloo"
    assert process_group_backend("cpu", offload_to_cpu=False) == "gloo"


def test_a_cpu_rank_joins_a_gloo_group() -> None:
    env = {**os.environ, **torchrun_env(0, 1, free_port())}
    code = "import torch.distributed as d; from trainer.world import init_world; init_world('cpu', offload_to_cpu=True); print(d.get_backend())"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip().splitlines()[-1] == "gloo", proc.stderr[-2000:]


def test_more_local_ranks_than_gpus_is_one_line_naming_the_counts() -> None:
    assert local_ranks_error(8, 8) is None
    error = local_ranks_error(4, 2)
    assert error is not None and "\n" not in error
    assert error.startswith("4 ranks on this host but only 2 CUDA devices are visible")
    assert "--nproc_per_node" in error


def test_rank_environment_turns_on_nccl_error_handling_flight_recorder_and_expandable_segments(
    monkeypatch, tmp_path
) -> None:
    for key in (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_DUMP_TEMP_FILE",
    ):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")  # a user's own setting wins
    set_rank_environment(tmp_path)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert int(os.environ["TORCH_FR_BUFFER_SIZE"]) == 2000
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl_traces" / "rank_")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    set_rank_environment(None)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOC_CONF == "expandable_segments:True"


def error_handling_of_the_rank(*args: object) -> str | None:
    """Stands in for trainer.launch.rank_main: what the elastic agent handed the rank."""
    return os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")


@pytest.mark.timeout(120)
def test_ranks_of_the_elastic_launcher_get_nccl_error_handling_3(monkeypatch, tmp_path) -> None:
    """The agent puts its own environment's value, else "1", into every rank's environment before
    the rank runs (issue 27, item 5): the job's launcher must set 3 where the agent reads it."""
    import trainer.launch

    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.setenv(key, "")  # recorded, so that the launcher's settings are undone after the test
        monkeypatch.delenv(key)
    monkeypatch.setattr(trainer.launch, "rank_main", error_handling_of_the_rank)
    plain = to_plain(TrainConfig())  # one node, no rendezvous endpoint, no memory cap: as a job hands it over
    launched = trainer.launch.launch_local(plain, tmp_path, "cpu", nproc=1, max_restarts=0, predicted={})
    assert launched == "3"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # a user's own setting wins
    assert trainer.launch.launch_local(plain, tmp_path, "cpu", nproc=1, max_restarts=0, predicted={}) == "2"


def tf32_settings() -> tuple:
    """Every getter of TF32, the legacy ones and the new: each raises if the two APIs were mixed."""
    return (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.cudnn.conv.fp32_precision,
    )


@pytest.mark.torch_versions
def test_precision_tf32_reads_the_same_through_the_legacy_and_the_new_api() -> None:
    """pytorch/pytorch#166387: setting fp32_precision alone makes a later legacy read raise."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        apply_tf32(True)
        assert tf32_settings() == (True, True, "high", "tf32", "tf32")
        assert tf32_enabled()
        apply_tf32(False)
        assert tf32_settings() == (False, False, "highest", "ieee", "ieee")
        assert not tf32_enabled()
    finally:
        apply_tf32(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_device_names_are_exact_and_variants_differ() -> None:
    assert find_device("NVIDIA L4").short == "l4"
    assert find_device("NVIDIA L40").short == "l40" and find_device("NVIDIA L40S").short == "l40s"
    shorts = {find_device(n).short for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL")}
    assert shorts == {"h100-sxm", "h100-pcie", "h100-nvl"}
    assert {find_device(n).short for n in DEVICES if "A100" in n} == {
        "a100-40gb",
        "a100-80gb",
        "a100-40gb-pcie",
        "a100-80gb-pcie",
    }
    assert find_device("NVIDIA H100 80GB HBM3 MIG 1g.10gb") is None  # a slice: unknown, not the whole GPU
    assert find_device("NVIDIA L4 ") is not None and find_device("L4") is None


@pytest.mark.parametrize(
    ("name", "short"),
    [
        ("H100", "h100-sxm"),
        ("h100", "h100-sxm"),
        ("H200", "h200"),
        ("A100-80GB", "a100-80gb"),
        ("L40S", "l40s"),
    ],
)
def test_plan_accelerator_is_accepted_in_any_case(name: str, short: str) -> None:
    config = compose_config(f"plan.accelerator={name}")
    memory = device_memory(config.plan, config.device_memory_gib, "cuda", 8, config.nodes)
    # Less the CUDA context (0.75 GiB) and NCCL's buffers (688 MiB) of trainer/plan/headroom.py, in bytes.
    assert memory.per_rank_bytes == find_accelerator(short).memory_mib * 2**20 - 1_526_726_656
    assert memory.source.startswith(short)
    assert compose_config("plan.accelerator=H200").plan.accelerator == "h200"
    assert find_accelerator("h200").memory_mib * 2**20 / GIB == pytest.approx(140.4, abs=0.05)


def test_an_unknown_accelerator_is_refused_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"^plan\.accelerator=H300 is unknown; allowed \(any case\): .*h100-pcie.*l40s"
    ):
        compose_config("plan.accelerator=H300")
