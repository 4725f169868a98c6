"""The ``hf`` engine backend: any Hugging Face ``AutoModelForCausalLM`` checkpoint, driven by
the same microbatch core as :class:`forge_ext.engine.titan.TitanEngine` (issue 40, part 2).

A first step: one process, no parallelism, full fine-tuning. The model is transformers'
own module (``AutoModelForCausalLM.from_pretrained(model.hf_path)``, SDPA attention), so a
family torchtitan lacks (Qwen2 with q/k/v biases, Mistral, Gemma, ...) trains as it is
served. Everything else is shared with the titan backend by inheritance: the microbatch core
(``forward_backward_batch``: one loss normalisation, gradient accumulation, token budget),
torchtitan's optimizer and LR-scheduler containers (which take any module) and the verl
interface (modes, offload, ``to``). What it does not do yet (data, tensor, pipeline or context
parallelism, LoRA, packing, activation checkpointing, compile, checkpoints) is refused by
:func:`validate_hf_engine` when the config is read, before anything is spawned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import utils as titan_utils

from forge_ext.engine.base import MODEL_TYPE, Batch, EngineRegistry
from forge_ext.engine.config import EngineConfig, engine_config_from_mapping
from forge_ext.engine.models import read_hf_config
from forge_ext.engine.titan import TitanEngine


def validate_hf_engine(config: EngineConfig) -> None:
    """Refuse what the ``hf`` backend does not do yet, naming the field and the fix.

    Raises:
        ValueError: a parallel degree above 1, LoRA, packing, activation checkpointing,
            compile or checkpoints; no ``model.hf_path``; ``training.seq_len`` beyond the
            checkpoint's ``max_position_embeddings``.
        FileNotFoundError: ``model.hf_path`` without a config.json.
    """
    par = config.parallelism
    for name in ("pipeline_parallel_degree", "tensor_parallel_degree",
                 "context_parallel_degree", "data_parallel_replicate_degree",
                 "expert_parallel_degree"):
        degree = getattr(par, name, 1)
        if degree > 1:
            raise ValueError(
                f"engine=hf does not support parallelism.{name}={degree} (one process for "
                "now); use engine=titan for Qwen3 / Llama 3, or parallelism."
                f"{name}=1"
            )
    if par.data_parallel_shard_degree > 1:
        raise ValueError(
            f"engine=hf does not support parallelism.data_parallel_shard_degree="
            f"{par.data_parallel_shard_degree} yet (one process); set it to 1 or -1"
        )
    unsupported = {
        "lora": config.lora is not None,
        "training.packing": config.training.packing,
        "activation_checkpoint.mode": config.activation_checkpoint.mode != "none",
        "compile.enable": config.compile.enable,
        "checkpoint.enable": config.checkpoint.enable,
    }
    for name, used in unsupported.items():
        if used:
            raise ValueError(f"engine=hf does not support {name} yet; remove it or use "
                             "engine=titan")
    if config.model.attn_backend != "sdpa":
        raise ValueError(f"engine=hf runs transformers' SDPA attention; set "
                         f"model.attn_backend=sdpa, not {config.model.attn_backend!r}")
    if not config.model.hf_path:
        raise ValueError("engine=hf needs model.hf_path (a Hugging Face checkpoint directory)")
    hf = read_hf_config(config.model.hf_path)
    longest = hf.get("max_position_embeddings")
    if longest is not None and config.training.seq_len > longest:
        raise ValueError(f"training.seq_len={config.training.seq_len} exceeds the checkpoint's "
                         f"max_position_embeddings={longest}")


@EngineRegistry.register(MODEL_TYPE, "hf")
class HFEngine(TitanEngine):
    """An ``AutoModelForCausalLM`` with optimizer and LR scheduler, driven in microbatches by
    :class:`TitanEngine`'s core (``trainer.engine: hf``); one process.

    Args:
        config: an :class:`EngineConfig` (``engine: hf``) or its mapping.

    Raises:
        ValueError: a config error (:func:`validate_hf_engine`).
    """

    def __init__(self, config: EngineConfig | dict):
        # Not TitanEngine.__init__ (no torchtitan model, device mesh or checkpointer): the
        # attributes its microbatch core and verbs read are set here instead.
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if not isinstance(config, EngineConfig):
            config = engine_config_from_mapping(config)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size > 1:  # each process would train its own copy, silently
            raise ValueError(f"engine=hf runs on one process for now, not WORLD_SIZE="
                             f"{world_size}; use engine=titan for data parallelism")
        self.config = config
        self.device = titan_utils.get_local_device()
        self.num_microbatches = config.num_microbatches()
        self.num_pp_microbatches = 1
        self.pp_schedule = None
        self.pp_has_first_stage = self.pp_has_last_stage = True
        self.train_context = contextlib.nullcontext  # no SPMD context without a mesh
        self.dp_mesh = None
        self.sd_adapter = None
        torch.manual_seed(config.seed)
        # No "Loading weights" bar in the middle of a run's console (restored after), as
        # the transformers generator (forge_ext/rollout/engines/hf.py).
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                config.model.hf_path, dtype=TORCH_DTYPE_MAP[config.training.dtype],
                attn_implementation="sdpa",
            ).to(self.device)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        model.train()
        self.model_parts = [model]
        self.optimizers = config.optimizer.to_titan().build(model_parts=self.model_parts)
        self.lr_schedulers = config.lr_scheduler.build(
            optimizers=self.optimizers, training_steps=config.training.steps
        )
        self.step = 0
        self.checkpointer = None
        self._optimizer_homes: dict[tuple[int, str], torch.device] = {}
        self.offload()

    def _model_forward(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """Logits ``[b, L, V]`` of transformers' model (causal, no padding mask: right
        padding never changes an earlier position)."""
        return model(input_ids=mb["input_ids"], use_cache=False).logits

    def _clip_grad_norm(self) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(
            self.trainable_parameters(), self.config.training.max_norm, foreach=True
        )

    # ---- weights: HF names already -------------------------------------------------------
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict, in HF names (transformers' module)."""
        with self.resident(optimizer=False):
            return self.model_parts[0].state_dict()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Same as :meth:`model_state_dict`: the module is transformers' own."""
        return self.model_state_dict()

    def load_model_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full tensors in HF names (strict: every key of the model, no other).

        Raises:
            RuntimeError: missing or unexpected keys (``load_state_dict(strict=True)``).
        """
        with self.resident(optimizer=False):
            self.model_parts[0].load_state_dict(state_dict, strict=True)

    load_hf_state_dict = load_model_state_dict

    def get_per_tensor_param(self, sharded: bool = False
                             ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict | None]:
        """``(tensors, None)``: ``(HF name, tensor)`` of :meth:`hf_state_dict`, one at a
        time; nothing to gather in one process, so ``sharded`` changes nothing."""
        return self._hf_tensors(), None

    def _hf_tensors(self, sharded: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        with self.resident(optimizer=False):
            yield from ((k, v.detach()) for k, v in self.model_parts[0].state_dict().items())

    # ---- refused until implemented (validate_hf_engine refuses the configs first) -------
    def save_checkpoint(self, step: int) -> None:
        raise ValueError("engine=hf does not save checkpoints yet; use engine=titan")

    def load_checkpoint(self, step: int | None = None) -> int:
        raise ValueError("engine=hf does not load checkpoints yet; use engine=titan")

    def close(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}
