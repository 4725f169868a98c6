"""Monarch actors: thin adapters over the engine and the weight publisher."""

from forge_ext.actors.trainer import RLTrainer, TrainerHandle, spawn_trainer

__all__ = ["RLTrainer", "TrainerHandle", "spawn_trainer"]
