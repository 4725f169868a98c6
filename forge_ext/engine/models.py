"""Model specs for the engine: torchtitan's registries plus small flavors and HF checkpoints.

A model is named by ``model.name`` (``qwen3`` or ``llama3``) and ``model.flavor``: any flavor
of torchtitan's registry (``torchtitan.models.qwen3.qwen3_configs``,
``torchtitan.models.llama3.llama3_configs``), one of the small flavors registered here
(``tiny``, ``small``: a few layers, dim 64-256, so tests and demos run in seconds on CPU),
or ``hf`` with ``model.hf_path`` pointing at a Hugging Face checkpoint directory whose
``config.json`` gives the architecture (e.g. a downloaded ``Qwen/Qwen3-0.6B``).

The small flavors are written as HF ``config.json`` fields so that one converter
(:func:`decoder_config_from_hf`) serves both, and the HF checkpoint written for a small flavor
loads into ``transformers`` unchanged.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from torchtitan.models import llama3 as titan_llama3
from torchtitan.models import qwen3 as titan_qwen3
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.protocols.model_spec import ModelSpec

# Small flavors, as HF config.json fields (Qwen3Config / LlamaConfig names).
SMALL_FLAVORS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3": {
        "tiny": dict(
            vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        "small": dict(
            vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    },
    "llama3": {
        "tiny": dict(
            vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        ),
    },
}

_TITAN_REGISTRIES = {
    "qwen3": (titan_qwen3.model_registry, titan_qwen3.qwen3_configs),
    "llama3": (titan_llama3.model_registry, titan_llama3.llama3_configs),
}

ATTN_BACKENDS = ("sdpa", "flex", "varlen")


def known_flavors(name: str) -> list[str]:
    """Flavors accepted for ``model.name=name`` (``hf`` needs ``model.hf_path``)."""
    return sorted({*SMALL_FLAVORS.get(name, {}), *_TITAN_REGISTRIES[name][1], "hf"})


def read_hf_config(hf_path: str) -> dict[str, Any]:
    """Read ``<hf_path>/config.json``.

    Raises:
        FileNotFoundError: naming ``model.hf_path`` when the file is absent.
    """
    path = os.path.join(hf_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"model.hf_path={hf_path!r} has no config.json; point it at a Hugging Face "
            "checkpoint directory (config.json + *.safetensors)"
        )
    with open(path) as f:
        return json.load(f)


def decoder_config_from_hf(name: str, hf: dict[str, Any], attn_backend: str = "flex"):
    """Build a torchtitan decoder config from HF ``config.json`` fields.

    Uses the same per-layer builders as torchtitan's own flavors
    (``torchtitan/models/qwen3/__init__.py``, ``torchtitan/models/llama3/__init__.py``), so
    parameter names, fused QKV layout and init match the registry flavors.

    Args:
        name: ``"qwen3"`` or ``"llama3"``.
        hf: ``config.json`` mapping (``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``,
            ``vocab_size``, ``rope_theta`` (or ``rope_parameters.rope_theta``),
            ``max_position_embeddings``, ``rms_norm_eps``,
            ``tie_word_embeddings``, and for qwen3 ``head_dim``).

    Raises:
        KeyError: naming a required field missing from ``hf``.
    """
    dim = hf["hidden_size"]
    vocab = hf["vocab_size"]
    n_heads = hf["num_attention_heads"]
    n_kv_heads = hf.get("num_key_value_heads", n_heads)
    head_dim = hf.get("head_dim") or dim // n_heads
    tied = bool(hf.get("tie_word_embeddings", False))
    eps = hf.get("rms_norm_eps", 1e-6)
    # transformers 5 writes rope_theta inside rope_parameters; older configs at the top level.
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta")
    if theta is None:
        raise KeyError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    rope = CosSinRoPE.Config(
        dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=float(theta)
    )
    norm_init = {"weight": titan_qwen3._NORM_INIT["weight"]}
    if name == "qwen3":
        layers = titan_qwen3._build_qwen3_layers(
            n_layers=hf["num_hidden_layers"], dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, hidden_dim=hf["intermediate_size"], fuse_qkv=True,
            attn_backend=attn_backend, rope=rope,
        )
        for layer in layers:
            layer.attention_norm = replace(layer.attention_norm, eps=eps)
            layer.ffn_norm = replace(layer.ffn_norm, eps=eps)
            layer.attention.qk_norm = replace(layer.attention.qk_norm, eps=eps)
        model_cls = titan_qwen3.Qwen3Model
        linear_init = titan_qwen3._LINEAR_INIT
    elif name == "llama3":
        layers = titan_llama3._build_llama3_layers(
            n_layers=hf["num_hidden_layers"], dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
            hidden_dim=hf["intermediate_size"], rope=rope, fuse_qkv=True, attn_backend=attn_backend,
        )
        for layer in layers:
            layer.attention_norm = replace(layer.attention_norm, eps=eps)
            layer.ffn_norm = replace(layer.ffn_norm, eps=eps)
        model_cls = titan_llama3.Llama3Model
        linear_init = titan_llama3._LINEAR_INIT
    else:
        raise ValueError(f"model.name={name!r} must be one of {sorted(_TITAN_REGISTRIES)}")
    return model_cls.Config(
        vocab_size=vocab,
        dim=dim,
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=norm_init),
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=titan_qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear_init),
        layers=layers,
    )


def hf_config_for(name: str, flavor: str, hf_path: str | None) -> dict[str, Any] | None:
    """The HF ``config.json`` fields of a small flavor or of ``hf_path``; None otherwise."""
    if flavor == "hf":
        return read_hf_config(hf_path or "")
    return SMALL_FLAVORS.get(name, {}).get(flavor)


def build_model_spec(
    name: str, flavor: str, *, hf_path: str | None = None, attn_backend: str = "sdpa"
) -> ModelSpec:
    """Look up a model by name and flavor and set its inner attention backend.

    ``attn_backend="sdpa"`` replaces each layer's inner attention with torchtitan's
    ``ScaledDotProductAttention`` (causal, no document masks): the only backend with a CPU
    backward (FlexAttention has none on CPU, varlen is CUDA-only). Batches are right-padded,
    so causal attention is exact for every valid token.

    Raises:
        ValueError: unknown ``model.name``, ``model.flavor`` or ``model.attn_backend``
            (the message lists the accepted values).
    """
    if name not in _TITAN_REGISTRIES:
        raise ValueError(f"model.name={name!r} must be one of {sorted(_TITAN_REGISTRIES)}")
    if attn_backend not in ATTN_BACKENDS:
        raise ValueError(f"model.attn_backend={attn_backend!r} must be one of {ATTN_BACKENDS}")
    registry, titan_flavors = _TITAN_REGISTRIES[name]
    if flavor not in known_flavors(name):
        raise ValueError(
            f"model.flavor={flavor!r} is not a {name} flavor; choose one of "
            f"{known_flavors(name)} (or 'hf' with model.hf_path)"
        )
    hf = hf_config_for(name, flavor, hf_path)
    titan_backend = "flex" if attn_backend == "sdpa" else attn_backend
    if hf is None:
        spec = registry(flavor, attn_backend=titan_backend)
    else:
        spec = registry(next(iter(titan_flavors)), attn_backend=titan_backend)
        spec.flavor = flavor
        spec.model = decoder_config_from_hf(name, hf, titan_backend)
    if attn_backend == "sdpa":
        for layer in spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec
