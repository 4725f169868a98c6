"""YAML ``critic:``, PPO's value model (:mod:`forge_ext.actors.critic` runs it): its own fields
and how the section splits into them and an engine section. Standard library only, so that a
config is validated before torch is imported (issue 38)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from forge_ext.config import from_mapping
from forge_ext.engine.schema import engine_section_problems


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """YAML ``critic:``: the value model. Its presence makes the run PPO
    (``algorithm.advantage: gae``). Besides the fields below it takes every field of
    ``trainer:`` (an engine section: ``model``, ``training``, ``optimizer``, ``lr_scheduler``,
    ``parallelism``, ``checkpoint``, ...) for the critic's own engine, ``model.value_head``
    always true. Unset, ``model`` is the policy's checkpoint (``flavor: hf``), and
    ``checkpoint`` follows the trainer's (enabled with it, folder ``critic_checkpoints`` in
    the trainer's ``dump_folder``, same ``keep_latest_k``)."""

    hf_path: str | None = None
    """The checkpoint the critic starts from: a causal LM (its trunk; the value head starts
    at zero) or a sequence classifier with ``num_labels: 1`` (e.g. a reward model; its
    ``score`` head is read too). Default: the policy's ``model.hf_path``."""
    clip_value: float | None = 0.2
    """The value loss's clip: a new value may move at most this far from the value the
    step's returns were computed with (:mod:`forge_ext.rl.losses.value`); null: no clipping."""
    warmup_steps: int = 0
    """Steps at the start of the run that train the critic only: the policy moves from step
    ``warmup_steps + 1`` on (verl's ``critic_warmup``)."""

    def __post_init__(self) -> None:
        if self.clip_value is not None and not self.clip_value > 0:
            raise ValueError(
                f"critic.clip_value={self.clip_value} must be > 0 (or null: no clipping)")
        if self.warmup_steps < 0:
            raise ValueError(f"critic.warmup_steps={self.warmup_steps} must be >= 0")


CRITIC_FIELDS = tuple(f.name for f in fields(CriticConfig))
"""The keys of a ``critic:`` section that are the critic's own; the others are its engine's."""


def critic_key_problems(mapping: Mapping[str, Any], section: str = "critic") -> list[str]:
    """The unknown keys of a ``critic:`` section (its own fields, :data:`CRITIC_FIELDS`, and
    its engine's); a :data:`forge_ext.config.SectionCheck` for the app's ``from_mapping``."""
    return engine_section_problems(mapping, section, types=False, extra=CRITIC_FIELDS)


def critic_sections(critic: Mapping[str, Any], *, policy_hf_path: str,
                    trainer: Mapping[str, Any]) -> tuple[dict[str, Any], CriticConfig]:
    """Split a YAML ``critic:`` mapping into its engine section (defaults filled as
    :class:`CriticConfig` says, ``model.value_head`` set) and its own fields.

    Raises:
        ValueError: a bad critic field, ``critic.hf_path`` and ``critic.model.hf_path``
            disagreeing, or the critic's checkpoints where the trainer's are (naming fields).
    """
    raw = copy.deepcopy(dict(critic))
    options = from_mapping(CriticConfig, {k: raw.pop(k) for k in CRITIC_FIELDS if k in raw},
                           "critic")
    model = dict(raw.get("model") or {})
    if model.get("value_head") is False:
        raise ValueError("critic.model.value_head=false: a critic's output is a value head; "
                         "leave the field out")
    hf_path = options.hf_path or model.get("hf_path") or policy_hf_path
    if options.hf_path and model.get("hf_path") and model["hf_path"] != options.hf_path:
        raise ValueError(f"critic.hf_path={options.hf_path!r} and critic.model.hf_path="
                         f"{model['hf_path']!r} differ; set one of them")
    model.setdefault("flavor", "hf")
    raw["model"] = {**model, "hf_path": hf_path, "value_head": True}
    policy_checkpoint = dict(trainer.get("checkpoint") or {})
    checkpoint = dict(raw.get("checkpoint") or {})
    checkpoint.setdefault("enable", bool(policy_checkpoint.get("enable")))
    checkpoint.setdefault("folder", "critic_checkpoints")
    if "keep_latest_k" in policy_checkpoint:
        checkpoint.setdefault("keep_latest_k", policy_checkpoint["keep_latest_k"])
    raw["checkpoint"] = checkpoint
    if "dump_folder" in trainer:
        raw.setdefault("dump_folder", trainer["dump_folder"])
    if checkpoint["enable"] and (raw.get("dump_folder"), checkpoint["folder"]) == (
            trainer.get("dump_folder"), policy_checkpoint.get("folder", "checkpoint")):
        raise ValueError(
            f"critic.checkpoint.folder={checkpoint['folder']!r} is the trainer's checkpoint "
            "folder (same dump_folder): the two would overwrite each other; give the critic "
            "its own, e.g. critic.checkpoint.folder=critic_checkpoints")
    return raw, options
