"""The engine: one microbatch core and every verb written on top of it, once for all backends.

Modelled on verl's ``BaseEngine`` (``verl/workers/engine/base.py``): the interface is one
class with docstrings, and the high-level calls (``train_batch``, ``infer_batch``,
``eval_batch``, ``forward_batch``) and the mode contexts (``train_mode``, ``eval_mode``,
verl's ``BaseEngineCtx``) are written on top of :meth:`BaseEngine.forward_backward_batch`,
the only loop over microbatches, the only place that weights losses and runs backward
(its parts: :mod:`forge_ext.engine.core`). Here that core, the optimizer verbs, checkpoints
and device moves are written once too; a backend (:mod:`forge_ext.engine.titan`:
torchtitan's models and every parallelism; :mod:`forge_ext.engine.hf`: any transformers
``AutoModelForCausalLM``) builds its model and fills the hooks that differ:

- :meth:`BaseEngine.validate_config`: its own config checks, before anything is spawned
  (:meth:`forge_ext.engine.registry.EngineRegistry.validate` calls it);
- :meth:`BaseEngine._model_forward`: one microbatch's logits;
- the weights' names (:class:`forge_ext.engine.model_weights.ModelWeights`: ``_to_hf``,
  ``_hf_module_name``, ``load_hf_state_dict``);
- under pipeline parallelism (titan): ``pp_schedule``, ``pp_has_first_stage``,
  ``pp_has_last_stage``, ``pp_mesh`` and ``_pp_loss``, which the core drives one
  ``schedule.step`` per microbatch.

A backend's ``__init__`` sets ``config``, ``device``, ``model_parts``, ``dp_mesh`` (None with
one data-parallel rank), ``num_microbatches`` (and under PP ``num_pp_microbatches``),
``train_context`` and ``sd_adapter`` (each has a default below), then calls
:meth:`BaseEngine._build_training_state` (optimizer, LR scheduler, checkpointer, step).
The batch format: :mod:`forge_ext.engine.core`.
"""

from __future__ import annotations

import contextlib
import math
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import CommConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils as titan_utils

from forge_ext.engine import microbatch as token_budget
from forge_ext.engine import offload
from forge_ext.engine.checkpoint import build_checkpointer
from forge_ext.engine.core import (
    Batch, ForwardBackwardOutputs, InferOutputs, LossFn, LossTerm, LossWeightFn, pad_to,
    split_batch, validate_batch,
)
from forge_ext.engine.distributed import rendezvous_on_master_addr
from forge_ext.engine.model_weights import ModelWeights


class BaseEngine(ModelWeights):
    """A model with optimizer, LR scheduler and checkpointer, driven in microbatches: the
    verbs every backend shares (module docstring); backends build the model and fill the
    hooks."""

    mode: str | None = None
    """``"train"`` or ``"eval"`` inside :meth:`train_mode` / :meth:`eval_mode` (the innermost),
    None outside both."""
    _resident_depth: int = 0
    # What a backend's __init__ may leave at these defaults: one data-parallel rank, no
    # pipeline, no SPMD context, HF names already (no state-dict adapter).
    dp_mesh: Any = None
    pp_schedule: Any = None
    pp_mesh: Any = None
    pp_has_first_stage: bool = True
    pp_has_last_stage: bool = True
    num_pp_microbatches: int = 1
    ep_enabled: bool = False
    train_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    sd_adapter: Any = None

    # ---- what a backend implements --------------------------------------------------------
    @classmethod
    @abstractmethod
    def validate_config(cls, config: Any) -> None:
        """Check everything an :class:`~forge_ext.engine.config.EngineConfig` for this
        backend shows before any process is spawned (its :meth:`validate` included).

        Raises:
            ValueError: naming the offending field and the fix.
            FileNotFoundError: ``model.hf_path`` without a config.json.
        """

    @abstractmethod
    def _model_forward(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """Logits ``[b, L, V]`` of one microbatch; a packed microbatch (``position_ids``)
        runs with positions restarting per sequence and attention confined to each."""

    # ---- construction -------------------------------------------------------------------
    def _init_distributed(self) -> int:
        """Set ``self.device`` (this rank's accelerator, or the CPU) and join the world
        (``torch.distributed`` from the usual environment; the rendezvous listens on
        ``MASTER_ADDR`` only, not on every interface); return the world size."""
        self.device = titan_utils.get_local_device()
        titan_utils.device_module.set_device(self.device)
        with rendezvous_on_master_addr():
            return dist_utils.init_distributed(CommConfig(), base_folder=self.config.dump_folder)

    def _build_training_state(self) -> None:
        """The optimizer and LR scheduler over ``model_parts`` (torchtitan's containers, which
        take any module and only its ``requires_grad`` parameters), the step counter, and
        ``self.checkpointer`` over them
        (:func:`forge_ext.engine.checkpoint.build_checkpointer`)."""
        config = self.config
        self.optimizers = config.optimizer.to_titan().build(model_parts=self.model_parts)
        self.lr_schedulers = config.lr_scheduler.build(
            optimizers=self.optimizers, training_steps=config.training.steps
        )
        self.step = 0
        # (id(param), key) -> device of each optimizer state tensor moved to the host.
        self._optimizer_homes: dict[tuple[int, str], torch.device] = {}
        self.checkpointer = build_checkpointer(
            config, model_parts=self.model_parts, optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, train_state=self, sd_adapter=self.sd_adapter,
        )

    # ---- modules, data parallelism, offload (verl's interface) --------------------------
    def model_modules(self) -> list[torch.nn.Module]:
        """The model parts on this rank: one, or one per pipeline stage held here."""
        return self.model_parts

    def get_data_parallel_size(self) -> int:
        """Data-parallel ranks: ``data_parallel_replicate_degree x data_parallel_shard_degree``
        (torchtitan's ``batch`` mesh; the ``hf`` backend's FSDP mesh), 1 without data
        parallelism."""
        return self.dp_mesh.size() if self.dp_mesh is not None else 1

    def get_data_parallel_rank(self) -> int:
        """This process's coordinate on the ``batch`` mesh (0 without data parallelism): the
        index of the batch part it trains on."""
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's data-parallel ranks (the ``batch`` mesh), over
        which losses and weights are summed; None without data parallelism."""
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None

    @property
    def is_param_offload_enabled(self) -> bool:
        """``trainer.offload.params``: parameters and gradients rest in host memory
        outside :meth:`train_mode` / :meth:`eval_mode` and the state verbs."""
        return self.config.offload.params

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        """``trainer.offload.optimizer``: the optimizer state rests in host memory outside
        :meth:`train_mode` and the checkpoint verbs."""
        return self.config.offload.optimizer

    def to(self, device: str | torch.device, model: bool = True, optimizer: bool = True,
           grad: bool = True) -> None:
        """Move parameters and buffers (``model``), gradients (``grad``) and the optimizer
        state (``optimizer``) of this rank to ``device``: ``"cpu"`` (pinned host memory when
        the engine runs on an accelerator) or the engine's device (``"cuda"`` means this
        rank's). Exact: copies, no casts; a round trip gives back the same bits, each
        optimizer state tensor on the device it came from (Adam's ``step`` stays on the CPU).
        After a move to the CPU the accelerator's cached blocks are released
        (``empty_cache``), so the engine's memory there is free for the generator.

        A gradient lives on its parameter's device (torch refuses anything else), so
        gradients move with the parameters whenever ``model`` is set; ``grad=False`` only
        says the caller does not need them (verl's ``eval_mode`` passes it). A tensor
        already on ``device`` is not copied: on a machine without an accelerator the engine's
        device is the CPU and ``to`` is the identity.

        The compute verbs need what they use on the engine's device: call them inside
        :meth:`train_mode` / :meth:`eval_mode` (``train_batch`` and ``infer_batch`` enter them
        themselves), or after ``to(engine.device)``. verl's ``BaseEngine.to``.

        Raises:
            ValueError: ``device`` is neither the CPU nor the engine's device type, or
                ``grad`` without ``model``.
        """
        target = torch.device(device)
        if target.type != "cpu":
            if target.type != self.device.type:
                raise ValueError(f"to(device={str(device)!r}): the engine runs on "
                                 f"{self.device}; move to 'cpu' or {self.device.type!r}")
            target = self.device
        if grad and not model:
            raise ValueError("to(model=False, grad=True): a gradient lives on its "
                             "parameter's device; move both (model=True) or neither "
                             "(grad=False)")
        if model and not offload.modules_on(self.model_parts, target):
            offload.move_modules(self.model_parts, target)
        if optimizer:
            offload.move_optimizer_state(self.optimizers, target, self._optimizer_homes)
        if self.device.type != "cpu":
            titan_utils.device_module.synchronize()  # the pinned copies have landed
            if target.type == "cpu":
                titan_utils.device_module.empty_cache()

    # ---- modes and residency (verl's BaseEngineCtx) ---------------------------------------
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

    # ---- the microbatch core ------------------------------------------------------------
    def check_batch(self, batch: Batch) -> None:
        """Raise the errors :meth:`microbatches` would, without splitting (no collective)."""
        validate_batch(batch, self.config.training)

    def microbatches(self, batch: Batch) -> list[Batch]:
        """Check ``batch`` against the config and split it into microbatches: fixed row
        counts, or with ``training.max_tokens_per_microbatch`` token-budget microbatches
        (packed with ``training.packing``), as many on every data-parallel rank (a
        collective over the DP group: every rank calls it once per step).

        Raises:
            ValueError: missing/mistyped ``input_ids``, a tensor whose leading dimension or
                sequence length disagrees with ``input_ids``, a batch size other than
                ``training.local_batch_size`` (fixed rows only), or
                ``seq_len > training.seq_len``.
        """
        validate_batch(batch, self.config.training)
        t = self.config.training
        if t.max_tokens_per_microbatch is None:
            return split_batch(batch, self.num_microbatches)
        lengths = token_budget.row_lengths(batch).tolist()
        plan = (token_budget.plan_packing if t.packing else token_budget.plan_token_budget)(
            lengths, t.max_tokens_per_microbatch, t.pad_to_multiple_of
        )
        count = self._dp_all_reduce(torch.tensor(max(len(plan), 1), device=self.device),
                                    dist.ReduceOp.MAX)
        plan = token_budget.equalize(plan, int(count), lengths)
        build = token_budget.packed_microbatch if t.packing else token_budget.padded_microbatch
        return [build(batch, rows, lengths, t.pad_to_multiple_of) for rows in plan]

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
        # With offload on the parameters come to the device for the call (the mode
        # contexts keep them there across calls).
        with self.resident(optimizer=False):
            return self._forward_backward_batch(
                data_iterator, loss_fn, loss_weight_fn, output_post_hook, return_outputs,
                forward_only,
            )

    def _forward_backward_batch(
        self, data_iterator, loss_fn, loss_weight_fn, output_post_hook, return_outputs,
        forward_only,
    ) -> ForwardBackwardOutputs:
        if loss_fn is not None and loss_weight_fn is None:
            raise ValueError("loss_weight_fn is required with loss_fn")
        microbatches = [self._to_device(mb) for mb in data_iterator]
        self._check_dp_microbatch_count(len(microbatches))
        seq_len = microbatches[0]["input_ids"].shape[1] if microbatches else 0
        if self.pp_schedule is not None:
            # Schedules fix activation shapes at their first step: pad to training.seq_len.
            microbatches = [pad_to(mb, self.config.training.seq_len) for mb in microbatches]
        # Under PP each microbatch is one schedule.step over its PP microbatches; the loss
        # weights belong to the PP microbatches, which are the units the loss sees.
        groups = (
            [split_batch(mb, self.num_pp_microbatches) for mb in microbatches]
            if self.pp_schedule is not None else [[mb] for mb in microbatches]
        )
        units = [mb for group in groups for mb in group]
        out = ForwardBackwardOutputs()
        weights: list[torch.Tensor] = []
        global_weight = None
        if loss_fn is not None:
            weights = [
                torch.as_tensor(loss_weight_fn(mb), dtype=torch.float32, device=self.device)
                for mb in units
            ]
            # Known before any backward: the step's loss is normalised once, globally.
            global_weight = self._dp_all_reduce(torch.stack(weights).sum())
            out.global_weight = float(global_weight)
        loss_term = LossTerm(
            loss_fn, weights, global_weight, output_post_hook, keep_outputs=return_outputs
        )
        grad_ctx = torch.no_grad() if forward_only else torch.enable_grad()
        with grad_ctx, self.train_context():
            if self.pp_schedule is None:
                model = self.model_parts[0]
                for i, mb in enumerate(units):
                    scaled = loss_term(self._model_forward(model, mb), mb, i)
                    if loss_fn is not None and not forward_only:
                        # FSDP reduces (and reshards) gradients after every backward unless
                        # told otherwise; reduce once, after the last microbatch.
                        _set_gradient_sync(model, i == len(units) - 1)
                        scaled.backward()
                _set_gradient_sync(model, True)
            else:
                self._pipeline_steps(groups, units, loss_term, forward_only)
        loss_term.fill(out)
        if self.pp_schedule is not None:
            out.mb_outputs = [
                o[:, :seq_len] if torch.is_tensor(o) and o.dim() >= 2 else o
                for o in out.mb_outputs
            ]
        if loss_fn is not None:
            # Only ranks holding the last PP stage computed losses; others report None. One
            # collective (and one host sync) for the loss and the loss function's metrics.
            names, local = loss_term.weighted_sums()
            totals = self._dp_all_reduce(local).tolist()
            out.loss = totals[0] if self.pp_has_last_stage else None
            out.metrics = {
                name: total / out.global_weight if out.global_weight else math.nan
                for name, total in zip(names, totals[1:])
            }
        return out

    def _pipeline_steps(
        self, groups: list[list[Batch]], units: list[Batch], loss_term: LossTerm,
        forward_only: bool,
    ) -> None:
        """Run one ``schedule.step`` (or ``eval``) per group of PP microbatches.

        The schedule calls ``self._pp_loss(logits, target)`` on the last stage per PP
        microbatch; ``target`` carries the microbatch's index into ``units`` (a tensor the
        schedule splits like the inputs), so the loss reads the whole microbatch dict and
        returns the globally normalised term: backward inside ``step`` sees the final scale.
        """
        self._pp_loss.term, self._pp_loss.units = loss_term, units
        offset = 0
        for group in groups:
            n = len(group)
            target = torch.arange(offset, offset + n, device=self.device)
            inputs = (torch.cat([mb["input_ids"] for mb in group]),) if self.pp_has_first_stage else ()
            run = self.pp_schedule.eval if forward_only else self.pp_schedule.step
            kwargs = {"target": target} if self.pp_has_last_stage else {}
            if not forward_only:
                kwargs["return_outputs"] = False
            run(*inputs, **kwargs)
            offset += n
        self._pp_loss.term, self._pp_loss.units = None, []

    def _dp_all_reduce(self, x: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """``x`` reduced with ``op`` (sum, max) over this rank's data-parallel group (a
        collective: every rank of the group must call it); ``x`` itself when there is one DP
        rank. ``x`` must be on ``self.device``."""
        if self.dp_mesh is None or self.dp_mesh.size() == 1:
            return x
        x = x.clone()
        dist.all_reduce(x, op=op, group=self.dp_mesh.get_group())
        return x

    def _check_dp_microbatch_count(self, count: int) -> None:
        """Raise unless every rank of this rank's data-parallel group runs ``count``
        microbatches (a collective: one small all-reduce).

        FSDP all-gathers and reduce-scatters per microbatch, pairing the ranks' calls in
        order: with unequal counts a rank waits in a collective its peers never enter, until
        the process group's timeout (minutes), and fails without naming the cause. Every
        rank sees the same minimum and maximum here, so all of them raise, before any
        other collective of the step.

        Raises:
            RuntimeError: naming this rank's count and the group's minimum and maximum.
        """
        if self.dp_mesh is None or self.dp_mesh.size() == 1:
            return
        most, negated_least = self._dp_all_reduce(
            torch.tensor([count, -count], dtype=torch.int64, device=self.device),
            dist.ReduceOp.MAX,
        ).tolist()
        if most != -negated_least:
            raise RuntimeError(
                f"data-parallel ranks disagree on the microbatch count: this rank has "
                f"{count}, the group between {-negated_least} and {most}; every rank must "
                "run as many (FSDP's collectives pair up per microbatch), so the split must "
                "equalise them (microbatches() does, with a MAX all-reduce, under "
                "training.max_tokens_per_microbatch)"
            )

    def _to_device(self, mb: Batch) -> Batch:
        tensors = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
        return mb.with_tensors(tensors) if isinstance(mb, token_budget.Microbatch) else tensors

    # ---- optimizer verbs ---------------------------------------------------------------
    def optimizer_zero_grad(self) -> None:
        """Zero the gradients of all model parts (never called per microbatch)."""
        self.optimizers.zero_grad()

    def optimizer_step(self) -> float:
        """Clip gradients to ``training.max_norm``, step, then zero the gradients the step
        consumed (the next ``forward_backward_batch`` accumulates from zero); return the
        pre-clip grad norm.

        Raises:
            FloatingPointError: the gradient norm is not finite (nothing is stepped).
        """
        with self.resident(optimizer=True):
            return self._optimizer_step()

    def _clip_grad_norm(self) -> torch.Tensor:
        """Clip the trainable parameters' gradients to ``training.max_norm``; return the
        pre-clip norm over all ranks and stages (torchtitan's ``clip_grad_norm_``: under
        FSDP the norm of sharded gradients is a DTensor, reduced over its mesh)."""
        return dist_utils.clip_grad_norm_(
            self.trainable_parameters(),
            self.config.training.max_norm,
            foreach=True,
            pp_mesh=self.pp_mesh,
            ep_enabled=self.ep_enabled,
        )

    def _optimizer_step(self) -> float:
        grad_norm = self._clip_grad_norm()
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"gradient norm is {grad_norm} at step {self.step + 1}")
        self.optimizers.step()
        # The step consumed these gradients: whatever verb comes next (forward_backward,
        # train_batch), its accumulation must start from zero, never re-apply this batch.
        self.optimizer_zero_grad()
        self.step += 1
        return grad_norm

    def lr_scheduler_step(self) -> float:
        """Step the LR scheduler; return the learning rate of the next optimizer step."""
        self.lr_schedulers.step()
        return self.current_lr()

    def current_lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return float(self.lr_schedulers.schedulers[0].get_last_lr()[0])

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Train state saved with checkpoints (``train_state``): the step counter."""
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the train state :meth:`state_dict` saved."""
        self.step = int(state_dict["step"])

    def save_checkpoint(self, step: int) -> None:
        """Save model, optimizer, LR scheduler and train state for ``step`` with DCP under
        ``<dump_folder>/<checkpoint.folder>/step-<step>`` (``.metadata`` written last, so a
        half-written step is never picked by :meth:`load_checkpoint`). Then only the newest
        ``checkpoint.keep_latest_k`` complete checkpoints are kept; a folder a crashed save
        left is set aside as ``step-<N>.incomplete`` (:mod:`forge_ext.engine.checkpoint`).

        Raises:
            ValueError: if ``checkpoint.enable`` is false.
            forge_ext.runtime.disk.CheckpointWriteError: before writing, if the free space is
                short of the last save's size; or if the write hit an OSError (no space,
                permissions, read-only filesystem, quota). One line: what, where, free and
                needed space, the last complete checkpoint.
        """
        if not self.checkpointer.enable:
            raise ValueError("checkpoint.enable is false; set trainer.checkpoint.enable=true")
        with self.resident(optimizer=True):
            self.checkpointer.save_step(step)

    def load_checkpoint(self, step: int | None = None) -> int:
        """Restore ``step`` (the latest complete one when None); return the step restored,
        0 when there is no checkpoint yet.

        Raises:
            ValueError: if ``checkpoint.enable`` is false.
            FileNotFoundError: if ``step`` is given and was not saved, or its save did not
                finish (no ``.metadata``).
        """
        if not self.checkpointer.enable:
            raise ValueError("checkpoint.enable is false; set trainer.checkpoint.enable=true")
        with self.resident(optimizer=True):
            self.checkpointer.load(step=-1 if step is None else step)
        return self.step

    def close(self) -> None:
        """Stop the checkpointer's background work (async saves, the purge thread)."""
        self.checkpointer.close()

    # ---- written once on top of forward_backward_batch ---------------------------------
    def train_batch(self, batch: Batch, loss_fn: LossFn, loss_weight_fn: LossWeightFn,
                    post_hook: Callable[[torch.Tensor, Batch], Any] | None = None) -> dict:
        """One optimizer step on ``batch`` in :meth:`train_mode`: zero grad, forward/backward
        over microbatches, clip, optimizer step, LR step. ``post_hook(logits, mb)``: applied
        to each microbatch's logits of this forward (under the weights before the update,
        e.g. the sampled tokens' log-probs), returned as ``outputs``, ``[B, S, ...]`` in row
        order as :meth:`forward_batch` gives them (None on PP stages without the last).

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
            out = self.forward_backward_batch(microbatches, loss_fn, loss_weight_fn,
                                              output_post_hook=post_hook,
                                              return_outputs=post_hook is not None)
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
            "computed_tokens": token_budget.count_tokens(microbatches),
            **{f"loss/{name}": value for name, value in out.metrics.items()},
            **({"outputs": self._rows_of(out, microbatches, batch)} if post_hook else {}),
        }

    @staticmethod
    def _rows_of(out: ForwardBackwardOutputs, microbatches: list, batch: Batch) -> Any:
        """``out``'s per-microbatch outputs as one ``[B, S, ...]`` tensor in ``batch``'s row
        order (:func:`forge_ext.engine.microbatch.restore_rows`); None without any."""
        if not out.mb_outputs:
            return None
        return torch.cat(token_budget.restore_rows(out.mb_outputs, microbatches,
                                                   *batch["input_ids"].shape[:2]))

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
            rows = token_budget.restore_rows(out.mb_outputs, microbatches, *ids.shape[:2])
            outputs = aggregate_fn(rows)
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



def _set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)

