"""precision=fp8 in a block's backward: what torchao's Float8Linear makes while w2's backward runs.

torchao's matmul (`matmul_with_hp_or_float8_args.backward`, torchao/float8/float8_linear.py) casts, in
eager mode, each operand of its two backward GEMMs to float8 as it goes: the output gradient (twice: for the
input gradient and for the weight gradient), the weight, then the saved input. Each cast
(`_ToFloat8ConstrFunc.forward`, torchao/float8/float8_training_tensor.py) computes
`tensor.to(torch.float32) * scale` and then `to_fp8_saturated`'s `x.clamp(...)` (torchao/float8/float8_utils.py)
before `x.to(float8_dtype)`: two fp32 copies of the tensor alive as its float8 bits are written. The
worst of w2's backward is the last cast, of its saved B·T·M input, with the float8 casts before it, the
input gradient (B·T·M, compute dtype) and the gradient arriving (under autocast also its cast to the
compute dtype, for w2's bf16 output; under sequence parallelism its all-gather over T) alive; w2's weight
gradient is not made yet.

This is the eager cast's arithmetic, the same code on every device (compiled, inductor fuses the casts:
trainer/plan/build.py's COMPILE_NOTE); measured with MemTracker on CPU ranks (the emulated GEMM,
`float8_ops.py` `float8_mm`, dequantizes its operands after this cast and is not the worst there).
"""

from __future__ import annotations

from trainer.config import TrainConfig
from trainer.model.fp8 import precision_split
from trainer.plan.activations import sequence_shards

FP32 = 4
FP8 = 1


def fp8_w2_backward(config: TrainConfig, compute: int, regime: str, incoming: int) -> int:
    """The worst of w2's backward under fp8 (module docstring), beside `incoming` (the gradient arriving down
    the residual); 0 without fp8 or where w2 stays a bf16 nn.Linear."""
    if not config.precision.is_fp8:
        return 0
    if "feed_forward.w2" not in precision_split(config.model, config.precision, config.parallel.tp).converted:
        return 0
    m, n = config.model, config.micro_batch * config.seq_len
    nd, nm, md = n * m.dim, n * m.ffn_dim, m.dim * m.ffn_dim
    # The output gradient in the compute dtype, all T: the fp32 residual's gradient cast (autocast), or under
    # sequence parallelism the all-gather of the T / tp that arrive (its input freed by this cast; measured:
    # tp=2, SP on, checkpointing=full, at zero=stage0 under autocast and at stage3 in bf16, within 0.2%).
    sp = sequence_shards(config) > 1
    output_grad = compute * nd if regime == "autocast" or sp else 0
    casts = FP8 * (2 * nd + md + nm)  # the output gradient twice, the weight, the input
    return incoming + output_grad + compute * nm + casts + 2 * FP32 * nm
