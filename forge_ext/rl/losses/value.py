"""The critic's clipped value loss, for the engine's ``loss_fn(logits, mb) -> scalar`` contract.

The critic is the engine's model with a value head (``model.value_head: true``): its output
is ``[batch, seq, 1]``, one value per position, aligned like the policy's log-probs (the
value at position ``t`` is ``V(x_{<=t})``, the state in which the label ``x_{t+1}`` was
sampled). Per valid token, with ``V`` the critic's value now, ``V_old`` the value it gave the
same token when the step's advantages were computed (``old_values``), ``R`` the GAE return
(``returns``) and ``c = clip_value``::

    V_clip = V_old + clip(V - V_old, -c, c)
    l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

PPO's clipped value objective (Schulman et al. 2017, arXiv:1707.06347, as implemented in
OpenAI baselines ``ppo2/model.py``: ``vf_loss = .5 * mean(max(vf_losses1, vf_losses2))``; verl
``trainer/ppo/core_algos.py`` ``compute_value_loss``). ``V_old`` must be the values the
returns were computed with: clipping against the new values (``V`` detached) would clip
nothing. ``clip_value: null`` gives the plain ``0.5 (V - R)^2``.

The token losses are aggregated like the policy loss (``loss.aggregation``,
:func:`forge_ext.rl.losses.grpo.aggregation_coefficients`): a microbatch's loss is its mean over
valid tokens (``token_mean``) or over its sequences, and :meth:`ValueLoss.weight` is that
unit's count, so the engine's global normalisation makes the value loss, and the critic's
gradient, exact under any microbatching, gradient accumulation, DP, PP or packing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from forge_ext.rl.losses.config import AGGREGATIONS
from forge_ext.rl.losses.grpo import (
    _require,
    _sequence_slots,
    aggregation_coefficients,
    loss_mask,
    sequence_ids,
    valid_sequence_count,
    valid_token_count,
)
from forge_ext.rl.losses.off_policy import sequence_sums


def value_predictions(logits: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` fp32 values from a value head's output ``[batch, seq, 1]``.

    Raises:
        ValueError: an output with more than one value per position (an LM head: the critic
            needs ``model.value_head: true``).
    """
    if logits.dim() != 3 or logits.shape[-1] != 1:
        raise ValueError(
            f"the value loss needs a value head's output [batch, seq, 1], got "
            f"{tuple(logits.shape)}; build the critic with model.value_head: true"
        )
    return logits[..., 0].float()


def value_loss_and_metrics(
    logits: torch.Tensor,
    mb: Mapping[str, torch.Tensor],
    *,
    clip_value: float | None = 0.2,
    aggregation: str = "token_mean",
    max_response_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss of one microbatch (module docstring) and detached metrics.

    Args:
        logits: ``[batch, seq, 1]`` the critic's values.
        mb: ``labels`` ``[batch, seq]`` (``-100``: no value trained there), ``returns`` and
            ``old_values`` ``[batch, seq]`` aligned with ``labels`` (their values at ignored
            positions, even inf/NaN, do not matter), optionally ``sequence_ids``.
        clip_value: ``c``; None: no clipping.
        aggregation, max_response_tokens: as the policy loss's
            (:func:`forge_ext.rl.losses.grpo.grpo_loss_and_metrics`).

    Returns:
        ``(loss, metrics)``: the microbatch's mean over its unit; metrics (means over the same
        unit, NaN when there is none): ``loss``, ``clip_fraction`` (tokens whose clipped
        term is the larger, so they get no gradient from it, verl's ``vf_clipfrac``),
        ``values_mean`` (the critic's current values).

    Raises:
        ValueError: a missing key, a shape mismatch, an unknown aggregation, or an output
            that is not a value head's.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"loss.aggregation={aggregation!r} must be one of {list(AGGREGATIONS)}")
    if clip_value is not None and not clip_value > 0:
        raise ValueError(f"critic.clip_value={clip_value} must be > 0 (or null: no clipping)")
    values = value_predictions(logits)
    shape = tuple(mb["labels"].shape)
    if tuple(values.shape) != shape:
        raise ValueError(f"values {tuple(values.shape)} do not match labels {shape}")
    mask = loss_mask(mb)
    zeros = torch.zeros_like(values)
    # Mask first: padding may hold anything, and inf * 0 = NaN.
    returns = torch.where(mask, _require(mb, "returns", shape).float(), zeros)
    old_values = torch.where(mask, _require(mb, "old_values", shape).float(), zeros)
    unclipped = (values - returns) ** 2
    if clip_value is None:
        token_loss = 0.5 * unclipped
        clipped_wins = torch.zeros_like(mask)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_value, clip_value)
        clipped = (clipped_values - returns) ** 2
        token_loss = 0.5 * torch.maximum(unclipped, clipped)
        clipped_wins = clipped > unclipped
    token_loss = torch.where(mask, token_loss, zeros)

    ids = sequence_ids(mb)
    counts = sequence_sums(mask.to(values.dtype), ids, mask, _sequence_slots(mb))
    coef, metric_coef, units = aggregation_coefficients(
        mask, ids, counts, aggregation, max_response_tokens
    )
    loss = (token_loss * coef).sum() / units.clamp(min=1.0)
    with torch.no_grad():
        sums = {
            "loss": (token_loss * coef).sum(),
            "clip_fraction": (clipped_wins.to(values.dtype) * metric_coef).sum(),
            "values_mean": (torch.where(mask, values, zeros) * metric_coef).sum(),
        }
        nan = torch.full_like(units, math.nan)
        metrics = {name: torch.where(units > 0, total / units.clamp(min=1.0), nan)
                   for name, total in sums.items()}
    return loss, metrics


class ValueLoss:
    """Callable clipped value loss built from a :class:`ValueLoss.Config`, for the engine:
    ``loss_fn(logits, mb) -> (loss, metrics)`` with the metrics ``clip_fraction`` and
    ``values_mean`` (returned by ``train_step`` as ``loss/<name>``), and :meth:`weight` the
    engine's ``loss_weight_fn``. Stateless."""

    metric_names = ("clip_fraction", "values_mean")

    @dataclass(kw_only=True, slots=True)
    class Config:
        clip_value: float | None = 0.2
        """``c``: the new value may move at most ``c`` from the value the step's returns were
        computed with (module docstring); null: no clipping."""
        aggregation: Literal[
            "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
        ] = "token_mean"
        """As the policy loss's ``loss.aggregation`` (the app passes it)."""
        max_response_tokens: int | None = None
        """The constant of ``seq_mean_token_sum_norm``."""

        def __post_init__(self) -> None:
            if self.clip_value is not None and not self.clip_value > 0:
                raise ValueError(
                    f"critic.clip_value={self.clip_value} must be > 0 (or null: no clipping)"
                )
            if self.aggregation not in AGGREGATIONS:
                raise ValueError(
                    f"loss.aggregation={self.aggregation!r} must be one of {list(AGGREGATIONS)}"
                )
            if self.aggregation == "seq_mean_token_sum_norm" and not (
                    self.max_response_tokens and self.max_response_tokens >= 1):
                raise ValueError(
                    "the value loss with loss.aggregation=seq_mean_token_sum_norm needs "
                    f"loss.max_response_tokens >= 1, got {self.max_response_tokens}"
                )

    def __init__(self, config: Config) -> None:
        self.config = config

    def __call__(self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.config
        loss, metrics = value_loss_and_metrics(
            logits, mb, clip_value=c.clip_value, aggregation=c.aggregation,
            max_response_tokens=c.max_response_tokens,
        )
        return loss, {name: metrics[name] for name in self.metric_names}

    def weight(self, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The count of the unit the microbatch loss is a mean over: valid tokens
        (``token_mean``) or sequences with a valid token."""
        if self.config.aggregation == "token_mean":
            return valid_token_count(mb)
        return valid_sequence_count(mb)


def build(**config: Any) -> tuple[ValueLoss, Callable[[Mapping[str, torch.Tensor]], torch.Tensor]]:
    """``(loss_fn, loss_weight_fn)`` for the engine
    (:func:`forge_ext.rl.losses.registry.build_loss` with ``name="value"``).

    Raises:
        TypeError: an unknown key. ValueError: an invalid value.
    """
    loss_fn = ValueLoss(ValueLoss.Config(**config))
    return loss_fn, loss_fn.weight


def value_loss_spec(clip_value: float | None, policy_loss: Mapping[str, Any]) -> dict[str, Any]:
    """The critic's ``loss`` spec for the trainer actor
    (:func:`forge_ext.rl.losses.registry.build_loss`): this clipped value loss with
    ``critic.clip_value``, aggregated like the policy loss (``aggregation`` and
    ``max_response_tokens`` of the policy's ``loss`` section, ``policy_loss``)."""
    return {"name": "value", "clip_value": clip_value,
            "aggregation": policy_loss.get("aggregation", "token_mean"),
            "max_response_tokens": policy_loss.get("max_response_tokens")}
