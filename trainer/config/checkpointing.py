"""`checkpointing:` (CheckpointingConfig): activation checkpointing; TORCHTITAN_SAVE_OPS, its op list's default."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config.enums import CheckpointMode
from trainer.config.errors import _require

# torchtitan's per-op save list for Llama 3 (pytorch/torchtitan@1f029641b5caeb4df18ac094263e8bcc674b3686,
# torchtitan/models/llama3/parallelize.py lines 45-61, `_op_sac_save_list`: the last per-model list before
# 114151ad4 centralised the policy), less its ops this model never runs (flex attention, varlen attention,
# inductor-compiled code), plus the SDPA op CPU runs. The one source of checkpointing.save_ops's default
# (conf/checkpointing/op.yaml sets no list); tests/unit/test_config.py holds it against a copy of that list.
TORCHTITAN_SAVE_OPS = (
    "aten.mm",
    "aten.linear",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_attention_math",
    "aten._scaled_dot_product_fused_attention_overrideable",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.reduce_scatter_tensor",
    "aten.max",
)


@dataclass
class CheckpointingConfig:
    """conf/checkpointing/*.yaml: activation checkpointing (recompute in backward)."""

    mode: CheckpointMode = CheckpointMode.none
    """none, full (every block), selective (every Nth block) or op (every block keeps the outputs of save_ops)."""
    every_n_layers: int = 2
    """selective only: checkpoint blocks 0, N, 2N, ..."""
    save_ops: list[str] = field(default_factory=lambda: list(TORCHTITAN_SAVE_OPS))
    """op only: the ops whose outputs every block keeps (`namespace.op[.overload]`, e.g. aten.mm);
    of aten.mm and aten.linear every other call is recomputed all the same (torchtitan's policy)."""

    def __post_init__(self) -> None:
        _require(
            self.every_n_layers >= 1, f"checkpointing.every_n_layers must be >= 1, got {self.every_n_layers}"
        )
        from trainer.model.op_names import unknown_op  # a leaf: torch and private_apis only

        for name in self.save_ops:
            reason = unknown_op(name)
            _require(reason is None, f"checkpointing.save_ops: {name!r} {reason}")
