"""Typed engine configuration, built from the nested mapping of a YAML ``trainer:`` section.

The sections mirror torchforge's YAML apps and torchtitan's ``Trainer.Config``::

    trainer:
      engine: titan                  # the backend (forge_ext.engine.registry.EngineRegistry)
      model: {name: qwen3, flavor: tiny, hf_path: null, attn_backend: sdpa}
      training: {local_batch_size: 8, microbatch_size: 2, seq_len: 64, steps: 100}
      parallelism: {data_parallel_replicate_degree: 1, data_parallel_shard_degree: -1}
      optimizer: {name: AdamW, lr: 1.0e-3, weight_decay: 0.0}
      lr_scheduler: {warmup_steps: 0}
      checkpoint: {enable: false, folder: checkpoint, interval: 10}
      compile: {enable: false}
      activation_checkpoint: {mode: none}
      lora: {rank: 8, alpha: 16, target_modules: all-linear}   # absent or null: full fine-tuning
      offload: {params: false, optimizer: false}

``training``, ``parallelism``, ``lr_scheduler``, ``checkpoint`` and ``compile`` are torchtitan's
own config dataclasses (``torchtitan/config/configs.py``, ``CheckpointManager.Config``
(built as :class:`forge_ext.engine.checkpoint.CheckpointManager`),
``LRSchedulersContainer.Config``), so every torchtitan field is accepted under its torchtitan
name. ``training`` adds ``microbatch_size`` / ``gradient_accumulation_steps``. ``lora``
(:class:`LoRAConfig`) trains low-rank adapters through torchtitan's ``LoRAConverter`` instead
of every weight (``docs/lora.md``).

CPU-safe defaults (applied only to fields the mapping leaves unset, when no accelerator is
present; see shared FINDINGS): ``training.mixed_precision_param=float32`` (bf16 matmuls are ~20x
slower on CPU) and ``parallelism.spmd_backend=partial_dtensor``. Data parallelism follows
torchtitan's defaults (FSDP over all ranks: ``data_parallel_shard_degree=-1``); replication
(``data_parallel_replicate_degree``) and HSDP work too, on gloo as on NCCL. Always:
``training.disable_cuda_graphs=true``.

Data only: no backend is named here. :func:`parse_engine_config` reads a mapping and
:meth:`EngineConfig.validate` checks what every backend needs; the backend that ``engine``
names checks the rest (its model, its parallelisms) behind the registry
(:func:`forge_ext.engine.registry.engine_config_from_mapping`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
)
from torchtitan.config import CompileConfig, ParallelismConfig
from torchtitan.config import TrainingConfig as TitanTrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from forge_ext.config import check_keys, from_mapping
from forge_ext.engine import schema
# torchtitan's manager with retention that counts only complete checkpoints (same fields).
from forge_ext.engine.checkpoint import CheckpointManager
from forge_ext.engine.models import model_name_of, read_hf_config

# torchtitan warnings (through the root logger, torchtitan/tools/logging.py) about defaults
# that do not apply to the engine, printed by every process for every engine config or model:
# - CheckpointManager.Config.__post_init__: "initial_load_model_only=True has no effect without
#   an initial_load_path": True is its default, and the engine loads model.hf_path itself;
# - StateDictAdapter.__init__: "model.safetensors.index.json not found ...": an unsharded
#   checkpoint has none, and the engine never saves through the adapter's HF writer;
# - LRSchedulersContainer (components/optimizer/lr_scheduler.py): "Warmup steps (10) exceed
#   total steps (2) ..." and "Warmup (10) + decay (3) steps exceed total steps ...": a short
#   run (a try, a test) of a config written for a long one; torchtitan fits the warm-up and
#   decay into the run itself, so there is nothing for the user to fix.
TITAN_NOTICES_NOT_APPLICABLE = (
    "initial_load_model_only=True has no effect without an initial_load_path",
    "model.safetensors.index.json not found at hf_assets_path",
    "Warmup steps (", "Warmup (",
)


class _NotApplicableTitanNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(TITAN_NOTICES_NOT_APPLICABLE)


if not any(isinstance(f, _NotApplicableTitanNotices) for f in logging.getLogger().filters):
    logging.getLogger().addFilter(_NotApplicableTitanNotices())


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str | None = None
    """Model family: ``qwen3`` or ``llama3``. Default: the family of ``hf_path``'s
    config.json ``model_type`` (``qwen3``; ``llama`` -> ``llama3``), ``qwen3`` without
    ``hf_path``. A name given must read that ``model_type`` (checked before spawning)."""
    flavor: str = "tiny"
    """A torchtitan registry flavor, a small forge_ext flavor (``tiny``, ``small``), or ``hf``."""
    hf_path: str | None = None
    """HF checkpoint directory (config.json + safetensors). With ``flavor: hf`` the
    architecture comes from its config.json; when set, weights are loaded from it, and any
    other flavor must describe the same model as its config.json (shapes, norm eps, RoPE),
    checked before spawning."""
    attn_backend: Literal["sdpa", "flex", "varlen"] = "sdpa"
    """Inner attention. ``sdpa`` (causal) is the only one with a CPU backward."""
    value_head: bool = False
    """The output projection is a value head, one scalar per position instead of the
    vocabulary's logits (a critic, a reward model): HF ``score.weight [1, hidden]``, read from
    ``hf_path`` when the checkpoint has it (a ``*ForSequenceClassification`` with
    ``num_labels: 1``), zeros otherwise (``forge_ext.engine.models.apply_value_head``)."""

    def __post_init__(self) -> None:
        if self.name is None:
            self.name = model_name_of(self.hf_path)


@dataclass(kw_only=True, slots=True)
class TrainingConfig(TitanTrainingConfig):
    """torchtitan's ``TrainingConfig`` plus the microbatch split of ``local_batch_size``.

    Set at most one of ``microbatch_size``, ``gradient_accumulation_steps`` and
    ``max_tokens_per_microbatch``; with none, the batch is one microbatch.
    """

    seq_len: int = 512
    """Longest sequence a batch may hold (tokens); also the RoPE table length."""
    microbatch_size: int | None = None
    """Sequences per microbatch (per data-parallel rank)."""
    gradient_accumulation_steps: int | None = None
    """Microbatches per step (per data-parallel rank)."""
    max_tokens_per_microbatch: int | None = None
    """Token budget of a microbatch (padded positions, per data-parallel rank) instead of a row
    count: rows are grouped by length so that rows x their longest row stays within it, each
    microbatch padded only to its own longest row; a rank's batch may then hold any number of
    rows (see :mod:`forge_ext.engine.microbatch`)."""
    pad_to_multiple_of: int = 1
    """Round each microbatch's padded length (packed row length with ``packing``) up to a
    multiple of this (e.g. 8 or 64 for GPU kernels); only with ``max_tokens_per_microbatch``."""
    packing: bool = False
    """Pack several sequences into one row of at most ``max_tokens_per_microbatch`` tokens,
    positions restarting and attention confined per sequence (document masking). Pays on
    long-tailed lengths; on equal lengths it only adds masked attention work."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """One optimizer over all parameters, torchforge style (torchtitan's ``default_adamw``)."""

    name: Literal["AdamW", "Adam"] = "AdamW"
    """``torch.optim`` class."""
    lr: float = 1e-3
    """Peak learning rate (the LR schedule scales it, see ``lr_scheduler``)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's moment decay rates ``[beta1, beta2]``."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (Adam)."""
    implementation: Literal["for-loop", "foreach", "fused"] = "foreach"
    """``torch.optim`` kernel choice (``fused`` needs an accelerator)."""

    def to_titan(self) -> OptimizersContainer.Config:
        return OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name=self.name,
                    optimizer_kwargs=dict(
                        lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                        weight_decay=self.weight_decay,
                    ),
                )
            ],
            implementation=self.implementation,
        )


@dataclass(kw_only=True, slots=True)
class ActivationCheckpointConfig:
    mode: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward instead of keeping them: ``full`` per layer,
    ``selective`` torchtitan's op-level policy; ``none`` keeps them all."""

    def to_titan(self):
        """torchtitan AC config, or None for ``mode: none``."""
        return {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[
            self.mode
        ]


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """Low-rank adapters (Hu et al. 2021, arXiv:2106.09685) on the decoder blocks' linear
    layers, built by torchtitan's ``LoRAConverter`` (``torchtitan/components/lora.py``): each
    adapted layer computes ``x W^T + (alpha / rank) x A^T B^T`` with ``A [rank, in]``
    (kaiming-uniform init) and ``B [out, rank]`` (zero init, so training starts at the base
    model). Only A and B require grad and sit in the optimizer; checkpoints hold them and
    their optimizer state, the base weights come from ``model.hf_path`` (``docs/lora.md``).
    """

    rank: int
    """Rank ``r`` of every adapter (>= 1)."""
    alpha: float | None = None
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``. Default
    ``2 * rank`` (a scale of 2 at any rank, torchtitan's 16 / 8)."""
    target_modules: list[str] | str | None = None
    """HF names of the adapted layers, among ``q_proj k_proj v_proj o_proj gate_proj up_proj
    down_proj``; ``all-linear`` or null: all seven (never the embeddings or the LM head)."""
    export_merged: bool = False
    """Also write a merged HF checkpoint (``W + (alpha / rank) B A``) beside the final PEFT
    adapter folder at the end of a GRPO or SFT run."""

    def __post_init__(self) -> None:
        if self.alpha is None and isinstance(self.rank, int):
            self.alpha = 2.0 * self.rank

    @property
    def targets(self) -> tuple[str, ...]:
        """The adapted layers' HF names (``target_modules`` resolved,
        :func:`forge_ext.engine.schema.check_targets`).

        Raises:
            ValueError: an empty list or a name that is not one of the seven, naming
                ``lora.target_modules``.
        """
        return schema.check_targets(self.target_modules, "lora.target_modules")

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor of the adapter's output."""
        return float(self.alpha) / self.rank

    def check(self) -> None:
        """Raise ValueError naming the field for a rank below 1, a non-positive alpha or a
        target that is not a decoder linear layer (``HFEngine.validate_config`` calls it;
        :func:`forge_ext.engine.schema.check_lora` holds the rules)."""
        schema.check_lora(self)


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """What rests in host memory while the engine is not using it (verl's ``param_offload``
    / ``optimizer_offload``): moved to the accelerator on entering ``train_mode`` /
    ``eval_mode`` (and the state verbs), back on leaving. Frees the accelerator for a
    generator sharing it, at the cost of two copies per use. On a machine without an
    accelerator the engine already computes in host memory: accepted, nothing moves."""

    params: bool = False
    """Parameters, buffers and gradients."""
    optimizer: bool = False
    """The optimizer state (Adam's moments)."""


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """An engine section (YAML ``trainer:``, ``reference:``): the model, how it is trained and
    parallelised, and its checkpoints (module docstring)."""

    engine: str = "titan"
    """The engine backend, a name registered with ``forge_ext.engine.EngineRegistry``:
    ``titan`` (torchtitan's models, ``forge_ext.engine.TitanEngine``, every parallelism) or
    ``hf`` (any ``AutoModelForCausalLM`` checkpoint in ``model.hf_path``,
    ``forge_ext.engine.hf.HFEngine``; FSDP2 over all ranks, LoRA, checkpoints, packing; no
    tensor, pipeline or context parallelism)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model: family, flavor, checkpoint, attention backend."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """torchtitan's parallelism degrees (DP replicate/shard, TP, PP, CP) and their options."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulersContainer.Config = field(
        default_factory=LRSchedulersContainer.Config
    )
    """torchtitan's learning-rate schedule (warm-up, decay) over ``training.steps``."""
    checkpoint: CheckpointManager.Config = field(default_factory=CheckpointManager.Config)
    """torchtitan's DCP checkpoints under ``<dump_folder>/<checkpoint.folder>`` (forge_ext's
    manager keeps ``keep_latest_k`` complete ones)."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """torchtitan's ``torch.compile`` settings."""
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    """Activation checkpointing (recomputation in backward)."""
    lora: LoRAConfig | None = None
    """LoRA adapters instead of full fine-tuning (:class:`LoRAConfig`); null: every weight
    trains."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Parameter and optimizer offload to host memory between uses (:class:`OffloadConfig`)."""
    dump_folder: str = "outputs"
    """Base folder for checkpoints (``<dump_folder>/<checkpoint.folder>``)."""
    seed: int = 0
    """Seed for weight init (same on every rank, so DP replicas start identical)."""

    @property
    def pp_degree(self) -> int:
        return self.parallelism.pipeline_parallel_degree

    def num_microbatches(self) -> int:
        """Microbatches per step on each data-parallel rank.

        Raises:
            ValueError: naming ``training.local_batch_size`` and the microbatch field when
                they do not divide, or when both microbatch fields are set.
        """
        return schema.num_microbatches(self.training)

    def num_pp_microbatches(self) -> int:
        """PP microbatches per ``schedule.step`` (1 without PP): each gradient-accumulation
        microbatch is split into pieces of ``parallelism.pipeline_parallel_microbatch_size``.

        Raises:
            ValueError: naming the fields when they do not divide or when there would be
                fewer PP microbatches than pipeline stages.
        """
        par = self.parallelism
        if par.pipeline_parallel_degree <= 1:
            return 1
        per_step = self.training.local_batch_size // self.num_microbatches()
        size = par.pipeline_parallel_microbatch_size
        if size <= 0 or per_step % size:
            raise ValueError(
                f"training.local_batch_size={self.training.local_batch_size} / "
                f"{self.num_microbatches()} gradient-accumulation microbatches = {per_step} "
                f"sequences per pipeline step is not divisible by "
                f"parallelism.pipeline_parallel_microbatch_size={size}"
            )
        n = per_step // size
        if n < par.pipeline_parallel_degree:
            raise ValueError(
                f"{n} PP microbatches per step is fewer than "
                f"parallelism.pipeline_parallel_degree={par.pipeline_parallel_degree} stages; "
                "lower parallelism.pipeline_parallel_microbatch_size or raise "
                "training.local_batch_size"
            )
        return n

    def validate(self) -> None:
        """Check the batch split every backend needs (``training.local_batch_size`` > 0, the
        microbatch fields, the token budget), naming the field and the fix. The backend's
        own checks (the model, its parallelisms) are its ``validate_config``, which calls
        this: :meth:`forge_ext.engine.registry.EngineRegistry.validate` runs the whole check.

        Raises:
            ValueError: naming the offending field and the fix.
        """
        if self.training.local_batch_size <= 0:
            raise ValueError(
                f"training.local_batch_size={self.training.local_batch_size} must be > 0"
            )
        self.num_microbatches()
        self._validate_token_budget()

    def _validate_token_budget(self) -> None:
        t, par = self.training, self.parallelism
        budget = t.max_tokens_per_microbatch
        if t.pad_to_multiple_of < 1:
            raise ValueError(f"training.pad_to_multiple_of={t.pad_to_multiple_of} must be >= 1")
        if budget is None:
            if t.packing:
                raise ValueError(
                    "training.packing=true needs training.max_tokens_per_microbatch (the "
                    "packed row length), e.g. training.max_tokens_per_microbatch=4096"
                )
            if t.pad_to_multiple_of != 1:
                raise ValueError(
                    "training.pad_to_multiple_of applies to token-budget microbatches; set "
                    "training.max_tokens_per_microbatch too, or leave it at 1"
                )
            return
        if budget < t.pad_to_multiple_of:
            raise ValueError(
                f"training.max_tokens_per_microbatch={budget} must be >= "
                f"training.pad_to_multiple_of={t.pad_to_multiple_of} (and > 0)"
            )
        if self.pp_degree > 1:
            raise ValueError(
                "training.max_tokens_per_microbatch does not work with pipeline parallelism "
                "(its schedules fix the microbatch shapes); use training."
                "gradient_accumulation_steps, or parallelism.pipeline_parallel_degree=1"
            )
        if t.packing and par.context_parallel_degree > 1:
            raise ValueError(
                "training.packing=true does not work with parallelism.context_parallel_degree"
                f"={par.context_parallel_degree} (document masks are not sharded by sequence)"
            )


def _defaults(raw: dict[str, Any]) -> None:
    """Fill forge_ext's defaults into fields ``raw`` leaves unset.

    ``checkpoint.last_save_model_only=false``: ``save_checkpoint(step)`` writes a resumable
    full state (model, optimizer, LR scheduler, step). ``lr_scheduler.warmup_steps=0``.
    Without an accelerator, also the CPU-safe values listed in the module docstring.
    """
    raw.setdefault("checkpoint", {}).setdefault("last_save_model_only", False)
    raw.setdefault("lr_scheduler", {}).setdefault("warmup_steps", 0)
    # The engine never captures CUDA graphs; torchtitan refuses PP unless they are off.
    raw.setdefault("training", {}).setdefault("disable_cuda_graphs", True)
    if torch.cuda.is_available():
        return
    training = raw.setdefault("training", {})
    training.setdefault("mixed_precision_param", "float32")
    par = raw.setdefault("parallelism", {})
    par.setdefault("spmd_backend", "partial_dtensor")


def parse_engine_config(mapping: Mapping[str, Any] | None, section: str = "trainer"
                        ) -> EngineConfig:
    """An :class:`EngineConfig` from a nested mapping (YAML ``trainer:``), defaults filled and
    ``model.name`` resolved from the checkpoint, not yet validated: the whole check is
    :func:`forge_ext.engine.registry.engine_config_from_mapping`, which calls this first.

    Args:
        section: the YAML section the mapping came from, for error messages.

    Raises:
        ValueError: an unknown key or a value of the wrong type (named with its full path,
            e.g. ``trainer.training.foo``); a checkpoint of a family the titan backend
            lacks (prefixed ``trainer: ``).
        FileNotFoundError: ``model.hf_path`` without a config.json (prefixed the same way).
    """
    raw = copy.deepcopy(dict(mapping or {}))
    check_keys(EngineConfig, raw, section)
    _defaults(raw)
    model = raw.get("model")
    if (raw.get("engine") == "hf" and isinstance(model, Mapping) and model.get("name") is None
            and model.get("hf_path")):
        # Any family: the name is the checkpoint's own model_type, read by transformers.
        try:
            model_type = read_hf_config(model["hf_path"]).get("model_type")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{section}: {e}") from None
        raw["model"] = model = {**model, "name": model_type}
    if isinstance(model, Mapping) and model.get("name") is None:
        # The name from the checkpoint here, so that a refusal names the section.
        try:
            raw["model"] = {**model, "name": model_name_of(model.get("hf_path"))}
        except ValueError as e:
            raise ValueError(f"{section}: {e}") from None
    return from_mapping(EngineConfig, raw, section)


def describe_engine_fields() -> dict[str, Any]:
    """The field tree of :class:`EngineConfig` as it is now: what
    :data:`forge_ext.engine.schema.FIELDS_FILE` saves for the light check
    (``{section: {field: {"types": [...], "default": ..., "section": <nested or None>}}}``,
    ``""`` the top level). Regenerate the file with ``python -m forge_ext.engine.config
    --write``."""
    tree: dict[str, Any] = {}

    def walk(cls: type, name: str) -> None:
        hints = typing.get_type_hints(cls)
        section: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            entry: dict[str, Any] = {"types": _kinds(hint)}
            nested = next((a for a in (hint, *typing.get_args(hint))
                           if dataclasses.is_dataclass(a)), None)
            if nested is not None:
                entry["section"] = f"{name}.{f.name}".lstrip(".")
                walk(nested, entry["section"])
            elif f.default is not dataclasses.MISSING:
                entry["default"] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                entry["default"] = f.default_factory()
            if "default" in entry:
                try:
                    json.dumps(entry["default"])
                except TypeError:
                    entry.pop("default")
            section[f.name] = entry
        tree[name] = section

    walk(EngineConfig, "")
    return tree


def _kinds(hint: Any) -> list[Any]:
    """The light check's names for the values a type hint admits
    (:func:`forge_ext.engine.schema.check_engine_section` reads them)."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return [{"literal": list(typing.get_args(hint))}]
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return [k for arg in typing.get_args(hint) for k in _kinds(arg)]
    if hint is type(None):
        return ["null"]
    if hint in (int, float, bool, str):
        return [hint.__name__]
    if dataclasses.is_dataclass(hint):
        return ["section"]
    return ["any"]  # lists, tuples, mappings, callables: the full check reads them


if __name__ == "__main__":  # python -m forge_ext.engine.config --write
    text = json.dumps(describe_engine_fields(), indent=1, sort_keys=True) + "\n"
    if "--write" in sys.argv:
        schema.FIELDS_FILE.write_text(text)
    else:
        sys.stdout.write(text)
