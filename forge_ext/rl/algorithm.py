"""YAML ``algorithm:``, the advantage estimator's config, and the values of
``grpo.advantage_scaling``: standard library only, so that a config is validated before torch
is imported (issue 38). :func:`forge_ext.rl.advantages.build_estimator` builds the estimator
from it (this module names none of them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ESTIMATORS = ("grpo", "rloo", "gae")
"""Values of ``algorithm.advantage``."""

ADVANTAGE_SCALINGS = ("group_std", "none", "batch_std")
"""Values of ``grpo.advantage_scaling``
(:func:`forge_ext.rl.advantages.compute_group_advantages`)."""


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """YAML ``algorithm:``: the advantage estimator and its coefficients (module docstring)."""

    advantage: Literal["grpo", "rloo", "gae"] = "grpo"
    """``grpo``: group-normalised rewards (``grpo.advantage_scaling``); ``rloo``: the reward
    minus the mean of the prompt's other samples; ``gae``: PPO's per-token GAE with a learned
    critic (needs the ``critic:`` section; ``grpo.group_size`` may be 1)."""
    gamma: float = 1.0
    """GAE's discount per model token (``gae`` only)."""
    lam: float = 1.0
    """GAE's ``lambda``: 1 gives Monte-Carlo returns minus the value, 0 the one-step TD error
    (``gae`` only)."""
    whiten: bool = True
    """Whiten GAE's advantages over the step's valid tokens (module docstring; ``gae``
    only)."""
    kl_in_reward: bool = False
    """Add ``-kl_coef * (log pi_gen - log pi_ref)`` to every model token's reward (``gae``
    only; needs a KL reference: the ``reference:`` section, or ``trainer.lora``)."""
    kl_coef: float = 0.0
    """The coefficient of the per-token KL penalty in the reward (``kl_in_reward``); the
    policy loss's own KL term is ``loss.kl_coef``."""

    def __post_init__(self) -> None:
        if self.advantage not in ESTIMATORS:
            raise ValueError(
                f"algorithm.advantage={self.advantage!r} must be one of {list(ESTIMATORS)}"
            )
        for name, value in (("gamma", self.gamma), ("lam", self.lam)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"algorithm.{name}={value} must lie in [0, 1]")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"algorithm.kl_coef={self.kl_coef} must be finite and >= 0")
        if self.advantage != "gae":
            for name, default in (("gamma", 1.0), ("lam", 1.0), ("kl_in_reward", False)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"algorithm.{name}={getattr(self, name)} applies to "
                        f"algorithm.advantage=gae only (it is {self.advantage!r})"
                    )

    @property
    def needs_critic(self) -> bool:
        """Whether the estimator needs the ``critic:`` role."""
        return self.advantage == "gae"

    @property
    def min_group_size(self) -> int:
        """The fewest samples per prompt the estimator can use (``grpo.group_size``)."""
        return 1 if self.advantage == "gae" else 2

    def check_group_size(self, group_size: int) -> None:
        """Raise ValueError if ``group_size`` is below :attr:`min_group_size`, naming the
        fields."""
        if group_size < self.min_group_size:
            raise ValueError(
                f"grpo.group_size={group_size} with algorithm.advantage={self.advantage}: "
                f"needs >= {self.min_group_size} samples per prompt (a group of one has no "
                "baseline but a critic's; use algorithm.advantage=gae with a critic: section)"
            )
