"""RL losses that satisfy the engine's ``loss_fn(logits, mb) -> scalar`` contract."""

from forge_ext.losses.grpo import (
    GRPOLoss,
    build,
    compute_group_advantages,
    grpo_loss,
    grpo_loss_and_metrics,
    grpo_metrics,
    k3_kl,
    loss_mask,
    per_token,
    sequence_ids,
    token_logprobs,
    truncated_importance_weights,
    valid_sequence_count,
    valid_token_count,
)

__all__ = [
    "GRPOLoss",
    "build",
    "compute_group_advantages",
    "grpo_loss",
    "grpo_loss_and_metrics",
    "grpo_metrics",
    "k3_kl",
    "loss_mask",
    "per_token",
    "sequence_ids",
    "token_logprobs",
    "truncated_importance_weights",
    "valid_sequence_count",
    "valid_token_count",
]
