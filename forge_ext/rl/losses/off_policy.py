"""Off-policy corrections of the GRPO loss (``loss.off_policy_correction``): what to do with
tokens sampled by a policy other than the one trained.

Three policies meet in a step (decoupled PPO, Hilton et al. 2021, arXiv:2110.00641; AReaL,
Fu et al. 2025, arXiv:2505.24298, section 5.2): ``pi_gen``, the *behaviour* policy that
sampled the tokens (the generator: other kernels, another precision, maybe older weights:
``generator_logprobs``); ``pi_prox``, the *proximal* policy, the trainer's weights at the
step's start (its log-probs are the step's forward with the gradient stopped: the trainer
makes one optimizer step per batch, so every microbatch's forward runs under them); and
``pi_theta``, the policy being optimised (the same values, with gradient). With ``g_t =
log pi_prox(o_t) - log pi_gen(o_t)`` the trainer-generator gap of token ``t``:

- ``none``: PPO's ratio against the behaviour policy, ``r_t = pi_theta / pi_gen``; the gap
  goes into the clipped ratio itself.
- ``token_tis`` (truncated importance sampling; Yao et al. 2025,
  https://fengyao.notion.site/off-policy-rl; verl ``rollout_is: token``): ``r_t = pi_theta /
  pi_prox`` and each token weighted by ``w_t = min(exp(g_t), C)`` with ``C =
  tis_imp_ratio_cap``; per sequence with ``ratio_level: sequence`` (the capped geometric
  mean, verl ``rollout_is: geometric``).
- ``decoupled`` (AReaL's decoupled PPO objective, for ``loop.mode: async``): clip against the
  proximal policy, ``r_t = pi_theta / pi_prox``, weight by ``w_t = min(pi_prox / pi_gen,
  C)``. The proximal log-probs are ``mb["proximal_logprobs"]`` when the batch carries them
  (a trainer taking several optimizer steps on one batch must, as AReaL's recomputation
  does), else the step's forward without gradient, where it equals ``token_tis`` value for
  value and gradient for gradient.
- ``token_mask`` (token-level rejection sampling; verl ``rollout_rs: token``, prime-rl's
  masking by mismatch): PPO's ratio against the behaviour policy as ``none``, but a token
  whose gap ratio ``exp(g_t)`` leaves ``[1 / C_low, C_high]`` (``mask_imp_ratio_cap_low``,
  ``_high``) gets no gradient: its loss (surrogate and KL penalty) is 0.
- ``sequence_mask`` (sequence-level rejection; verl ``rollout_rs: geometric``; "When Speed
  Kills Stability", Liu, Li et al. 2025, https://richardli.xyz/rl-collapse-3): as
  ``token_mask`` with every token of a sequence judged by the sequence's geometric-mean
  ratio ``exp(mean_t g_t)``, so a sequence is kept or dropped whole.

A rejected token still counts in the loss's unit (the engine fixes the step's normaliser
before the forward that finds the gap, :meth:`forge_ext.rl.losses.grpo.GRPOLoss.weight`):
rejecting it is as if its advantage were 0, the way a binding clip is. With no gap
(``pi_gen == pi_prox`` exactly) every weight is exactly 1, nothing is rejected, and each
correction's loss and gradient equal the uncorrected ones bit for bit.

Gaps are clamped to ``+-MAX_LOG_RATIO`` before ``exp``.
"""

from __future__ import annotations

import math

import torch

MAX_LOG_RATIO = 10.0
"""Bound on ``|log(pi_a / pi_b)|`` before ``exp``; ``exp(10) ~ 2.2e4``."""

IS_CORRECTIONS = ("token_tis", "decoupled")
"""The corrections that clip against the proximal policy and weight each token."""

MASK_CORRECTIONS = ("token_mask", "sequence_mask")
"""The corrections that reject tokens (or sequences) outside the band."""


def sequence_sums(values: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                  slots: int) -> torch.Tensor:
    """``out[n] = sum of values[b, t] over the masked tokens of sequence n``: ``[slots]``
    (``ids``: each token's sequence, :func:`forge_ext.rl.losses.grpo.sequence_ids`)."""
    index = torch.where(mask, ids, torch.zeros_like(ids)).reshape(-1)
    source = torch.where(mask, values, torch.zeros_like(values)).reshape(-1)
    return values.new_zeros(slots).index_add(0, index, source)


def sequence_mean_per_token(values: torch.Tensor, ids: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]``: each masked token's value replaced by its sequence's mean over the
    masked tokens; 0 elsewhere."""
    slots = ids.numel()
    counts = sequence_sums(mask.to(values.dtype), ids, mask, slots)
    means = sequence_sums(values, ids, mask, slots) / counts.clamp(min=1.0)
    index = torch.where(mask, ids, torch.zeros_like(ids))
    return torch.where(mask, means[index], torch.zeros_like(values))


def truncated_importance_weights(
    logprobs: torch.Tensor, generator_logprobs: torch.Tensor, mask: torch.Tensor, cap: float,
    *, sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights ``w = min(exp(logprobs - generator_logprobs), cap)``
    (module docstring, ``token_tis``), detached.

    With ``sequence_ids`` (``loss.ratio_level: sequence``) the weight is per sequence and
    consistent with GSPO's ratio: ``w_i = min(exp(mean_t (logprobs - generator_logprobs)),
    cap)``, the capped geometric mean of the sequence's token ratios (verl's
    ``rollout_is: geometric``), given to each of its tokens.

    Args:
        logprobs: ``[batch, seq]`` the trainer's (proximal) log-probs of the sampled tokens
            (their gradient is not used).
        generator_logprobs: ``[batch, seq]`` the generator's log-probs of the same tokens.
        mask: ``[batch, seq]`` bool, True on scored tokens; elsewhere the weight is 1 and
            not capped, whatever the inputs hold there.
        cap: ``C > 0``, the largest weight.
        sequence_ids: ``[batch, seq]`` int64 (:func:`forge_ext.rl.losses.grpo.sequence_ids`),
            or None for token-level weights.

    Returns:
        ``(weights, capped)``: ``[batch, seq]`` fp32 weights, and bool, True where the raw
        ratio exceeded ``cap`` (the log-ratio is clamped to ``+-MAX_LOG_RATIO`` first).
    """
    with torch.no_grad():
        log_ratio = _gap(logprobs, generator_logprobs, mask, sequence_ids)
        raw = torch.exp(log_ratio)
        return raw.clamp(max=cap), (raw > cap) & mask


def rejection_mask(
    logprobs: torch.Tensor, generator_logprobs: torch.Tensor, mask: torch.Tensor,
    cap_low: float, cap_high: float, *, sequence_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[batch, seq]`` bool, True on the scored tokens that ``token_mask`` (or, with
    ``sequence_ids``, ``sequence_mask``) rejects (module docstring): those whose ratio
    ``exp(logprobs - generator_logprobs)`` (per sequence: its geometric mean) lies outside
    ``[1 / cap_low, cap_high]``. Compared in log space: ``g < -log(cap_low)`` or ``g >
    log(cap_high)``. Detached; False off ``mask``.

    Args:
        logprobs: ``[batch, seq]`` the trainer's (proximal) log-probs of the sampled tokens.
        generator_logprobs: ``[batch, seq]`` the generator's log-probs of the same tokens.
        mask: ``[batch, seq]`` bool, the scored tokens.
        cap_low, cap_high: ``C_low, C_high >= 1``, the band's reciprocal lower and its upper
            bound (verl's ``rollout_rs_threshold_lower = 1 / C_low``, ``rollout_rs_threshold``).
        sequence_ids: ``[batch, seq]`` int64, or None for a token-level judgement.
    """
    with torch.no_grad():
        gap = _gap(logprobs, generator_logprobs, mask, sequence_ids)
        outside = (gap < -math.log(cap_low)) | (gap > math.log(cap_high))
        return outside & mask


def _gap(logprobs: torch.Tensor, generator_logprobs: torch.Tensor, mask: torch.Tensor,
         sequence_ids: torch.Tensor | None) -> torch.Tensor:
    """``[batch, seq]`` clamped ``log(pi_prox / pi_gen)`` per token (or its sequence's mean
    with ``sequence_ids``); 0 off ``mask``, whatever the inputs hold there (NaN, inf)."""
    zeros = torch.zeros_like(logprobs)
    # Mask before exp: ignored positions may hold inf or NaN, and inf * 0 = NaN.
    log_ratio = torch.where(mask, logprobs.detach() - generator_logprobs, zeros)
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if sequence_ids is not None:
        log_ratio = sequence_mean_per_token(log_ratio, sequence_ids, mask)
    return log_ratio
