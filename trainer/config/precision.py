"""`precision:` (PrecisionConfig): the compute dtype, fp16's loss scaler, fp8's recipe and its rules."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.enums import DType, Fp8Filter, Fp8Recipe
from trainer.config.errors import _require


@dataclass
class PrecisionConfig:
    """conf/precision/*.yaml: the compute dtype; master weights and optimizer state stay fp32."""

    name: str = "fp32"
    """Preset name, reported in logs."""
    compute_dtype: DType = DType.float32
    """Dtype the forward and backward run in."""
    loss_scale_init: float = 2.0**16
    """fp16 only: the dynamic loss scaler's starting scale."""
    growth_interval: int = 2000
    """fp16 only: overflow-free steps before the scale grows."""
    growth_factor: float = 2.0
    """fp16 only: factor the scale grows by."""
    backoff_factor: float = 0.5
    """fp16 only: factor the scale shrinks by on overflow."""
    min_loss_scale: float = 1.0
    """fp16 only: the scale never backs off below this."""
    tf32: bool = True
    """CUDA: fp32 matmuls and convolutions may use TF32 tensor cores (torch.backends fp32_precision "tf32"; false: "ieee")."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.none
    """precision=fp8: the block linears become torchao's Float8Linear with this named recipe (none: no fp8)."""
    fp8_all_gather: bool = False
    """fp8, tensorwise, zero=stage2/3 on CUDA: FSDP2 all-gathers the converted weights in fp8 (torchao's
    enable_fsdp_float8_all_gather)."""
    fp8_filter: Fp8Filter = Fp8Filter.auto
    """fp8: which block linears convert: auto, those torchao's small-GEMM filter for the recipe passes
    (_auto_filter_for_recipe, torchao/float8/float8_linear_utils.py); all, every one whose dims divide by 16."""

    def __post_init__(self) -> None:
        _require(
            self.loss_scale_init > 0, f"precision.loss_scale_init must be > 0, got {self.loss_scale_init}"
        )
        _require(
            self.growth_interval >= 1, f"precision.growth_interval must be >= 1, got {self.growth_interval}"
        )
        _require(self.growth_factor > 1, f"precision.growth_factor must be > 1, got {self.growth_factor}")
        _require(
            0 < self.backoff_factor < 1,
            f"precision.backoff_factor must be in (0, 1), got {self.backoff_factor}",
        )
        _require(self.min_loss_scale > 0, f"precision.min_loss_scale must be > 0, got {self.min_loss_scale}")
        self.check_fp8()

    def check_fp8(self) -> None:
        """fp8 runs its matmuls' other half in bf16 (torchao's training recipes are for bf16 autocast
        or bf16 FSDP2 parameters); fp8 all-gather casts a whole tensor with one scale: tensorwise only."""
        if not self.is_fp8:
            _require(
                not self.fp8_all_gather,
                "precision.fp8_all_gather=true needs precision=fp8 (precision.fp8_recipe=tensorwise)",
            )
            return
        _require(
            self.name == "fp8",
            f"precision.fp8_recipe={self.fp8_recipe.value} needs precision=fp8 (got precision={self.name}: logs, "
            "W&B groups and the sweep report would name an fp8 run after it); use precision=fp8 "
            f"precision.fp8_recipe={self.fp8_recipe.value}",
        )
        _require(
            self.compute_dtype == DType.bfloat16,
            f"precision.fp8_recipe={self.fp8_recipe.value} needs precision.compute_dtype=bfloat16 "
            f"(got {self.compute_dtype.value}): use precision=fp8",
        )
        _require(
            not self.fp8_all_gather or self.fp8_recipe == Fp8Recipe.tensorwise,
            f"precision.fp8_all_gather=true with precision.fp8_recipe={self.fp8_recipe.value}: "
            "fp8 all-gather is tensorwise only (one scale per weight); use precision.fp8_recipe=tensorwise "
            "or precision.fp8_all_gather=false",
        )
        _require(
            self.fp8_filter != Fp8Filter.auto or self.fp8_recipe != Fp8Recipe.rowwise_with_gw_hp,
            "precision.fp8_filter=auto with precision.fp8_recipe=rowwise_with_gw_hp: torchao's small-GEMM "
            "filter has no rule for that recipe (_auto_filter_for_recipe raises NotImplementedError); "
            "use precision.fp8_filter=all",
        )

    @property
    def is_fp16(self) -> bool:
        return self.compute_dtype == DType.float16

    @property
    def is_fp8(self) -> bool:
        return self.fp8_recipe != Fp8Recipe.none
