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
from forge_ext.engine.microbatch import balance_rows, row_lengths
from forge_ext.engine.schema import data_parallel_size


def data_parallel_rows(
    batch: dict[str, torch.Tensor], config: EngineConfig, dp: int
) -> list[list[int]] | None:
    """Rows of ``batch`` per data-parallel rank, balanced by tokens (the lengths the engine's
    token budget computes, :func:`forge_ext.engine.microbatch.row_lengths`) when ``config``
    has ``training.max_tokens_per_microbatch``; None (equal row blocks) otherwise."""
    if config.training.max_tokens_per_microbatch is None or dp == 1:
        return None
    return balance_rows(row_lengths(batch).tolist(), dp)


def split_for_data_parallel(
    batch: dict[str, torch.Tensor], dp: int, input_keys: tuple[str, ...] = ("input_ids",),
    rows: list[list[int]] | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """``(inputs, targets)`` lists indexed by data-parallel rank, as the trainer's endpoints
    take them: each tensor of ``batch`` ``[B, ...]`` is cut into ``dp`` equal row blocks, or
    into the row sets ``rows[r]`` (see :func:`data_parallel_rows`).

    Raises:
        ValueError: ``B`` is not a multiple of ``dp`` (equal blocks only).
    """
    if rows is None:
        count = batch["input_ids"].shape[0]
        if count % dp:
            raise ValueError(f"batch of {count} rows does not split over {dp} data-parallel ranks")
        chunks = {k: v.chunk(dp) for k, v in batch.items()}
    else:
        index = [torch.tensor(r, dtype=torch.int64) for r in rows]
        chunks = {k: [v.index_select(0, i) for i in index] for k, v in batch.items()}
    inputs = [{k: chunks[k][r] for k in batch if k in input_keys} for r in range(dp)]
    targets = [{k: chunks[k][r] for k in batch if k not in input_keys} for r in range(dp)]
    return inputs, targets


async def forward_rows(trainer: TrainerHandle, batch: dict[str, torch.Tensor], output: str,
                       adapter: bool = True) -> torch.Tensor:
    """``trainer.forward(..., output)`` of ``batch``'s ``input_ids`` and ``labels``, split over
    its data-parallel ranks (balanced by tokens under a token budget) and returned in the
    batch's row order: ``[B, S]`` (``output``: ``logprobs`` or ``values``)."""
    dp = data_parallel_size(trainer.config, trainer.num_procs)
    batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    rows = data_parallel_rows(batch, trainer.config, dp)
    inputs, targets = split_for_data_parallel(batch, dp, rows=rows)
    out = await trainer.forward(inputs, targets, output=output, adapter=adapter)
    return in_batch_order(out, rows)


def in_batch_order(out: torch.Tensor, rows: list[list[int]] | None) -> torch.Tensor:
    """``out``, the data-parallel ranks' rows in rank order (``rows[r]``: rank ``r``'s, from
    :func:`data_parallel_rows`; None: equal blocks, already in order), put back in the
    batch's row order."""
    if rows is None:
        return out
    order = torch.tensor([i for r in rows for i in r], dtype=torch.int64)
    return out[torch.argsort(order)]


@dataclass
class ReferenceModel:
    """Controller handle: ``await ref.logprobs(batch)`` -> ``[B, S]`` reference log-probs.

    Either its own engine on its own procs (:func:`spawn_reference`), or, for a LoRA policy,
    the policy trainer itself with its adapters disabled (:func:`base_of_trainer`): the same
    frozen base weights, no second copy of them (``docs/lora.md``).
    """

    trainer: TrainerHandle
    adapter: bool = True
    """False: the trainer's forward runs with its LoRA adapters disabled."""
    owns_trainer: bool = True
    """Whether :meth:`stop` stops the trainer (not when it is the policy's)."""

    async def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probability of each label under the reference model.

        Args:
            batch: ``input_ids`` and ``labels`` ``[B, S]`` (labels shifted, ``-100`` ignored),
                ``B`` = the reference's ``training.local_batch_size`` x data-parallel size.

        Returns:
            ``[B, S]`` float32, 0 where the label is ignored.
        """
        return await forward_rows(self.trainer, batch, "logprobs", adapter=self.adapter)

    async def stop(self) -> None:
        if self.owns_trainer:
            await self.trainer.stop()


def base_of_trainer(trainer: TrainerHandle) -> ReferenceModel:
    """The reference of a LoRA policy: ``trainer``'s frozen base (its forward with the
    adapters disabled), which equals a reference engine loaded from the same
    ``model.hf_path`` without a second copy of the weights or procs. Its forwards run on the
    trainer's procs, between the trainer's own calls.

    Raises:
        ValueError: the trainer has no LoRA adapters (its weights move: not a reference).
    """
    if trainer.config.lora is None:
        raise ValueError("the trainer's own weights train: it can be the reference only "
                         "with trainer.lora (its frozen base); set the reference: section")
    return ReferenceModel(trainer, adapter=False, owns_trainer=False)


async def spawn_reference(
    reference: dict[str, Any], num_procs: int | None = None, name: str = "reference",
    spawn_procs: Callable[[], Any] | None = None, master_addr: str | None = None,
) -> ReferenceModel:
    """Spawn the reference model from a YAML ``reference:`` engine mapping (same schema as
    ``trainer:``; ``spawn_procs`` and ``master_addr`` as in :func:`spawn_trainer`). Raises
    ValueError on a config error, before spawning."""
    return ReferenceModel(
        await spawn_trainer(reference, num_procs=num_procs, name=name, spawn_procs=spawn_procs,
                            master_addr=master_addr)
    )
