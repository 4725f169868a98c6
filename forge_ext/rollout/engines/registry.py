"""Sampling backends by name (``generator.backend``): each one's light face (what of a
``generator:`` section it can check without importing its engine) and where its engine class
lives.

The config layer (:mod:`forge_ext.rollout.config`) names no backend's module: it checks what
every backend shares, then hands the section to the backend its ``backend`` names
(:func:`validate_backend`). A face checks the weight-update modes its engine serves; a
backend that checks more (vLLM: engine arguments, the checkpoint's architecture and head
size) does so in its engine class's ``validate_config``
(:meth:`forge_ext.rollout.engines.vllm.VLLMEngine.validate_config`). As vLLM's model registry
keeps its model classes (``vllm/model_executor/models/registry.py``: architecture ->
``(module, class)``, imported on first use), an engine's module is imported only when it is
built or runs its own checks, so this module and the config load without torch (issue 38):
an ``hf`` section is checked without importing transformers. vLLM's LoRA ranks live here too
(:data:`VLLM_LORA_RANKS`), for the config's ``lora_engine_args`` and the engine alike.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from forge_ext.rollout.engines.base import WEIGHT_UPDATE_MODES


@dataclass(frozen=True, slots=True)
class Backend:
    """One sampling backend's light face."""

    engine: str
    """``"module:Class"`` of its :class:`~forge_ext.rollout.engines.base.Engine`."""
    weight_updates: tuple[str, ...] = ("between_requests",)
    """The ``generator.weight_update`` modes it serves."""
    why: str = ""
    """Why it serves no other mode (for the error)."""
    checks_more: bool = False
    """Its engine class checks more (``validate_config``; imports its module: torch)."""


BACKENDS: dict[str, Backend] = {
    "hf": Backend(engine="forge_ext.rollout.engines.hf:HFEngine",
                  why="transformers' generate cannot change weights mid-batch"),
    "vllm": Backend(engine="forge_ext.rollout.engines.vllm:VLLMEngine",
                    weight_updates=WEIGHT_UPDATE_MODES, checks_more=True),
}
"""``generator.backend`` -> its :class:`Backend`."""

# What of vLLM's LoRA arguments the config checks without vLLM (``lora_engine_args`` in
# forge_ext.rollout.config), and the engine uses.
#: ``max_lora_rank`` values vLLM accepts (``MaxLoRARanks`` in ``vllm/config/lora.py``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's ``max_lora_rank`` when unset (``LoRAConfig.max_lora_rank``).
VLLM_DEFAULT_MAX_LORA_RANK = 16


def backend(name: str) -> Backend:
    """The face of backend ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`BACKENDS`, naming ``generator.backend``.
    """
    if name not in BACKENDS:
        raise ValueError(f"generator.backend={name!r} must be one of {sorted(BACKENDS)}")
    return BACKENDS[name]


def engine_class(name: str) -> type:
    """The engine class of backend ``name`` (its module imported now: torch, seconds).

    Raises:
        ValueError: an unknown backend (:func:`backend`).
    """
    module, _, cls = backend(name).engine.partition(":")
    return getattr(importlib.import_module(module), cls)


def validate_backend(config: Any) -> None:
    """Check a ``generator:`` section (:class:`~forge_ext.rollout.config.GeneratorConfig`)
    as its ``backend`` needs it, before anything is spawned: the face's weight-update modes,
    then, for a backend that checks more, its engine class's ``validate_config``.

    Raises:
        ValueError: naming the field and the fix.
    """
    face = backend(config.backend)
    if config.weight_update not in face.weight_updates:
        serving = [n for n, b in BACKENDS.items() if config.weight_update in b.weight_updates]
        raise ValueError(
            f"generator.weight_update={config.weight_update} needs generator.backend="
            f"{' or '.join(serving)} ({face.why}); use {' or '.join(face.weight_updates)}"
        )
    if face.checks_more:
        engine_class(config.backend).validate_config(config)
