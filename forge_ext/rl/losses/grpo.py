"""GRPO loss for the engine's ``loss_fn(logits, mb) -> scalar`` contract.

Objective (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, eq. 3), maximised::

    J = E[ min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A) - beta * KL_t ]

with, per response token t of a sequence whose group-normalised advantage is ``A``:

- ``r_t = pi_theta(o_t) / pi_gen(o_t)``: the importance ratio against the log-probs the
  generator recorded while sampling (``generator_logprobs``);
- ``KL_t = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1``: the k3 estimator of
  ``KL(pi_theta || pi_ref)`` (DeepSeekMath eq. 4; Schulman, "Approximating KL divergence",
  2020), always >= 0, against a frozen reference model's log-probs (``ref_logprobs``);
- ``A = (r_i - mean(r_group)) / (std(r_group) + eps)`` (DeepSeekMath section 4.1.2), or
  another scaling (``grpo.advantage_scaling``), see
  :func:`forge_ext.rl.advantages.compute_group_advantages`.

Separate ``eps_low``/``eps_high`` are DAPO's "clip-higher" (Yu et al. 2025,
arXiv:2503.14476, section 3.1); equal values give GRPO's symmetric clip.

Aggregation (``loss.aggregation``; verl ``core_algos.py`` ``agg_loss``, TRL ``GRPOTrainer``
``loss_type``). With ``l_{i,t}`` the loss of valid token ``t`` of sequence ``i``, ``|o_i|`` its
valid tokens and ``N`` the sequences with at least one valid token, over the whole step:

- ``token_mean`` (default; DAPO section 3.3, TRL ``dapo``/``bnpo``): ``sum_{i,t} l / sum_i |o_i|``;
- ``seq_mean_token_mean`` (DeepSeekMath eq. 3, TRL ``grpo``): ``1/N sum_i 1/|o_i| sum_t l``;
- ``seq_mean_token_sum`` (verl ``seq-mean-token-sum``): ``1/N sum_i sum_t l``;
- ``seq_mean_token_sum_norm`` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, eq. 3, TRL
  ``dr_grpo``): ``1/N sum_i sum_t l / L`` with ``L = max_response_tokens``, a constant.

A microbatch's loss is its own mean over the unit of the mode (valid tokens, or sequences
with a valid token), and the engine weights it by that unit's count (:meth:`GRPOLoss.weight`)
and divides by the count over every microbatch and data-parallel rank, so each mode is the
full-step quantity above under any microbatching, gradient accumulation, DP or PP. Sequences
are found by :func:`sequence_ids`, so a packed row holding several sequences aggregates as
the same sequences in separate rows would.

Sequence-level ratio (``loss.ratio_level: sequence``; GSPO, Zheng et al. 2025,
arXiv:2507.18071, eq. 5-7): every token of sequence ``i`` uses
``s_i = exp(1/|o_i| sum_t log(pi_theta(o_t) / pi_old(o_t)))``, the geometric mean of its token
ratios, clipped per sequence to ``[1 - eps_low, 1 + eps_high]`` with GSPO's much smaller
defaults (3e-4, 4e-4); with ``seq_mean_token_mean`` the objective is GSPO's
``1/N sum_i min(s_i A_i, clip(s_i) A_i)``, and on one-token responses it is token-level GRPO.

Off-policy correction (``off_policy_correction``; :mod:`forge_ext.rl.losses.off_policy` gives
each formula and its source): ``none`` (the default) takes the clipped ratio against the
generator's log-probs, ``r_t = pi_theta / pi_gen``. ``token_tis`` and ``decoupled`` take it
against the proximal policy ``pi_prox`` (the trainer's weights at the step's start: the
forward's log-probs with the gradient stopped, or ``mb["proximal_logprobs"]``) and weight each
token by ``w_t = min(pi_prox(o_t) / pi_gen(o_t), C)``, so that
``J = E[ w_t * min(r_t * A, clip(r_t) * A) - beta * KL_t ]`` with ``r_t = pi_theta / pi_prox``
(decoupled PPO); the trainer makes one optimizer step per batch, so ``r_t`` is 1 in value and
the gradient is ``w_t * A * grad log pi_theta(o_t)``. ``token_mask`` and ``sequence_mask`` keep
``none``'s ratio and give no gradient to the tokens (whole sequences) whose gap ratio
``pi_prox / pi_gen`` leaves ``[1 / C_low, C_high]``. With ``pi_gen == pi_prox`` each equals
``none`` in loss and gradient, bit for bit.

Log-ratios are clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` before ``exp`` (as
``torchtitan.experiments.rl.losses.dapo`` does), so a token that is wildly off-policy cannot
overflow to inf/NaN; that token's clamped term then carries no gradient.

Metrics (:func:`grpo_loss_and_metrics`), each a mean over the loss's unit: valid tokens for
``token_mean``; for the ``seq_mean_*`` modes, sequences (each sequence's token mean, then the
mean over sequences). NaN when there are none:

- ``loss``: the loss value;
- ``kl``: mean k3 KL to the reference (0 without ``ref_logprobs``; measured even when
  ``kl_coef == 0``);
- ``ratio_mean``: mean clipped-ratio argument: ``pi_theta / pi_gen`` (``none`` and the
  masks), ``pi_theta / pi_prox`` (``token_tis``, ``decoupled``; 1 without
  ``proximal_logprobs``); per sequence for ``sequence``;
- ``clip_fraction``: fraction of tokens where the clip binds (ratio below ``1 - eps_low``
  with ``A < 0`` or above ``1 + eps_high`` with ``A > 0``, so the token gets no policy
  gradient; the definition TRL's ``GRPOTrainer`` logs as ``clip_ratio``);
- ``tis_weight_mean``, ``tis_capped_fraction`` (``token_tis``, ``decoupled``): mean
  importance weight ``w`` and fraction of tokens (sequences, for ``sequence``) whose ratio
  exceeded the cap;
- ``rejected_fraction`` (``token_mask``, ``sequence_mask``): fraction of tokens given no
  gradient because their (sequence's) gap ratio left the band;
- ``num_valid_tokens``, ``num_sequences``: the valid tokens and the sequences with at least
  one (floats, for weighting).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import compute_logprobs

from forge_ext.engine.losses import IGNORE_INDEX
from forge_ext.rl.losses.config import GRPOLossConfig, check_loss_options, default_clip_eps
from forge_ext.rl.losses.off_policy import (
    IS_CORRECTIONS, MASK_CORRECTIONS, MAX_LOG_RATIO, rejection_mask, sequence_sums,
    truncated_importance_weights,
)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label token under ``logits``.

    ``out[b, t] = log_softmax(logits[b, t])[labels[b, t]]``, and ``0.0`` where
    ``labels[b, t] == -100``. Labels are already shifted: the label at position ``t`` is the
    input token at ``t + 1``. Used by the GRPO loss for the current policy and by a reference
    model's forward-only pass to produce ``ref_logprobs``.

    Delegates to ``torchtitan.components.loss.compute_logprobs`` (a cross-entropy gather in
    fp32 that also gathers vocab-sharded tensor-parallel logits).

    Args:
        logits: ``[batch, seq, vocab]``, any float dtype (upcast to fp32).
        labels: ``[batch, seq]`` int64 token ids, ``-100`` to ignore.

    Returns:
        ``[batch, seq]`` fp32 log-probabilities (nats), differentiable w.r.t. ``logits``.

    Raises:
        ValueError: if ``logits.shape[:2] != labels.shape``.
    """
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(labels.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [batch, seq, vocab] matching "
            f"labels {tuple(labels.shape)} = [batch, seq]"
        )
    return compute_logprobs(logits, labels)


def k3_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)`` from samples of ``pi``.

    ``k3 = pi_ref/pi - log(pi_ref/pi) - 1`` (Schulman, "Approximating KL divergence", 2020;
    DeepSeekMath eq. 4), always >= 0; the log-ratio is clamped to ``+-MAX_LOG_RATIO`` first.

    Args:
        logprobs: ``[batch, seq]`` log-probs of the sampled tokens under ``pi``.
        ref_logprobs: ``[batch, seq]`` the same tokens under ``pi_ref``.
        mask: ``[batch, seq]`` bool, True on scored tokens; other positions are 0 in the
            result whatever the inputs hold there (even inf/NaN).

    Returns:
        ``[batch, seq]`` per-token estimates (differentiable w.r.t. ``logprobs``).
    """
    log_ratio = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


def sequence_ids(mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The sequence each token of a microbatch belongs to: ``[batch, seq]`` int64.

    ``mb["sequence_ids"]`` when present (the index of each token's sequence within the
    microbatch, ``-1`` on padding: a packed row may hold several sequences), else the row
    index broadcast over ``seq`` (one sequence per row). Every per-sequence quantity of the
    loss (GSPO's ratio, the sequence-mean weights, the sequence count the engine weights by)
    groups tokens through this one function, never by assuming one sequence per row.

    Raises:
        ValueError: ``sequence_ids`` shaped unlike ``labels``.
    """
    labels = mb["labels"]
    if "sequence_ids" in mb:
        ids = mb["sequence_ids"]
        if tuple(ids.shape) != tuple(labels.shape):
            raise ValueError(
                f"mb['sequence_ids'] has shape {tuple(ids.shape)}, expected labels' "
                f"{tuple(labels.shape)} = [batch, seq]"
            )
        return ids.long()
    batch, seq = labels.shape
    return torch.arange(batch, device=labels.device)[:, None].expand(batch, seq)


def _sequence_slots(mb: Mapping[str, torch.Tensor]) -> int:
    """An upper bound on the number of sequences in ``mb`` (the size of per-sequence
    buffers): ``batch`` rows, or ``batch * seq`` tokens when rows are packed. A bound known
    from shapes alone, so grouping never waits on the device for ``max(sequence_ids)``."""
    labels = mb["labels"]
    return labels.numel() if "sequence_ids" in mb else labels.shape[0]


def per_token(mb: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    """``mb[key]`` as ``[batch, seq]``: a per-row ``[batch]`` value (one sequence per row)
    is broadcast over ``seq``; an already per-token ``[batch, seq]`` value (packed rows) is
    returned as is.

    Raises:
        ValueError: ``key`` missing, or shaped neither ``[batch]`` nor ``[batch, seq]``.
    """
    if key not in mb:
        raise ValueError(f"GRPO microbatch is missing {key!r}; it has {sorted(mb)}")
    value, (batch, seq) = mb[key], mb["labels"].shape
    if tuple(value.shape) == (batch,):
        return value[:, None].expand(batch, seq)
    if tuple(value.shape) == (batch, seq):
        return value
    raise ValueError(
        f"mb[{key!r}] has shape {tuple(value.shape)}, expected [batch]=({batch},) or "
        f"[batch, seq]=({batch}, {seq})"
    )


def loss_mask(mb: Mapping[str, torch.Tensor], mask_truncated: bool = False) -> torch.Tensor:
    """``[batch, seq]`` bool, True on the tokens the loss trains on: ``labels != -100``, on
    a sequence (``sequence_ids >= 0`` when given), and with ``mask_truncated`` not in a
    response cut at the length limit (``mb["truncated"]``, ``[batch]`` or ``[batch, seq]``
    bool; DAPO's overlong filtering, Yu et al. 2025, arXiv:2503.14476, section 3.4).

    Raises:
        ValueError: ``mask_truncated`` without ``mb["truncated"]``.
    """
    mask = mb["labels"] != IGNORE_INDEX
    if "sequence_ids" in mb:
        mask = mask & (sequence_ids(mb) >= 0)
    if mask_truncated:
        if "truncated" not in mb:
            raise ValueError(
                "loss.mask_truncated=true needs mb['truncated'] ([batch] bool, True for a "
                f"response cut at the length limit); the microbatch has {sorted(mb)}"
            )
        mask = mask & ~per_token(mb, "truncated").bool()
    return mask


def valid_token_count(mb: Mapping[str, torch.Tensor], mask_truncated: bool = False) -> torch.Tensor:
    """Number of valid (trained) tokens in a microbatch (:func:`loss_mask`'s True entries;
    ``(mb["labels"] != -100).sum()`` for unpacked rows without ``mask_truncated``).

    The engine's ``loss_weight_fn`` for ``aggregation: token_mean``: it multiplies the
    per-microbatch mean returned by :func:`grpo_loss` by this count and divides by the count
    summed over all microbatches and data-parallel ranks, which makes gradient accumulation
    exact.

    Returns:
        0-dim int64 tensor on ``labels``' device.
    """
    return loss_mask(mb, mask_truncated).sum()


def valid_sequence_count(
    mb: Mapping[str, torch.Tensor], mask_truncated: bool = False
) -> torch.Tensor:
    """Number of sequences (:func:`sequence_ids`) with at least one valid token.

    The engine's ``loss_weight_fn`` for the ``seq_mean_*`` aggregations, whose microbatch
    loss is a mean over exactly these sequences: ``sum_i w_i * loss_i / sum_i w_i`` is then
    the mean over every sequence of the step, whatever the microbatching, gradient
    accumulation, DP or PP split (a sequence never straddles two microbatches).

    Returns:
        0-dim int64 tensor on ``labels``' device.
    """
    mask = loss_mask(mb, mask_truncated)
    counts = sequence_sums(mask.float(), sequence_ids(mb), mask, _sequence_slots(mb))
    return (counts > 0).sum()


def aggregation_coefficients(
    mask: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, aggregation: str,
    max_response_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's share of a microbatch's loss under ``aggregation`` (module docstring,
    "Aggregation"): the loss is ``sum_t coef_t * loss_t / units``, with ``units`` the
    engine's loss weight (valid tokens for ``token_mean``, sequences with a valid token for
    the ``seq_mean_*`` modes). Shared by every loss aggregated like the policy loss (GRPO's,
    the critic's value loss).

    Args:
        mask: ``[batch, seq]`` bool, the valid tokens (:func:`loss_mask`).
        ids: ``[batch, seq]`` int64, each token's sequence (:func:`sequence_ids`).
        counts: ``[slots]`` valid tokens per sequence (``sequence_sums`` of the mask).
        aggregation: one of :data:`forge_ext.rl.losses.config.AGGREGATIONS`.
        max_response_tokens: the constant of ``seq_mean_token_sum_norm``.

    Returns:
        ``(coef, metric_coef, units)``: ``[batch, seq]`` loss coefficients (0 off the mask),
        ``[batch, seq]`` coefficients of a metric averaged over the same unit (each token's
        share of its sequence for the ``seq_mean_*`` modes), and the 0-dim unit count.
    """
    dtype = counts.dtype
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    seq_of = torch.where(mask, ids, torch.zeros_like(ids))  # a safe gather index everywhere
    per_sequence_mean = torch.where(mask, (1.0 / counts.clamp(min=1.0))[seq_of], zeros)
    if aggregation == "token_mean":
        coef = mask.to(dtype)
        return coef, coef, counts.sum()
    if aggregation == "seq_mean_token_mean":
        coef = per_sequence_mean
    elif aggregation == "seq_mean_token_sum":
        coef = mask.to(dtype)
    else:  # seq_mean_token_sum_norm (Dr. GRPO): a constant, not the sequence's length
        coef = mask.to(dtype) / float(max_response_tokens)
    return coef, per_sequence_mean, (counts > 0).sum().to(dtype)


@dataclass(frozen=True, slots=True)
class _Tokens:
    """A microbatch's valid tokens and the sequence each belongs to: the grouping every
    per-sequence quantity of the loss uses."""

    mask: torch.Tensor
    """``[batch, seq]`` bool, the valid tokens (:func:`loss_mask`)."""
    ids: torch.Tensor
    """``[batch, seq]`` int64, each token's sequence (:func:`sequence_ids`)."""
    slots: int
    """The size of per-sequence buffers (:func:`_sequence_slots`)."""
    counts: torch.Tensor
    """``[slots]`` valid tokens per sequence, in the log-probs' dtype."""

    @classmethod
    def of(cls, mb: Mapping[str, torch.Tensor], mask: torch.Tensor,
           dtype: torch.dtype) -> _Tokens:
        ids, slots = sequence_ids(mb), _sequence_slots(mb)
        return cls(mask, ids, slots, sequence_sums(mask.to(dtype), ids, mask, slots))

    def sequence_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Each valid token's value replaced by its sequence's mean over valid tokens; 0
        elsewhere."""
        means = sequence_sums(values, self.ids, self.mask, self.slots) / self.counts.clamp(min=1.0)
        seq_of = torch.where(self.mask, self.ids, torch.zeros_like(self.ids))  # a safe gather index
        return torch.where(self.mask, means[seq_of], torch.zeros_like(values))


def _require(mb: Mapping[str, torch.Tensor], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if key not in mb:
        raise ValueError(f"GRPO microbatch is missing {key!r}; it has {sorted(mb)}")
    value = mb[key]
    if tuple(value.shape) != shape:
        raise ValueError(f"mb[{key!r}] has shape {tuple(value.shape)}, expected {shape}")
    return value


def _importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, tokens: _Tokens,
                      *, sequence_level: bool) -> torch.Tensor:
    """``[batch, seq]`` the clipped ratio's argument ``r = pi_theta / pi_old`` (module
    docstring; ``pi_old``: the generator's or the proximal log-probs); per sequence (GSPO)
    with ``sequence_level``; 1 off the valid tokens."""
    # Mask before exp: values at ignored positions are arbitrary (padding) and inf * 0 = NaN.
    log_ratio = torch.where(tokens.mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if sequence_level:
        # GSPO eq. 7: s_i = exp(mean_t log(pi_theta / pi_old)), the same for every token of
        # the sequence; its gradient reaches each token through the mean.
        log_ratio = tokens.sequence_mean(log_ratio)
    return torch.exp(log_ratio)


def _proximal_logprobs(logprobs: torch.Tensor, mb: Mapping[str, torch.Tensor],
                       correction: str) -> torch.Tensor:
    """``[batch, seq]`` the proximal policy's log-probs, without gradient
    (:mod:`forge_ext.rl.losses.off_policy`): ``mb["proximal_logprobs"]`` under
    ``decoupled`` when the batch carries them, else the trainer's own in this forward (the
    weights at the step's start: one optimizer step per batch)."""
    if correction == "decoupled" and "proximal_logprobs" in mb:
        return _require(mb, "proximal_logprobs", tuple(mb["labels"].shape)).to(logprobs.dtype)
    return logprobs.detach()


def _clipped_surrogate(
    logprobs: torch.Tensor, mb: Mapping[str, torch.Tensor], advantages: torch.Tensor,
    tokens: _Tokens, *, clip_eps_low: float, clip_eps_high: float, off_policy_correction: str,
    tis_imp_ratio_cap: float, mask_imp_ratio_cap_low: float, mask_imp_ratio_cap_high: float,
    sequence_level: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """``[batch, seq]`` ``w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` (module
    docstring; ``w = 1`` but for ``token_tis`` and ``decoupled``), the per-token values of the
    metrics it gives (``ratio_mean``, ``clip_fraction``; ``tis_weight_mean`` and
    ``tis_capped_fraction`` with importance weights, ``rejected_fraction`` with rejection),
    and ``[batch, seq]`` bool, the valid tokens the correction keeps (all but the rejected)."""
    generator_logprobs = _require(mb, "generator_logprobs", tuple(mb["labels"].shape))
    weighted = off_policy_correction in IS_CORRECTIONS
    proximal = _proximal_logprobs(logprobs, mb, off_policy_correction)
    # The clipped ratio's denominator: the generator's log-probs, or (decoupled PPO) the
    # proximal policy's.
    ratio = _importance_ratio(logprobs, proximal if weighted else generator_logprobs, tokens,
                              sequence_level=sequence_level)
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    # Where the clip binds the token gets no policy gradient (TRL's clip_ratio).
    clip_binds = ((ratio < 1.0 - clip_eps_low) & (advantages < 0)) | (
        (ratio > 1.0 + clip_eps_high) & (advantages > 0)
    )
    values = {"ratio_mean": ratio, "clip_fraction": clip_binds.to(logprobs.dtype)}
    keep = tokens.mask
    if weighted:
        is_weights, capped = truncated_importance_weights(
            proximal, generator_logprobs, tokens.mask, tis_imp_ratio_cap,
            sequence_ids=tokens.ids if sequence_level else None,
        )
        surrogate = is_weights * surrogate
        values["tis_weight_mean"] = is_weights
        values["tis_capped_fraction"] = capped.to(logprobs.dtype)
    elif off_policy_correction in MASK_CORRECTIONS:
        rejected = rejection_mask(
            proximal, generator_logprobs, tokens.mask, mask_imp_ratio_cap_low,
            mask_imp_ratio_cap_high,
            sequence_ids=tokens.ids if off_policy_correction == "sequence_mask" else None,
        )
        keep = tokens.mask & ~rejected
        values["rejected_fraction"] = rejected.to(logprobs.dtype)
    return surrogate, values, keep


def _with_kl_penalty(surrogate: torch.Tensor, logprobs: torch.Tensor,
                     mb: Mapping[str, torch.Tensor], mask: torch.Tensor,
                     kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(objective, kl)``, ``[batch, seq]`` each: ``surrogate - kl_coef * kl`` and the k3 KL
    to the reference (:func:`k3_kl`), measured without gradient when ``kl_coef == 0`` and
    ``ref_logprobs`` is given, 0 when it is not."""
    shape = tuple(mb["labels"].shape)
    if kl_coef != 0.0:
        kl = k3_kl(logprobs, _require(mb, "ref_logprobs", shape), mask)
        return surrogate - kl_coef * kl, kl
    if "ref_logprobs" not in mb:
        return surrogate, torch.zeros_like(logprobs)
    with torch.no_grad():  # no penalty, but the KL is still worth logging
        return surrogate, k3_kl(logprobs, _require(mb, "ref_logprobs", shape), mask)


@torch.no_grad()
def _unit_means(weighted_loss: torch.Tensor, values: Mapping[str, torch.Tensor],
                metric_coef: torch.Tensor, mask: torch.Tensor,
                units: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics as means over the loss's unit (module docstring, "Metrics"): ``loss`` from
    ``weighted_loss`` (the token losses times their aggregation coefficients), each of
    ``values`` (``[batch, seq]``) weighted by ``metric_coef``; NaN without a unit. Tensor ops
    only (no ``.item()``), so computing metrics never forces a device sync."""
    sums = {"loss": weighted_loss.masked_fill(~mask, 0).sum()}
    for name, value in values.items():
        sums[name] = (value * metric_coef).masked_fill(~mask, 0).sum()
    nan = torch.full_like(units, math.nan)
    return {name: torch.where(units > 0, total / units.clamp(min=1.0), nan)
            for name, total in sums.items()}


def grpo_loss_and_metrics(
    logits: torch.Tensor,
    mb: Mapping[str, torch.Tensor],
    *,
    clip_eps_low: float | None = None, clip_eps_high: float | None = None,
    kl_coef: float = 0.04,
    off_policy_correction: str = "none",
    tis_imp_ratio_cap: float = 2.0,
    mask_imp_ratio_cap_low: float = 2.0, mask_imp_ratio_cap_high: float = 2.0,
    aggregation: str = "token_mean",
    ratio_level: str = "token",
    max_response_tokens: int | None = None,
    mask_truncated: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one microbatch (a mean over the unit ``aggregation`` names) and detached
    metrics (means over the same unit).

    Args:
        logits: ``[batch, seq, vocab]`` current-policy logits (fp32).
        mb: one microbatch with ``labels`` ``[batch, seq]`` int64 (``-100`` = not a response
            token; label at ``t`` is the token at ``t + 1``), ``advantages`` ``[batch]`` (one
            per row) or ``[batch, seq]`` (per token, packed rows), ``generator_logprobs``
            ``[batch, seq]`` aligned with ``labels``, ``ref_logprobs`` ``[batch, seq]``
            (needed only when ``kl_coef != 0``), optionally ``sequence_ids`` ``[batch, seq]``
            (:func:`sequence_ids`), ``truncated`` (``mask_truncated``) and, for
            ``decoupled``, ``proximal_logprobs`` ``[batch, seq]``. Values of
            ``generator_logprobs``/``ref_logprobs`` at ignored positions (even inf/NaN) do
            not affect the loss or its gradient.
        clip_eps_low, clip_eps_high: the ratio's bounds ``[1 - low, 1 + high]``; None: the
            ratio level's default (:func:`~forge_ext.rl.losses.config.default_clip_eps`).
        kl_coef: ``beta``, weight of the k3 KL penalty.
        off_policy_correction, tis_imp_ratio_cap, mask_imp_ratio_cap_low,
            mask_imp_ratio_cap_high: the correction and its ``C``, ``C_low``, ``C_high``
            (:class:`~forge_ext.rl.losses.config.GRPOLossConfig`).
        aggregation: ``token_mean``, ``seq_mean_token_mean``, ``seq_mean_token_sum`` or
            ``seq_mean_token_sum_norm`` (module docstring, "Aggregation").
        ratio_level: ``token`` or ``sequence`` (GSPO; module docstring).
        max_response_tokens: the constant divisor of ``seq_mean_token_sum_norm``.
        mask_truncated: drop responses with ``mb["truncated"]`` (:func:`loss_mask`).

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-dim tensor, ``-J`` aggregated as ``aggregation``
        says (``0.0``, still attached to the graph, if no token is valid); ``metrics`` are
        0-dim detached tensors (module docstring, "Metrics").

    Raises:
        ValueError: if a required key is missing, shapes disagree, a mode is unknown, or
            ``seq_mean_token_sum_norm`` lacks ``max_response_tokens``.
    """
    default_low, default_high = default_clip_eps(ratio_level)
    clip_eps_low = default_low if clip_eps_low is None else clip_eps_low
    clip_eps_high = default_high if clip_eps_high is None else clip_eps_high
    check_loss_options(
        aggregation=aggregation, ratio_level=ratio_level,
        off_policy_correction=off_policy_correction, max_response_tokens=max_response_tokens,
        clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high,
    )
    if "labels" not in mb:
        raise ValueError(f"GRPO microbatch is missing 'labels'; it has {sorted(mb)}")
    logprobs = token_logprobs(logits, mb["labels"])
    advantages = per_token(mb, "advantages").to(logprobs.dtype)
    tokens = _Tokens.of(mb, loss_mask(mb, mask_truncated), logprobs.dtype)
    surrogate, values, keep = _clipped_surrogate(
        logprobs, mb, advantages, tokens, clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high, off_policy_correction=off_policy_correction,
        tis_imp_ratio_cap=tis_imp_ratio_cap, mask_imp_ratio_cap_low=mask_imp_ratio_cap_low,
        mask_imp_ratio_cap_high=mask_imp_ratio_cap_high, sequence_level=ratio_level == "sequence",
    )
    objective, kl = _with_kl_penalty(surrogate, logprobs, mb, tokens.mask, kl_coef)
    # A rejected token (token_mask, sequence_mask) keeps its place in the unit, not its loss.
    token_loss = torch.where(keep, -objective, torch.zeros_like(logprobs))
    coef, metric_coef, units = aggregation_coefficients(
        tokens.mask, tokens.ids, tokens.counts, aggregation, max_response_tokens
    )
    weighted_loss = token_loss * coef
    loss = weighted_loss.sum() / units.clamp(min=1.0)
    metrics = _unit_means(weighted_loss, {"kl": kl, **values}, metric_coef, tokens.mask, units)
    metrics["num_valid_tokens"] = tokens.counts.sum()
    metrics["num_sequences"] = (tokens.counts > 0).sum().to(logprobs.dtype)
    return loss, metrics


def grpo_loss(logits: torch.Tensor, mb: Mapping[str, torch.Tensor], **coefs: Any) -> torch.Tensor:
    """The GRPO loss alone: a 0-dim tensor, the microbatch's mean (over valid tokens or
    sequences, by ``aggregation``).

    ``coefs``: the keyword arguments of :func:`grpo_loss_and_metrics`, which gives the
    formula and the errors raised.
    """
    return grpo_loss_and_metrics(logits, mb, **coefs)[0]


def grpo_metrics(
    logits: torch.Tensor, mb: Mapping[str, torch.Tensor], **coefs: Any
) -> dict[str, float]:
    """GRPO metrics for one microbatch as Python floats, computed without autograd.

    Keys, meaning and ``coefs`` as in :func:`grpo_loss_and_metrics`. Means are over valid
    tokens (``token_mean``) or sequences; to combine microbatches or ranks, weight each by
    ``num_valid_tokens`` or ``num_sequences`` (sum the products and the counts, then divide),
    never average the means.
    """
    with torch.no_grad():
        _, metrics = grpo_loss_and_metrics(logits, mb, **coefs)
    return {name: float(value) for name, value in metrics.items()}


class GRPOLoss:
    """Callable GRPO loss built from a :class:`GRPOLoss.Config`, for the engine.

    ``loss_fn = GRPOLoss(GRPOLoss.Config(kl_coef=0.0))`` satisfies the engine's
    ``loss_fn(logits, mb) -> (loss, metrics)`` contract (``forge_ext.engine.core.LossFn``):
    ``loss`` as :func:`grpo_loss`, ``metrics`` the means ``kl``, ``ratio_mean`` and
    ``clip_fraction`` of :func:`grpo_loss_and_metrics` (with ``token_tis`` also
    ``tis_weight_mean`` and ``tis_capped_fraction``), which the engine weights by
    :meth:`weight` (valid tokens for ``token_mean``, sequences with a valid token for the
    ``seq_mean_*`` modes) across microbatches and data-parallel ranks and returns as
    ``loss/<name>``. Stateless: a repeated call (PP shape inference) changes nothing.
    """

    metric_names = ("kl", "ratio_mean", "clip_fraction")
    """The metrics every call returns with the loss (means over the loss's unit, see
    grpo_loss_and_metrics)."""

    tis_metric_names = ("tis_weight_mean", "tis_capped_fraction")
    """The metrics ``off_policy_correction: token_tis`` (``decoupled``) adds."""

    mask_metric_names = ("rejected_fraction",)
    """The metric ``off_policy_correction: token_mask`` (``sequence_mask``) adds."""

    Config = GRPOLossConfig

    def __init__(self, config: Config) -> None:
        check_loss_options(
            aggregation=config.aggregation, ratio_level=config.ratio_level,
            off_policy_correction=config.off_policy_correction,
            max_response_tokens=config.max_response_tokens,
            clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high,
        )
        self.config = config
        self._kwargs = config.loss_kwargs()
        correction = config.off_policy_correction
        self.names = self.metric_names + (
            self.tis_metric_names if correction in IS_CORRECTIONS
            else self.mask_metric_names if correction in MASK_CORRECTIONS else ()
        )
        """The metrics this loss returns."""

    def __call__(
        self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = grpo_loss_and_metrics(logits, mb, **self._kwargs)
        return loss, {name: metrics[name] for name in self.names}

    def weight(self, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The engine's ``loss_weight_fn``: the count of the unit the microbatch loss is a
        mean over (:func:`valid_token_count` for ``token_mean``,
        :func:`valid_sequence_count` for the ``seq_mean_*`` modes), with the same mask."""
        if self.config.aggregation == "token_mean":
            return valid_token_count(mb, self.config.mask_truncated)
        return valid_sequence_count(mb, self.config.mask_truncated)


def build(**config: Any) -> tuple[GRPOLoss, Callable[[Mapping[str, torch.Tensor]], torch.Tensor]]:
    """``(loss_fn, loss_weight_fn)`` for the engine, from a ``loss`` config section.

    ``forge_ext.rl.losses.registry.build_loss(name="grpo", **config)`` calls this, e.g. with
    ``{"kl_coef": 0.0, "clip_eps_high": 0.28, "aggregation": "seq_mean_token_mean"}``.

    Raises:
        TypeError: an unknown key (not a field of :class:`GRPOLoss.Config`).
        ValueError: an invalid value.
    """
    loss_fn = GRPOLoss(GRPOLoss.Config(**config))
    return loss_fn, loss_fn.weight
