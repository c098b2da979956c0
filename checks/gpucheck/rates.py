"""The kernel-rates job: what one device does per kernel, measured with torch alone, written as JSON
for the advisor (a file it can read; nothing reads it yet): the model presets' GEMMs in bf16 and in
fp8 (`torch._scaled_mm`, tensorwise scales), SDPA forward and forward+backward per backend, copy
bandwidth, fused AdamW's parameters per second, and eager dispatch's host cost per op.

torch is imported inside the functions: the check imports this module on any host, and a dry run
measures the tiny preset's shapes on CPU (fp8 and the CUDA-only SDPA kernels say why they have no
figure there). On CUDA the GPU times come from CUDA events around `repeats` calls after a warm-up;
dispatch is host time, the figure a step's launches cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from checks.gpucheck.runner import REPO

PASSES = ("fwd", "dgrad", "wgrad")
"""A linear's three GEMMs per step: the forward (tokens x in -> out), the input's gradient
(tokens x out -> in) and the weight's (out x tokens -> in)."""
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def preset(name: str) -> dict[str, int]:
    from omegaconf import OmegaConf

    config = OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml")
    return {k: int(config[k]) for k in ("dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")}


def linears(model: str) -> dict[str, tuple[int, int]]:
    """(in, out) of each distinct linear of a block and the output head (trainer/model/decoder.py)."""
    p = preset(model)
    head_dim = p["dim"] // p["n_heads"]
    return {"wq": (p["dim"], p["n_heads"] * head_dim), "wkv": (p["dim"], p["n_kv_heads"] * head_dim),
            "wo": (p["n_heads"] * head_dim, p["dim"]), "w13": (p["dim"], p["ffn_dim"]),
            "w2": (p["ffn_dim"], p["dim"]), "output": (p["dim"], p["vocab_size"])}  # fmt: skip


def gemm_shapes(models: tuple[str, ...], tokens: int) -> dict[str, tuple[int, int, int]]:
    """Every GEMM the presets' steps run at `tokens` per micro-batch, as (m, k, n), by name."""
    shapes = {}
    for model in models:
        for name, (k, n) in linears(model).items():
            by_pass = {"fwd": (tokens, k, n), "dgrad": (tokens, n, k), "wgrad": (n, tokens, k)}
            shapes.update({f"{model}.{name}.{p} {'x'.join(map(str, s))}": s for p, s in by_pass.items()})
    return shapes


def time_ms(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 3) -> float:
    """Milliseconds per call: CUDA events on a GPU, the host clock on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) * 1e3 / repeats
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / repeats


def gemm_tflops(shape: tuple[int, int, int], device: Any, fp8: bool, repeats: int) -> float:
    import torch

    m, k, n = shape
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    if fp8:  # _scaled_mm takes its second operand column-major: the transpose of a row-major (n, k)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        ms = time_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), device, repeats)
    else:
        bt = b.t()
        ms = time_ms(lambda: a @ bt, device, repeats)
    return 2 * m * k * n / (ms * 1e-3) / 1e12


def fp8_unavailable(device: Any) -> str | None:
    """Why `torch._scaled_mm` cannot run here (compute capability 8.9: trainer/cuda.py), else None."""
    import torch

    if device.type != "cuda":
        return "fp8 GEMMs need a GPU of compute capability >= 8.9"
    major, minor = torch.cuda.get_device_capability(device)
    return None if (major, minor) >= (8, 9) else f"compute capability {major}.{minor} < 8.9"


def gemm_rates(models: tuple[str, ...], tokens: int, device: Any, repeats: int) -> dict[str, Any]:
    shapes = gemm_shapes(models, tokens)
    rates: dict[str, Any] = {
        "bf16": {name: gemm_tflops(s, device, False, repeats) for name, s in shapes.items()}
    }
    why = fp8_unavailable(device)
    rates["fp8"] = {} if why else {name: gemm_tflops(s, device, True, repeats) for name, s in shapes.items()}
    rates["fp8_unavailable"] = why
    return rates


def sdpa_rates(model: str, micro_batch: int, seq_len: int, device: Any, repeats: int) -> dict[str, Any]:
    """Causal SDPA at the preset's heads, forward and forward+backward, per backend: ms and TFLOPS
    (forward 2 x 2·B·H·T²·D halved by the causal mask; backward 2.5 forwards, FlashAttention's count);
    a backend that cannot run here gives its error instead."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = preset(model)
    shape = (micro_batch, p["n_heads"], seq_len, p["dim"] // p["n_heads"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    fwd_flops = 4 * shape[0] * shape[1] * seq_len**2 * shape[3] / 2
    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    out: dict[str, Any] = {"shape_bhtd": list(shape)}
    for name in SDPA_BACKENDS:

        def forward() -> Any:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        try:
            with sdpa_kernel(kernels[name]):
                fwd = time_ms(forward, device, repeats)
                both = time_ms(lambda: forward().sum().backward(), device, repeats)
        except RuntimeError as err:  # not on this device, dtype or shape
            out[name] = {"error": str(err).splitlines()[0][:200]}
            continue
        out[name] = {"fwd_ms": fwd, "fwd_bwd_ms": both, "fwd_tflops": fwd_flops / fwd / 1e9,
                     "fwd_bwd_tflops": 3.5 * fwd_flops / both / 1e9}  # fmt: skip
    return out


def copy_gbps(nbytes: int, device: Any, repeats: int) -> float:
    """Device-to-device copy: bytes read plus bytes written per second."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_ms(lambda: dst.copy_(src), device, repeats) * 1e-3) / 1e9


def adamw_params_per_s(numel: int, tensors: int, device: Any, repeats: int) -> float:
    """Fused AdamW (the trainer's, trainer/rank/optim.py) over fp32 parameters with gradients."""
    import torch

    params = [torch.zeros(numel // tensors, device=device, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    return numel / (time_ms(optimizer.step, device, repeats) * 1e-3)


def dispatch_us(device: Any, ops: int) -> float:
    """Host microseconds per eager op (an in-place add on one element): what each launch costs the
    step where the GPU waits on the host."""
    import torch

    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1.0)
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    host = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return host * 1e6 / ops


SIZES = {
    # models, tokens (micro_batch x seq_len), SDPA's model, micro_batch, seq_len, copy bytes,
    # AdamW params and tensors, dispatched ops, repeats
    "gpu": (("125m", "1b"), 8 * 1024, "1b", 8, 1024, 2**30, 2**27, 32, 5000, 20),
    "dry": (("tiny",), 2 * 32, "tiny", 2, 32, 2**24, 2**17, 4, 500, 3),
}


def measure(dry_run: bool) -> dict[str, Any]:
    """Every rate, for the GPU's shapes (the throughput rows': micro_batch 8, seq_len 1024) or, in a
    dry run, the tiny preset's on CPU."""
    import torch

    models, tokens, attn, mb, seq, nbytes, numel, tensors, ops, repeats = SIZES["dry" if dry_run else "gpu"]
    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    name = "cpu" if dry_run else torch.cuda.get_device_name(device)
    return {"device": name, "peak_bf16_tflops": bf16_peak(name), "torch": torch.__version__,
            "tokens": tokens, "gemm": gemm_rates(models, tokens, device, repeats),
            "sdpa": sdpa_rates(attn, mb, seq, device, repeats), "copy_gbps": copy_gbps(nbytes, device, repeats),
            "adamw_params_per_s": adamw_params_per_s(numel, tensors, device, repeats),
            "dispatch_us": dispatch_us(device, ops)}  # fmt: skip


def bf16_peak(name: str) -> float | None:
    """The device table's dense bf16 peak (trainer/devices.py); None off the table or on CPU."""
    from trainer.devices import find_device

    spec = find_device(name) if name != "cpu" else None
    return spec.bf16 if spec is not None else None
