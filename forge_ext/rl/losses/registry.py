"""A trainer's loss by name: the ``loss`` spec ``{"name": <loss>, **fields}`` of the trainer
actor (:class:`forge_ext.actors.trainer.RLTrainer`, every model role's) becomes the engine's
``(loss_fn, loss_weight_fn)`` pair
(:meth:`forge_ext.engine.base.BaseEngine.forward_backward_batch`).

- ``cross_entropy`` (the default): the engine's token-level cross entropy
  (:func:`forge_ext.engine.losses.cross_entropy_loss`), weighted by valid tokens;
- ``grpo``: the GRPO policy loss and its variants, fields of ``loss:``
  (:func:`forge_ext.rl.losses.grpo.build`);
- ``value``: PPO's clipped value loss, the critic's (:func:`forge_ext.rl.losses.value.build`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from forge_ext.engine.base import LossFn, LossWeightFn
from forge_ext.engine.losses import cross_entropy_loss, valid_tokens
from forge_ext.rl.losses import grpo, value


def _cross_entropy() -> tuple[LossFn, LossWeightFn]:
    return cross_entropy_loss, valid_tokens


LOSSES: dict[str, Callable[..., tuple[LossFn, LossWeightFn]]] = {
    "cross_entropy": _cross_entropy,
    "grpo": grpo.build,
    "value": value.build,
}
"""``{loss.name: build(**fields) -> (loss_fn, loss_weight_fn)}``."""


def build_loss(name: str = "cross_entropy", **fields: Any) -> tuple[LossFn, LossWeightFn]:
    """``(loss_fn, loss_weight_fn)`` of the loss ``name`` with ``fields`` (a ``loss`` spec
    without its ``name``), e.g. ``build_loss(name="grpo", kl_coef=0.0)``.

    Raises:
        ValueError: an unknown ``loss.name`` (naming the known ones), an unknown field or a
            bad value (naming the loss).
    """
    if name not in LOSSES:
        raise ValueError(f"loss.name={name!r} must be one of {sorted(LOSSES)}")
    try:
        return LOSSES[name](**fields)
    except TypeError as e:
        raise ValueError(f"loss {name!r}: {e}") from None
