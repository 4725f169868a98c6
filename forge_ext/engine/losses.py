"""Default losses for the engine, in the ``loss_fn(logits, mb) -> mean`` /
``loss_weight_fn(mb) -> weight`` contract of :meth:`BaseEngine.forward_backward_batch`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value of tokens that carry no loss (same as torchtitan and transformers)."""


def valid_tokens(mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Number of labels that are not ``IGNORE_INDEX`` in ``mb['labels']`` ``[b, S]``."""
    return (mb["labels"] != IGNORE_INDEX).sum()


def cross_entropy_loss(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-level cross entropy, mean over the microbatch's valid tokens (0 if none).

    Args:
        logits: ``[b, S, V]``.
        mb: with ``labels`` ``[b, S]`` int64, already shifted (``labels[:, t]`` is the target
            of ``logits[:, t]``), ``IGNORE_INDEX`` where no loss applies.
    """
    labels = mb["labels"]
    total = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    return total / valid_tokens(mb).clamp(min=1)


def _grpo(**kwargs):
    from forge_ext.rl.losses import grpo

    return grpo.build(**kwargs)


def _value(**kwargs):
    from forge_ext.rl.losses import value

    return value.build(**kwargs)


LOSSES = {
    "cross_entropy": lambda: (cross_entropy_loss, valid_tokens),
    "grpo": _grpo,
    "value": _value,  # the critic's clipped value loss (forge_ext/rl/losses/value.py)
}


def build_loss(name: str = "cross_entropy", **kwargs):
    """``(loss_fn, loss_weight_fn)`` for a loss named in a config (``loss.name``).

    Raises:
        ValueError: unknown ``loss.name`` (lists the known ones) or bad keyword arguments.
    """
    if name not in LOSSES:
        raise ValueError(f"loss.name={name!r} must be one of {sorted(LOSSES)}")
    try:
        return LOSSES[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"loss {name!r}: {e}") from None
