"""trainer/cuda.py and trainer/devices.py on CPU: what a CUDA rank would be given, decided by pure functions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, compose_config, free_port, run_in_one_process, torchrun_env
from trainer.config import AttentionKernel, ConfigError, DType, TrainConfig, to_plain
from trainer.cuda import (
    ALLOC_CONF,
    apply_tf32,
    capability_error,
    local_ranks_error,
    process_group_backend,
    set_rank_environment,
)
from trainer.devices import DEVICES, find_accelerator, find_device, tf32_enabled
from trainer.model.attention import SDPBackend, choose_sdpa
from trainer.plan import device_memory
from trainer.units import GIB
from trainer.world import rank_threads, usable_cores


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


def test_rank_environment_tears_cupti_down_after_a_profile(monkeypatch) -> None:
    """kineto detaches CUPTI only under TEARDOWN_CUPTI=1; left attached, the steps after a profiled one run
    10-20% slower (pytorch/pytorch#146604). A user's own setting wins."""
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    set_rank_environment(None)
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    set_rank_environment(None)
    assert os.environ["TEARDOWN_CUPTI"] == "0"


def test_ranks_sharing_a_host_split_its_cores() -> None:
    """CUDA ranks too (world.py): under offload=cpu each rank's AdamW runs on the host."""
    assert rank_threads(1) == usable_cores()
    assert rank_threads(2) == max(1, usable_cores() // 2)
    assert rank_threads(10**6) == 1


BF16_NEEDS, FP8_NEEDS = (
    "precision=bf16 needs compute capability 8.0",
    "precision=fp8 needs float8 tensor cores",
)


@pytest.mark.parametrize(
    ("precision", "capability", "refused", "way_out"),
    [
        ("bf16", (7, 0), BF16_NEEDS, "use precision=fp16 (dynamic loss scaling) or precision=fp32"),
        ("fp16", (7, 0), None, None),
        ("fp32", (6, 0), None, None),
        ("fp8", (7, 0), FP8_NEEDS, "use precision=fp16"),
        ("fp8", (8, 0), FP8_NEEDS, "use precision=bf16"),
        ("fp8", (8, 6), FP8_NEEDS, "use precision=bf16"),
        ("bf16", (8, 0), None, None),
        ("fp8", (8, 9), None, None),
        ("fp8", (9, 0), None, None),
    ],
)
def test_what_the_gpu_cannot_run_is_one_line(
    precision: str, capability: tuple[int, int], refused: str | None, way_out: str | None
) -> None:
    """fp8's torch._scaled_mm needs 8.9 (Ada, Hopper); bf16 8.0 (Ampere). The way out is what it can run."""
    error = capability_error(compose_config(f"precision={precision}").precision, capability, "GPU")
    if refused is None:
        assert error is None
        return
    assert error is not None and error.startswith(refused) and "\n" not in error
    assert f"has compute capability {capability[0]}.{capability[1]}; {way_out}" in error and error.endswith(
        way_out
    )


def test_attention_below_ampere_is_the_efficient_kernel_and_flash_is_refused() -> None:
    """torch's CUDA flash kernel needs compute capability 8.0: `auto` takes the efficient kernel there in
    half precision; an explicit `flash` is one line. Where no GPU is visible (a plan for another machine)
    the capability is unknown and flash assumed."""
    turing = choose_sdpa(AttentionKernel.auto, "cuda", DType.bfloat16, grouped=True, capability=(7, 5))
    assert turing.backend == SDPBackend.EFFICIENT_ATTENTION and turing.repeat_kv
    ampere = choose_sdpa(AttentionKernel.auto, "cuda", DType.bfloat16, grouped=True, capability=(8, 0))
    assert ampere.backend == SDPBackend.FLASH_ATTENTION
    unknown = choose_sdpa(AttentionKernel.auto, "cuda", DType.bfloat16, grouped=True)
    assert unknown.backend == SDPBackend.FLASH_ATTENTION
    with pytest.raises(
        ConfigError,
        match=r"^attention=flash needs compute capability 8.0 .* has 7.5; use attention=efficient",
    ):
        choose_sdpa(AttentionKernel.flash, "cuda", DType.bfloat16, grouped=True, capability=(7, 5))
    # SDPA's cuDNN backend likewise (sdp_utils.cpp check_cudnn_hardware_support: sm80 to sm121), K/V unrepeated
    with pytest.raises(
        ConfigError,
        match=r"^attention=cudnn needs compute capability 8.0 .* has 7.5; use attention=efficient",
    ):
        choose_sdpa(AttentionKernel.cudnn, "cuda", DType.float16, grouped=True, capability=(7, 5))
    hopper = choose_sdpa(AttentionKernel.cudnn, "cuda", DType.bfloat16, grouped=True, capability=(9, 0))
    assert hopper.backend == SDPBackend.CUDNN_ATTENTION and not hopper.repeat_kv


FAKE_V100 = """
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_capability = lambda device=None: (7, 0)
torch.cuda.get_device_name = lambda device=None: "Tesla V100-SXM2-16GB"
"""


def test_a_job_on_a_gpu_without_them_ends_in_one_line_before_any_rank_starts(tmp_path) -> None:
    """`python -m trainer device=cuda ...` with torch.cuda faking a V100 (compute capability 7.0): bf16, fp8,
    flash and cudnn each end in one `error:` line and exit 2; no rank started (no metrics.jsonl)."""
    cases = {
        "precision=bf16": "precision=bf16 needs compute capability 8.0",
        "precision=fp8": "precision=fp8 needs float8 tensor cores",
        "attention=flash": "attention=flash needs compute capability 8.0",
        "attention=cudnn": "attention=cudnn needs compute capability 8.0",
    }
    argvs = [
        ["device=cuda", "logger=none", "nproc=1", "steps=1", "save=off", "precision=fp16" if "attention" in case else case,
         *([case] if "attention" in case else []), f"hydra.run.dir={tmp_path / str(n)}"]
        for n, case in enumerate(cases)
    ]  # fmt: skip
    results = run_in_one_process(argvs, tmp_path / "results.json", timeout=300, prelude=FAKE_V100)
    for n, ((case, expected), result) in enumerate(zip(cases.items(), results)):
        lines = (result["stdout"] + result["stderr"]).strip().splitlines()
        assert result["returncode"] == 2, (case, result)
        assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), (case, lines)
        assert not (tmp_path / str(n) / "metrics.jsonl").exists()


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
