"""The engine interface: one microbatch core and the high-level calls written on top of it.

Modelled on verl's ``BaseEngine`` (``verl/workers/engine/base.py``): a backend implements
:meth:`BaseEngine.forward_backward_batch` (the only loop over microbatches, the only place
that weights losses and runs backward) and the optimizer verbs; ``train_batch``,
``eval_batch`` and ``forward_batch`` are written once here.

Batch format: a ``dict[str, torch.Tensor]`` whose tensors share the leading batch dimension
``B`` (per data-parallel rank). ``input_ids`` is ``[B, S]`` int64 (right-padded); ``labels``,
when present, is ``[B, S]`` int64 already shifted (``labels[:, t]`` is the target of the
logits at position ``t``) with ``-100`` marking tokens that carry no loss. Any other per-sample
tensor (``advantages [B]``, ``generator_logprobs [B, S]``, ...) rides along and is split the
same way.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from forge_ext.engine.microbatch import count_tokens, restore_rows

Batch = dict[str, torch.Tensor]
LossMetrics = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Batch], "torch.Tensor | tuple[torch.Tensor, LossMetrics]"]
"""``loss_fn(logits [b, S, V], microbatch) -> scalar``: the microbatch's *mean* loss; or
``-> (scalar, metrics)`` with ``metrics`` a dict of 0-dim tensors, each a mean over the same
unit as the loss (e.g. valid tokens), which the engine combines like the loss (see
:attr:`ForwardBackwardOutputs.metrics`). The metric names must be the same on every call and
every rank (the engine reduces them in one collective)."""
LossWeightFn = Callable[[Batch], torch.Tensor | int | float]
"""``loss_weight_fn(microbatch) -> scalar``: the microbatch's weight, e.g. its valid tokens."""


@dataclass
class ForwardBackwardOutputs:
    """What :meth:`BaseEngine.forward_backward_batch` returns for one step.

    Attributes:
        mb_outputs: per microbatch, ``output_post_hook(logits, mb)`` (or the logits) when
            ``return_outputs=True``; empty otherwise. Under PP only the last stage has them.
        losses: per microbatch, the detached ``loss_fn`` value (a mean over the microbatch).
        loss: the step loss ``sum_i w_i * loss_i / sum_i w_i`` over all microbatches of all
            data-parallel ranks, as a float, identical on every rank; None without a loss
            function and on PP ranks without the last stage (they hold no loss). A weighted
            mean, never a sum logged as a mean.
        global_weight: ``sum_i w_i`` over all microbatches and data-parallel ranks.
        metrics: the loss function's metrics (when it returns ``(loss, metrics)``), each
            weighted like the loss: ``sum_i w_i * m_i / sum_i w_i`` over all microbatches of
            all data-parallel ranks (NaN if the weights sum to 0); empty otherwise and on PP
            ranks without the last stage. Microbatches of weight 0 contribute nothing.
    """

    mb_outputs: list[Any] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    loss: float | None = None
    global_weight: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


def split_batch(batch: Batch, num_microbatches: int) -> list[Batch]:
    """Split every tensor of ``batch`` along dim 0 into ``num_microbatches`` equal parts.

    Raises:
        ValueError: if the batch size is not a multiple of ``num_microbatches``, naming both.
    """
    batch_size = next(iter(batch.values())).shape[0]
    if batch_size % num_microbatches:
        raise ValueError(
            f"batch size {batch_size} is not divisible into {num_microbatches} microbatches "
            "(training.local_batch_size / training.microbatch_size)"
        )
    chunks = {k: v.chunk(num_microbatches, dim=0) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(num_microbatches)]


class BaseEngine(ABC):
    """Engine interface. Backends implement the abstract methods; the rest is shared."""

    # ---- implemented by backends -------------------------------------------------------
    @abstractmethod
    def forward_backward_batch(
        self,
        data_iterator: Iterable[Batch],
        loss_fn: LossFn | None,
        loss_weight_fn: LossWeightFn | None,
        output_post_hook: Callable[[torch.Tensor, Batch], Any] | None = None,
        return_outputs: bool = False,
        forward_only: bool = False,
    ) -> ForwardBackwardOutputs:
        """Run forward (and, unless ``forward_only``, backward) over all microbatches.

        The loss backpropagated is ``sum_i w_i * loss_i / W`` with ``W`` the sum of weights
        over all microbatches of the step and all data-parallel ranks, taken before any
        backward; gradients accumulate across microbatches (never zeroed here) and equal the
        full-batch gradient whatever the split. Every data-parallel rank runs as many
        microbatches (:meth:`microbatches` splits so).

        Raises:
            RuntimeError: the data-parallel ranks were given different microbatch counts
                (checked before any other collective, so no rank is left waiting in one).
        """

    @abstractmethod
    def microbatches(self, batch: Batch) -> list[Batch]:
        """Validate ``batch`` and split it into this engine's microbatches."""

    @abstractmethod
    def optimizer_zero_grad(self) -> None:
        """Zero the gradients of all model parts (never called per microbatch)."""

    @abstractmethod
    def optimizer_step(self) -> float:
        """Clip gradients to ``training.max_norm``, step, then zero the gradients the step
        consumed (the next ``forward_backward_batch`` accumulates from zero); return the
        pre-clip grad norm."""

    @abstractmethod
    def lr_scheduler_step(self) -> float:
        """Step the LR scheduler; return the learning rate of the next optimizer step."""

    @abstractmethod
    def current_lr(self) -> float:
        """The learning rate the next optimizer step will use."""

    @abstractmethod
    def save_checkpoint(self, step: int) -> None:
        """Save the full training state (model, optimizer, LR scheduler, step) for ``step``."""

    @abstractmethod
    def load_checkpoint(self, step: int | None = None) -> int:
        """Load ``step`` (latest when None); return the step loaded."""

    # ---- written once on top of forward_backward_batch ---------------------------------
    def train_batch(self, batch: Batch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict:
        """One optimizer step on ``batch``: zero grad, forward/backward over microbatches,
        clip, optimizer step, LR step.

        Returns:
            ``loss`` (weighted mean over the global batch), ``grad_norm`` (pre-clip),
            ``lr`` (used by this step), ``num_tokens`` (global weight, e.g. valid tokens),
            ``tokens_per_second`` (this rank's ``input_ids.numel()`` / step seconds),
            ``num_microbatches`` and ``computed_tokens`` (this rank's microbatches and the
            positions they hold, padding included: what the split costs), and the
            loss function's metrics, if any, as ``loss/<name>`` (see
            :attr:`ForwardBackwardOutputs.metrics`; measured before this step's update).
        """
        start = time.perf_counter()
        microbatches = self.microbatches(batch)
        lr = self.current_lr()
        self.optimizer_zero_grad()
        out = self.forward_backward_batch(microbatches, loss_fn, loss_weight_fn)
        grad_norm = self.optimizer_step()
        self.lr_scheduler_step()
        seconds = time.perf_counter() - start
        return {
            "loss": out.loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "num_tokens": out.global_weight,
            "tokens_per_second": batch["input_ids"].numel() / seconds,
            "num_microbatches": len(microbatches),
            "computed_tokens": count_tokens(microbatches),
            **{f"loss/{name}": value for name, value in out.metrics.items()},
        }

    @torch.no_grad()
    def eval_batch(self, batch: Batch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> float:
        """The weighted mean loss of ``batch`` over all data-parallel ranks, without grads.

        Never scaled by the number of microbatches: any split gives the same value.
        """
        out = self.forward_backward_batch(
            self.microbatches(batch), loss_fn, loss_weight_fn, forward_only=True
        )
        return out.loss

    @torch.no_grad()
    def forward_batch(
        self,
        batch: Batch,
        output_seqlens: list[int] | None = None,
        post_hook: Callable[[torch.Tensor, Batch], Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> Any:
        """Forward-only pass over ``batch`` in microbatches.

        Args:
            batch: needs ``input_ids [B, S]``.
            output_seqlens: if given, per sample the number of trailing positions to keep
                (e.g. response lengths); the result is then a list of ``[len_i, ...]`` tensors.
            post_hook: ``post_hook(logits [b, S, V], mb)`` applied per microbatch (e.g.
                token log-probs) before aggregation; default keeps the logits.
            aggregate_fn: combines the per-microbatch outputs (default ``torch.cat`` on dim 0).

        Returns:
            ``aggregate_fn`` of the per-microbatch outputs (``[B, S, V]`` logits by default);
            None on PP stages other than the last. With token-budget microbatches
            (``training.max_tokens_per_microbatch``) the outputs are first put back in row
            order as one ``[B, S, ...]`` tensor, zero past each row's last valid label
            (:func:`forge_ext.engine.microbatch.restore_rows`).
        """
        microbatches = self.microbatches(batch)
        out = self.forward_backward_batch(
            microbatches, None, None, output_post_hook=post_hook,
            return_outputs=True, forward_only=True,
        )
        if not out.mb_outputs:
            return None
        ids = batch["input_ids"]
        result = aggregate_fn(restore_rows(out.mb_outputs, microbatches, *ids.shape[:2]))
        if output_seqlens is not None:
            result = [row[row.shape[0] - n :] for row, n in zip(result, output_seqlens)]
        return result

    forward = forward_batch

    def step_lr_scheduler(self) -> float:
        """Alias of :meth:`lr_scheduler_step`."""
        return self.lr_scheduler_step()

