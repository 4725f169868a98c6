"""``ReferenceModel``: the frozen reference policy of GRPO's KL term.

It is the engine of :class:`forge_ext.actors.trainer.RLTrainer` on its own proc mesh, used
forward-only (``RLTrainer.forward(..., output="logprobs")``): the same model code, parallelism
and HF loading path as the trainer, and never an optimizer step, so it keeps the weights it
loaded from ``model.hf_path``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from forge_ext.actors.trainer import TrainerHandle, spawn_trainer
from forge_ext.engine import EngineConfig


def data_parallel_size(config: EngineConfig, world_size: int) -> int:
    """Data-parallel ranks of an engine world: processes / (TP * PP * CP)."""
    par = config.parallelism
    model_parallel = (
        par.tensor_parallel_degree * par.pipeline_parallel_degree * par.context_parallel_degree
    )
    return world_size // model_parallel


def split_for_data_parallel(
    batch: dict[str, torch.Tensor], dp: int, input_keys: tuple[str, ...] = ("input_ids",)
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """``(inputs, targets)`` lists indexed by data-parallel rank, as the trainer's endpoints
    take them: each tensor of ``batch`` ``[B, ...]`` is cut into ``dp`` equal row blocks.

    Raises:
        ValueError: ``B`` is not a multiple of ``dp``.
    """
    rows = batch["input_ids"].shape[0]
    if rows % dp:
        raise ValueError(f"batch of {rows} rows does not split over {dp} data-parallel ranks")
    chunks = {k: v.chunk(dp) for k, v in batch.items()}
    inputs = [{k: chunks[k][r] for k in batch if k in input_keys} for r in range(dp)]
    targets = [{k: chunks[k][r] for k in batch if k not in input_keys} for r in range(dp)]
    return inputs, targets


@dataclass
class ReferenceModel:
    """Controller handle: ``await ref.logprobs(batch)`` -> ``[B, S]`` reference log-probs."""

    trainer: TrainerHandle

    async def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probability of each label under the reference model.

        Args:
            batch: ``input_ids`` and ``labels`` ``[B, S]`` (labels shifted, ``-100`` ignored),
                ``B`` = the reference's ``training.local_batch_size`` x data-parallel size.

        Returns:
            ``[B, S]`` float32, 0 where the label is ignored.
        """
        dp = data_parallel_size(self.trainer.config, self.trainer.num_procs)
        inputs, targets = split_for_data_parallel(
            {"input_ids": batch["input_ids"], "labels": batch["labels"]}, dp
        )
        return await self.trainer.forward(inputs, targets, output="logprobs")

    async def stop(self) -> None:
        await self.trainer.stop()


async def spawn_reference(
    reference: dict[str, Any], num_procs: int | None = None, name: str = "reference",
    spawn_procs: Callable[[], Any] | None = None,
) -> ReferenceModel:
    """Spawn the reference model from a YAML ``reference:`` engine mapping (same schema as
    ``trainer:``; ``spawn_procs`` as in :func:`spawn_trainer`). Raises ValueError on a config
    error, before spawning."""
    return ReferenceModel(
        await spawn_trainer(reference, num_procs=num_procs, name=name, spawn_procs=spawn_procs)
    )
