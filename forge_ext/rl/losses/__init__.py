"""RL losses that satisfy the engine's ``loss_fn(logits, mb) -> scalar`` contract."""


def __getattr__(name: str):
    # The losses import torch and torchtitan (seconds): on first use, so that their configs
    # (forge_ext.rl.losses.config) load without them (issue 38).
    if name in __all__:
        from forge_ext.rl.losses import grpo

        return getattr(grpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
