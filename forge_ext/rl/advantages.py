"""Advantage estimators: how a step's rewards become the policy loss's advantages, chosen by
``algorithm.advantage`` in the one RL app and loop (PPO is the app with a critic role).

- ``grpo``: group-normalised rewards, one advantage per response
  (:func:`compute_group_advantages`, ``grpo.advantage_scaling``);
- ``rloo``: REINFORCE with a leave-one-out baseline, one advantage per response,
  ``A_i = r_i - 1/(G-1) sum_{j != i} r_j`` over the ``G`` samples of a prompt (Kool et al.
  2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et al. 2024,
  arXiv:2402.14740, eq. 6; TRL ``RLOOTrainer``);
- ``gae``: PPO's generalised advantage estimation with a learned critic, one advantage per
  response token (below). It needs the ``critic:`` role and works from one sample per
  prompt (``grpo.group_size: 1``).

:func:`build_estimator` builds the one ``algorithm.advantage`` names from its config
(:class:`forge_ext.rl.algorithm.AlgorithmConfig`, which names no estimator).

GAE (Schulman et al. 2016, arXiv:1506.02438, eq. 11-16; verl ``trainer/ppo/core_algos.py``
``compute_gae_advantage_return``), on the packed batch's layout (:mod:`forge_ext.rl.episode`:
position ``t`` holds the label ``x_{t+1}``, its log-probs and the critic's value
``V_t = V(x_{<=t})``), over the *model tokens* of a row (``labels != -100``; the prompt,
padding and a multi-turn episode's environment tokens are not)::

    r_t     = -kl_coef * KL_t   (+ R, the episode's reward, at its last model token)
    delta_t = r_t + gamma * V_next(t) - V_t
    A_t     = delta_t + gamma * lam * A_next(t)
    returns_t = A_t + V_t

with ``next(t)`` the row's next *model* token after ``t`` (0 after the last one: the episode
ends there). ``KL_t = log pi_gen(x) - log pi_ref(x)`` (the k1 estimator, verl's default
``kl_penalty: kl``) only with ``algorithm.kl_in_reward``.

Multi-turn episodes: environment tokens are skipped, as verl does (its loop carries
``nextvalues`` and ``lastgaelam`` unchanged across ``response_mask == 0``): a model turn's
last token bootstraps from the value at the *next turn's first model token*, one ``gamma``
step away however many environment tokens lie between; the environment's tokens get no value,
advantage or return, and no discount. An episode of turns is therefore the same recursion as
one response made of its model tokens alone (tested). Environment rewards count in the
episode's reward, placed at its last model token. A truncated episode (cut at the length
limit) ends like any other (no bootstrap from a value after it), as in verl.

Whitening (``algorithm.whiten``): ``(A - mean) / sqrt(var + 1e-8)`` with the mean and the
unbiased variance over every valid token of the step's batch (verl ``masked_whiten``), never
over padding, prompt or environment tokens, which stay 0. The metrics report the advantages'
mean and std before whitening.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from forge_ext.engine.losses import IGNORE_INDEX
from forge_ext.rl.algorithm import ADVANTAGE_SCALINGS, AlgorithmConfig

WHITEN_EPS = 1e-8
"""Added to the variance before the square root when whitening (verl's ``masked_whiten``)."""


@dataclass
class TokenAdvantages:
    """What a per-token estimator gives a step (shapes ``[B, S]``, aligned with ``labels``;
    0 where the label is ignored)."""

    advantages: torch.Tensor
    """fp32 advantages for the policy loss (whitened when ``algorithm.whiten``)."""
    returns: torch.Tensor
    """fp32 ``A + V`` before whitening: the critic's regression targets."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``advantage/mean``, ``advantage/std`` (before whitening), ``critic/values_mean``,
    ``critic/returns_mean``, ``critic/explained_variance`` (``1 - Var(R - V) / Var(R)``),
    over the step's valid tokens."""


class AdvantageEstimator(ABC):
    """An estimator of ``algorithm.advantage`` (module docstring). Episode-level estimators
    implement :meth:`episode_advantages`; per-token ones (:attr:`needs_critic`) return zeros
    there and give their advantages at train time, from the critic's values
    (:meth:`token_advantages`)."""

    name: str
    needs_critic: bool = False

    @classmethod
    @abstractmethod
    def from_config(cls, config: AlgorithmConfig, *, group_size: int,
                    scaling: str) -> AdvantageEstimator:
        """The estimator of ``config`` for ``group_size`` samples per prompt (``scaling``:
        ``grpo.advantage_scaling``); :func:`build_estimator` has checked the group size."""

    def episode_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """``[N]`` advantages of ``[N]`` rewards, ``group_size`` consecutive per prompt."""
        return torch.zeros_like(rewards, dtype=torch.float32)

    def token_advantages(self, rewards: torch.Tensor, labels: torch.Tensor,
                         values: torch.Tensor, kl: torch.Tensor | None = None) -> TokenAdvantages:
        """Per-token advantages of a step from the critic: ``rewards`` ``[B]`` (one per
        episode, placed at its last model token), ``labels`` ``[B, S]`` (``-100`` where no
        advantage exists: prompt, padding, environment tokens), ``values`` ``[B, S]`` (the
        critic's, aligned with ``labels``), ``kl`` ``[B, S]`` or None (per-token KL penalty
        added to the rewards when ``algorithm.kl_in_reward``).

        Raises:
            NotImplementedError: an episode-level estimator (``grpo``, ``rloo``)."""
        raise NotImplementedError(f"algorithm.advantage={self.name} has no per-token advantages")


class GroupAdvantage(AdvantageEstimator):
    """``grpo``: :func:`compute_group_advantages`."""

    name = "grpo"

    def __init__(self, group_size: int, scaling: str = "group_std") -> None:
        self.group_size, self.scaling = group_size, scaling

    @classmethod
    def from_config(cls, config: AlgorithmConfig, *, group_size: int,
                    scaling: str) -> GroupAdvantage:
        return cls(group_size, scaling)

    def episode_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return compute_group_advantages(rewards, self.group_size, scaling=self.scaling)


def compute_group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scaling: str = "group_std"
) -> torch.Tensor:
    """Group-relative advantages ``A_i = (r_i - mean(r_g)) / s``.

    ``s`` by ``scaling`` (``grpo.advantage_scaling``):

    - ``group_std``: ``std(r_g) + eps``, the group's own spread (DeepSeekMath,
      arXiv:2402.03300, section 4.1.2, outcome supervision);
    - ``none``: 1, the mean-centred reward alone (Dr. GRPO, Liu et al. 2025,
      arXiv:2503.20783, section 3.1: dividing by the group's std up-weights questions that
      are too easy or too hard);
    - ``batch_std``: ``std(r) + eps`` over the whole batch, group means still per group
      (TRL ``GRPOTrainer`` ``scale_rewards="batch"``; Hu et al. 2025, REINFORCE++,
      arXiv:2501.03262).

    ``std`` is the population standard deviation (divide by the count), as torchtitan's
    ``AdvantageEstimator`` uses (``statistics.pstdev``), computed in float64. A group whose
    rewards are all equal gets exactly 0 for every member, whatever the scaling, magnitude
    and dtype, and ``group_size == 1`` is allowed (all zeros).

    Args:
        rewards: ``[num_groups * group_size]``, consecutive ``group_size`` entries form one
            group (the completions of one prompt).
        group_size: completions per prompt, >= 1.
        eps: added to the std to avoid division by zero.
        scaling: ``group_std``, ``none`` or ``batch_std``.

    Returns:
        ``[num_groups * group_size]`` advantages, same dtype as ``rewards`` (fp32 if integer).

    Raises:
        ValueError: if ``rewards`` is not 1-D, ``group_size < 1``, its length is not a
            multiple of ``group_size``, or ``scaling`` is unknown.
    """
    if scaling not in ADVANTAGE_SCALINGS:
        raise ValueError(
            f"grpo.advantage_scaling={scaling!r} must be one of {list(ADVANTAGE_SCALINGS)}"
        )
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
    if scaling == "group_std":
        scale = grouped.std(dim=1, unbiased=False, keepdim=True) + eps
    elif scaling == "batch_std":
        scale = grouped.std(unbiased=False) + eps
    else:
        scale = torch.ones((), dtype=torch.float64)
    advantages = (grouped - mean) / scale
    no_spread = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    advantages = advantages.masked_fill(no_spread, 0.0)
    return advantages.view(-1).to(out_dtype)


def groups_with_spread(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[num_groups]`` bool: True for a group whose rewards are not all equal. The others
    get exactly zero advantage (:func:`compute_group_advantages`) and so no policy
    gradient: DAPO's dynamic sampling (arXiv:2503.14476, section 3.2) drops them.

    Raises:
        ValueError: ``rewards`` not 1-D with a length that is a multiple of ``group_size``.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} must be 1-D with a length that is a "
            f"multiple of group_size={group_size}"
        )
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


class LeaveOneOutAdvantage(AdvantageEstimator):
    """``rloo``: ``A_i = r_i - mean_{j != i} r_j`` within each group of ``group_size >= 2``
    (module docstring), in float64; a group whose rewards are all equal gets exactly 0."""

    name = "rloo"

    def __init__(self, group_size: int) -> None:
        if group_size < 2:
            raise ValueError(f"rloo needs grpo.group_size >= 2, got {group_size}")
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: AlgorithmConfig, *, group_size: int,
                    scaling: str) -> LeaveOneOutAdvantage:
        return cls(group_size)

    def episode_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return leave_one_out_advantages(rewards, self.group_size)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N]`` RLOO advantages of ``[N]`` rewards, ``group_size`` consecutive per group:
    ``r_i - (sum_g - r_i) / (G - 1)``.

    Raises:
        ValueError: ``group_size < 2`` or a length that is not a multiple of it.
    """
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} must be 1-D with a length that is a "
            f"multiple of group_size={group_size} >= 2"
        )
    grouped = rewards.to(torch.float64).view(-1, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    advantages = grouped - others
    no_spread = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return advantages.masked_fill(no_spread, 0.0).view(-1).float()


class GAE(AdvantageEstimator):
    """``gae``: per-token advantages and returns from the critic's values (module
    docstring)."""

    name = "gae"
    needs_critic = True

    def __init__(self, *, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
                 kl_coef: float = 0.0) -> None:
        self.gamma, self.lam, self.whiten, self.kl_coef = gamma, lam, whiten, kl_coef

    @classmethod
    def from_config(cls, config: AlgorithmConfig, *, group_size: int, scaling: str) -> GAE:
        return cls(gamma=config.gamma, lam=config.lam, whiten=config.whiten,
                   kl_coef=config.kl_coef if config.kl_in_reward else 0.0)

    def token_advantages(self, rewards: torch.Tensor, labels: torch.Tensor,
                         values: torch.Tensor, kl: torch.Tensor | None = None) -> TokenAdvantages:
        """Args: ``rewards [B]`` (each row's episode reward), ``labels [B, S]`` (``-100``
        off the model tokens), ``values [B, S]`` (the critic's), ``kl [B, S]`` (``log pi_gen
        - log pi_ref``; needed when ``kl_coef != 0``)."""
        mask = labels != IGNORE_INDEX
        if self.kl_coef and kl is None:
            raise ValueError("algorithm.kl_in_reward needs the reference's log-probs")
        token_rewards = token_level_rewards(rewards, mask, kl, self.kl_coef)
        advantages, returns = gae(token_rewards, values, mask, self.gamma, self.lam)
        metrics = advantage_metrics(advantages, returns, values, mask)
        if self.whiten:
            advantages = masked_whiten(advantages, mask)
        return TokenAdvantages(advantages=advantages.float(), returns=returns.float(),
                               metrics=metrics)


def token_level_rewards(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                        kl_coef: float = 0.0) -> torch.Tensor:
    """``[B, S]`` float64 per-token rewards: ``-kl_coef * kl`` on every model token, plus the
    row's ``rewards[b]`` at its last model token (a row without one gets nothing)."""
    mask = mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if kl_coef:
        out = torch.where(mask, -kl_coef * kl.to(torch.float64), out)
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = (mask * positions).argmax(dim=1)
    has_token = mask.any(dim=1)
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    out[rows, last[has_token]] += rewards.to(torch.float64)[has_token]
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the model tokens of each row (module docstring), right to left, in float64.

    Args:
        token_rewards, values: ``[B, S]`` (values at unmasked positions are never read:
            they may hold anything, even NaN).
        mask: ``[B, S]`` bool, the model tokens.

    Returns:
        ``(advantages, returns)``, ``[B, S]`` float64, 0 off the mask.
    """
    mask = mask.bool()
    zeros = torch.zeros(mask.shape[0], dtype=torch.float64, device=mask.device)
    rewards = torch.where(mask, token_rewards.to(torch.float64), 0.0)
    values = torch.where(mask, values.to(torch.float64), 0.0)
    next_value, next_advantage = zeros, zeros
    columns = []
    for t in reversed(range(mask.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        on = mask[:, t]
        # Off the model tokens both carry over unchanged: the recursion skips them.
        next_value = torch.where(on, values[:, t], next_value)
        next_advantage = torch.where(on, advantage, next_advantage)
        columns.append(torch.where(on, advantage, 0.0))
    advantages = torch.stack(columns[::-1], dim=1)
    return advantages, torch.where(mask, advantages + values, 0.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with the mean and unbiased variance of ``x`` over
    ``mask``'s True entries; 0 elsewhere (verl ``utils/torch_functional.py``
    ``masked_whiten``). With fewer than two entries, only centred."""
    mask = mask.bool()
    values = x.to(torch.float64)[mask]
    if values.numel() == 0:
        return torch.zeros_like(x)
    centred = x.to(torch.float64) - values.mean()
    if values.numel() > 1:
        centred = centred / torch.sqrt(values.var(unbiased=True) + WHITEN_EPS)
    return torch.where(mask, centred, 0.0).to(x.dtype)


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` of 1-D tensors (population variances; NaN when ``R`` is
    constant): 1 for a perfect critic, 0 for one that predicts the mean, negative for
    worse (OpenAI baselines ``common/math_util.py``)."""
    variance = returns.to(torch.float64).var(unbiased=False)
    if values.numel() == 0 or float(variance) == 0.0:
        return math.nan
    residual = (returns.to(torch.float64) - values.to(torch.float64)).var(unbiased=False)
    return float(1.0 - residual / variance)


def advantage_metrics(advantages: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, float]:
    """The step's PPO figures over its valid tokens (:attr:`TokenAdvantages.metrics`)."""
    mask = mask.bool()
    a, r, v = advantages[mask].double(), returns[mask].double(), values[mask].double()
    if a.numel() == 0:
        return {}
    return {
        "advantage/mean": float(a.mean()),
        "advantage/std": float(a.std(unbiased=False)),
        "critic/values_mean": float(v.mean()),
        "critic/returns_mean": float(r.mean()),
        "critic/explained_variance": explained_variance(v, r),
    }


ESTIMATOR_TYPES: dict[str, type[AdvantageEstimator]] = {
    estimator.name: estimator for estimator in (GroupAdvantage, LeaveOneOutAdvantage, GAE)
}
"""The estimator of each value of ``algorithm.advantage``
(:data:`forge_ext.rl.algorithm.ESTIMATORS`)."""


def build_estimator(config: AlgorithmConfig, *, group_size: int,
                    scaling: str = "group_std") -> AdvantageEstimator:
    """The estimator ``config.advantage`` names, for ``group_size`` samples per prompt
    (``scaling``: ``grpo.advantage_scaling``, for ``grpo``).

    Raises:
        ValueError: ``group_size`` below ``config.min_group_size``, naming the fields.
    """
    config.check_group_size(group_size)
    return ESTIMATOR_TYPES[config.advantage].from_config(config, group_size=group_size,
                                                         scaling=scaling)
