"""The engine interface: one microbatch core and the high-level calls written on top of it.

Modelled on verl's ``BaseEngine`` (``verl/workers/engine/base.py``): a backend implements
:meth:`BaseEngine.forward_backward_batch` (the only loop over microbatches, the only place
that weights losses and runs backward), the optimizer verbs, device moves (:meth:`BaseEngine.to`)
and weight export (:meth:`BaseEngine.get_per_tensor_param`); the mode contexts
(:meth:`BaseEngine.train_mode`, :meth:`BaseEngine.eval_mode`, verl's ``BaseEngineCtx``) and
``train_batch``, ``infer_batch``, ``eval_batch`` and ``forward_batch`` are written once here.
Backends register under a model type and a backend name (:class:`EngineRegistry`, verl's
registry), which ``trainer.engine`` names.

Batch format: a ``dict[str, torch.Tensor]`` whose tensors share the leading batch dimension
``B`` (per data-parallel rank). ``input_ids`` is ``[B, S]`` int64 (right-padded); ``labels``,
when present, is ``[B, S]`` int64 already shifted (``labels[:, t]`` is the target of the
logits at position ``t``) with ``-100`` marking tokens that carry no loss. Any other per-sample
tensor (``advantages [B]``, ``generator_logprobs [B, S]``, ...) rides along and is split the
same way.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
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


@dataclass
class InferOutputs:
    """What :meth:`BaseEngine.infer_batch` returns.

    Attributes:
        outputs: the per-microbatch outputs (``post_hook(logits, mb)``, default the logits
            ``[b, S, V]``) aggregated as :meth:`BaseEngine.forward_batch` documents; None when
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


MODEL_TYPE = "language_model"
"""The model type of a causal LM policy or reference (verl's ``language_model``); a critic
would register as ``value_model``."""


class EngineRegistry:
    """Engine backends by model type and backend name (verl's ``EngineRegistry``,
    ``verl/workers/engine/base.py``): ``trainer.engine`` names the backend, the actors build
    it with :meth:`new`, so a second backend plugs in without touching them::

        @EngineRegistry.register("language_model", "titan")
        class TitanEngine(BaseEngine): ...

        engine = EngineRegistry.new("language_model", "titan", config)
    """

    _engines: dict[str, dict[str, type]] = {}

    @classmethod
    def register(cls, model_type: str, backend: str | list[str]) -> Callable[[type], type]:
        """A class decorator registering a :class:`BaseEngine` subclass as ``backend`` (one
        name or several) for ``model_type``.

        Raises:
            TypeError: the class is not a :class:`BaseEngine`.
            ValueError: another class is registered under the same names already.
        """

        def decorator(engine_class: type) -> type:
            if not (isinstance(engine_class, type) and issubclass(engine_class, BaseEngine)):
                raise TypeError(f"{engine_class!r} is not a BaseEngine subclass")
            backends = cls._engines.setdefault(model_type, {})
            for name in [backend] if isinstance(backend, str) else backend:
                known = backends.get(name)
                if known is not None and known.__qualname__ != engine_class.__qualname__:
                    raise ValueError(f"engine backend {name!r} for {model_type!r} is "
                                     f"{known.__qualname__} already")
                backends[name] = engine_class
            return engine_class

        return decorator

    @classmethod
    def backends(cls, model_type: str = MODEL_TYPE) -> list[str]:
        """The backend names registered for ``model_type``, sorted."""
        return sorted(cls._engines.get(model_type, {}))

    @classmethod
    def get_engine_cls(cls, model_type: str, backend: str) -> type:
        """The class registered as ``backend`` for ``model_type``.

        Raises:
            ValueError: naming ``trainer.engine`` and the registered backends.
        """
        known = cls._engines.get(model_type, {})
        if backend not in known:
            raise ValueError(f"engine={backend!r} is not an engine backend for {model_type} "
                             f"(registered: {', '.join(sorted(known)) or 'none'}); set engine "
                             "to one of them")
        return known[backend]

    @classmethod
    def new(cls, model_type: str, backend: str, *args: Any, **kwargs: Any) -> "BaseEngine":
        """Build the engine registered as ``backend`` for ``model_type`` with ``*args``,
        ``**kwargs`` (for the built-in backends: the engine config).

        Raises:
            ValueError: an unknown backend (:meth:`get_engine_cls`).
        """
        return cls.get_engine_cls(model_type, backend)(*args, **kwargs)


class BaseEngine(ABC):
    """Engine interface. Backends implement the abstract methods; the rest is shared.

    The interface is verl's ``BaseEngine`` (``verl/workers/engine/base.py``) with this
    project's batch format and microbatch core: mode contexts with offload, ``train_batch`` /
    ``infer_batch``, ``get_per_tensor_param``, data-parallel accessors, ``to``, and
    ``disable_adapter``.
    """

    mode: str | None = None
    """``"train"`` or ``"eval"`` inside :meth:`train_mode` / :meth:`eval_mode` (the innermost),
    None outside both."""
    _resident_depth: int = 0

    # ---- implemented by backends -------------------------------------------------------
    @abstractmethod
    def model_modules(self) -> list[torch.nn.Module]:
        """The model's modules on this rank (one, or one per pipeline stage held here)."""

    @property
    @abstractmethod
    def is_param_offload_enabled(self) -> bool:
        """Whether parameters (and gradients) rest in host memory between uses
        (``trainer.offload.params``)."""

    @property
    @abstractmethod
    def is_optimizer_offload_enabled(self) -> bool:
        """Whether the optimizer state rests in host memory between optimizer steps
        (``trainer.offload.optimizer``)."""

    @abstractmethod
    def to(self, device: str | torch.device, model: bool = True, optimizer: bool = True,
           grad: bool = True) -> None:
        """Move the model's parameters (``model``), their gradients (``grad``) and the
        optimizer state (``optimizer``) to ``device`` (``"cpu"`` or the engine's
        accelerator), exactly (copies, no casts). verl's ``BaseEngine.to``.

        Raises:
            ValueError: a device other than the CPU and the engine's own, or ``grad``
                without ``model``.
        """

    @abstractmethod
    def get_per_tensor_param(self) -> tuple[Iterator[tuple[str, torch.Tensor]], dict | None]:
        """``(tensors, adapter_config)``: a generator of ``(HF name, full tensor)`` pairs of
        what a generator needs for this policy, one tensor at a time, and the PEFT
        ``adapter_config.json`` mapping under LoRA (None otherwise). verl's
        ``get_per_tensor_param``."""

    @abstractmethod
    def get_data_parallel_size(self) -> int:
        """Data-parallel ranks (replicate x shard degrees)."""

    @abstractmethod
    def get_data_parallel_rank(self) -> int:
        """This process's rank among the data-parallel ranks (0-based)."""

    @abstractmethod
    def get_data_parallel_group(self) -> Any:
        """The ``torch.distributed`` process group of the data-parallel ranks (None with one
        data-parallel rank)."""

    @abstractmethod
    def disable_adapter(self) -> contextlib.AbstractContextManager:
        """A context within which the model computes its base model (LoRA adapters off);
        a no-op without LoRA."""

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

    # ---- modes and residency (verl's BaseEngineCtx) ---------------------------------------
    # Backends set ``self.device``: the accelerator (or CPU) the engine computes on.
    def train_mode(self) -> contextlib.AbstractContextManager:
        """A context that puts every model module in training mode (``module.train()``)
        and, with offload on, first moves parameters, gradients and optimizer state to the
        engine's device. On exit the modules' previous modes are restored and, when this is
        the outermost context, what offload covers goes back to host memory. Nests with
        :meth:`eval_mode`. verl's ``train_mode`` (``BaseEngineCtx``)."""
        return self._mode_context("train")

    def eval_mode(self) -> contextlib.AbstractContextManager:
        """A context that puts every model module in evaluation mode (``module.eval()``) and,
        with parameter offload on, first moves the parameters to the engine's device (not
        the optimizer state). Exit as :meth:`train_mode`. verl's ``eval_mode``."""
        return self._mode_context("eval")

    @contextlib.contextmanager
    def _mode_context(self, mode: str):
        modules = self.model_modules()
        before, previous = [m.training for m in modules], self.mode
        with self.resident(optimizer=mode == "train"):
            for m in modules:
                m.train(mode == "train")
            self.mode = mode
            try:
                yield self
            finally:
                self.mode = previous
                for m, training in zip(modules, before):
                    m.train(training)

    @contextlib.contextmanager
    def resident(self, optimizer: bool = True):
        """A context within which the parameters (and, with ``optimizer``, the optimizer
        state) are on the engine's device; with offload on they are moved there first and,
        on leaving the outermost such context, back to host memory. Without offload, no
        move at all. The mode contexts and the engine's state verbs (checkpoints, weight
        export) use it."""
        offload = self.is_param_offload_enabled or self.is_optimizer_offload_enabled
        if offload:
            self.to(self.device, model=True, optimizer=optimizer, grad=True)
        self._resident_depth += 1
        try:
            yield
        finally:
            self._resident_depth -= 1
            if offload and self._resident_depth == 0:
                self.offload()

    def offload(self) -> None:
        """Move what offload covers (``trainer.offload``) to host memory now; a no-op
        without offload."""
        params = self.is_param_offload_enabled
        if params or self.is_optimizer_offload_enabled:
            self.to("cpu", model=params, optimizer=self.is_optimizer_offload_enabled,
                    grad=params)

    # ---- data parallelism (verl's accessors) ----------------------------------------------
    @property
    def dp_size(self) -> int:
        """Alias of :meth:`get_data_parallel_size`."""
        return self.get_data_parallel_size()

    @property
    def dp_rank(self) -> int:
        """Alias of :meth:`get_data_parallel_rank`."""
        return self.get_data_parallel_rank()

    # ---- written once on top of forward_backward_batch ---------------------------------
    def train_batch(self, batch: Batch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict:
        """One optimizer step on ``batch`` in :meth:`train_mode`: zero grad, forward/backward
        over microbatches, clip, optimizer step, LR step.

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
        with self.train_mode():
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
    def infer_batch(
        self,
        batch: Batch,
        loss_fn: LossFn | None = None,
        loss_weight_fn: LossWeightFn | None = None,
        *,
        post_hook: Callable[[torch.Tensor, Batch], Any] | None = None,
        return_outputs: bool = True,
        output_seqlens: list[int] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> InferOutputs:
        """Forward only over ``batch`` in microbatches, in :meth:`eval_mode`, without
        gradients; with ``loss_fn`` also the loss (verl's ``infer_batch``). ``eval_batch``
        and ``forward_batch`` are this with one half switched off.

        Args:
            batch: needs ``input_ids [B, S]``; ``labels [B, S]`` and whatever the loss reads
                when ``loss_fn`` is given.
            loss_fn, loss_weight_fn: as for :meth:`forward_backward_batch` (both or neither).
            post_hook: ``post_hook(logits [b, S, V], mb)`` applied per microbatch (e.g.
                token log-probs) before aggregation; default keeps the logits.
            return_outputs: keep the outputs (False: only the loss, no logits kept).
            output_seqlens, aggregate_fn: see :meth:`forward_batch`.

        Returns:
            :class:`InferOutputs`: never scaled by the number of microbatches, so any split
            gives the same loss and outputs.

        Raises:
            ValueError: a bad batch (:meth:`microbatches`), or ``loss_fn`` without
                ``loss_weight_fn``.
        """
        with self.eval_mode():
            microbatches = self.microbatches(batch)
            out = self.forward_backward_batch(
                microbatches, loss_fn, loss_weight_fn, output_post_hook=post_hook,
                return_outputs=return_outputs, forward_only=True,
            )
        result = InferOutputs(loss=out.loss, global_weight=out.global_weight,
                              metrics=out.metrics)
        if return_outputs and out.mb_outputs:
            ids = batch["input_ids"]
            outputs = aggregate_fn(restore_rows(out.mb_outputs, microbatches, *ids.shape[:2]))
            if output_seqlens is not None:
                outputs = [row[row.shape[0] - n :] for row, n in zip(outputs, output_seqlens)]
            result.outputs = outputs
        return result

    def eval_batch(self, batch: Batch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> float:
        """The weighted mean loss of ``batch`` over all data-parallel ranks, without grads
        (:meth:`infer_batch` without outputs). Never scaled by the number of microbatches:
        any split gives the same value."""
        return self.infer_batch(batch, loss_fn, loss_weight_fn, return_outputs=False).loss

    def forward_batch(
        self,
        batch: Batch,
        output_seqlens: list[int] | None = None,
        post_hook: Callable[[torch.Tensor, Batch], Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> Any:
        """Forward-only pass over ``batch`` in microbatches (:meth:`infer_batch` without a
        loss).

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
        return self.infer_batch(batch, post_hook=post_hook, output_seqlens=output_seqlens,
                                aggregate_fn=aggregate_fn).outputs

    forward = forward_batch

    def step_lr_scheduler(self) -> float:
        """Alias of :meth:`lr_scheduler_step`."""
        return self.lr_scheduler_step()

