"""The ``hf`` engine backend: any Hugging Face ``AutoModelForCausalLM`` checkpoint, driven by
the same microbatch core as :class:`forge_ext.engine.titan.TitanEngine` (issue 40).

The model is transformers' own module (``AutoModelForCausalLM.from_pretrained(
model.hf_path)``, SDPA attention), so a family torchtitan lacks (Qwen2 with q/k/v biases,
Mistral, Gemma, ...) trains as it is served. Everything else is
:class:`forge_ext.engine.base.BaseEngine`'s, as for the titan backend: the microbatch core
(``forward_backward_batch``: one loss normalisation over all microbatches and data-parallel
ranks, gradient accumulation, token budget, packing), the optimizer and LR-scheduler
containers (torchtitan's, which take any module), the DCP checkpoint manager
(:mod:`forge_ext.engine.checkpoint`), the weight and LoRA state verbs
(:mod:`forge_ext.engine.model_weights`) and the verl interface (modes, offload, ``to``).

Data parallelism is FSDP2 (``torch.distributed.fsdp.fully_shard``) over all ranks of the
world, as verl's and AReaL's FSDP engines shard transformers models: each decoder layer
(the classes the model lists in ``_no_split_modules``) is its own FSDP unit, then the root
(embeddings, final norm, LM head, tied or not). FSDP's own gradient division is switched off:
the loss is already normalised by the global weight, so gradients are summed.

LoRA is forge_ext's own adapter (:class:`LoRALinear`, torchtitan's ``LoRALinear`` formula on
transformers' ``nn.Linear``): the base weights keep their HF names and the adapters export in
PEFT's names, the titan backend's contract (``docs/lora.md``).

A checkpoint's dropout is turned off (:func:`turn_off_dropout`): RL trains the policy the
generator samples from, and the on-policy ratio is exactly 1.

What it does not do (tensor, pipeline, context or expert parallelism, replication, activation
checkpointing, compile) is refused by :meth:`HFEngine.validate_config` when the config is
read, before anything is spawned.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP

from forge_ext.engine import microbatch as token_budget
from forge_ext.engine.attention import DocumentMask
from forge_ext.engine.base import BaseEngine
from forge_ext.engine.config import EngineConfig
from forge_ext.engine.core import Batch
from forge_ext.engine.distributed import init_single_process_env
from forge_ext.engine.lora import is_adapter_key
from forge_ext.engine.models import read_hf_config
from forge_ext.engine.registry import MODEL_TYPE, EngineRegistry, engine_config_from_mapping
from forge_ext.engine.schema import check_model_limits, checkpoint_label

logger = logging.getLogger(__name__)

_DROPOUT_NAME = re.compile(r"dropout|pdrop|layerdrop")
"""Names of dropout probabilities in transformers' configs and modules: ``attention_dropout``,
``hidden_dropout``, ``resid_pdrop``, ``embd_pdrop``, ``activation_dropout``, ``layerdrop``,
``hidden_dropout_prob``, ..."""
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)
"""torch's dropout modules (their ``p``)."""


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter: ``x W^T + b + (alpha / rank) x A^T B^T``, ``A =
    lora_a.weight [rank, in]`` (kaiming-uniform, ``a = sqrt(5)``), ``B = lora_b.weight
    [out, rank]`` (zeros: training starts at the base model). torchtitan's ``LoRALinear``
    (``torchtitan/components/lora.py``) on transformers' layers, which keep their own
    parameter names (``...q_proj.weight``), so the base's HF names are unchanged and the
    adapters' are ``...q_proj.lora_a.weight`` / ``lora_b.weight`` (what the engine's
    checkpoint and weight verbs look for, :func:`forge_ext.engine.lora.is_adapter_key`)."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_scaling: float

    @classmethod
    def adapt(cls, linear: nn.Linear, rank: int, alpha: float) -> "LoRALinear":
        """Turn ``linear`` into a :class:`LoRALinear` in place (its class and new adapter
        submodules; its weight and bias untouched and frozen)."""
        weight = linear.weight
        linear.__class__ = cls
        linear.lora_a = nn.Linear(linear.in_features, rank, bias=False,
                                  device=weight.device, dtype=weight.dtype)
        linear.lora_b = nn.Linear(rank, linear.out_features, bias=False,
                                  device=weight.device, dtype=weight.dtype)
        nn.init.kaiming_uniform_(linear.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(linear.lora_b.weight)
        linear.lora_scaling = alpha / rank
        return linear

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) + self.lora_scaling * self.lora_b(self.lora_a(input))


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...]) -> int:
    """Freeze every parameter of ``model`` and put a :class:`LoRALinear` adapter on each
    ``nn.Linear`` whose name ends in one of ``targets`` (HF names: ``q_proj``, ...) inside
    the decoder layers (never the LM head). Returns the number of adapted layers.

    Raises:
        ValueError: no linear layer of the model matches ``targets``, naming
            ``lora.target_modules``.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    layers = _decoder_layers(model)
    adapted = 0
    for layer in layers:
        for name, module in list(layer.named_modules()):
            if type(module) is nn.Linear and name.rsplit(".", 1)[-1] in targets:
                LoRALinear.adapt(module, rank, alpha)
                adapted += 1
    if not adapted:
        raise ValueError(f"lora.target_modules={list(targets)} matches no nn.Linear in the "
                         f"decoder layers of {type(model).__name__}; name its linear layers")
    return adapted


def turn_off_dropout(model: nn.Module) -> dict[str, float]:
    """Set every dropout of ``model`` to 0, in place: each dropout module's ``p``
    (:data:`_DROPOUT_MODULES`), each float module attribute and each config field
    (``model.config`` and its sub-configs) named like a dropout probability
    (:data:`_DROPOUT_NAME`; transformers' attention passes ``self.attention_dropout`` to SDPA
    in training mode, OPT's layers and LayerDrop read floats). An RL step's log-probs are
    then the same in training and evaluation mode: trainer, reference and generator (vLLM
    has no dropout) compute one policy, and the on-policy ratio is exactly 1 (TRL's
    ``disable_dropout_in_model``, PR #3234, which zeroes the modules only).

    Returns:
        ``{name: p}`` of what was on: config fields by their name (``resid_pdrop``), modules
        and attributes by their module's class (``GPT2Attention.attn_dropout``).
    """
    found: dict[str, float] = {}

    def probability(name: str, value: object) -> bool:
        return (bool(_DROPOUT_NAME.search(name)) and isinstance(value, (int, float))
                and not isinstance(value, bool) and value > 0)

    configs, seen = [getattr(model, "config", None)], set()
    while configs:
        config = configs.pop()
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        for key, value in list(vars(config).items()):
            if probability(key, value):
                found[key] = float(value)
                setattr(config, key, 0.0)
            elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
                configs.append(value)  # a sub-config (text_config, ...)
    for module in model.modules():
        owner = type(module).__name__
        if isinstance(module, _DROPOUT_MODULES) and module.p > 0:
            found.setdefault(owner, float(module.p))
            module.p = 0.0
        for attr, value in list(vars(module).items()):
            if probability(attr, value) and isinstance(value, float):
                found.setdefault(f"{owner}.{attr}", value)
                setattr(module, attr, 0.0)
    return found


def attention_windows(config: Any) -> dict[str | None, int | None]:
    """The attention window (tokens; None: the whole document) of each kind of decoder layer
    of a transformers config, as its model builds its masks: by ``layer_types`` where the
    config has them (``full_attention``: None; ``sliding_attention``: ``sliding_window``;
    Gemma-2, Qwen2/Qwen3 with ``use_sliding_window``), else one kind for every layer (key
    None) with ``sliding_window`` (Mistral, Phi-3; None when the config has no window).

    Raises:
        ValueError: a layer type a 4-D mask cannot express (chunked, linear or sparse
            attention, ...), naming ``layer_types`` and ``training.packing``.
    """
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return {None: window}
    kinds = {"full_attention": None, "sliding_attention": window}
    other = sorted(set(types) - set(kinds))
    if other:
        raise ValueError(
            f"engine=hf packs rows only for full and sliding-window attention; "
            f"{config.model_type}'s config.json has layer_types {other}: set "
            "training.packing=false")
    return {kind: kinds[kind] for kind in dict.fromkeys(types)}


def packed_attention_mask(windows: dict[str | None, int | None], position_ids: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """transformers' ``attention_mask`` for a packed row: float ``0 / -inf`` ``[b, 1, T, T]``
    block-causal masks (:func:`forge_ext.engine.microbatch.block_causal_mask`), each layer
    kind's with its window (:func:`attention_windows`). One kind: one 4-D mask, which every
    model uses as it is on every layer. Several: ``{layer type: mask}``, the mapping models
    with ``layer_types`` (Gemma-2, Qwen2, ...) take in place of the masks they would build,
    layer ``i`` reading ``mask[config.layer_types[i]]``."""
    masks = {w: DocumentMask(token_budget.block_causal_mask(position_ids, w)).additive(dtype)
             for w in set(windows.values())}
    if len(masks) == 1:
        return next(iter(masks.values()))
    return {kind: masks[w] for kind, w in windows.items()}


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules of the classes transformers lists in
    ``_no_split_modules`` (the unit verl's and AReaL's FSDP wrap policies shard)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(f"engine=hf: {type(model).__name__} lists no decoder layer class "
                         f"(_no_split_modules={sorted(classes)}); it cannot be sharded")
    return layers


def _shard(model: nn.Module, mesh) -> None:
    """FSDP2 over ``mesh``: each decoder layer, then the root (embeddings, final norm and
    LM head, which hold a tied weight together). Gradients are summed, not averaged (the
    loss is normalised by the global weight already); on CPU with plain SUM collectives
    (gloo has no ``PREMUL_SUM``, which FSDP issues otherwise)."""
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if mesh.device_type == "cpu":
                module.set_force_sum_reduction_for_comms(True)


@EngineRegistry.register(MODEL_TYPE, "hf")
class HFEngine(BaseEngine):
    """An ``AutoModelForCausalLM`` with optimizer, LR scheduler and checkpointer, driven in
    microbatches by :class:`~forge_ext.engine.base.BaseEngine`'s core
    (``trainer.engine: hf``); FSDP2 over all ranks when ``WORLD_SIZE > 1``.

    Args:
        config: an :class:`EngineConfig` (``engine: hf``) or its mapping.

    Raises:
        ValueError: a config error (:meth:`validate_config`), or
            ``parallelism.data_parallel_shard_degree`` other than -1 or the world size.
    """

    @classmethod
    def validate_config(cls, config: EngineConfig) -> None:
        """Refuse what the ``hf`` backend does not do, naming the field and the fix.

        Raises:
            ValueError: tensor, pipeline, context or expert parallelism, replication,
                activation checkpointing or compile; a bad batch split or token budget
                (:meth:`EngineConfig.validate`); a bad ``lora`` section; no
                ``model.hf_path``; ``training.seq_len`` beyond the checkpoint's
                ``max_position_embeddings``; ``model.value_head``; ``training.packing`` with
                a layer type other than full or sliding-window attention
                (:func:`attention_windows`).
            FileNotFoundError: ``model.hf_path`` without a config.json.
        """
        par = config.parallelism
        for name in ("pipeline_parallel_degree", "tensor_parallel_degree",
                     "context_parallel_degree", "data_parallel_replicate_degree",
                     "expert_parallel_degree"):
            degree = getattr(par, name, 1)
            if degree > 1:
                raise ValueError(
                    f"engine=hf does not support parallelism.{name}={degree} (its data "
                    "parallelism is FSDP over all ranks, parallelism.data_parallel_shard_degree);"
                    f" use engine=titan for Qwen3 / Llama 3, or parallelism.{name}=1"
                )
        unsupported = {
            "activation_checkpoint.mode": config.activation_checkpoint.mode != "none",
            "compile.enable": config.compile.enable,
            "model.value_head": config.model.value_head,
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"engine=hf does not support {name} yet; remove it or use "
                                 "engine=titan")
        if config.model.attn_backend != "sdpa":
            raise ValueError(f"engine=hf runs transformers' SDPA attention; set "
                             f"model.attn_backend=sdpa, not {config.model.attn_backend!r}")
        config.validate()
        if config.lora is not None:
            config.lora.check()
        if not config.model.hf_path:
            raise ValueError("engine=hf needs model.hf_path (a Hugging Face checkpoint directory)")
        if config.training.packing:  # a layer kind a packed row's mask cannot express
            from transformers import AutoConfig

            attention_windows(AutoConfig.from_pretrained(config.model.hf_path))
        hf = read_hf_config(config.model.hf_path)
        heads = hf.get("num_attention_heads") or 1
        check_model_limits(config.training, config.parallelism,
                           max_seq_len=hf.get("max_position_embeddings"), n_heads=heads,
                           n_kv_heads=hf.get("num_key_value_heads") or heads,
                           model=checkpoint_label(config.model.hf_path))

    def __init__(self, config: EngineConfig | dict):
        if not isinstance(config, EngineConfig):
            config = engine_config_from_mapping(config)
        self.config = config
        # A world of one without torchrun's environment (DCP checkpoints want a process
        # group); as TitanEngine, the rendezvous listens on MASTER_ADDR only.
        init_single_process_env()
        world_size = self._init_distributed()
        shard = config.parallelism.data_parallel_shard_degree
        if shard not in (-1, world_size):
            raise ValueError(f"parallelism.data_parallel_shard_degree={shard} does not fit "
                             f"world size {world_size}: engine=hf shards over all ranks "
                             "(set it to -1 or the number of processes)")
        self.num_microbatches = config.num_microbatches()
        torch.manual_seed(config.seed)  # the same on every rank: LoRA's A starts equal
        model = self._load_model()
        # Each layer kind's window, for the masks of packed rows, read at the first (unpacked
        # rows take the model's own masks).
        self._attention_windows: dict[str | None, int | None] | None = None
        dropout = turn_off_dropout(model)
        if dropout:
            logger.info("engine=hf: dropout off (RL trains the policy the generator samples "
                        "from): %s", ", ".join(f"{k}={v:g}" for k, v in sorted(dropout.items())))
        # A tied weight's second name (``lm_head.weight`` of a tied head) and its first: one
        # tensor, published and exported once, as transformers' save_pretrained writes it.
        first: dict[int, str] = {}
        self._tied = {name: first.setdefault(id(p), name)
                      for name, p in model.named_parameters(remove_duplicate=False)
                      if first.setdefault(id(p), name) != name}
        if config.lora is not None:
            lora = config.lora
            apply_lora(model, lora.rank, float(lora.alpha), lora.targets)
        if world_size > 1:
            self.dp_mesh = init_device_mesh(self.device.type, (world_size,),
                                            mesh_dim_names=("dp_shard",))
            _shard(model, self.dp_mesh)
        model.train()
        self.model_parts = [model]
        self._build_training_state()
        self.offload()

    def _load_model(self) -> nn.Module:
        """transformers' model of ``model.hf_path`` in ``training.dtype`` with SDPA
        attention, on the engine's device."""
        # transformers takes seconds to import: only an hf engine pays for it.
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        config = self.config
        # No "Loading weights" bar in the middle of a run's console (restored after), as
        # the transformers generator (forge_ext/rollout/engines/hf.py).
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            return AutoModelForCausalLM.from_pretrained(
                config.model.hf_path, dtype=TORCH_DTYPE_MAP[config.training.dtype],
                attn_implementation="sdpa",
            ).to(self.device)
        finally:
            if bars:
                hf_logging.enable_progress_bar()

    def _model_forward(self, model: nn.Module, mb: Batch) -> torch.Tensor:
        """Logits ``[b, L, V]`` of transformers' model: causal, no padding mask (right
        padding never changes an earlier position). A packed microbatch (``position_ids``)
        passes its positions and its block-causal masks as float ``attention_mask``
        (the titan backend's :class:`DocumentMask`, one per layer kind with its sliding
        window, :func:`packed_attention_mask`), which transformers hands to SDPA as it
        is. (transformers 5.19 also infers documents from ``position_ids`` when no mask is
        given and no cache is used, splitting wherever a position is not its predecessor +
        1; the explicit masks keep forge_ext's rule, a document starts at position 0,
        whatever the transformers version.)"""
        if "position_ids" not in mb:
            return model(input_ids=mb["input_ids"], use_cache=False).logits
        positions = mb["position_ids"]
        if self._attention_windows is None:
            self._attention_windows = attention_windows(model.config)
        mask = packed_attention_mask(self._attention_windows, positions,
                                     TORCH_DTYPE_MAP[self.config.training.dtype])
        return model(input_ids=mb["input_ids"], position_ids=positions, attention_mask=mask,
                     use_cache=False).logits

    # ---- weights: HF names already -------------------------------------------------------
    def _to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` without the LoRA adapters' entries (they travel in PEFT names,
        :meth:`adapter_state_dict`) and without a tied weight's second name (a tied
        ``lm_head.weight``: the embedding, which vLLM and transformers re-tie): the module's
        names are HF names."""
        return {k: v for k, v in state_dict.items()
                if not is_adapter_key(k) and k not in self._tied}

    def _hf_module_name(self, module: str, weight: torch.Tensor) -> str:
        """``module``: the model's own names are HF names."""
        return module

    def load_model_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full (or sharded) tensors in HF names; under FSDP each full tensor is sharded
        the way the parameter it replaces is. Every key of the model is needed (but the LoRA
        adapters', which keep their values when absent), no other.

        Raises:
            KeyError: missing or unexpected keys.
        """
        with self.resident(optimizer=False):
            extra = sorted(set(state_dict) - set(self.model_state_dict()))
            if extra:
                raise KeyError(f"state dict has keys the model lacks: {extra[:5]}")
            # A tied weight's second name may be absent (hf_state_dict leaves it out).
            state_dict = {**{t: state_dict[s] for t, s in self._tied.items()
                             if t not in state_dict and s in state_dict}, **state_dict}
            self._load_model_state_dict(state_dict)

    load_hf_state_dict = load_model_state_dict

