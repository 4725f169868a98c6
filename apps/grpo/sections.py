"""The GRPO app's small YAML sections (``model:``, ``grpo:``, ``procs:``, ``debug:``,
``export:``), each validating its own fields; :class:`apps.grpo.config.GRPOConfig` holds them
and checks them against each other. Standard library only (and the advantage scalings'
names), like every config module: a config error shows before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from forge_ext.rl.algorithm import ADVANTAGE_SCALINGS


@dataclass(kw_only=True, slots=True)
class ModelSection:
    hf_path: str
    """HF checkpoint directory (config.json + safetensors + tokenizer): the warm-start of the
    demo, or e.g. a downloaded ``Qwen/Qwen3-0.6B``."""


@dataclass(kw_only=True, slots=True)
class GRPOSection:
    prompts_per_step: int = 8
    """Distinct training prompts per step."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are relative to each group's mean (``grpo``,
    ``rloo``: at least 2). PPO (``algorithm.advantage: gae``) takes 1: its baseline is the
    critic's."""
    advantage_scaling: Literal["group_std", "none", "batch_std"] = "group_std"
    """What the mean-centred rewards are divided by: the group's std (DeepSeekMath), nothing
    (Dr. GRPO), or the whole batch's std
    (:func:`forge_ext.rl.advantages.compute_group_advantages`)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (arXiv:2503.14476, section 3.2): groups whose rewards are all
    equal (no gradient) are dropped, and more prompts are rolled out until the step has
    ``prompts_per_step`` groups with spread or ``max_rollout_batches`` rollouts were made."""
    max_rollout_batches: int = 4
    """With ``dynamic_sampling``: the most rollouts of ``prompts_per_step`` prompts one step
    makes; if they hold fewer groups with spread, the step fills up with dropped groups
    (zero advantage: no policy gradient, counted in ``rollout/short_groups``)."""

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1 or self.group_size < 1:
            raise ValueError(
                f"grpo.prompts_per_step={self.prompts_per_step} and grpo.group_size="
                f"{self.group_size} must be >= 1"
            )
        if self.advantage_scaling not in ADVANTAGE_SCALINGS:
            raise ValueError(
                f"grpo.advantage_scaling={self.advantage_scaling!r} must be one of "
                f"{list(ADVANTAGE_SCALINGS)}"
            )
        if self.max_rollout_batches < 1:
            raise ValueError(
                f"grpo.max_rollout_batches={self.max_rollout_batches} must be >= 1"
            )

    @property
    def batch_size(self) -> int:
        """Sequences trained on per step."""
        return self.prompts_per_step * self.group_size


@dataclass(kw_only=True, slots=True)
class RoleProcs:
    num_procs: int | None = None
    """Processes of this role's mesh (default: the product of its parallelism degrees; the
    generator's are its replicas, ``generator.replicas``, and may not be set here)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of this role's procs, e.g. ``{CUDA_VISIBLE_DEVICES: "4,5"}`` to give each
    role its own GPUs on one node. Roles with an ``env`` are spawned one after another."""


@dataclass(kw_only=True, slots=True)
class ProcsSection:
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every process, set in the controller before anything is spawned
    (e.g. ``OMP_NUM_THREADS: "1"`` on a small CPU, see :func:`forge_ext.config.apply_env`)."""
    trainer: RoleProcs = field(default_factory=RoleProcs)
    """The trainer's processes."""
    reference: RoleProcs = field(default_factory=RoleProcs)
    """The reference model's processes."""
    critic: RoleProcs = field(default_factory=RoleProcs)
    """The critic's processes (PPO)."""
    generator: RoleProcs = field(default_factory=RoleProcs)
    """The generator's processes (one per replica: ``generator.replicas``)."""

    def __post_init__(self) -> None:
        if self.generator.num_procs is not None:
            raise ValueError(
                f"procs.generator.num_procs={self.generator.num_procs}: the generator runs one "
                "process per replica; set generator.replicas (and "
                "generator.vllm.tensor_parallel_size for GPUs per replica) instead"
            )


@dataclass(kw_only=True, slots=True)
class DebugSection:
    fail_at_step: int | None = None
    """Fault injection: at this (1-based) step the trainer's ``train_step`` raises mid-step
    (the batch's advantages are NaN, so the engine's gradient-norm check raises
    ``FloatingPointError`` after backward, before the optimizer step). For testing that a
    crash stops every proc and that a rerun resumes from the last checkpoint."""


EXPORT_DTYPES = ("float32", "bfloat16", "float16")
"""``export.dtype``'s names (:data:`forge_ext.engine.export.DTYPES`' keys)."""


@dataclass(kw_only=True, slots=True)
class ExportSection:
    enable: bool = True
    """Write the policy as an HF checkpoint folder ``<output_dir>/hf/step-N`` (safetensors
    shards, config.json, generation_config.json, tokenizer files) at the last step and every
    ``loop.export_every`` steps: what transformers loads, vLLM serves and a next run takes as
    ``model.hf_path``. LoRA runs write their adapter instead (``trainer.lora``)."""
    dtype: str | None = None
    """``float32``, ``bfloat16`` or ``float16``; null: the parameters' dtype."""
    max_shard_mb: float = 5000.0
    """Largest safetensors file (MB); a larger model is written in several, with
    ``model.safetensors.index.json``."""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in EXPORT_DTYPES:
            raise ValueError(f"export.dtype={self.dtype!r} must be one of {sorted(EXPORT_DTYPES)} "
                             "(or null: the parameters' dtype)")
        if not self.max_shard_mb > 0:
            raise ValueError(f"export.max_shard_mb={self.max_shard_mb} must be > 0")
