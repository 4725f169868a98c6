"""Monarch actors: thin adapters over the engine and the weight publisher.

Imports are lazy: a proc that runs only the Generator imports ``forge_ext.rollout.generator``,
and this package must not pull the trainer (and torchtitan, ~13 s per process) in with it.
"""

import importlib

_EXPORTS = {
    "RLTrainer": "forge_ext.actors.trainer",
    "TrainerHandle": "forge_ext.actors.trainer",
    "spawn_trainer": "forge_ext.actors.trainer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
