"""The GRPO loss's config (YAML ``loss:``) and the names of its modes: standard library only,
so that a config is validated before torch is imported (issue 38). The loss itself is
:class:`forge_ext.rl.losses.grpo.GRPOLoss` (``GRPOLoss.Config`` is :class:`GRPOLossConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from forge_ext.rl.losses.presets import PRESETS

OFF_POLICY_CORRECTIONS = ("none", "token_tis", "decoupled", "token_mask", "sequence_mask")
"""Values of ``loss.off_policy_correction`` (module docstring)."""

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                "seq_mean_token_sum_norm")
"""Values of ``loss.aggregation`` (module docstring, "Aggregation")."""

RATIO_LEVELS = ("token", "sequence")
"""Values of ``loss.ratio_level``: PPO/GRPO token ratios, or GSPO's sequence ratio."""

TOKEN_CLIP_EPS = (0.2, 0.2)
"""Default ``(clip_eps_low, clip_eps_high)`` of token ratios (PPO, DeepSeekMath)."""

SEQUENCE_CLIP_EPS = (3e-4, 4e-4)
"""Default ``(clip_eps_low, clip_eps_high)`` of GSPO's sequence ratio (arXiv:2507.18071,
section 5.1)."""


def default_clip_eps(ratio_level: str) -> tuple[float, float]:
    """``(clip_eps_low, clip_eps_high)`` when unset: ``(0.2, 0.2)`` for token ratios (PPO,
    DeepSeekMath), ``(3e-4, 4e-4)`` for sequence ratios (GSPO, arXiv:2507.18071, section
    5.1: a geometric-mean ratio moves far less than a token's)."""
    return SEQUENCE_CLIP_EPS if ratio_level == "sequence" else TOKEN_CLIP_EPS


def check_loss_options(
    *, aggregation: str, ratio_level: str, off_policy_correction: str,
    max_response_tokens: int | None, clip_eps_low: float, clip_eps_high: float,
) -> None:
    """Raise ``ValueError`` naming the ``loss.`` field of an unknown mode or a bad value."""
    for name, value, known in (
        ("aggregation", aggregation, AGGREGATIONS),
        ("ratio_level", ratio_level, RATIO_LEVELS),
        ("off_policy_correction", off_policy_correction, OFF_POLICY_CORRECTIONS),
    ):
        if value not in known:
            raise ValueError(f"loss.{name}={value!r} must be one of {list(known)}")
    if aggregation == "seq_mean_token_sum_norm" and (
        max_response_tokens is None or max_response_tokens < 1
    ):
        raise ValueError(
            f"loss.aggregation=seq_mean_token_sum_norm divides by the constant "
            f"loss.max_response_tokens={max_response_tokens}; set it to a positive token "
            "count (the GRPO app defaults it to generator.sampling.max_new_tokens)"
        )
    if ratio_level == "sequence":
        for name, eps in (("clip_eps_low", clip_eps_low), ("clip_eps_high", clip_eps_high)):
            if not 0 < eps < 1:
                raise ValueError(f"loss.{name}={eps} with loss.ratio_level=sequence must lie in "
                                 "(0, 1) (GSPO clips the sequence ratio to [1 - low, 1 + high]; "
                                 "the paper uses 3e-4 and 4e-4)")


@dataclass(kw_only=True, slots=True)
class GRPOLossConfig:
    """YAML ``loss:``, :class:`forge_ext.rl.losses.grpo.GRPOLoss`'s config (``GRPOLoss.Config``)."""

    preset: str | None = None
    """The named preset (``grpo``, ``dr_grpo``, ``dapo``, ``gspo``) the GRPO app filled
    this section's unset fields from (:mod:`forge_ext.rl.losses.presets`); recorded, not
    applied here: a Python caller passes the fields."""

    aggregation: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
    ] = "token_mean"
    """How token losses become the step loss (module docstring, "Aggregation"):
    ``token_mean`` over all valid tokens of the step (DAPO); the mean over sequences of
    each sequence's token mean (GRPO's ``1/|o_i|``), token sum, or token sum divided by
    ``max_response_tokens`` (Dr. GRPO)."""

    ratio_level: Literal["token", "sequence"] = "token"
    """``token``: PPO/GRPO per-token ratios; ``sequence``: GSPO's geometric-mean
    sequence ratio, clipped per sequence."""

    clip_eps_low: float | None = None
    """Importance ratio lower clip: ``ratio >= 1 - clip_eps_low``; unset: 0.2 for token
    ratios, 3e-4 for sequence ratios (GSPO)."""

    clip_eps_high: float | None = None
    """Importance ratio upper clip: ``ratio <= 1 + clip_eps_high`` (DAPO uses 0.28);
    unset: 0.2 for token ratios, 4e-4 for sequence ratios (GSPO)."""

    kl_coef: float = 0.04
    """``beta`` in DeepSeekMath eq. 3; 0 disables the KL term and ``ref_logprobs``."""

    max_response_tokens: int | None = None
    """The constant divisor of ``seq_mean_token_sum_norm`` (Dr. GRPO's ``MAX_TOKENS``);
    the GRPO app sets it to ``generator.sampling.max_new_tokens`` when unset."""

    mask_truncated: bool = False
    """Exclude responses cut at the length limit from the loss (DAPO's overlong
    filtering, arXiv:2503.14476, section 3.4); needs ``truncated`` in the batch."""

    off_policy_correction: Literal[
        "none", "token_tis", "decoupled", "token_mask", "sequence_mask"
    ] = "none"
    """What to do with the gap between the generator's log-probs and the trainer's at the
    step's start (formulas and sources: :mod:`forge_ext.rl.losses.off_policy`). ``none``:
    the clipped ratio against the generator's log-probs; ``token_tis``: truncated importance
    sampling (per sequence with ``ratio_level: sequence``); ``decoupled``: AReaL's decoupled
    PPO (clip against the proximal policy, the trainer's weights at the step's start, weight
    by proximal / behaviour truncated at ``tis_imp_ratio_cap``), for ``loop.mode: async``;
    ``token_mask`` / ``sequence_mask``: tokens / whole sequences whose ratio leaves ``[1 /
    mask_imp_ratio_cap_low, mask_imp_ratio_cap_high]`` get no gradient (``loss/rejected_fraction``)."""

    tis_imp_ratio_cap: float = 2.0
    """``C``, the largest importance weight of ``token_tis`` and ``decoupled`` (verl's
    ``tis_imp_ratio_cap``; 2.0 is verl's default ``rollout_is_threshold``)."""

    mask_imp_ratio_cap_low: float = 2.0
    """``C_low >= 1``: ``token_mask`` / ``sequence_mask`` reject a ratio below ``1 / C_low``
    (verl's ``rollout_rs_threshold_lower`` is ``1 / C_low``)."""

    mask_imp_ratio_cap_high: float = 2.0
    """``C_high >= 1``: ``token_mask`` / ``sequence_mask`` reject a ratio above ``C_high``
    (verl's ``rollout_rs_threshold``, default 2.0)."""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(
                f"loss.preset={self.preset!r} must be one of {sorted(PRESETS)} (or unset)"
            )
        default_low, default_high = default_clip_eps(self.ratio_level)
        if self.clip_eps_low is None:
            self.clip_eps_low = default_low
        if self.clip_eps_high is None:
            self.clip_eps_high = default_high
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"loss.{name}={getattr(self, name)} must be >= 0")
        if self.max_response_tokens is not None and self.max_response_tokens < 1:
            raise ValueError(
                f"loss.max_response_tokens={self.max_response_tokens} must be >= 1"
            )
        check_loss_options(
            aggregation=self.aggregation, ratio_level=self.ratio_level,
            off_policy_correction=self.off_policy_correction,
            max_response_tokens=self.max_response_tokens or 1,  # may be filled later
            clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
        )
        if not self.tis_imp_ratio_cap > 0:
            raise ValueError(
                f"loss.tis_imp_ratio_cap={self.tis_imp_ratio_cap} must be > 0"
            )
        for name in ("mask_imp_ratio_cap_low", "mask_imp_ratio_cap_high"):
            if not getattr(self, name) >= 1:
                raise ValueError(
                    f"loss.{name}={getattr(self, name)} must be >= 1 (the band [1 / "
                    "mask_imp_ratio_cap_low, mask_imp_ratio_cap_high] must hold ratio 1)"
                )
        if self.clip_eps_low >= 1:
            raise ValueError(
                f"loss.clip_eps_low={self.clip_eps_low} must be < 1 "
                "(the lower ratio bound 1 - clip_eps_low must stay positive)"
            )

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`grpo_loss_and_metrics` (all but ``preset``)."""
        return {name: getattr(self, name) for name in self.__slots__ if name != "preset"}
