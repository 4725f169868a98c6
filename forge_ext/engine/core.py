"""The pieces of the microbatch core that are not the engine itself: the batch format, the
loss function's contract, what a step returns, how a batch is checked and split, and the one
object that computes a microbatch's share of the step's loss.

:meth:`forge_ext.engine.base.BaseEngine.forward_backward_batch` is the only loop over
microbatches; it uses these for the plain loop and for the pipeline schedule alike.

Batch format: a ``dict[str, torch.Tensor]`` whose tensors share the leading batch dimension
``B`` (per data-parallel rank). ``input_ids`` is ``[B, S]`` int64 (right-padded); ``labels``,
when present, is ``[B, S]`` int64 already shifted (``labels[:, t]`` is the target of the
logits at position ``t``) with ``-100`` marking tokens that carry no loss. Any other per-sample
tensor (``advantages [B]``, ``generator_logprobs [B, S]``, ...) rides along and is split the
same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from forge_ext.engine import microbatch as token_budget
from forge_ext.engine.losses import IGNORE_INDEX

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
    """What :meth:`~forge_ext.engine.base.BaseEngine.forward_backward_batch` returns for one
    step.

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


@dataclass
class InferOutputs:
    """What :meth:`~forge_ext.engine.base.BaseEngine.infer_batch` returns.

    Attributes:
        outputs: the per-microbatch outputs (``post_hook(logits, mb)``, default the logits
            ``[b, S, V]``) aggregated as ``BaseEngine.forward_batch`` documents; None when
            not asked for (``return_outputs=False``) and on PP stages other than the last.
        loss: with a loss function, the weighted mean loss over all microbatches of all
            data-parallel ranks (as :attr:`ForwardBackwardOutputs.loss`); None otherwise.
        global_weight: the loss weights' sum over all data-parallel ranks (0 without loss).
        metrics: the loss function's metrics, weighted like the loss (as
            :attr:`ForwardBackwardOutputs.metrics`).
    """

    outputs: Any = None
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


def validate_batch(batch: Batch, training: Any) -> None:
    """Check a batch's fields and shapes against an engine's ``training`` section (see
    ``BaseEngine.microbatches``).

    Raises:
        ValueError: missing/mistyped ``input_ids``, a tensor whose leading dimension or
            sequence length disagrees with ``input_ids``, a batch size other than
            ``training.local_batch_size`` (fixed rows only), ``seq_len > training.seq_len``,
            or a key the engine's packing sets.
    """
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError("batch must be a dict with 'input_ids' [batch, seq] (int64)")
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(
            f"batch['input_ids'] must be [batch, seq] int64, got {tuple(ids.shape)} {ids.dtype}"
        )
    bsz, seq = ids.shape
    # A token budget takes any number of rows (the controller balances ranks by tokens).
    fixed_rows = training.max_tokens_per_microbatch is None
    if fixed_rows and bsz != training.local_batch_size:
        raise ValueError(
            f"batch['input_ids'] has batch size {bsz}, expected "
            f"training.local_batch_size={training.local_batch_size}"
        )
    if seq > training.seq_len:
        raise ValueError(
            f"batch['input_ids'] has sequence length {seq} > training.seq_len="
            f"{training.seq_len}"
        )
    for key, value in batch.items():
        if key in token_budget.RESERVED_KEYS:
            raise ValueError(f"batch[{key!r}] is set by the engine's packing; rename it")
        if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != bsz:
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"batch[{key!r}] must be a tensor with leading dim {bsz}, got {shape}")
        if value.dim() >= 2 and key != "input_ids" and value.shape[1] != seq:
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}; dim 1 must equal the "
                f"sequence length {seq} of input_ids"
            )


def pad_to(mb: Batch, seq_len: int) -> Batch:
    """Right-pad every ``[b, S, ...]`` tensor of ``mb`` to ``seq_len`` along dim 1: labels
    with ``IGNORE_INDEX`` (no loss), everything else with zeros. Causal attention keeps the
    padded tail from changing any earlier position."""
    pad = seq_len - mb["input_ids"].shape[1]
    if pad <= 0:
        return mb
    out = {}
    for key, value in mb.items():
        if value.dim() >= 2:
            fill = IGNORE_INDEX if key == "labels" else 0
            shape = (value.shape[0], pad, *value.shape[2:])
            value = torch.cat([value, value.new_full(shape, fill)], dim=1)
        out[key] = value
    return out


class LossTerm:
    """Computes one microbatch's contribution ``w_i * loss_i / W`` and records outputs.

    Shared by the plain loop and the PP schedule's loss callback, so both normalise the same
    way. Records are keyed by microbatch index: the schedule may call the loss once more for
    its shape inference, and the real call then overwrites that record. Without a loss
    function (``forward_batch``) the term is a zero that keeps the schedule's loss path
    well defined.
    """

    def __init__(self, loss_fn, weights, global_weight, post_hook, *, keep_outputs):
        self.loss_fn, self.weights, self.global_weight = loss_fn, weights, global_weight
        self.post_hook, self.keep_outputs = post_hook, keep_outputs
        self.scaled: dict[int, torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.metrics: dict[int, dict[str, torch.Tensor]] = {}
        self.outputs: dict[int, Any] = {}

    def __call__(self, logits: torch.Tensor, mb: Batch, index: int) -> torch.Tensor:
        if self.keep_outputs:
            hooked = self.post_hook(logits, mb) if self.post_hook else logits
            self.outputs[index] = hooked.detach() if torch.is_tensor(hooked) else hooked
        if self.loss_fn is None:
            return logits.sum() * 0.0
        loss = self.loss_fn(logits, mb)
        if isinstance(loss, tuple):  # (loss, metrics): see LossFn
            loss, metrics = loss
            known = next(iter(self.metrics.values()), metrics)
            if set(metrics) != set(known):
                raise ValueError(
                    f"loss_fn returned metrics {sorted(metrics)} for microbatch {index} but "
                    f"{sorted(known)} before; it must return the same names on every call"
                )
            self.metrics[index] = {name: m.detach() for name, m in metrics.items()}
        self.losses[index] = loss.detach()
        # Zero-weight microbatches still run backward (keeps DP collectives in step).
        scaled = loss * self.weights[index] / self.global_weight.clamp(min=1e-12)
        self.scaled[index] = scaled.detach()
        return scaled

    def weighted_sums(self) -> tuple[list[str], torch.Tensor]:
        """Metric names and a vector ``[sum_i scaled_i, sum_i w_i * m_i for each name]`` of
        this rank's microbatches (zero-weight microbatches add nothing, even NaN)."""
        device = self.global_weight.device
        names = sorted({name for metrics in self.metrics.values() for name in metrics})
        sums = [sum(self.scaled.values(), torch.zeros((), device=device))]
        for name in names:
            total = torch.zeros((), device=device)
            for index, metrics in self.metrics.items():
                w = self.weights[index]
                total = total + torch.where(w > 0, w * metrics[name].float(), 0.0)
            sums.append(total)
        return names, torch.stack(sums)

    def fill(self, out: ForwardBackwardOutputs) -> None:
        out.mb_outputs = [self.outputs[i] for i in sorted(self.outputs)]
        out.losses = [self.losses[i] for i in sorted(self.losses)]


class PipelineLoss:
    """The loss callable handed to torchtitan's ``pipelining_fn`` at build time; the engine
    points it at the current step's :class:`LossTerm` before each ``schedule.step``."""

    def __init__(self):
        self.term: LossTerm | None = None
        self.units: list[Batch] = []

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, **_: Any):
        if self.term is None or logits.device.type == "meta":
            # Shape inference by the schedule: any scalar depending on the output will do.
            return logits.sum() * 0.0, {}
        index = int(target.reshape(-1)[0])
        return self.term(logits, self.units[index], index), {}
