"""`moe:` (MoeConfig): how a mixture of experts routes while it trains: the balance loss, the aux-loss-free bias,
the router's z-loss, a capacity and its drop policy, and the imbalance the memory plan assumes. The experts'
shape (how many, top_k, their width) is the model's (model.n_experts and beside it)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.enums import BalanceLoss, DropPolicy
from trainer.config.errors import _require


@dataclass
class MoeConfig:
    """conf/moe/*.yaml: read only when model.n_experts > 0 (trainer/model/moe.py)."""

    balance: BalanceLoss = BalanceLoss.aux
    """The auxiliary load-balancing loss: aux, over each micro-batch's tokens (Switch Transformer, eq. 4);
    seq_aux, per sequence, then averaged (DeepSeek-V3, eq. 17); none."""
    aux_coeff: float = 1e-3
    """The balance loss's weight (torchtitan's load_balance_coeff; Megatron's --moe-aux-loss-coeff)."""
    bias_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3, section 2.1.2): after every step each expert's routing bias moves
    by this rate towards the mean load, by the sign of its error (torchtitan: 1e-3); 0: off."""
    router_z_coeff: float = 0.0
    """The router's z-loss weight: mean over the tokens of logsumexp(router logits)^2 (ST-MoE, eq. 5: 1e-3); 0: off."""
    capacity_factor: float | None = None
    """Tokens an expert takes per micro-batch: capacity_factor * tokens * top_k / n_experts, the rest dropped
    (the residual carries them); null: dropless."""
    drop_policy: DropPolicy = DropPolicy.probs
    """With a capacity, which tokens an expert keeps: those of the highest routing scores (probs), or the first
    in the micro-batch (position) (Megatron's --moe-token-drop-policy)."""
    imbalance: float = 1.0
    """The memory plan's assumption: the busiest expert group's tokens over the mean (1.0: balanced). A running
    job compares it with what its router measures."""

    def __post_init__(self) -> None:
        _require(self.aux_coeff >= 0, f"moe.aux_coeff must be >= 0, got {self.aux_coeff}")
        _require(self.bias_rate >= 0, f"moe.bias_rate must be >= 0, got {self.bias_rate}")
        _require(self.router_z_coeff >= 0, f"moe.router_z_coeff must be >= 0, got {self.router_z_coeff}")
        _require(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"moe.capacity_factor must be > 0, or null (dropless), got {self.capacity_factor}",
        )
        _require(self.imbalance >= 1.0, f"moe.imbalance must be >= 1.0 (max over mean), got {self.imbalance}")
