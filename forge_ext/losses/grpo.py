"""GRPO loss for the engine's ``loss_fn(logits, mb) -> scalar`` contract.

Objective (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, eq. 3), maximised::

    J = E[ min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A) - beta * KL_t ]

with, per response token t of a sequence whose group-normalised advantage is ``A``:

- ``r_t = pi_theta(o_t) / pi_gen(o_t)``: the importance ratio against the log-probs the
  generator recorded while sampling (``generator_logprobs``);
- ``KL_t = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1``: the k3 estimator of
  ``KL(pi_theta || pi_ref)`` (DeepSeekMath eq. 4; Schulman, "Approximating KL divergence",
  2020), always >= 0, against a frozen reference model's log-probs (``ref_logprobs``);
- ``A = (r_i - mean(r_group)) / (std(r_group) + eps)`` (DeepSeekMath section 4.1.2), see
  :func:`compute_group_advantages`.

Separate ``eps_low``/``eps_high`` are DAPO's "clip-higher" (Yu et al. 2025,
arXiv:2503.14476, section 3.1); equal values give GRPO's symmetric clip.

Normalisation: the loss is the *mean over the microbatch's valid tokens* (``labels != -100``),
i.e. DAPO's token-level policy-gradient loss (arXiv:2503.14476, section 3.3), not
DeepSeekMath's per-sequence ``1/|o_i|`` mean. The engine multiplies each microbatch mean by
:func:`valid_token_count` and divides by the global token count, so the optimised quantity is
the mean over every valid token of the step, independent of how it is split into microbatches.

Off-policy correction (``off_policy_correction: token_tis``): token-level truncated
importance sampling, the standard fix for samples drawn by a policy other than the one
trained (stale weights in asynchronous RL, or an inference engine whose numerics differ from
the trainer's): Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training" (https://fengyao.notion.site/off-policy-rl), verl's ``tis_imp_ratio_cap``
(now ``algorithm.rollout_correction.rollout_is: token`` with ``rollout_is_threshold``),
SkyRL's ``off_policy_correction``. It is decoupled PPO (Hilton et al. 2021,
arXiv:2110.00641; AReaL, arXiv:2505.24298): the clipped ratio is taken against the
*trainer's* log-probs before this step, ``pi_old``, and each token is weighted by

    w_t = min(pi_old(o_t) / pi_gen(o_t), C)          (C = tis_imp_ratio_cap, e.g. 2.0)

so that ``J = E[ w_t * min(r_t * A, clip(r_t) * A) - beta * KL_t ]`` with
``r_t = pi_theta / pi_old``. The trainer makes one optimizer step per batch, so ``pi_old`` is
the current policy with its gradient stopped: ``r_t`` is 1 in value (its clip never binds)
and the gradient is ``w_t * A * grad log pi_theta(o_t)``. With ``pi_gen == pi_old`` every
``w_t`` is 1 and the loss and gradient equal the uncorrected ones. ``none`` (the default)
keeps the ratio against the generator's log-probs.

Log-ratios are clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` before ``exp`` (as
``torchtitan.experiments.rl.losses.dapo`` does), so a token that is wildly off-policy cannot
overflow to inf/NaN; that token's clamped term then carries no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchtitan.components.loss import IGNORE_INDEX, compute_logprobs

MAX_LOG_RATIO = 10.0
"""Bound on ``|log(pi_a / pi_b)|`` before ``exp``; ``exp(10) ~ 2.2e4``."""

OFF_POLICY_CORRECTIONS = ("none", "token_tis")
"""Values of ``loss.off_policy_correction`` (module docstring)."""


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


def truncated_importance_weights(
    logprobs: torch.Tensor, generator_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level truncated importance weights ``w = min(exp(logprobs - generator_logprobs),
    cap)`` (module docstring), detached.

    Args:
        logprobs: ``[batch, seq]`` the trainer's log-probs of the sampled tokens (their
            gradient is not used).
        generator_logprobs: ``[batch, seq]`` the generator's log-probs of the same tokens.
        mask: ``[batch, seq]`` bool, True on scored tokens; elsewhere the weight is 1 and
            not capped, whatever the inputs hold there.
        cap: ``C > 0``, the largest weight.

    Returns:
        ``(weights, capped)``: ``[batch, seq]`` fp32 weights, and bool, True where the raw
        ratio exceeded ``cap`` (the log-ratio is clamped to ``+-MAX_LOG_RATIO`` first).
    """
    with torch.no_grad():
        log_ratio = torch.where(mask, logprobs - generator_logprobs, torch.zeros_like(logprobs))
        raw = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
        return raw.clamp(max=cap), (raw > cap) & mask


def valid_token_count(mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Number of valid (trained) tokens in a microbatch: ``(mb["labels"] != -100).sum()``.

    This is the engine's ``loss_weight_fn``: it multiplies the per-microbatch mean returned by
    :func:`grpo_loss` by this count and divides by the count summed over all microbatches and
    data-parallel ranks, which makes gradient accumulation exact.

    Returns:
        0-dim int64 tensor on ``labels``' device.
    """
    return (mb["labels"] != IGNORE_INDEX).sum()


def compute_group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages: ``A_i = (r_i - mean(r_g)) / (std(r_g) + eps)``.

    DeepSeekMath (arXiv:2402.03300) section 4.1.2, outcome supervision. ``std`` is the
    population standard deviation (divide by ``group_size``), as torchtitan's
    ``AdvantageEstimator`` uses (``statistics.pstdev``), computed in float64. A group whose
    rewards are all equal gets exactly 0 for every member, whatever their magnitude and dtype,
    and ``group_size == 1`` is allowed (all zeros).

    Args:
        rewards: ``[num_groups * group_size]``, consecutive ``group_size`` entries form one
            group (the completions of one prompt).
        group_size: completions per prompt, >= 1.
        eps: added to the std to avoid division by zero.

    Returns:
        ``[num_groups * group_size]`` advantages, same dtype as ``rewards`` (fp32 if integer).

    Raises:
        ValueError: if ``rewards`` is not 1-D, ``group_size < 1``, or its length is not a
            multiple of ``group_size``.
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} must be 1-D with a length that is a "
            f"multiple of group_size={group_size}"
        )
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    # float64 keeps the mean's rounding residue far below any real spread; a group with no
    # spread at all is set to 0 exactly, because even in float64 mean(r, ..., r) can differ
    # from r by one ulp, and dividing that residue by (0 + eps) gives a large advantage
    # (eight fp32 copies of 0.35 gave +0.029 each).
    grouped = rewards.to(torch.float64).view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, unbiased=False, keepdim=True)
    advantages = (grouped - mean) / (std + eps)
    no_spread = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    advantages = advantages.masked_fill(no_spread, 0.0)
    return advantages.view(-1).to(out_dtype)


def _require(mb: Mapping[str, torch.Tensor], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if key not in mb:
        raise ValueError(f"GRPO microbatch is missing {key!r}; it has {sorted(mb)}")
    value = mb[key]
    if tuple(value.shape) != shape:
        raise ValueError(f"mb[{key!r}] has shape {tuple(value.shape)}, expected {shape}")
    return value


def grpo_loss_and_metrics(
    logits: torch.Tensor,
    mb: Mapping[str, torch.Tensor],
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.04,
    off_policy_correction: str = "none",
    tis_imp_ratio_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss (token mean over valid tokens) and detached per-token-mean metrics.

    Args:
        logits: ``[batch, seq, vocab]`` current-policy logits (fp32).
        mb: one microbatch with ``labels`` ``[batch, seq]`` int64 (``-100`` = not a response
            token; label at ``t`` is the token at ``t + 1``), ``advantages`` ``[batch]`` (or
            ``[batch, seq]``, one per token, in a packed row), ``generator_logprobs`` ``[batch, seq]`` aligned with ``labels``, and
            ``ref_logprobs`` ``[batch, seq]`` (needed only when ``kl_coef != 0``). Values of
            ``generator_logprobs``/``ref_logprobs`` at ignored positions (even inf/NaN) do
            not affect the loss or its gradient.
        clip_eps_low: ratio lower bound is ``1 - clip_eps_low``.
        clip_eps_high: ratio upper bound is ``1 + clip_eps_high``.
        kl_coef: ``beta``, weight of the k3 KL penalty.
        off_policy_correction: ``none``, or ``token_tis``: truncated importance weights
            against the generator and the clipped ratio against the trainer's own log-probs
            (module docstring).
        tis_imp_ratio_cap: ``C``, the largest importance weight (``token_tis`` only).

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-dim tensor, ``-J`` averaged over valid tokens
        (``0.0``, still attached to the graph, if there are none). ``metrics`` are 0-dim
        detached tensors, each a mean over valid tokens (NaN when there are none):

        - ``loss``: the loss value;
        - ``kl``: mean k3 KL to the reference (0 without ``ref_logprobs``; measured even
          when ``kl_coef == 0``);
        - ``ratio_mean``: mean clipped-ratio argument ``r_t``: ``pi_theta / pi_gen``
          (``none``), ``pi_theta / pi_old`` = 1 (``token_tis``);
        - ``clip_fraction``: fraction of tokens where the clip binds (ratio below
          ``1 - eps_low`` with ``A < 0`` or above ``1 + eps_high`` with ``A > 0``, so the token
          gets no policy gradient; the definition TRL's ``GRPOTrainer`` logs as ``clip_ratio``);
        - ``tis_weight_mean``, ``tis_capped_fraction`` (``token_tis`` only): mean importance
          weight ``w_t`` and fraction of tokens whose ratio exceeded the cap;
        - ``num_valid_tokens``: the count the means are over (a float, for weighting).

    Raises:
        ValueError: if a required key is missing, shapes disagree, or
            ``off_policy_correction`` is unknown.
    """
    if off_policy_correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"loss.off_policy_correction={off_policy_correction!r} must be one of "
            f"{list(OFF_POLICY_CORRECTIONS)}"
        )
    if "labels" not in mb:
        raise ValueError(f"GRPO microbatch is missing 'labels'; it has {sorted(mb)}")
    labels = mb["labels"]
    logprobs = token_logprobs(logits, labels)
    batch, seq = labels.shape
    # One advantage per row, or per token in a packed row (forge_ext.engine.microbatch).
    advantages = mb.get("advantages")
    if advantages is not None and advantages.dim() == 2:
        advantages = _require(mb, "advantages", (batch, seq)).to(logprobs.dtype)
    else:
        advantages = _require(mb, "advantages", (batch,)).to(logprobs.dtype)[:, None]
    generator_logprobs = _require(mb, "generator_logprobs", (batch, seq))

    mask = labels != IGNORE_INDEX
    num_valid = mask.sum().to(logprobs.dtype)
    zeros = torch.zeros_like(logprobs)

    tis = off_policy_correction == "token_tis"
    # The clipped ratio's denominator: the generator's log-probs, or (decoupled PPO) the
    # trainer's own before this step's update, i.e. the current ones without gradient.
    old_logprobs = logprobs.detach() if tis else generator_logprobs
    # Mask before exp: values at ignored positions are arbitrary (padding) and inf * 0 = NaN.
    log_ratio = torch.where(mask, logprobs - old_logprobs, zeros)
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    if tis:
        is_weights, capped = truncated_importance_weights(
            logprobs, generator_logprobs, mask, tis_imp_ratio_cap
        )
        surrogate = is_weights * surrogate

    if kl_coef != 0.0:
        kl = k3_kl(logprobs, _require(mb, "ref_logprobs", (batch, seq)), mask)
        objective = surrogate - kl_coef * kl
    else:
        objective = surrogate
        if "ref_logprobs" in mb:  # no penalty, but the KL is still worth logging
            with torch.no_grad():
                kl = k3_kl(logprobs, _require(mb, "ref_logprobs", (batch, seq)), mask)
        else:
            kl = zeros

    token_loss = torch.where(mask, -objective, zeros)
    loss = token_loss.sum() / num_valid.clamp(min=1.0)

    # Tensor ops only (no .item()), so computing metrics never forces a device sync.
    with torch.no_grad():
        clipped = ((ratio < 1.0 - clip_eps_low) & (advantages < 0)) | (
            (ratio > 1.0 + clip_eps_high) & (advantages > 0)
        )
        sums = {
            "loss": token_loss.sum(),
            "kl": (kl * mask).sum(),
            "ratio_mean": (ratio * mask).sum(),
            "clip_fraction": (clipped & mask).sum().to(logprobs.dtype),
        }
        if tis:
            sums["tis_weight_mean"] = (is_weights * mask).sum()
            sums["tis_capped_fraction"] = capped.sum().to(logprobs.dtype)
        nan = torch.full_like(num_valid, math.nan)
        metrics = {
            name: torch.where(num_valid > 0, total / num_valid.clamp(min=1.0), nan)
            for name, total in sums.items()
        }
        metrics["num_valid_tokens"] = num_valid
    return loss, metrics


def grpo_loss(logits: torch.Tensor, mb: Mapping[str, torch.Tensor], **coefs: Any) -> torch.Tensor:
    """The GRPO loss alone: a 0-dim tensor, mean over the microbatch's valid tokens.

    ``coefs``: ``clip_eps_low``, ``clip_eps_high``, ``kl_coef``, ``off_policy_correction``,
    ``tis_imp_ratio_cap``; see
    :func:`grpo_loss_and_metrics` for them, the formula and errors.
    """
    return grpo_loss_and_metrics(logits, mb, **coefs)[0]


def grpo_metrics(
    logits: torch.Tensor, mb: Mapping[str, torch.Tensor], **coefs: Any
) -> dict[str, float]:
    """GRPO metrics for one microbatch as Python floats, computed without autograd.

    Keys, meaning and ``coefs`` as in :func:`grpo_loss_and_metrics`. Means are over valid
    tokens; to combine microbatches or ranks, weight each by ``num_valid_tokens`` (sum the
    products and the counts, then divide), never average the means.
    """
    with torch.no_grad():
        _, metrics = grpo_loss_and_metrics(logits, mb, **coefs)
    return {name: float(value) for name, value in metrics.items()}


class GRPOLoss:
    """Callable GRPO loss built from a :class:`GRPOLoss.Config`, for the engine.

    ``loss_fn = GRPOLoss(GRPOLoss.Config(kl_coef=0.0))`` satisfies the engine's
    ``loss_fn(logits, mb) -> (loss, metrics)`` contract (``forge_ext.engine.base.LossFn``):
    ``loss`` as :func:`grpo_loss`, ``metrics`` the token means ``kl``, ``ratio_mean`` and
    ``clip_fraction`` of :func:`grpo_loss_and_metrics` (with ``token_tis`` also
    ``tis_weight_mean`` and ``tis_capped_fraction``), which the engine weights by valid
    tokens (``valid_token_count``, the loss's own weight) across microbatches and
    data-parallel ranks and returns as ``loss/<name>``. Stateless: a repeated call (PP shape
    inference) changes nothing.
    """

    metric_names = ("kl", "ratio_mean", "clip_fraction")
    """The metrics every call returns with the loss (token means, see
    grpo_loss_and_metrics)."""

    tis_metric_names = ("tis_weight_mean", "tis_capped_fraction")
    """The metrics ``off_policy_correction: token_tis`` adds."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        clip_eps_low: float = 0.2
        """Importance ratio lower clip: ``ratio >= 1 - clip_eps_low``."""

        clip_eps_high: float = 0.2
        """Importance ratio upper clip: ``ratio <= 1 + clip_eps_high`` (DAPO uses 0.28)."""

        kl_coef: float = 0.04
        """``beta`` in DeepSeekMath eq. 3; 0 disables the KL term and ``ref_logprobs``."""

        off_policy_correction: Literal["none", "token_tis"] = "none"
        """``token_tis``: token-level truncated importance sampling between the trainer's
        and the generator's log-probs (module docstring); ``none``: the ratio against the
        generator's log-probs."""

        tis_imp_ratio_cap: float = 2.0
        """``C``, the largest importance weight of ``token_tis`` (verl's
        ``tis_imp_ratio_cap``; 2.0 is verl's default ``rollout_is_threshold``)."""

        def __post_init__(self) -> None:
            for name in ("clip_eps_low", "clip_eps_high", "kl_coef"):
                if getattr(self, name) < 0:
                    raise ValueError(f"GRPOLoss.Config.{name}={getattr(self, name)} must be >= 0")
            if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
                raise ValueError(
                    f"GRPOLoss.Config.off_policy_correction={self.off_policy_correction!r} "
                    f"must be one of {list(OFF_POLICY_CORRECTIONS)}"
                )
            if not self.tis_imp_ratio_cap > 0:
                raise ValueError(
                    f"GRPOLoss.Config.tis_imp_ratio_cap={self.tis_imp_ratio_cap} must be > 0"
                )
            if self.clip_eps_low >= 1:
                raise ValueError(
                    f"GRPOLoss.Config.clip_eps_low={self.clip_eps_low} must be < 1 "
                    "(the lower ratio bound 1 - clip_eps_low must stay positive)"
                )

    def __init__(self, config: Config) -> None:
        self.config = config
        self.names = self.metric_names + (
            self.tis_metric_names if config.off_policy_correction == "token_tis" else ()
        )
        """The metrics this loss returns."""

    def __call__(
        self, logits: torch.Tensor, mb: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.config
        loss, metrics = grpo_loss_and_metrics(
            logits, mb, clip_eps_low=c.clip_eps_low, clip_eps_high=c.clip_eps_high,
            kl_coef=c.kl_coef, off_policy_correction=c.off_policy_correction,
            tis_imp_ratio_cap=c.tis_imp_ratio_cap,
        )
        return loss, {name: metrics[name] for name in self.names}


def build(**config: Any) -> tuple[GRPOLoss, Callable[[Mapping[str, torch.Tensor]], torch.Tensor]]:
    """``(loss_fn, loss_weight_fn)`` for the engine, from a ``loss`` config section.

    ``forge_ext.engine.losses.build_loss(name="grpo", **config)`` calls this, e.g. with
    ``{"kl_coef": 0.0, "clip_eps_high": 0.28}``.

    Raises:
        TypeError: an unknown key (not a field of :class:`GRPOLoss.Config`).
        ValueError: an invalid value.
    """
    return GRPOLoss(GRPOLoss.Config(**config)), valid_token_count
