"""``RLTrainer``: a Monarch actor wrapping the engine, in the shape of torchforge's RLTrainer.

Each endpoint is one verb; the actor validates the request, calls the engine (or the weight
publisher) and returns plain data. Under data parallelism every rank receives the whole
request (lists indexed by data-parallel rank, as in torchforge) and picks its own part, so all
ranks validate the same thing and a rejected request never leaves ranks out of step.

Controller usage::

    trainer = await spawn_trainer({...trainer section...}, loss={"name": "cross_entropy"})
    loss = await trainer.train_step(inputs, targets)   # calls every rank, returns one value
    await trainer.stop()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from monarch.actor import Actor, ProcMesh, current_rank, endpoint, this_host
from monarch.spmd import setup_torch_elastic_env_async

from forge_ext.engine import BaseEngine, EngineConfig, build_engine, engine_config_from_mapping
from forge_ext.engine.distributed import free_port
from forge_ext.engine.schema import check_weights_transport, world_size_of
from forge_ext.rl.losses.grpo import token_logprobs
from forge_ext.rl.losses.registry import build_loss
from forge_ext.rl.losses.value import value_predictions
from forge_ext.runtime.run_logs import log_role, startup_phases
from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.publish import WeightsPublisher

logger = logging.getLogger(__name__)

# How long stop() waits for the ranks' cleanup (releasing the checkpointer) before it stops
# the procs regardless.
CLEANUP_SECONDS = 10.0


class RLTrainer(Actor):
    """Trainer actor: one per process of a proc mesh; together they form the DP/PP world.

    Args:
        trainer: the YAML ``trainer:`` mapping (see :mod:`forge_ext.engine.config`).
        loss: ``{"name": <registered loss>, **kwargs}`` (see
            :func:`forge_ext.rl.losses.registry.build_loss`); default token-level cross entropy.
        weights: the YAML ``weights:`` mapping (:class:`forge_ext.weights.config.WeightsConfig`)
            for :meth:`push_weights`; torchstore must be initialised by the controller.
    """

    def __init__(
        self,
        trainer: dict[str, Any],
        loss: dict[str, Any] | None = None,
        weights: dict[str, Any] | None = None,
    ):
        self.trainer_config = dict(trainer)
        self.loss_config = dict(loss or {"name": "cross_entropy"})
        self.weights_config = WeightsConfig(**(weights or {}))
        self.engine: BaseEngine | None = None
        self.publisher: WeightsPublisher | None = None

    @endpoint
    async def setup(self, role: str = "trainer") -> dict[str, int]:
        """Initialise ``torch.distributed`` from the proc mesh environment and build the engine.

        Args:
            role: the role's name, which names its log file (``<output_dir>/logs/<role>-
                <rank>.log``, :func:`forge_ext.runtime.run_logs.log_role`: torchtitan's INFO lines go
                there, warnings and errors also to the console).

        Returns:
            ``{"rank", "dp_rank", "dp_size", "policy_version", "setup_seconds"}`` of this
            process (``setup_seconds``: this call's, model and engine built, checkpoint
            loaded).
        """
        began = time.perf_counter()
        log_role(role, current_rank().rank)
        self.loss_fn, self.loss_weight_fn = build_loss(**self.loss_config)
        # trainer.engine names the backend (forge_ext.engine.EngineRegistry).
        self.engine = build_engine(engine_config_from_mapping(self.trainer_config))
        return {
            "rank": current_rank().rank,
            "dp_rank": self.engine.dp_rank,
            "dp_size": self.engine.dp_size,
            "policy_version": self.engine.step,
            "setup_seconds": time.perf_counter() - began,
        }

    @endpoint
    async def set_loss(self, loss: dict[str, Any]) -> None:
        """Train with another loss from the next step on (e.g. another GRPO aggregation):
        ``loss`` as in the constructor. The handle validates it in the controller first
        (:meth:`TrainerHandle.set_loss`), so every rank switches or none does."""
        self.loss_fn, self.loss_weight_fn = build_loss(**loss)
        self.loss_config = dict(loss)

    # ---- training verbs ----------------------------------------------------------------
    @endpoint
    async def train_step(
        self,
        inputs: list[dict[str, torch.Tensor]],
        targets: list[dict[str, torch.Tensor]],
        return_metrics: bool = False,
        return_logprobs: bool = False,
    ) -> float | dict[str, Any]:
        """One optimizer step on the global batch.

        Args:
            inputs: one dict per data-parallel rank with ``input_ids`` ``[local_batch, S]``.
            targets: one dict per data-parallel rank with ``labels`` ``[local_batch, S]`` and
                whatever else the loss reads (e.g. ``advantages``, ``generator_logprobs``).
            return_metrics: return the full metrics dict instead of the loss.
            return_logprobs: with ``return_metrics``, also ``logprobs``: ``[local_batch, S]``
                fp32, each label's log-prob in this step's forward, under the weights
                before its update (0 where the label is ignored; None on PP stages without
                the last): what the train-inference mismatch is measured from
                (:mod:`forge_ext.rl.mismatch`), at the cost of one more log-softmax over the
                logits and no other forward.

        Returns:
            The step's loss (weighted mean over all ranks' valid tokens, the same on every
            rank), or with ``return_metrics`` a dict with ``loss``, ``grad_norm``, ``lr``,
            ``num_tokens``, ``tokens_per_second``, ``policy_version``, plus the loss's own
            metrics as ``loss/<name>`` (GRPO: ``loss/kl``, ``loss/ratio_mean``,
            ``loss/clip_fraction``; means over the global batch's valid tokens, or its
            sequences for the ``seq_mean_*`` aggregations, before the update).

        Raises:
            ValueError: ``inputs``/``targets`` lengths differ from each other or from the DP
                size, or a batch has the wrong keys/shapes (before any computation).
        """
        batch = self._local_batch(inputs, targets)
        hook = _sampled_logprobs if return_logprobs else None
        metrics = self.engine.train_batch(batch, self.loss_fn, self.loss_weight_fn, hook)
        metrics["policy_version"] = self.engine.step
        if return_logprobs:
            metrics["logprobs"] = metrics.pop("outputs")
        return metrics if return_metrics else metrics["loss"]

    @endpoint
    async def forward_backward(
        self, inputs: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]]
    ) -> dict[str, float]:
        """Accumulate gradients of this batch's mean loss (tinker style; no zero_grad here).

        Returns:
            ``{"loss": weighted mean loss, "num_tokens": global weight}`` plus the loss
            function's metrics as ``loss/<name>`` (as in :meth:`train_step`).
        """
        batch = self._local_batch(inputs, targets)
        with self.engine.train_mode():
            out = self.engine.forward_backward_batch(
                self.engine.microbatches(batch), self.loss_fn, self.loss_weight_fn
            )
        metrics = {f"loss/{name}": value for name, value in out.metrics.items()}
        return {"loss": out.loss, "num_tokens": out.global_weight, **metrics}

    @endpoint
    async def optim_step(self) -> dict[str, float]:
        """Clip, optimizer step, LR step, then zero the gradients; bumps the policy version.

        Returns:
            ``{"grad_norm", "lr" (used by this step), "policy_version"}``.
        """
        lr = self.engine.current_lr()
        with self.engine.train_mode():
            grad_norm = self.engine.optimizer_step()  # zeroes the gradients it applied
        self.engine.lr_scheduler_step()
        return {"grad_norm": grad_norm, "lr": lr, "policy_version": self.engine.step}

    @endpoint
    async def eval_step(
        self, inputs: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]]
    ) -> float:
        """The weighted mean loss of the global batch, without gradients."""
        batch = self._local_batch(inputs, targets)
        return self.engine.eval_batch(batch, self.loss_fn, self.loss_weight_fn)

    # ---- state verbs -------------------------------------------------------------------
    @endpoint
    async def get_policy_version(self) -> int:
        """Completed optimizer steps (restored by :meth:`load_checkpoint`)."""
        return self.engine.step

    @endpoint
    async def save_checkpoint(self, step: int | None = None) -> int:
        """Save the full training state at ``step`` (default: the policy version)."""
        step = self.engine.step if step is None else step
        self.engine.save_checkpoint(step)
        return step

    @endpoint
    async def load_checkpoint(self, step: int | None = None) -> int:
        """Load ``step`` (latest complete one when None); return the policy version."""
        return self.engine.load_checkpoint(step)

    @endpoint
    async def push_weights(self, policy_version: int | None = None,
                           reader_base: int | None = None) -> dict[str, Any]:
        """Publish the model's weights in HF layout as ``policy_version`` (default: the current
        policy version) through ``weights.transport``; collective over all ranks.

        With ``trainer.lora`` the version is the LoRA adapter alone: its PEFT-named tensors
        (``base_model.model.<module>.lora_A.weight [r, in]`` / ``lora_B.weight [out, r]``,
        :mod:`forge_ext.engine.lora`), with ``{"adapter_config": <adapter_config.json mapping>}`` as
        the version's metadata; ``bytes`` is then the adapter's size.

        Floating-point parameters are cast to ``weights.dtype`` when set; buffers keep their
        dtype. DTensor shards are written by the ranks that own them (no rank gathers the
        model). The version becomes fetchable (``forge_ext.weights.fetch.fetch_weights``)
        only once all of it is stored.

        With ``weights.delta``, ``reader_base`` is the version every generator holds whole
        (``GeneratorReplicas.reader_base``): the version is then a delta on it when this
        trainer published it last, full otherwise (``forge_ext.weights.transports.delta``).

        Returns:
            ``{"policy_version", "bytes", "seconds", "rdma", "same_host"}`` for this rank
            (``same_host``: the version went into shared memory, see
            ``forge_ext.weights.publish``); with ``weights.delta`` also ``delta_base`` (None:
            a full version), ``changed`` and ``elements`` (this rank's elements whose bits
            changed, of all), ``full_bytes`` (what a full version of this rank takes),
            ``delta_skipped`` (full because a recent delta did not pay) and
            ``delta_warning`` (the text saying so, once; else None).

        Raises:
            Under pipeline parallelism each stage publishes its own tensors, which needs
            ``weights.transport: dcp`` (checked by :func:`spawn_trainer` before spawning).
            forge_ext.weights.errors.WeightsPublishError: the push failed on some rank; the
                version stays absent and earlier ones are untouched.
        """
        if self.publisher is None:
            self.publisher = WeightsPublisher(self.weights_config)
            self.hf_buffer_names = self._hf_buffer_names()
        version = self.engine.step if policy_version is None else policy_version
        # One source for what a generator needs (verl's get_per_tensor_param): HF-named
        # tensors as each rank holds them (shards, no gather, no copy: each rank writes its
        # own), or under LoRA the adapter alone, its adapter_config.json mapping travelling
        # in the commit record (forge_ext.engine.lora); the base weights never change then.
        with self.engine.resident(optimizer=False):
            tensors, adapter_config = self.engine.get_per_tensor_param(sharded=True)
            if adapter_config is not None:
                result = await self.publisher.publish(
                    dict(tensors), version, metadata={"adapter_config": adapter_config},
                )
            else:
                result = await self.publisher.publish(
                    dict(tensors), version, exclude_from_cast=self.hf_buffer_names,
                    reader_base=reader_base,
                )
        out = {"policy_version": version, "bytes": result.bytes_written,
               "seconds": result.seconds, "rdma": result.rdma, "same_host": result.same_host}
        if result.delta is not None:
            out.update(delta_base=result.delta.base_version, changed=result.delta.changed,
                       elements=result.delta.elements, full_bytes=result.delta.full_bytes,
                       delta_skipped=result.delta.skipped, delta_warning=result.delta.warning)
        return out

    def _hf_buffer_names(self) -> set[str]:
        """HF names of the buffers in the state dict (they keep their dtype when cast)."""
        titan_sd = self.engine.model_state_dict()
        buffers = {
            name for part in self.engine.model_parts for name, _ in part.named_buffers()
        }
        buffer_sd = {k: v for k, v in titan_sd.items() if k in buffers}
        if not buffer_sd or self.engine.sd_adapter is None:  # None: HF names already
            return set(buffer_sd)
        return set(self.engine.sd_adapter.to_hf(buffer_sd))

    @endpoint
    async def forward(
        self,
        inputs: list[dict[str, torch.Tensor]],
        targets: list[dict[str, torch.Tensor]] | None = None,
        output: str = "logits",
        adapter: bool = True,
    ) -> torch.Tensor | None:
        """Forward-only pass over this rank's batch (no gradients).

        Args:
            output: ``"logits"`` (``[local_batch, S, V]``), ``"logprobs"`` (``[local_batch,
                S]`` log-probability of each label, 0 where the label is ignored; needs
                ``targets`` with ``labels``) or ``"values"`` (``[local_batch, S]`` fp32, a
                value head's one value per position: ``model.value_head``).
            adapter: false: with the LoRA adapters disabled, i.e. the frozen base model
                (the KL reference of a LoRA policy, ``TitanEngine.disable_adapter``).

        Returns:
            The output on ranks holding the last PP stage; None on the other stages.
        """
        if output not in ("logits", "logprobs", "values"):
            raise ValueError(f"output={output!r} must be 'logits', 'logprobs' or 'values'")
        if output == "logprobs" and targets is None:
            raise ValueError("output='logprobs' needs targets with 'labels'")
        if output == "values" and not self.engine.config.model.value_head:
            raise ValueError("output='values' needs a value head (model.value_head: true)")
        batch = self._local_batch(inputs, targets or [{} for _ in inputs])
        hook = {"logprobs": _label_logprobs, "values": _values}.get(output)
        if adapter:
            return self.engine.forward_batch(batch, post_hook=hook)
        with self.engine.disable_adapter():
            return self.engine.forward_batch(batch, post_hook=hook)

    @endpoint
    async def export_hf(self, folder: str, dtype: str | None = None,
                        max_shard_bytes: int | None = None) -> dict[str, Any]:
        """Write the model as an HF checkpoint folder (``TitanEngine.export_hf``; collective:
        tensors gathered one at a time, each pipeline stage's first rank writes). ``dtype``:
        ``"float32"``, ``"bfloat16"``, ``"float16"`` or None (the parameters')."""
        from forge_ext.engine.export import export_dtype

        return self.engine.export_hf(folder, dtype=export_dtype(dtype),
                                     max_shard_bytes=max_shard_bytes)

    @endpoint
    async def export_lora(self, folder: str, merged_folder: str | None = None) -> dict[str, str]:
        """Write the LoRA adapters as a PEFT folder, and with ``merged_folder`` a merged HF
        checkpoint (``TitanEngine.export_lora``; collective, rank 0 writes)."""
        return self.engine.export_lora(folder, merged_folder)

    @endpoint
    async def load_adapter_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the LoRA adapters from full tensors in PEFT names
        (``TitanEngine.load_adapter_state_dict``)."""
        self.engine.load_adapter_state_dict(tensors)

    @endpoint
    async def get_adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters in PEFT names, full tensors (``TitanEngine.adapter_state_dict``)."""
        return {k: v.cpu() for k, v in self.engine.adapter_state_dict().items()}

    @endpoint
    async def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the model weights with full tensors in HF layout (each PP stage and DP/TP
        shard takes its part). Optimizer state is left as is."""
        self.engine.load_hf_state_dict(state_dict)

    @endpoint
    async def get_gradients(self) -> dict[str, torch.Tensor]:
        """This rank's accumulated gradients, gathered to full tensors, by parameter name
        (torchtitan names; under PP only this stage's parameters). For tests and debugging."""
        return {
            name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for part in self.engine.model_parts
            for name, p in part.named_parameters()
            if p.grad is not None
        }

    @endpoint
    async def get_model_training(self, mode: str | None = None) -> list[bool]:
        """``module.training`` of each model part on this rank, inside
        ``engine.train_mode()`` / ``engine.eval_mode()`` when ``mode`` is ``"train"`` /
        ``"eval"``, as the verbs leave it when None. For tests and debugging."""
        if mode is None:
            return [m.training for m in self.engine.model_modules()]
        if mode not in ("train", "eval"):
            raise ValueError(f"mode={mode!r} must be 'train', 'eval' or None")
        with getattr(self.engine, f"{mode}_mode")():
            return [m.training for m in self.engine.model_modules()]

    @endpoint
    async def get_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) model weights in HF layout; for tests and small models."""
        sd = self.engine.hf_state_dict()
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in sd.items()}

    @endpoint
    async def cleanup(self) -> None:
        """Release the checkpointer's resources and unlink the weight publisher's
        shared-memory slots (versions published into them can no longer be fetched). The
        proc mesh owns the process group and tears it down on ``stop()`` (destroying it here
        can race with mesh shutdown)."""
        if self.publisher is not None:
            self.publisher.close()
        if self.engine is not None:
            self.engine.close()

    # ---- helpers -----------------------------------------------------------------------
    def _local_batch(
        self, inputs: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        dp_size = self.engine.dp_size
        if not isinstance(inputs, (list, tuple)) or not isinstance(targets, (list, tuple)):
            raise ValueError("inputs and targets must be lists indexed by data-parallel rank")
        if len(inputs) != len(targets):
            raise ValueError(
                f"len(inputs)={len(inputs)} != len(targets)={len(targets)}: pass one inputs "
                "dict and one targets dict per data-parallel rank"
            )
        if len(inputs) != dp_size:
            raise ValueError(
                f"len(inputs)={len(inputs)} but the trainer has {dp_size} data-parallel "
                "ranks: pass one batch per data-parallel rank"
            )
        batches = []
        for rank, (inp, tgt) in enumerate(zip(inputs, targets)):
            overlap = set(inp) & set(tgt)
            if overlap:
                raise ValueError(f"inputs[{rank}] and targets[{rank}] both have keys {overlap}")
            batches.append({**inp, **tgt})
        # Every rank checks every rank's batch: all accept or all reject, in step.
        for batch in batches:
            self.engine.check_batch(batch)
        return batches[self.engine.dp_rank]


@dataclass
class TrainerHandle:
    """The controller's handle on a spawned trainer: the actor mesh and its proc mesh."""

    actor: RLTrainer
    procs: ProcMesh
    config: EngineConfig
    num_procs: int
    startup: dict[str, float] = field(default_factory=dict)
    """``{"setup": s}``: the slowest rank's setup (:func:`forge_ext.runtime.run_logs.startup_phases`)."""

    async def stop(self) -> None:
        """Run ``cleanup`` on every rank, then stop the proc mesh. A rank that does not
        answer within ``CLEANUP_SECONDS`` (it is dead, or blocked in a collective with a
        dead peer) is not waited for: stopping the proc mesh releases everything anyway."""
        try:
            await asyncio.wait_for(self.actor.cleanup.call(), CLEANUP_SECONDS)
        except (Exception, asyncio.TimeoutError) as error:
            logger.debug("trainer cleanup skipped: %s", type(error).__name__)
        finally:
            await self.procs.stop()

    async def _call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``verb`` on every rank and return one rank's value: every rank returns the
        same (DP-reduced) value, except under PP where only last-stage ranks hold losses and
        outputs, so the last rank's value is returned."""
        values = await getattr(self.actor, verb).call(*args, **kwargs)
        return list(values.values())[-1]

    async def set_loss(self, loss: dict[str, Any]) -> None:
        """Switch every rank to ``loss`` (:meth:`RLTrainer.set_loss`).

        Raises:
            ValueError: a bad loss spec, before any rank is called.
        """
        build_loss(**loss)
        await self.actor.set_loss.call(loss)

    async def train_step(self, inputs, targets, return_metrics: bool = False,
                         return_logprobs: bool = False):
        """:meth:`RLTrainer.train_step`; with ``return_logprobs`` the metrics' ``logprobs``
        hold every data-parallel rank's rows, concatenated in DP-rank order (as
        :meth:`forward`)."""
        if not return_logprobs:
            return await self._call("train_step", inputs, targets, return_metrics)
        values = list((await self.actor.train_step.call(inputs, targets, True, True)).values())
        metrics = dict(values[-1])
        metrics["logprobs"] = torch.cat([v["logprobs"] for v in values
                                         if v["logprobs"] is not None])
        return metrics

    async def forward_backward(self, inputs, targets) -> dict[str, float]:
        return await self._call("forward_backward", inputs, targets)

    async def optim_step(self) -> dict[str, float]:
        return await self._call("optim_step")

    async def eval_step(self, inputs, targets) -> float:
        return await self._call("eval_step", inputs, targets)

    async def get_policy_version(self) -> int:
        return await self._call("get_policy_version")

    async def push_weights(self, policy_version: int | None = None,
                           reader_base: int | None = None) -> dict[str, Any]:
        return await self._call("push_weights", policy_version, reader_base)

    async def save_checkpoint(self, step: int | None = None) -> int:
        return await self._call("save_checkpoint", step)

    async def load_checkpoint(self, step: int | None = None) -> int:
        return await self._call("load_checkpoint", step)

    async def get_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights in HF layout, merged over PP stages."""
        merged: dict[str, torch.Tensor] = {}
        for part in (await self.actor.get_hf_state_dict.call()).values():
            merged.update(part)
        return merged

    async def forward(self, inputs, targets=None, output: str = "logits",
                      adapter: bool = True) -> torch.Tensor:
        """Outputs of every data-parallel rank, concatenated in DP-rank order (``adapter``:
        see :meth:`RLTrainer.forward`)."""
        values = await self.actor.forward.call(inputs, targets, output, adapter)
        return torch.cat([v for v in values.values() if v is not None])

    async def export_hf(self, folder: str, dtype: str | None = None,
                        max_shard_bytes: int | None = None) -> dict[str, Any]:
        """:meth:`RLTrainer.export_hf` on every rank.

        Raises:
            ValueError: a bad ``dtype``, before any rank is called.
        """
        from forge_ext.engine.export import export_dtype

        export_dtype(dtype)
        return await self._call("export_hf", str(folder), dtype, max_shard_bytes)

    async def export_lora(self, folder: str, merged_folder: str | None = None) -> dict[str, str]:
        return await self._call("export_lora", str(folder),
                                None if merged_folder is None else str(merged_folder))

    async def get_adapter_state_dict(self) -> dict[str, torch.Tensor]:
        return await self._call("get_adapter_state_dict")

    async def load_adapter_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        await self.actor.load_adapter_state_dict.call(tensors)

    async def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        await self.actor.load_hf_state_dict.call(state_dict)

    async def get_gradients(self) -> dict[str, torch.Tensor]:
        """Gradients of all parameters, merged over PP stages."""
        merged: dict[str, torch.Tensor] = {}
        for grads in (await self.actor.get_gradients.call()).values():
            merged.update(grads)
        return merged


async def spawn_trainer(
    trainer: dict[str, Any],
    loss: dict[str, Any] | None = None,
    num_procs: int | None = None,
    name: str = "trainer",
    weights: dict[str, Any] | None = None,
    spawn_procs: Callable[[], ProcMesh] | None = None,
    master_addr: str | None = None,
) -> TrainerHandle:
    """Validate the config, spawn a proc mesh, set up torch.distributed and the engine.

    The whole config is validated here, in the controller, before any process is spawned.
    The torch.distributed world is the whole proc mesh, across its hosts: rank = host x
    procs per host + local rank, ``MASTER_ADDR`` the first proc's host name
    (``monarch.spmd.setup_torch_elastic_env_async``), or ``master_addr``.

    Args:
        trainer: YAML ``trainer:`` mapping.
        loss: loss spec for :func:`forge_ext.rl.losses.registry.build_loss`.
        num_procs: processes to spawn (default: the product of parallel degrees).
        weights: YAML ``weights:`` mapping for ``push_weights``.
        spawn_procs: returns the proc mesh to run on, called after validation (e.g.
            :meth:`forge_ext.runtime.placement.Placement.spawn_procs` for a role on several hosts);
            default: ``num_procs`` procs on this host.
        master_addr: ``MASTER_ADDR`` of an address of this machine, with a free port of it,
            when every proc runs here (:attr:`forge_ext.runtime.placement.Placement.master_addr`);
            default: 127.0.0.1 for procs on this host (``spawn_procs`` None), else the first
            proc's host name. The world's store and gloo then listen on that address only
            (:func:`forge_ext.engine.distributed.rendezvous_on_master_addr`).

    Raises:
        ValueError: a config error naming the field; the mesh ``spawn_procs`` returned does
            not hold ``num_procs`` procs.
    """
    config = engine_config_from_mapping(trainer)
    build_loss(**(loss or {"name": "cross_entropy"}))
    try:
        weights_config = WeightsConfig(**(weights or {}))
    except TypeError as e:
        raise ValueError(f"weights: {e}") from None
    if weights:
        check_weights_transport(config, weights_config)
    n = world_size_of(config, num_procs)
    if spawn_procs is None:
        procs = this_host().spawn_procs(per_host={"procs": n}, name=name)
    else:
        procs = spawn_procs()
    try:
        if procs.size() != n:
            raise ValueError(f"{name}: the proc mesh holds {procs.size()} procs, not {n}")
        if master_addr is None and spawn_procs is None:
            master_addr = "127.0.0.1"
        if master_addr is None:
            await setup_torch_elastic_env_async(procs)
        else:
            await setup_torch_elastic_env_async(procs, master_addr, free_port(master_addr))
        actor = procs.spawn(name, RLTrainer, trainer, loss, weights)
        infos = await actor.setup.call(name)
    except BaseException:
        await procs.stop()
        raise
    return TrainerHandle(actor=actor, procs=procs, config=config, num_procs=n,
                         startup=startup_phases(list(infos.values())))


def _values(output: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b, S]`` fp32 values of a value head's output ``[b, S, 1]``."""
    return value_predictions(output)


def _sampled_logprobs(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b, S]`` each label's log-prob in a training forward, outside its autograd graph."""
    with torch.no_grad():
        return token_logprobs(logits.detach(), mb["labels"])


def _label_logprobs(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b, S]`` log-probability of each label under ``logits`` (0 where ignored)."""
    return token_logprobs(logits, mb["labels"])
