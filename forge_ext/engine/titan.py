"""TorchTitan backend of the engine: model, optimizer, LR scheduler and checkpointer built from
torchtitan components, in the order of ``torchtitan/trainer.py`` (``Trainer.__init__``) and
``torchtitan/experiments/rl/actors/trainer.py`` (``PolicyTrainer``).

No Monarch here: the engine runs in any process where ``torch.distributed`` can be set up from
the usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK`` environment
(torchrun, ``monarch.spmd.setup_torch_elastic_env_async``, or
:func:`forge_ext.engine.distributed.init_single_process_env` for one process).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.checkpoint import MODEL, ModelWrapper
from torchtitan.config import CommConfig, DebugConfig, TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils as titan_utils

from forge_ext.runtime import disk
from forge_ext.engine import microbatch as token_budget
from forge_ext.engine import offload
from forge_ext.engine.attention import DocumentMask
from forge_ext.engine.base import (
    MODEL_TYPE,
    Batch,
    BaseEngine,
    EngineRegistry,
    ForwardBackwardOutputs,
    LossFn,
    LossWeightFn,
    split_batch,
)
from forge_ext.engine.config import EngineConfig, engine_config_from_mapping
from forge_ext.engine.distributed import rendezvous_on_master_addr
from forge_ext.engine.losses import IGNORE_INDEX
from forge_ext.engine.models import (
    VALUE_HEAD_HF_NAME, apply_lora, build_model_spec, checkpoint_tensor_names,
)

logger = logging.getLogger(__name__)

# torch/distributed/tensor/_dispatch.py, at init_weights on a CPU device mesh.
DTENSOR_CPU_RANDOM_NOTICE = "DTensor random operators may not have complete support on cpu"


@EngineRegistry.register(MODEL_TYPE, "titan")
class TitanEngine(BaseEngine):
    """A torchtitan model with optimizer, LR scheduler and checkpointer, driven in microbatches.

    The ``titan`` backend (``trainer.engine: titan``), built by
    ``EngineRegistry.new("language_model", "titan", config)``.

    Args:
        config: an :class:`EngineConfig` or the nested mapping of a YAML ``trainer:`` section.

    Raises:
        ValueError: a config error (named field), or parallel degrees that do not fit the
            world size.
    """

    def __init__(self, config: EngineConfig | dict):
        if not isinstance(config, EngineConfig):
            config = engine_config_from_mapping(config)
        self.config = config
        self.device = titan_utils.get_local_device()
        titan_utils.device_module.set_device(self.device)
        with rendezvous_on_master_addr():  # not torch's store on every interface
            world_size = dist_utils.init_distributed(CommConfig(),
                                                     base_folder=config.dump_folder)
        par = config.parallelism
        try:
            self.parallel_dims = ParallelDims.from_config(par, world_size)
        except AssertionError as e:
            raise ValueError(
                f"parallelism degrees do not fit world size {world_size}: {e} "
                "(check parallelism.data_parallel_*_degree / pipeline_parallel_degree)"
            ) from None
        dist_utils.set_spmd_backend(par.spmd_backend)
        self.train_context = dist_utils.get_spmd_context(
            parallel_dims=self.parallel_dims, spmd_typechecking=False
        )
        self.num_microbatches = config.num_microbatches()
        self.num_pp_microbatches = config.num_pp_microbatches()

        self.model_spec = build_model_spec(
            config.model.name, config.model.flavor, hf_path=config.model.hf_path,
            attn_backend=config.model.attn_backend, value_head=config.model.value_head,
        )
        model_config = self.model_spec.model
        model_config.update_from_config(config=config)
        for layer in model_config.layers:
            layer.attention.rope = replace(
                layer.attention.rope, max_seq_len=config.training.seq_len
            )
        if config.lora is not None:
            # After update_from_config: its sharding plan knows only torchtitan's own q/k/v
            # layouts; split_qkv keeps the parameters' sharding configs.
            model_config = self.model_spec.model = apply_lora(model_config, config.lora)
        self.sd_adapter = (
            self.model_spec.state_dict_adapter(model_config, config.model.hf_path or "")
            if self.model_spec.state_dict_adapter
            else None
        )
        # Same seed on every rank of a DP/TP group so replicas start identical.
        dist_utils.set_determinism(
            self.parallel_dims, self.device, DebugConfig(seed=config.seed),
            distinct_seed_mesh_dims=["pp"],
        )
        with torch.device("meta"), titan_utils.set_default_dtype(
            TORCH_DTYPE_MAP[config.training.dtype]
        ):
            model = model_config.build()
        self.model_parts = self._parallelize(model)

        self.optimizers = config.optimizer.to_titan().build(model_parts=self.model_parts)
        self.lr_schedulers = config.lr_scheduler.build(
            optimizers=self.optimizers, training_steps=config.training.steps
        )
        self.step = 0
        self._build_checkpointer()
        if config.model.hf_path:
            self.load_hf_weights(config.model.hf_path)

        self.dp_mesh = self.parallel_dims.get_optional_mesh("batch")
        # (id(param), key) -> device of each optimizer state tensor moved to the host.
        self._optimizer_homes: dict[tuple[int, str], torch.device] = {}
        self.offload()  # with trainer.offload on, the engine rests in host memory

    # ---- construction ------------------------------------------------------------------
    def _build_checkpointer(self) -> None:
        """``self.checkpointer``: forge_ext's DCP manager
        (:class:`forge_ext.engine.checkpoint.CheckpointManager`) over the model parts,
        optimizers, LR schedulers and the step (``train_state``); both backends use it."""
        config = self.config
        # Size of the last complete checkpoint save, for the free-space check before the next.
        self._last_checkpoint_bytes: int | None = None
        self.checkpointer = config.checkpoint.build(
            dataloader=None,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            sd_adapter=self.sd_adapter,
            base_folder=config.dump_folder,
        )
        # The engine has no dataloader (callers feed batches); a None entry would be saved
        # and then demanded on load.
        getattr(self.checkpointer, "states", {}).pop("dataloader", None)
        if config.lora is not None and self.checkpointer.enable:
            # The base is model.hf_path's, unchanged: checkpoints hold only the adapters
            # (the optimizer holds only them already).
            self.checkpointer.states[MODEL] = _TrainableModelWrapper(self.model_parts)
        # The caller decides when to save (save_checkpoint(step)), so every step it passes
        # must pass torchtitan's interval check; its regular save path then also applies
        # checkpoint.keep_latest_k and checkpoint.async_mode.
        self.checkpointer.interval = 1

    def _parallelize(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Apply SPMD parallelisms (and PP stage splitting), materialise, init weights."""
        config = self.config
        common = dict(
            parallel_dims=self.parallel_dims,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=config.activation_checkpoint.to_titan(),
            dump_folder=config.dump_folder,
        )
        self.pp_schedule = None
        self.pp_has_first_stage = self.pp_has_last_stage = True
        if self.parallel_dims.pp_enabled:
            # One schedule.step per gradient-accumulation microbatch: the schedule splits that
            # microbatch into local_batch_size / GA / pipeline_parallel_microbatch_size pieces.
            step_training = replace(
                config.training,
                local_batch_size=config.training.local_batch_size // self.num_microbatches,
            )
            self._pp_loss = _PipelineLoss()
            (
                self.pp_schedule,
                parts,
                self.pp_has_first_stage,
                self.pp_has_last_stage,
            ) = self.model_spec.pipelining_fn(
                model, training=step_training, device=self.device,
                model_config=self.model_spec.model,
                parallelize_fn=self.model_spec.parallelize_fn, loss_fn=self._pp_loss,
                **common,
            )
        else:
            parts = [
                self.model_spec.parallelize_fn(model, training=config.training, **common)
            ]
        for part in parts:
            if self.device.type == "cpu":
                _force_sum_reduction(part)
            part.to_empty(device=self.device)
            with torch.no_grad(), warnings.catch_warnings():
                if config.model.hf_path:
                    # Every weight is replaced from the checkpoint right after: torch's
                    # notice about random init of DTensors on a CPU mesh does not apply.
                    warnings.filterwarnings("ignore", message=DTENSOR_CPU_RANDOM_NOTICE)
                part.init_weights(buffer_device=None)
            part.train()
        return parts

    # ---- verl's interface: modules, data parallelism, offload ---------------------------
    def model_modules(self) -> list[torch.nn.Module]:
        """The model parts on this rank: one, or one per pipeline stage held here."""
        return self.model_parts

    def get_data_parallel_size(self) -> int:
        """Data-parallel ranks: ``data_parallel_replicate_degree x data_parallel_shard_degree``
        (torchtitan's ``batch`` mesh), 1 without data parallelism."""
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

    def get_per_tensor_param(self, sharded: bool = False
                             ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict | None]:
        """What a generator needs to serve this policy, one tensor at a time (verl's
        ``get_per_tensor_param``): ``(tensors, adapter_config)``.

        Without LoRA ``tensors`` yields ``(HF name, tensor)`` for every entry of
        :meth:`hf_state_dict`, in its order and with its values: each is converted
        (state-dict adapter ``to_hf``, one torchtitan key at a time) and gathered to a
        full tensor (``full_tensor()``) only when the generator reaches it, so at most
        one gathered tensor is alive beyond the ones the caller keeps: never a second full
        copy of the model. Gathering is a collective under FSDP/TP: every rank must iterate
        in step. With ``sharded=True`` the tensors come as held (DTensor shards, no
        collective, no copy), for a consumer that writes each rank's own shard (the weight
        publisher, ``RLTrainer.push_weights``). ``adapter_config`` is None.

        With LoRA the base never changes: ``tensors`` yields the adapters in PEFT names
        (:meth:`adapter_state_dict`, full, small) and ``adapter_config`` is their
        ``adapter_config.json`` mapping (:meth:`adapter_config`).

        The tensors are detached and share storage with the parameters where no gather or
        layout change was needed: copy one before the next optimizer step if it must not
        change. With parameter offload on, the parameters are on the engine's device until
        the generator finishes (or is closed).

        Raises:
            ValueError: the model has no HF state-dict adapter.
        """
        self._check_hf_names()
        if self.lora_enabled:
            return iter(self.adapter_state_dict().items()), self.adapter_config()
        return self._hf_tensors(sharded), None

    def _hf_tensors(self, sharded: bool) -> Iterator[tuple[str, torch.Tensor]]:
        with self.resident(optimizer=False), torch.no_grad():
            for key, value in self.model_state_dict().items():
                for name, hf_value in self._to_hf({key: value}).items():
                    yield name, (hf_value if sharded else _full(hf_value)).detach()

    def _check_hf_names(self) -> None:
        """Raise ValueError unless the model's weights have HF names (a state-dict adapter)."""
        if self.sd_adapter is None:
            raise ValueError(f"model.name={self.config.model.name!r} has no HF adapter")

    def _to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` (model keys) in HF names and layout (the state-dict adapter's
        ``to_hf``); the ``hf`` backend's keys are HF names already."""
        self._check_hf_names()
        return self.sd_adapter.to_hf(state_dict)

    # ---- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Train state saved with checkpoints (``train_state``): the step counter."""
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in torchtitan layout (DTensors under DP/TP), all parts."""
        with self.resident(optimizer=False):
            return ModelWrapper(self.model_parts).state_dict()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in HF layout (torchtitan's state-dict adapter ``to_hf``).
        Under LoRA these are the frozen base weights, without the adapters (see
        :meth:`adapter_state_dict`, :meth:`merged_hf_state_dict`)."""
        return self._to_hf(self.model_state_dict())

    def merged_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered, every rank) HF weights with the adapters merged: each adapted
        ``W`` becomes ``W + (alpha / rank) B @ A`` (:func:`forge_ext.engine.lora.merge_into`,
        computed in fp32, cast to ``W``'s dtype); without LoRA, the full HF weights. A
        collective under FSDP/DP: every rank must call it."""
        from forge_ext.engine.lora import merge_into

        base = {k: _full(v).detach() for k, v in self.hf_state_dict().items()}
        if not self.lora_enabled:
            return base
        return merge_into(base, self.adapter_state_dict(), self.adapter_config())

    def load_model_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) tensors in torchtitan layout into every model part; each
        tensor is sharded the way the parameter it replaces is (``distribute_tensor``).

        With LoRA, adapter tensors (``lora_a``/``lora_b``) absent from ``state_dict`` keep
        their values, so an HF base state dict loads as it is.

        Raises:
            KeyError: naming keys of the model missing from ``state_dict``.
        """
        with self.resident(optimizer=False):
            self._load_model_state_dict(state_dict)

    def _load_model_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        wrapper = ModelWrapper(self.model_parts)
        current = wrapper.state_dict()
        # With LoRA a base state dict (from_hf of an HF checkpoint) has no adapter keys:
        # the adapters keep their values.
        missing = sorted(k for k in set(current) - set(state_dict) if not _is_adapter_key(k))
        if missing:
            raise KeyError(f"state dict lacks model keys {missing}")
        sharded = {}
        for key, cur in current.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if isinstance(cur, DTensor) and not isinstance(value, DTensor):
                value = distribute_tensor(
                    value.detach().to(cur.device, cur.dtype), cur.device_mesh, cur.placements
                )
            sharded[key] = value
        wrapper.load_state_dict(sharded)

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the weights with full tensors in HF names and layout (the inverse of
        :meth:`hf_state_dict`; each PP stage and DP/TP shard takes its part). Optimizer state
        is left as is.

        Raises:
            KeyError: naming model keys the converted state dict lacks.
        """
        if self.sd_adapter is None:
            raise ValueError(f"model.name={self.config.model.name!r} has no HF adapter")
        self.load_model_state_dict(self.sd_adapter.from_hf(state_dict))

    def load_hf_weights(self, hf_path: str) -> None:
        """Load HF safetensors from ``hf_path`` through the adapter and DCP's HF reader
        (the path torchtitan's ``CheckpointManager.dcp_load`` takes for ``from_hf``). With
        ``model.value_head`` a checkpoint without ``score.weight`` (a causal LM) loads every
        weight but the head, which keeps its zeros."""
        wrapper = ModelWrapper(self.model_parts)
        hf_sd = self.sd_adapter.to_hf(wrapper.state_dict())
        if self.config.model.value_head and VALUE_HEAD_HF_NAME not in checkpoint_tensor_names(
                hf_path):
            # A critic from a causal LM: its value head keeps its init (zeros), the LM head
            # is not read (models.apply_value_head); load_state_dict below is not strict.
            hf_sd.pop(VALUE_HEAD_HF_NAME, None)
        dcp.load(hf_sd, storage_reader=self.sd_adapter.get_hf_storage_reader(hf_path, False))
        wrapper.load_state_dict(self.sd_adapter.from_hf(hf_sd))

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter of the model parts (frozen base weights too, under LoRA)."""
        return [p for m in self.model_parts for p in m.parameters()]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates: all of them, or only the adapters under
        LoRA (torchtitan's optimizer container takes the ``requires_grad`` ones)."""
        return [p for p in self.parameters() if p.requires_grad]

    # ---- LoRA ----------------------------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        """Whether the model trains LoRA adapters (``trainer.lora`` set) instead of every
        weight."""
        return self.config.lora is not None

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters in PEFT's names and layout (:mod:`forge_ext.engine.lora`): for each
        adapted HF module ``m`` (``model.layers.{i}.self_attn.q_proj``, ...),
        ``base_model.model.<m>.lora_A.weight`` ``[rank, in]`` and ``...lora_B.weight``
        ``[out, rank]``, so that the module computes ``x W^T + (alpha / rank) x A^T B^T``
        (torchtitan ``LoRALinear``: ``lora_a.weight`` is A, ``lora_b.weight`` is B).

        Every rank returns the full tensors: DTensor shards (FSDP/DP) are gathered with
        ``full_tensor()``, a collective, so every rank of the trainer must call it
        (pipeline parallelism, where ranks hold different layers, is refused with LoRA).
        The tensors are detached copies in the parameters' dtype (fp32 by default) on the
        engine's device.

        Raises:
            ValueError: LoRA is off (no ``lora`` section).
        """
        from forge_ext.engine.lora import peft_key

        if not self.lora_enabled:
            raise ValueError("adapter_state_dict: LoRA is off; set trainer.lora.rank")
        out: dict[str, torch.Tensor] = {}
        with self.resident(optimizer=False):
            for titan_module, (weight, *tensors) in _adapter_modules(self.model_parts).items():
                module = self._hf_module_name(titan_module, weight)
                for matrix, value in zip("AB", tensors):
                    out[peft_key(module, matrix)] = _full(value).detach().clone()
        return out

    def load_adapter_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the adapters from full tensors in PEFT names (the inverse of
        :meth:`adapter_state_dict`: a PEFT folder's ``adapter_model.safetensors``); each is
        sharded like the parameter it replaces. Optimizer state is left as is.

        Raises:
            ValueError: LoRA is off, or ``tensors`` does not name exactly this model's adapters
                (under PP: this stage's), or a shape differs.
        """
        from forge_ext.engine.lora import peft_key

        if not self.lora_enabled:
            raise ValueError("load_adapter_state_dict: LoRA is off; set trainer.lora.rank")
        targets = {}
        for titan_module, (weight, a, b) in _adapter_modules(self.model_parts).items():
            module = self._hf_module_name(titan_module, weight)
            targets[peft_key(module, "A")], targets[peft_key(module, "B")] = a, b
        if set(tensors) != set(targets):
            extra, missing = sorted(set(tensors) - set(targets)), sorted(set(targets) - set(tensors))
            raise ValueError(f"adapter tensors do not match the model's adapters: extra "
                             f"{extra[:3]}, missing {missing[:3]}")
        with torch.no_grad(), self.resident(optimizer=False):
            for key, param in targets.items():
                value = tensors[key].detach()
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"{key}: shape {tuple(value.shape)}, the adapter's is "
                                     f"{tuple(param.shape)}")
                value = value.to(param.device, param.dtype)
                if isinstance(param, DTensor):
                    value = distribute_tensor(value, param.device_mesh, param.placements)
                param.copy_(value)

    def adapter_config(self) -> dict[str, Any]:
        """``adapter_config.json`` of :meth:`adapter_state_dict`
        (:func:`forge_ext.engine.lora.peft_adapter_config`: ``r``, ``lora_alpha``, the HF
        ``target_modules``, ``base_model_name_or_path`` = ``model.hf_path``).

        Raises:
            ValueError: LoRA is off.
        """
        from forge_ext.engine.lora import peft_adapter_config

        if not self.lora_enabled:
            raise ValueError("adapter_config: LoRA is off; set trainer.lora.rank")
        lora = self.config.lora
        return peft_adapter_config(
            lora.rank, float(lora.alpha), lora.targets, self.config.model.hf_path
        )

    @contextlib.contextmanager
    def disable_adapter(self):
        """Within the block the model computes its base model: every ``LoRALinear`` runs
        its base class's forward (``x W^T``, the adapter path skipped, not multiplied by 0),
        restored on exit. No copy of any weight: the KL reference of a LoRA policy
        (``docs/lora.md``). A no-op without LoRA. Not re-entrant across threads. PEFT's and
        verl's name (``PeftModel.disable_adapter``); alias :meth:`adapters_disabled`."""
        modules = [m for part in self.model_parts for m in part.modules()
                   if hasattr(m, "lora_a") and hasattr(m, "lora_b")]
        for m in modules:
            # An instance attribute shadows the class's forward; nn.Module.__call__ (and the
            # FSDP hooks around it) are unchanged.
            m.forward = super(type(m), m).forward
        try:
            yield
        finally:
            for m in modules:
                del m.forward

    def adapters_disabled(self):
        """Alias of :meth:`disable_adapter` (this project's earlier name)."""
        return self.disable_adapter()

    def export_hf(self, folder: str | os.PathLike, *, dtype: torch.dtype | None = None,
                  max_shard_bytes: int | None = None) -> dict[str, Any]:
        """Write the model as a Hugging Face checkpoint folder that transformers and vLLM
        load (safetensors shards, ``config.json``, ``model.hf_path``'s tokenizer files and
        ``generation_config.json``), atomically; tensors are gathered one at a time and each
        pipeline stage's first rank writes its own (:func:`forge_ext.engine.export.export_hf`).
        A collective: every rank calls it.

        Args:
            dtype: cast floating-point weights to it (None: the parameters' dtype).
            max_shard_bytes: largest safetensors file (default 5 GB).

        Returns:
            ``{"folder", "bytes", "files", "seconds"}``.

        Raises:
            ValueError: under LoRA (the base's weights are not the policy:
                :meth:`export_lora` writes the adapter and the merged model), or a model
                without a ``config.json`` source (a registry flavor without ``model.hf_path``).
            forge_ext.runtime.disk.OutputWriteError: not enough space, or a write failed (every rank).
        """
        from forge_ext.engine.export import export_hf
        from forge_ext.engine.hf_checkpoint import DEFAULT_MAX_SHARD_BYTES

        if self.lora_enabled:
            raise ValueError("export_hf: the model trains LoRA adapters; export_lora writes "
                             "the adapter (and the merged model with merged_folder)")
        return export_hf(self, folder, dtype=dtype,
                         max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)

    def export_lora(self, folder: str | os.PathLike, merged_folder: str | os.PathLike | None = None
                    ) -> dict[str, str]:
        """Write the adapters as a PEFT folder (:meth:`adapter_state_dict`,
        :meth:`adapter_config`; ``adapter_config.json`` + ``adapter_model.safetensors``,
        atomically, :func:`forge_ext.engine.lora.write_peft_folder`) that
        ``peft.PeftModel.from_pretrained(base, folder)`` and vLLM's ``LoRARequest`` load;
        with ``merged_folder`` also a merged HF checkpoint there
        (:meth:`merged_hf_state_dict`, ``config.json`` and tokenizer files from
        ``model.hf_path``, :func:`forge_ext.engine.hf_checkpoint.save_hf_checkpoint`).

        A collective (the adapters are gathered on every rank); rank 0 writes. Returns
        ``{"adapter": folder, "merged": merged_folder or ""}``.

        Raises:
            ValueError: LoRA is off, or ``merged_folder`` without a config.json source
                (``model.hf_path`` or a small flavor).
        """
        from forge_ext.engine.export import hf_config_of
        from forge_ext.engine.hf_checkpoint import save_hf_checkpoint
        from forge_ext.engine.lora import write_peft_folder

        m = self.config.model
        if merged_folder is not None:  # on every rank, before the collectives
            try:
                config = hf_config_of(m)
            except ValueError as e:
                raise ValueError(f"lora.export_merged: {e}") from None
        tensors = {k: v.cpu() for k, v in self.adapter_state_dict().items()}
        merged = self.merged_hf_state_dict() if merged_folder is not None else None
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_peft_folder(folder, tensors, self.adapter_config())
            if merged is not None:
                save_hf_checkpoint(merged_folder, {k: v.cpu() for k, v in merged.items()},
                                   config, tokenizer_from=m.hf_path)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # the folders exist on return, on every rank
        return {"adapter": str(folder), "merged": str(merged_folder or "")}

    def _hf_module_name(self, titan_module: str, weight: torch.Tensor) -> str:
        """HF module name of a torchtitan linear module (``layers.0.attention.qkv_linear.wq``
        -> ``model.layers.0.self_attn.q_proj``), through the model's state-dict adapter."""
        if self.sd_adapter is None:
            raise ValueError(f"model.name={self.config.model.name!r} has no HF adapter")
        probe = torch.empty(weight.shape, device="meta")
        hf = list(self.sd_adapter.to_hf({f"{titan_module}.weight": probe}))
        if len(hf) != 1 or not hf[0].endswith(".weight"):
            raise ValueError(f"no HF name for the adapted module {titan_module!r}: {hf}")
        return hf[0].removesuffix(".weight")

    # ---- microbatching -----------------------------------------------------------------
    def check_batch(self, batch: Batch) -> None:
        """Raise the errors :meth:`microbatches` would, without splitting (no collective)."""
        validate_batch(batch, self.config)

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
        validate_batch(batch, self.config)
        t = self.config.training
        if t.max_tokens_per_microbatch is None:
            return split_batch(batch, self.num_microbatches)
        lengths = token_budget.row_lengths(batch).tolist()
        plan = (token_budget.plan_packing if t.packing else token_budget.plan_token_budget)(
            lengths, t.max_tokens_per_microbatch, t.pad_to_multiple_of
        )
        count = self._dp_max(torch.tensor(max(len(plan), 1), device=self.device))
        plan = token_budget.equalize(plan, int(count), lengths)
        build = token_budget.packed_microbatch if t.packing else token_budget.padded_microbatch
        return [build(batch, rows, lengths, t.pad_to_multiple_of) for rows in plan]

    # ---- the microbatch core -----------------------------------------------------------
    def forward_backward_batch(
        self,
        data_iterator: Iterable[Batch],
        loss_fn: LossFn | None,
        loss_weight_fn: LossWeightFn | None,
        output_post_hook: Callable[[torch.Tensor, Batch], Any] | None = None,
        return_outputs: bool = False,
        forward_only: bool = False,
    ) -> ForwardBackwardOutputs:
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
            microbatches = [_pad_to(mb, self.config.training.seq_len) for mb in microbatches]
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
            global_weight = self._dp_sum(torch.stack(weights).sum())
            out.global_weight = float(global_weight)
        loss_term = _LossTerm(
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
            totals = self._dp_sum(local).tolist()
            out.loss = totals[0] if self.pp_has_last_stage else None
            out.metrics = {
                name: total / out.global_weight if out.global_weight else math.nan
                for name, total in zip(names, totals[1:])
            }
        return out

    def _pipeline_steps(
        self, groups: list[list[Batch]], units: list[Batch], loss_term: "_LossTerm",
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

    def _model_forward(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """Logits ``[b, L, V]``; a packed microbatch (``position_ids``) runs with positions
        restarting per sequence and attention confined to each (document masks)."""
        if "position_ids" not in mb:
            return model(mb["input_ids"])
        positions = mb["position_ids"]
        if self.config.model.attn_backend == "sdpa":
            masks = DocumentMask(token_budget.block_causal_mask(positions))
        else:  # flex / varlen: torchtitan's own document masks
            masks = model.get_attention_masks(positions)
        return model(mb["input_ids"], positions=positions, attention_masks=masks)

    def _dp_max(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s maximum over this rank's data-parallel group (a collective)."""
        if self.dp_mesh is None or self.dp_mesh.size() == 1:
            return x
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.dp_mesh.get_group())
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
        most, negated_least = self._dp_max(
            torch.tensor([count, -count], dtype=torch.int64, device=self.device)
        ).tolist()
        if most != -negated_least:
            raise RuntimeError(
                f"data-parallel ranks disagree on the microbatch count: this rank has "
                f"{count}, the group between {-negated_least} and {most}; every rank must "
                "run as many (FSDP's collectives pair up per microbatch), so the split must "
                "equalise them (microbatches() does, with a MAX all-reduce, under "
                "training.max_tokens_per_microbatch)"
            )

    def _dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over this rank's data-parallel group (a collective: every rank of
        the group must call it); ``x`` itself when there is one DP rank. ``x`` must be on
        ``self.device``."""
        if self.dp_mesh is None or self.dp_mesh.size() == 1:
            return x
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.dp_mesh.get_group())
        return x

    def _to_device(self, mb: Batch) -> Batch:
        tensors = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
        return mb.with_tensors(tensors) if isinstance(mb, token_budget.Microbatch) else tensors

    # ---- optimizer verbs ---------------------------------------------------------------
    def optimizer_zero_grad(self) -> None:
        self.optimizers.zero_grad()

    def optimizer_step(self) -> float:
        with self.resident(optimizer=True):
            return self._optimizer_step()

    def _clip_grad_norm(self) -> torch.Tensor:
        """Clip the trainable parameters' gradients to ``training.max_norm``; return the
        pre-clip norm over all ranks and stages (torchtitan's ``clip_grad_norm_``)."""
        return dist_utils.clip_grad_norm_(
            self.trainable_parameters(),
            self.config.training.max_norm,
            foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"),
            ep_enabled=self.parallel_dims.ep_enabled,
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
        self.lr_schedulers.step()
        return self.current_lr()

    def current_lr(self) -> float:
        return float(self.lr_schedulers.schedulers[0].get_last_lr()[0])

    # ---- checkpoints -------------------------------------------------------------------
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
            self._save_checkpoint(step)

    def _save_checkpoint(self, step: int) -> None:
        folder = self.checkpointer.folder
        # Not last_step=True: torchtitan's last-step save skips the keep_latest_k purge.
        self._last_checkpoint_bytes = disk.write_checkpoint(
            lambda: self.checkpointer.save(step),
            what=f"checkpoint step {step}",
            path=os.path.join(folder, f"step-{step}"),
            folder=folder,
            needed_bytes=self._last_checkpoint_bytes,
            gather=_all_gather if dist.is_initialized() and dist.get_world_size() > 1 else None,
        )

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
        self.checkpointer.close()


_ADAPTER_SUFFIXES = (".lora_a.weight", ".lora_b.weight")


def _is_adapter_key(key: str) -> bool:
    """Whether a torchtitan state-dict key is a LoRA adapter's (``LoRALinear``)."""
    return key.endswith(_ADAPTER_SUFFIXES)


def _adapter_modules(parts: list[torch.nn.Module]) -> dict[str, tuple[torch.Tensor, ...]]:
    """``{torchtitan module name: (base weight, lora_a.weight, lora_b.weight)}`` of the
    model parts' ``LoRALinear`` modules, in module order."""
    found = {}
    for part in parts:
        for name, module in part.named_modules():
            if hasattr(module, "lora_a") and hasattr(module, "lora_b"):
                found[name] = (module.weight, module.lora_a.weight, module.lora_b.weight)
    return found


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class _TrainableModelWrapper(ModelWrapper):
    """torchtitan's checkpoint ``ModelWrapper`` restricted to the LoRA adapters: a save
    writes only them and a load restores only them (``ModelWrapper.load_state_dict`` loads
    non-strictly), the frozen base staying as loaded from ``model.hf_path``."""

    def _get_state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super()._get_state_dict().items() if _is_adapter_key(k)}


def _all_gather(obj: Any) -> list[Any]:
    """``obj`` from every rank of the default group (the ranks that save a checkpoint)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def validate_batch(batch: Batch, config: EngineConfig) -> None:
    """Check a batch's fields and shapes against the config (see ``TitanEngine.microbatches``)."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError("batch must be a dict with 'input_ids' [batch, seq] (int64)")
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(
            f"batch['input_ids'] must be [batch, seq] int64, got {tuple(ids.shape)} {ids.dtype}"
        )
    bsz, seq = ids.shape
    # A token budget takes any number of rows (the controller balances ranks by tokens).
    fixed_rows = config.training.max_tokens_per_microbatch is None
    if fixed_rows and bsz != config.training.local_batch_size:
        raise ValueError(
            f"batch['input_ids'] has batch size {bsz}, expected "
            f"training.local_batch_size={config.training.local_batch_size}"
        )
    if seq > config.training.seq_len:
        raise ValueError(
            f"batch['input_ids'] has sequence length {seq} > training.seq_len="
            f"{config.training.seq_len}"
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


def _pad_to(mb: Batch, seq_len: int) -> Batch:
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


def _force_sum_reduction(model: torch.nn.Module) -> None:
    """Make FSDP reduce gradients with plain SUM collectives.

    torchtitan disables FSDP's gradient division (the loss is already normalised by the
    global weight), yet FSDP still issues ``ReduceOp.PREMUL_SUM``, which gloo lacks
    (``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``). With a divide factor of 1 a
    plain SUM is the same reduction.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


class _LossTerm:
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
        if isinstance(loss, tuple):  # (loss, metrics): see base.LossFn
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


class _PipelineLoss:
    """The loss callable handed to torchtitan's ``pipelining_fn`` at build time; the engine
    points it at the current step's :class:`_LossTerm` before each ``schedule.step``."""

    def __init__(self):
        self.term: _LossTerm | None = None
        self.units: list[Batch] = []

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, **_: Any):
        if self.term is None or logits.device.type == "meta":
            # Shape inference by the schedule: any scalar depending on the output will do.
            return logits.sum() * 0.0, {}
        index = int(target.reshape(-1)[0])
        return self.term(logits, self.units[index], index), {}
