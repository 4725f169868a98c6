"""The engine's default loss, token-level cross entropy, in the ``loss_fn(logits, mb) -> mean``
/ ``loss_weight_fn(mb) -> weight`` contract of :meth:`BaseEngine.forward_backward_batch`, and
the label that carries no loss. The RL losses, and the registry a trainer builds its loss
from by name, are :mod:`forge_ext.rl.losses`."""

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
