"""The decoder sizes the HF <-> vLLM layout conversion needs (:mod:`forge_ext.weights.convert`),
read from an HF config, and vLLM's vocabulary padding.

Supported: Qwen3, Qwen2 and Llama-3 decoders (HF ``model_type`` qwen3, qwen2, llama).
``transformers`` is imported only to complete a raw ``config.json`` with its model type's
defaults.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["VOCAB_PADDING_SIZE", "ModelConfig", "as_model_config", "padded_vocab_size"]

#: vLLM pads the vocabulary of ``VocabParallelEmbedding`` / ``ParallelLMHead`` to a multiple of
#: this (``DEFAULT_VOCAB_PADDING_SIZE`` in vLLM's ``layers/vocab_parallel_embedding.py``).
VOCAB_PADDING_SIZE = 64

_SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Sizes and optional parameters of a Qwen3, Qwen2 or Llama-3 decoder.

    Field names are those of HF ``config.json``. Build one with :meth:`from_hf` from an HF
    config, or directly.

    Attributes:
        qkv_bias: ``q_proj``, ``k_proj`` and ``v_proj`` have biases (Qwen2; ``attention_bias``
            in Qwen3 / Llama).
        o_proj_bias: ``o_proj`` has a bias (``attention_bias`` in Qwen3 / Llama).
        mlp_bias: ``gate_proj``, ``up_proj`` and ``down_proj`` have biases (Llama ``mlp_bias``).
        qk_norm: per-head RMSNorms ``self_attn.q_norm`` / ``self_attn.k_norm`` (Qwen3).

    Raises:
        ValueError: on a non-positive size or when ``num_attention_heads`` is not a multiple of
            ``num_key_value_heads``.
    """

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for name in (
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_hf(cls, config: Any) -> ModelConfig:
        """Read the sizes from an HF config.

        Args:
            config: a ``transformers.PretrainedConfig``, a mapping with the contents of an HF
                ``config.json``, or the path of a ``config.json`` (or of its directory).
                Missing fields take the defaults of the model type's transformers config class
                (e.g. ``head_dim = hidden_size // num_attention_heads`` for Llama and Qwen2).

        Raises:
            ValueError: if ``model_type`` is absent or not one of qwen3, qwen2, llama.
        """
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
        if isinstance(config, Mapping):
            fields = dict(config)
            model_type = fields.pop("model_type", None)
            if model_type not in _SUPPORTED_MODEL_TYPES:
                raise ValueError(
                    f"config model_type={model_type!r} is not supported; expected one of "
                    f"{_SUPPORTED_MODEL_TYPES}"
                )
            from transformers import AutoConfig  # only needed for a raw config.json

            config = AutoConfig.for_model(model_type, **fields)

        model_type = getattr(config, "model_type", None)
        attention_bias = bool(getattr(config, "attention_bias", False))
        if model_type == "qwen3":
            biases = dict(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm=True)
        elif model_type == "qwen2":
            # transformers' Qwen2Attention: q/k/v always have biases, o_proj never.
            biases = dict(qkv_bias=True)
        elif model_type == "llama":
            biases = dict(
                qkv_bias=attention_bias,
                o_proj_bias=attention_bias,
                mlp_bias=bool(getattr(config, "mlp_bias", False)),
            )
        else:
            raise ValueError(
                f"config model_type={model_type!r} is not supported; expected one of "
                f"{_SUPPORTED_MODEL_TYPES}"
            )
        heads = config.num_attention_heads
        return cls(
            num_hidden_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            **biases,
        )


def padded_vocab_size(vocab_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of 64, as vLLM's ``pad_vocab_size`` does."""
    return -(-vocab_size // VOCAB_PADDING_SIZE) * VOCAB_PADDING_SIZE


def as_model_config(model_config: Any) -> ModelConfig:
    """``model_config`` if it is a :class:`ModelConfig`, else :meth:`ModelConfig.from_hf` of it."""
    return (
        model_config if isinstance(model_config, ModelConfig) else ModelConfig.from_hf(model_config)
    )
