"""Named GRPO variants (``loss.preset``): each sets the fields its paper sets, nothing else.

A preset is data: for each config section, the values of the fields that define the variant.
:func:`apply_preset` fills them into a GRPO config mapping (the YAML after its CLI overrides)
*under* what the config writes: any field the YAML or a ``key=value`` override sets wins, so
``loss.preset=dapo loss.clip_eps_high=0.3`` is DAPO with another upper clip. Without a preset
every field keeps its own default (today's behaviour: token mean, group std, token ratios).

::

    preset   aggregation              advantages  ratio     clip lo/hi   KL    dynamic  overlong
    grpo     seq_mean_token_mean      group_std   token     0.2 / 0.2    0.04  no       no
    dr_grpo  seq_mean_token_sum_norm  none        token     0.2 / 0.2    0     no       no
    dapo     token_mean               group_std   token     0.2 / 0.28   0     yes      yes
    gspo     seq_mean_token_mean      group_std   sequence  3e-4 / 4e-4  0     no       no

Sources:

- ``grpo``: DeepSeekMath (Shao et al. 2024, arXiv:2402.03300), eq. 3: ``1/G sum_i 1/|o_i|
  sum_t``, advantages normalised by the group's std (section 4.1.2), eps 0.2, beta 0.04
  (section 4.2); TRL ``GRPOTrainer`` ``loss_type="grpo"``.
- ``dr_grpo``: Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783),
  section 3.1 / eq. 3: no ``1/|o_i|`` (a constant instead: ``loss.max_response_tokens``) and
  no std division; no KL term; TRL ``loss_type="dr_grpo"``, verl ``seq-mean-token-sum-norm``
  with ``norm_adv_by_std_in_grpo: false``.
- ``dapo``: Yu et al. 2025 (arXiv:2503.14476): clip-higher 0.2 / 0.28 (section 3.1), dynamic
  sampling (3.2), token-level loss (3.3), soft overlong punishment (3.4, eq. 13; its cache
  interval defaults to a fifth of the length limit, the paper's 4096 of 20480), KL removed
  (2.3). Overlong *filtering* (``loss.mask_truncated``) stays off: the paper reports it as
  the step before soft punishment, and masking truncated responses would discard the very
  penalty eq. 13 gives them.
- ``gspo``: Zheng et al. 2025 (arXiv:2507.18071): the sequence ratio ``(pi/pi_old)^(1/|y|)``
  clipped per sequence with 3e-4 / 4e-4 (eq. 5-7, section 5.1), one term per sequence
  (``seq_mean_token_mean``), no KL; TRL ``importance_sampling_level="sequence"``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

_FIELDS = ("loss.aggregation", "loss.ratio_level", "loss.clip_eps_low", "loss.clip_eps_high",
           "loss.kl_coef", "grpo.advantage_scaling", "grpo.dynamic_sampling",
           "reward.overlong.enable")
"""The dotted fields every preset sets: the columns of :data:`_VALUES`."""

_VALUES: dict[str, tuple[Any, ...]] = {
    #          aggregation                ratio       clip lo, hi  KL    advantages dynamic overlong
    "grpo":    ("seq_mean_token_mean",     "token",    0.2, 0.2,   0.04, "group_std", False, False),
    "dr_grpo": ("seq_mean_token_sum_norm", "token",    0.2, 0.2,   0.0,  "none",      False, False),
    "dapo":    ("token_mean",              "token",    0.2, 0.28,  0.0,  "group_std", True,  True),
    "gspo":    ("seq_mean_token_mean",     "sequence", 3e-4, 4e-4, 0.0,  "group_std", False, False),
}
"""Each preset's values of :data:`_FIELDS` (the module docstring's table)."""


def _nested(fields: tuple[str, ...], values: tuple[Any, ...]) -> dict[str, Any]:
    """``{"a.b": 1}`` as ``{"a": {"b": 1}}``, for each field and its value."""
    out: dict[str, Any] = {}
    for dotted, value in zip(fields, values, strict=True):
        *sections, name = dotted.split(".")
        target = out
        for section in sections:
            target = target.setdefault(section, {})
        target[name] = value
    return out


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    name: _nested(_FIELDS, values) for name, values in _VALUES.items()
}
"""``{preset: {section: {field: value}}}`` (nested sections as nested dicts)."""


def preset_fields(name: str) -> list[str]:
    """The dotted fields preset ``name`` sets, e.g. ``["loss.aggregation", ...]``."""
    out: list[str] = []

    def walk(values: Mapping[str, Any], prefix: str) -> None:
        for key, value in values.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                out.append(prefix + key)

    walk(PRESETS[name], "")
    return out


def apply_preset(mapping: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Fill ``loss.preset``'s fields into a config mapping wherever the mapping leaves them
    unset.

    Args:
        mapping: a GRPO config as a plain nested dict (:func:`forge_ext.config.load_yaml`).

    Returns:
        ``(mapping, overridden)``: a new mapping, and the dotted fields the preset sets but
        the config overrode (empty without a preset).

    Raises:
        ValueError: an unknown ``loss.preset`` (naming the known ones).
    """
    out = copy.deepcopy(dict(mapping))
    name = (out.get("loss") or {}).get("preset")
    if name is None:
        return out, []
    if name not in PRESETS:
        raise ValueError(f"loss.preset={name!r} must be one of {sorted(PRESETS)} (or unset)")
    overridden: list[str] = []

    def fill(target: dict[str, Any], values: Mapping[str, Any], prefix: str) -> None:
        for key, value in values.items():
            if isinstance(value, Mapping):
                if target.get(key) is None:
                    target[key] = {}
                fill(target[key], value, f"{prefix}{key}.")
            elif key in target:
                overridden.append(prefix + key)
            else:
                target[key] = value

    for section, values in PRESETS[name].items():
        if out.get(section) is None:
            out[section] = {}
        fill(out[section], values, f"{section}.")
    return out, overridden
