"""The engine's model weights in every layout its callers need, written once for both
backends: torchtitan's state dict (checkpoints), Hugging Face names (generators, export),
PEFT adapters (LoRA); loading each back; the LoRA switch; the HF and PEFT folders.

:class:`ModelWeights` is a base of :class:`forge_ext.engine.base.BaseEngine`. What a backend
says about its names are three hooks: :meth:`ModelWeights._to_hf` (model keys -> HF names and
layout: the titan backend's state-dict adapter; the ``hf`` backend's keys are HF names
already), :meth:`ModelWeights._hf_module_name` (the HF name of an adapted linear layer) and
:meth:`ModelWeights.load_hf_state_dict`. Both backends' LoRA layers name their adapters
``<module>.lora_a.weight`` / ``lora_b.weight`` (:func:`forge_ext.engine.lora.is_adapter_key`).
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.components.checkpoint import ModelWrapper

from forge_ext.engine import export
from forge_ext.engine.hf_checkpoint import DEFAULT_MAX_SHARD_BYTES, save_hf_checkpoint
from forge_ext.engine.lora import (
    is_adapter_key, merge_into, peft_adapter_config, peft_key, write_peft_folder,
)


class ModelWeights(ABC):
    """The weight verbs of an engine (module docstring). Reads the engine's ``config``,
    ``model_parts`` and ``resident`` (:class:`forge_ext.engine.base.BaseEngine`)."""

    # ---- what a backend says about its names ----------------------------------------------
    @abstractmethod
    def _to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` (model keys) in HF names and layout; the LoRA adapters travel in
        PEFT names instead (:meth:`adapter_state_dict`).

        Raises:
            ValueError: the model has no HF names (no state-dict adapter).
        """

    @abstractmethod
    def _hf_module_name(self, module: str, weight: torch.Tensor) -> str:
        """The HF name of the adapted linear layer ``module`` (a name of the model's own,
        e.g. ``layers.0.attention.qkv_linear.wq`` -> ``model.layers.0.self_attn.q_proj``);
        ``weight`` is its base weight (shape for the conversion)."""

    @abstractmethod
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the weights with full tensors in HF names and layout (the inverse of
        :meth:`hf_state_dict`; each PP stage and DP/TP shard takes its part). Optimizer state
        is left as is.

        Raises:
            KeyError: naming model keys the converted state dict lacks.
        """

    def _check_hf_names(self) -> None:
        """Raise ValueError unless the model's weights have HF names (checked before a
        generator starts); every model has them unless its backend says otherwise."""

    # ---- state dicts ---------------------------------------------------------------------
    def get_per_tensor_param(self, sharded: bool = False
                             ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict | None]:
        """What a generator needs to serve this policy, one tensor at a time (verl's
        ``get_per_tensor_param``): ``(tensors, adapter_config)``.

        Without LoRA ``tensors`` yields ``(HF name, tensor)`` for every entry of
        :meth:`hf_state_dict`, in its order and with its values: each is converted
        (:meth:`_to_hf`, one model key at a time) and gathered to a
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
            ValueError: the model has no HF names (no state-dict adapter).
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

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in torchtitan layout (DTensors under DP/TP), all parts."""
        with self.resident(optimizer=False):
            return ModelWrapper(self.model_parts).state_dict()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in HF names and layout (:meth:`_to_hf`: the titan backend's
        state-dict adapter ``to_hf``).
        Under LoRA these are the frozen base weights, without the adapters (see
        :meth:`adapter_state_dict`, :meth:`merged_hf_state_dict`)."""
        return self._to_hf(self.model_state_dict())

    def merged_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered, every rank) HF weights with the adapters merged: each adapted
        ``W`` becomes ``W + (alpha / rank) B @ A`` (:func:`forge_ext.engine.lora.merge_into`,
        computed in fp32, cast to ``W``'s dtype); without LoRA, the full HF weights. A
        collective under FSDP/DP: every rank must call it."""
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
        missing = sorted(k for k in set(current) - set(state_dict) if not is_adapter_key(k))
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
            forge_ext.runtime.disk.OutputWriteError: not enough space, or a write failed
                (every rank).
        """
        if self.lora_enabled:
            raise ValueError("export_hf: the model trains LoRA adapters; export_lora writes "
                             "the adapter (and the merged model with merged_folder)")
        return export.export_hf(self, folder, dtype=dtype,
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
        m = self.config.model
        if merged_folder is not None:  # on every rank, before the collectives
            try:
                config = export.hf_config_of(m)
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



def _adapter_modules(parts: list[torch.nn.Module]) -> dict[str, tuple[torch.Tensor, ...]]:
    """``{module name: (base weight, lora_a.weight, lora_b.weight)}`` of the model parts'
    LoRA layers, in module order."""
    found = {}
    for part in parts:
        for name, module in part.named_modules():
            if hasattr(module, "lora_a") and hasattr(module, "lora_b"):
                found[name] = (module.weight, module.lora_a.weight, module.lora_b.weight)
    return found


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t
