"""TorchTitan backend of the engine: model, optimizer, LR scheduler and checkpointer built from
torchtitan components, in the order of ``torchtitan/trainer.py`` (``Trainer.__init__``) and
``torchtitan/experiments/rl/actors/trainer.py`` (``PolicyTrainer``); every parallelism
torchtitan has (FSDP/HSDP, TP, PP, CP). The microbatch core, the optimizer verbs,
checkpoints and the weight verbs are :class:`forge_ext.engine.base.BaseEngine`'s; this module
builds the model, checks its config (:meth:`TitanEngine.validate_config`), computes its
forward, names its weights through torchtitan's state-dict adapter, and hands the core its
pipeline schedule.

No Monarch here: the engine runs in any process where ``torch.distributed`` can be set up from
the usual ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK`` environment
(torchrun, ``monarch.spmd.setup_torch_elastic_env_async``, or
:func:`forge_ext.engine.distributed.init_single_process_env` for one process).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import get_schedule_class
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.config import DebugConfig, TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common import ComplexRoPE
from torchtitan.tools import utils as titan_utils

from forge_ext.engine import microbatch as token_budget
from forge_ext.engine.attention import DocumentMask
from forge_ext.engine.base import BaseEngine
from forge_ext.engine.config import EngineConfig
from forge_ext.engine.core import Batch, PipelineLoss
from forge_ext.engine.models import (
    VALUE_HEAD_HF_NAME, apply_lora, build_model_spec, check_checkpoint_tensors,
    checkpoint_tensor_names,
)
from forge_ext.engine.registry import MODEL_TYPE, EngineRegistry, engine_config_from_mapping
from forge_ext.engine.schema import check_lora, check_model_limits, checkpoint_label

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
        world_size = self._init_distributed()
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
        self._build_training_state()
        if config.model.hf_path:
            self.load_hf_weights(config.model.hf_path)
        self.dp_mesh = self.parallel_dims.get_optional_mesh("batch")
        self.pp_mesh = self.parallel_dims.get_optional_mesh("pp")
        self.ep_enabled = self.parallel_dims.ep_enabled
        self.offload()  # with trainer.offload on, the engine rests in host memory

    @classmethod
    def validate_config(cls, config: EngineConfig) -> None:
        """Check a titan config before any process is spawned: the batch split
        (:meth:`EngineConfig.validate`), the model spec (flavor, checkpoint tensors, RoPE
        length, heads against tensor parallelism), value head, LoRA and pipeline settings,
        and an attention backend with a CPU backward on a machine without CUDA.

        Raises:
            ValueError: naming the offending field and the fix.
            FileNotFoundError: ``model.hf_path`` without a config.json.
        """
        config.validate()
        model = config.model
        spec = build_model_spec(
            model.name, model.flavor, hf_path=model.hf_path,
            attn_backend=model.attn_backend, value_head=model.value_head,
        )
        if model.value_head:
            _validate_value_head(config)
        if model.hf_path:
            check_checkpoint_tensors(spec, model.hf_path)
        attention = spec.model.layers[0].attention
        check_model_limits(config.training, config.parallelism,
                           max_seq_len=attention.rope.max_seq_len, n_heads=attention.n_heads,
                           n_kv_heads=attention.n_kv_heads or attention.n_heads,
                           model=(checkpoint_label(model.hf_path) if model.flavor == "hf"
                                  else f"{model.name} {model.flavor}"))
        if config.lora is not None:
            _validate_lora(config, spec)
        if config.pp_degree > 1:
            _validate_pipeline_config(config, spec)
        if not torch.cuda.is_available() and model.attn_backend != "sdpa":
            raise ValueError(
                f"model.attn_backend={model.attn_backend!r} has no CPU backward; use "
                "model.attn_backend=sdpa on a machine without CUDA"
            )

    # ---- construction ------------------------------------------------------------------
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
            self._pp_loss = PipelineLoss()
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

    def _model_forward(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """Logits ``[b, L, V]``; a packed microbatch (``position_ids``) runs with positions
        restarting per sequence and attention confined to each (document masks: ours under
        ``sdpa``, torchtitan's under ``flex`` / ``varlen``)."""
        if "position_ids" not in mb:
            return model(mb["input_ids"])
        positions = mb["position_ids"]
        if self.config.model.attn_backend == "sdpa":
            masks = DocumentMask(token_budget.block_causal_mask(positions))
        else:  # flex / varlen: torchtitan's own document masks
            masks = model.get_attention_masks(positions)
        return model(mb["input_ids"], positions=positions, attention_masks=masks)

    # ---- weights in HF names: torchtitan's state-dict adapter ------------------------------
    def _check_hf_names(self) -> None:
        """Raise ValueError unless the model's weights have HF names (a state-dict adapter)."""
        if self.sd_adapter is None:
            raise ValueError(f"model.name={self.config.model.name!r} has no HF adapter")

    def _to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` (model keys) in HF names and layout (the state-dict adapter's
        ``to_hf``)."""
        self._check_hf_names()
        return self.sd_adapter.to_hf(state_dict)

    def _hf_module_name(self, titan_module: str, weight: torch.Tensor) -> str:
        """HF module name of a torchtitan linear module (``layers.0.attention.qkv_linear.wq``
        -> ``model.layers.0.self_attn.q_proj``), through the model's state-dict adapter."""
        self._check_hf_names()
        probe = torch.empty(weight.shape, device="meta")
        hf = list(self.sd_adapter.to_hf({f"{titan_module}.weight": probe}))
        if len(hf) != 1 or not hf[0].endswith(".weight"):
            raise ValueError(f"no HF name for the adapted module {titan_module!r}: {hf}")
        return hf[0].removesuffix(".weight")

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the weights with full tensors in HF names and layout (the inverse of
        :meth:`hf_state_dict`; each PP stage and DP/TP shard takes its part). Optimizer state
        is left as is.

        Raises:
            KeyError: naming model keys the converted state dict lacks.
        """
        self._check_hf_names()
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


def _validate_value_head(config: EngineConfig) -> None:
    """What a value head cannot be combined with (before any spawn)."""
    tp = config.parallelism.tensor_parallel_degree
    if tp > 1:
        raise ValueError(
            f"model.value_head with parallelism.tensor_parallel_degree={tp} is not supported "
            "(a one-column head has no tensor-parallel split); use data or pipeline "
            "parallelism for the critic or reward model"
        )
    if config.lora is not None:
        raise ValueError(
            "model.value_head with a lora section is not supported (LoRA freezes every "
            "weight but the adapters, the value head included); remove the lora section "
            "of the critic"
        )


def _validate_lora(config: EngineConfig, spec) -> None:
    """LoRA settings the model or the parallelism cannot take (before any spawn)."""
    check_lora(config.lora, config.parallelism)  # rank, alpha, targets, PP, TP
    rope = spec.model.layers[0].attention.rope
    if isinstance(rope, ComplexRoPE.Config):
        # Its HF adapter permutes q/k rows (interleaved RoPE); the adapter export does not.
        raise ValueError(
            f"lora with model.name={config.model.name} flavor {config.model.flavor!r} "
            "(interleaved, complex RoPE) is not supported; use model.flavor=hf (HF's "
            "rotate-half layout) or a small flavor"
        )
    apply_lora(spec.model, config.lora)  # raises naming lora.target_modules


def _validate_pipeline_config(config: EngineConfig, spec) -> None:
    """What pipeline parallelism cannot take (before any spawn)."""
    par = config.parallelism
    try:
        get_schedule_class(par.pipeline_parallel_schedule)
    except ValueError:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule={par.pipeline_parallel_schedule!r} is "
            "not a torch.distributed.pipelining schedule (e.g. 1F1B, GPipe, Interleaved1F1B)"
        ) from None
    if getattr(spec.model, "enable_weight_tying", False):
        raise ValueError(
            f"model {config.model.name} {config.model.flavor} ties its embedding and output "
            "weights, which pipeline parallelism cannot split; use an untied flavor "
            "(tie_word_embeddings=false) or parallelism.pipeline_parallel_degree=1"
        )
    if spec.pipelining_fn is None:
        raise ValueError(f"model.name={config.model.name!r} does not support pipelining")
    config.num_pp_microbatches()


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
