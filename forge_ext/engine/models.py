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

RoPE from ``config.json`` (``rope_parameters``, or the older ``rope_scaling``): the
frequencies and the cos/sin scale come from ``transformers``' own functions
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``) and are applied in HF's rotate-half
layout (:class:`HFRoPE`), so the engine's logits equal ``transformers``' for ``default``,
``linear``, ``yarn`` and ``llama3``. ``dynamic`` (and other types) are refused before any
process is spawned (see :func:`rope_from_hf`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torchtitan.models import llama3 as titan_llama3
from torchtitan.models import qwen3 as titan_qwen3
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import BaseQKVLinear, FusedQKVLinear, QKVLinear
from torchtitan.models.common.config_utils import make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from forge_ext.engine.attention import DocumentMaskedSDPA
from forge_ext.engine.checkpoint_files import not_hf_folder_message
from forge_ext.engine.schema import TITAN_NAMES

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

# config.json ``model_type`` of the checkpoints each model.name reads. torchtitan 0.3.0 has no
# Qwen2 model (q/k/v biases, no q/k norm), so Qwen2/Qwen2.5 checkpoints are refused.
HF_MODEL_TYPES = {"qwen3": "qwen3", "llama3": "llama"}

# RoPE types whose frequencies do not depend on the sequence length, so one table computed
# by transformers' ROPE_INIT_FUNCTIONS serves every position (see HFRoPE).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


class HFRoPE(CosSinRoPE):
    """Rotate-half RoPE with inverse frequencies and a cos/sin scale computed by transformers.

    The cache is ``cat(cos(t * f) * a, sin(t * f) * a)`` for positions ``t < max_seq_len``,
    ``f = inv_freq`` (``[head_dim / 2]``) and ``a = attention_factor``: exactly what
    ``transformers``' ``*RotaryEmbedding.forward`` computes (e.g.
    ``transformers/models/qwen3/modeling_qwen3.py``, ``Qwen3RotaryEmbedding``; yarn's
    ``attention_factor`` scales both cos and sin, so q.k scales by its square), laid out as
    torchtitan's :class:`CosSinRoPE` cache (``[max_seq_len, 2 * head_dim]``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        rope_type: str = "default"
        """The checkpoint's ``rope_parameters.rope_type`` (for messages and signatures)."""
        inv_freq: tuple[float, ...] = ()
        """``[head_dim / 2]`` inverse frequencies (radians per position), fp32 values."""
        attention_factor: float = 1.0
        """Scale applied to cos and sin (yarn's mscale; 1 for the other types)."""

    def _precompute_cache(self) -> torch.Tensor:
        cfg = self.config
        inv_freq = torch.tensor(cfg.inv_freq, dtype=torch.float32)
        if inv_freq.numel() * 2 != cfg.dim:
            raise ValueError(
                f"HFRoPE has {inv_freq.numel()} frequencies for head_dim {cfg.dim}"
            )
        positions = torch.arange(cfg.max_seq_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return torch.cat(
            [emb.cos() * cfg.attention_factor, emb.sin() * cfg.attention_factor], dim=-1
        )


def rope_from_hf(name: str, hf: dict[str, Any]) -> CosSinRoPE.Config:
    """The RoPE config of a checkpoint's ``config.json`` (HF rotate-half layout).

    ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older configs) are normalised by
    the checkpoint's own ``transformers`` config class, and the frequencies come from
    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``, so they are the ones
    ``transformers`` (and vLLM) use. ``default`` gives torchtitan's :class:`CosSinRoPE`
    (the same table); ``linear``, ``yarn`` and ``llama3`` give :class:`HFRoPE`.

    Args:
        name: ``model.name`` (``qwen3`` or ``llama3``).
        hf: ``config.json`` mapping.

    Raises:
        ValueError: naming the ``config.json`` field, for RoPE the engine cannot reproduce:
            ``dynamic`` (frequencies recomputed from each batch's length in transformers, a
            fixed scaled table in vLLM: trainer and generator would disagree), ``longrope``
            and other types, ``partial_rotary_factor`` < 1, per-layer-type RoPE.
    """
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {k: v for k, v in hf.items() if k not in ("model_type", "transformers_version")}
    config = AutoConfig.for_model(HF_MODEL_TYPES[name], **fields)
    params = dict(config.rope_parameters or {})
    field = "rope_parameters" if "rope_parameters" in hf else (
        "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    )
    rope_type = params.get("rope_type")
    if not isinstance(rope_type, str):
        raise ValueError(
            f"model.hf_path config.json {field}={params!r} sets RoPE per layer type, which the "
            "engine does not support; use a checkpoint with one rope_parameters dict"
        )
    if rope_type not in STATIC_ROPE_TYPES:
        why = (
            "transformers recomputes its frequencies from each batch's sequence length while "
            "vLLM uses one table scaled for the longest, so trainer and generator would disagree"
            if rope_type == "dynamic" else "the engine has no implementation of it"
        )
        raise ValueError(
            f"model.hf_path config.json {field}.rope_type={rope_type!r} is not supported "
            f"({why}); supported: {list(STATIC_ROPE_TYPES)}. Use a checkpoint without it, or "
            f"set {field} to one of those in config.json if the model was trained that way"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(
            f"model.hf_path config.json {field}.partial_rotary_factor="
            f"{params['partial_rotary_factor']} is not supported: the engine rotates the "
            "whole head_dim"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    max_seq_len = config.max_position_embeddings
    if rope_type == "default":
        return CosSinRoPE.Config(
            dim=head_dim, max_seq_len=max_seq_len, theta=float(params["rope_theta"])
        )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return HFRoPE.Config(
        dim=head_dim, max_seq_len=max_seq_len, theta=float(params["rope_theta"]),
        rope_type=rope_type, inv_freq=tuple(inv_freq.float().tolist()),
        attention_factor=float(attention_factor),
    )


class Llama3HFStateDictAdapter(Llama3StateDictAdapter):
    """torchtitan's Llama-3 HF adapter, exact for the RoPE the model is built with.

    HF stores ``q_proj``/``k_proj`` rows for rotate-half RoPE (the first and second half of
    each head are the rotated pairs). torchtitan's :class:`ComplexRoPE` pairs adjacent
    dimensions, so torchtitan's adapter permutes those rows (``_permute`` /
    ``_reverse_permute``, HF's conversion script). A model built with :class:`CosSinRoPE`
    (or :class:`HFRoPE`; the ``hf`` and small flavors) rotates halves like HF and takes the
    rows as they are.

    Raises:
        ValueError: a model whose RoPE is neither (at construction).
    """

    def __init__(self, model_config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        rope = model_config.layers[0].attention.rope
        if not isinstance(rope, (CosSinRoPE.Config, ComplexRoPE.Config)):
            raise ValueError(
                f"llama3 HF conversion supports CosSinRoPE and ComplexRoPE, not "
                f"{type(rope).__qualname__}"
            )
        self.rotate_half = isinstance(rope, CosSinRoPE.Config)

    def _permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return w if self.rotate_half else super()._permute(w, n_heads_arg, dim1, dim2)

    def _reverse_permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return w if self.rotate_half else super()._reverse_permute(w, n_heads_arg, dim1, dim2)

    def _validate_hf_rope_config(self, expected_rope_cls: type) -> None:
        expected = CosSinRoPE.Config if self.rotate_half else ComplexRoPE.Config
        super()._validate_hf_rope_config(expected)


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
        raise FileNotFoundError(not_hf_folder_message(
            "model.hf_path", hf_path,
            "point it at a Hugging Face checkpoint directory (config.json + *.safetensors)"))
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
            ``tie_word_embeddings``, ``head_dim`` (default ``hidden_size / num_attention_heads``),
            ``rope_parameters`` / ``rope_scaling`` (see :func:`rope_from_hf`)).

    Raises:
        KeyError: naming a required field missing from ``hf``.
        ValueError: RoPE the engine cannot reproduce (see :func:`rope_from_hf`).
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
    if name not in _TITAN_REGISTRIES:
        raise ValueError(f"model.name={name!r} must be one of {sorted(_TITAN_REGISTRIES)}")
    rope = rope_from_hf(name, hf)
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
        for layer_id, layer in enumerate(layers):
            layer.attention_norm = replace(layer.attention_norm, eps=eps)
            layer.ffn_norm = replace(layer.ffn_norm, eps=eps)
            if head_dim != dim // n_heads:
                # torchtitan's llama3 builder derives head_dim = dim / n_heads; a config.json
                # head_dim (LlamaConfig.head_dim) overrides it, as in transformers.
                layer.attention = make_gqa_config(
                    dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                    wqkv_param_init=titan_llama3._LINEAR_INIT,
                    wo_param_init=titan_llama3._depth_init(layer_id),
                    inner_attention=layer.attention.inner_attention, fuse_qkv=True, rope=rope,
                )
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


def check_hf_model_type(name: str, hf: dict[str, Any]) -> None:
    """Refuse a checkpoint of another architecture than ``model.name``.

    Raises:
        ValueError: naming ``config.json`` ``model_type``, the ``model.name`` it needs and
            the fix.
    """
    model_type = hf.get("model_type")
    if model_type is not None and model_type != HF_MODEL_TYPES[name]:
        fits = {t: n for n, t in HF_MODEL_TYPES.items()}.get(model_type)
        fix = (f"; set model.name={fits} or leave model.name out to take it from config.json"
               if fits else "")
        raise ValueError(
            f"model.hf_path config.json model_type={model_type!r} cannot be loaded as "
            f"model.name={name!r}{fix}; the engine reads model_type {_supported_types()}"
            + _qwen2_note(model_type)
        )


def _supported_types() -> str:
    return ", ".join(f"{t!r} (model.name: {n})" for n, t in HF_MODEL_TYPES.items())


def _qwen2_note(model_type: Any) -> str:
    return (" (torchtitan 0.3.0 has no Qwen2 model: q/k/v biases, no q/k norm)"
            if model_type == "qwen2" else "")


def model_name_of(hf_path: str | None) -> str:
    """The default ``model.name``: the one that reads ``hf_path``'s config.json
    ``model_type`` (``qwen3`` -> ``qwen3``, ``llama`` -> ``llama3``, :data:`HF_MODEL_TYPES`);
    ``qwen3`` without a checkpoint (or without its config.json, which the engine's
    validation then reports).

    Raises:
        ValueError: a ``model_type`` the engine has no model for, naming it and the
            supported ones.
    """
    path = os.path.join(hf_path, "config.json") if hf_path else None
    if path is None or not os.path.isfile(path):
        return "qwen3"
    model_type = read_hf_config(hf_path).get("model_type")
    if model_type is None:
        return "qwen3"
    for name, hf_type in HF_MODEL_TYPES.items():
        if hf_type == model_type:
            return name
    raise ValueError(
        f"model.hf_path config.json model_type={model_type!r} cannot be loaded: the engine "
        f"reads model_type {_supported_types()}" + _qwen2_note(model_type)
    )


# config.json fields the engine's torchtitan decoders do not implement, with the values they
# do implement: a checkpoint with another value is refused before any spawn (a silent mismatch
# would train a model other than the checkpoint's, or fail at the first weight sync).
SUPPORTED_FIELD_VALUES: dict[str, tuple[Any, ...]] = {
    "attention_bias": (False, None),  # q/k/v/o biases
    "mlp_bias": (False, None),  # gate/up/down biases (Llama)
    "hidden_act": ("silu", None),  # SwiGLU with SiLU
    "use_sliding_window": (False, None),  # Qwen3 sliding-window layers
}


def check_hf_architecture(hf: dict[str, Any]) -> None:
    """Refuse ``config.json`` fields that describe layers the engine's decoders lack.

    Raises:
        ValueError: naming the ``config.json`` field and value (:data:`SUPPORTED_FIELD_VALUES`;
            ``layer_types`` other than ``full_attention``).
    """
    for field, supported in SUPPORTED_FIELD_VALUES.items():
        if hf.get(field) not in supported:
            raise ValueError(
                f"model.hf_path config.json {field}={hf[field]!r} is not supported: torchtitan "
                f"0.3.0's decoders have {field}={supported[0]!r} only; use a checkpoint without it"
            )
    other = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if other:
        raise ValueError(
            f"model.hf_path config.json layer_types has {other}: the engine runs full "
            "attention in every layer; use a checkpoint whose layer_types are all "
            "'full_attention'"
        )


def check_checkpoint_tensors(spec: ModelSpec, hf_path: str) -> None:
    """Refuse a checkpoint whose tensors are not the ones the model loads: the engine reads
    only the names its model has (``state_dict_adapter.to_hf``), so extra tensors (biases,
    layers of another architecture) would be dropped silently. Reads the safetensors
    headers only; a directory without ``*.safetensors`` is left to the load to report.

    Raises:
        ValueError: naming ``model.hf_path``, the first names in excess or missing and
            their count.
    """
    found = checkpoint_tensor_names(hf_path)
    if not found:
        return
    with torch.device("meta"):
        model = spec.model.build()
    expected = set(spec.state_dict_adapter(spec.model, None).to_hf(model.state_dict()))
    ignored = {"lm_head.weight"} if getattr(spec.model, "enable_weight_tying", False) else set()
    if VALUE_HEAD_HF_NAME in expected:
        # A value head reads a classifier's score, and starts from zeros on a causal LM,
        # whose LM head it does not read (apply_value_head).
        ignored |= {"lm_head.weight", VALUE_HEAD_HF_NAME}
    unused = sorted(n for n in found - expected - ignored if not n.endswith("rotary_emb.inv_freq"))
    missing = sorted(expected - found - ignored)
    if unused or missing:
        problems = []
        if unused:
            problems.append(f"tensors the engine's model has no place for: {unused[:3]} "
                            f"({len(unused)} in all)")
        if missing:
            problems.append(f"no {missing[:3]} ({len(missing)} missing in all)")
        raise ValueError(
            f"model.hf_path={hf_path!r} does not hold the weights of the model its config.json "
            f"describes to the engine: {'; '.join(problems)}. Training would drop or lack "
            "them; use a checkpoint of a supported architecture (Qwen3, Llama-3)"
        )


def rope_frequencies(rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``([head_dim / 2] radians per position, [head_dim / 2] cos/sin amplitude)`` of a RoPE
    config, read from the table its module builds (ComplexRoPE or CosSinRoPE layout)."""
    with torch.device("cpu"):
        table = replace(rope, max_seq_len=2).build().cache[1]
    if table.is_complex():
        return table.angle(), table.abs()
    half = rope.dim // 2
    cos, sin = table[:half], table[rope.dim : rope.dim + half]
    return torch.atan2(sin, cos), torch.hypot(cos, sin)


def check_flavor_matches_checkpoint(flavor: str, built: Any, from_checkpoint: Any) -> None:
    """Refuse ``model.flavor`` (not ``hf``) with a ``model.hf_path`` whose ``config.json``
    describes another model: other parameter shapes, norm eps or RoPE (e.g. a flavor without
    RoPE scaling for a checkpoint with yarn, or torchtitan's Llama-3 ``1B`` with its llama3
    factor 8 for Llama-3.2-1B's factor 32). Only the weights would come from the checkpoint,
    so logits would silently differ from transformers'.

    Raises:
        ValueError: naming the first difference and the fix (``model.flavor: hf``).
    """
    def shapes(config):
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in config.build().state_dict().items()}

    problems = []
    a, b = shapes(built), shapes(from_checkpoint)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()))[:2]
        problems.append(f"parameter shapes differ ({diff})")
    if bool(getattr(built, "enable_weight_tying", False)) != bool(
        getattr(from_checkpoint, "enable_weight_tying", False)
    ):
        problems.append("tie_word_embeddings differs")
    if built.norm.eps != from_checkpoint.norm.eps:
        problems.append(f"rms_norm_eps {built.norm.eps} != {from_checkpoint.norm.eps}")
    (f1, a1), (f2, a2) = (rope_frequencies(m.layers[0].attention.rope)
                          for m in (built, from_checkpoint))
    if f1.shape != f2.shape or not (
        torch.allclose(f1, f2, rtol=1e-5, atol=0) and torch.allclose(a1, a2, rtol=1e-6, atol=0)
    ):
        kind = getattr(from_checkpoint.layers[0].attention.rope, "rope_type", "default")
        problems.append(f"RoPE frequencies differ (config.json rope_type={kind!r})")
    if problems:
        raise ValueError(
            f"model.flavor={flavor!r} does not match model.hf_path config.json: "
            f"{'; '.join(problems)}. Use model.flavor=hf to take the architecture from "
            "config.json"
        )


VALUE_HEAD_HF_NAME = "score.weight"
"""HF name of a value head's ``[1, hidden]`` weight: transformers'
``Qwen3ForSequenceClassification`` / ``LlamaForSequenceClassification`` (and their token
classification twins) with ``num_labels: 1`` call their output projection ``score``."""


def apply_value_head(spec: ModelSpec) -> ModelSpec:
    """Make ``spec``'s output projection a value head, in place: ``lm_head`` becomes
    ``Linear(hidden, 1, bias=False)`` (one scalar per position, on the final norm's output,
    as transformers' ``*ForSequenceClassification.score``), zero-initialised so that a
    critic built from a causal LM starts at ``V = 0``; embeddings are untied. Its HF name is
    ``score.weight`` (:data:`VALUE_HEAD_HF_NAME`): a sequence-classification checkpoint (a
    reward model, a saved critic) loads its head, a causal LM's ``lm_head.weight`` is not
    read (:meth:`forge_ext.engine.TitanEngine.load_hf_weights`). The model's output is then
    ``[batch, seq, 1]`` where an LM's is ``[batch, seq, vocab]``."""
    model = spec.model
    model.lm_head = replace(model.lm_head, out_features=1, bias=False,
                            param_init={"weight": torch.nn.init.zeros_})
    model.enable_weight_tying = False
    base = spec.state_dict_adapter

    class ValueHeadStateDictAdapter(base):
        """``base``'s HF conversion with the output projection named ``score.weight``."""

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            hf = super().to_hf(state_dict)
            if "lm_head.weight" in hf:
                hf[VALUE_HEAD_HF_NAME] = hf.pop("lm_head.weight")
            return hf

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            hf = {k: v for k, v in hf_state_dict.items() if k != "lm_head.weight"}
            if VALUE_HEAD_HF_NAME in hf:
                hf["lm_head.weight"] = hf.pop(VALUE_HEAD_HF_NAME)
            return super().from_hf(hf)

    spec.state_dict_adapter = ValueHeadStateDictAdapter
    return spec


def checkpoint_tensor_names(hf_path: str) -> set[str]:
    """The tensor names of ``hf_path``'s ``*.safetensors`` files (headers only)."""
    import glob

    from safetensors import safe_open

    found: set[str] = set()
    for path in sorted(glob.glob(os.path.join(hf_path, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            found.update(f.keys())
    return found


def build_model_spec(
    name: str, flavor: str, *, hf_path: str | None = None, attn_backend: str = "sdpa",
    value_head: bool = False,
) -> ModelSpec:
    """Look up a model by name and flavor and set its inner attention backend.

    ``attn_backend="sdpa"`` replaces each layer's inner attention with torchtitan's
    ``ScaledDotProductAttention`` (causal), extended with document masks for packed rows
    (:class:`forge_ext.engine.attention.DocumentMaskedSDPA`): the only backend with a CPU
    backward (FlexAttention has none on CPU, varlen is CUDA-only). Batches are right-padded,
    so causal attention is exact for every valid token. ``value_head=True``: the output
    projection is a value head (:func:`apply_value_head`), for a critic or a reward model.

    Raises:
        ValueError: unknown ``model.name``, ``model.flavor`` or ``model.attn_backend``
            (the message lists the accepted values); a ``model.hf_path`` checkpoint of
            another ``model_type`` or with layers the engine lacks
            (:func:`check_hf_architecture`); RoPE the engine cannot reproduce
            (:func:`rope_from_hf`).
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
    if hf_path:
        checkpoint_config = read_hf_config(hf_path)
        check_hf_model_type(name, checkpoint_config)
        check_hf_architecture(checkpoint_config)
    hf = hf_config_for(name, flavor, hf_path)
    titan_backend = "flex" if attn_backend == "sdpa" else attn_backend
    if hf is None:
        spec = registry(flavor, attn_backend=titan_backend)
    else:
        spec = registry(next(iter(titan_flavors)), attn_backend=titan_backend)
        spec.flavor = flavor
        spec.model = decoder_config_from_hf(name, hf, titan_backend)
    if hf_path and flavor != "hf":
        check_flavor_matches_checkpoint(
            flavor, spec.model, decoder_config_from_hf(name, read_hf_config(hf_path), titan_backend)
        )
    if name == "llama3":
        spec.state_dict_adapter = Llama3HFStateDictAdapter
    if attn_backend == "sdpa":
        for layer in spec.model.layers:
            layer.attention.inner_attention = DocumentMaskedSDPA.Config()
    if value_head:
        apply_value_head(spec)
    return spec


class SplitQKVLinear(BaseQKVLinear):
    """Q, K and V as three separate linear layers ``wq``, ``wk``, ``wv`` (HF's ``q_proj``,
    ``k_proj``, ``v_proj``), each with its own config.

    torchtitan's :class:`FusedQKVLinear` (one ``wqkv``) cannot take a separate adapter per
    projection, and its :class:`QKVLinear` builds ``wk`` and ``wv`` from one ``wkv`` config,
    so ``LoRAConverter`` (which matches configs by name) would adapt both or neither. With
    LoRA the engine builds this instead: the same parameters under the state-dict names the
    HF adapters already use (``qkv_linear.wq.weight``, ...), the same forward as
    ``QKVLinear`` (``torchtitan/models/common/attention.py``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseQKVLinear.Config):
        wq: Linear.Config
        wk: Linear.Config
        wv: Linear.Config

    def __init__(self, config: Config):
        super().__init__(config)
        self.wq = config.wq.build()
        self.wk = config.wk.build()
        self.wv = config.wv.build()

    forward = QKVLinear.forward


def split_qkv(model_config: Any) -> None:
    """Replace every layer's fused ``wqkv`` config by a :class:`SplitQKVLinear` config of the
    same shapes, in place (parameter sharding configs are kept; random init: trunc-normal
    0.02, torchtitan's ``_LINEAR_INIT``; a run with ``model.hf_path`` loads every weight)."""
    for layer in model_config.layers:
        qkv = layer.attention.qkv_linear
        if isinstance(qkv, SplitQKVLinear.Config):
            continue
        if not isinstance(qkv, FusedQKVLinear.Config):
            raise ValueError(f"lora: attention projections {type(qkv).__name__} are not supported")
        fused, hd = qkv.wqkv, qkv.head_dim
        init = {"weight": partial(torch.nn.init.trunc_normal_, std=0.02)}

        def linear(out_features: int) -> Linear.Config:
            return Linear.Config(
                in_features=fused.in_features, out_features=out_features, bias=fused.bias,
                param_init=init, sharding_config=fused.sharding_config,
            )

        layer.attention.qkv_linear = SplitQKVLinear.Config(
            head_dim=hd, wq=linear(qkv.n_heads * hd), wk=linear(qkv.n_kv_heads * hd),
            wv=linear(qkv.n_kv_heads * hd),
        )


def apply_lora(model_config: Any, lora: Any) -> Any:
    """Convert ``model_config`` for LoRA training with torchtitan's ``LoRAConverter``
    (``torchtitan/components/lora.py``): q/k/v split (:func:`split_qkv`), then the layers
    named by ``lora.target_modules`` (HF names, mapped by
    :data:`forge_ext.engine.schema.TITAN_NAMES`) become ``LoRALinear`` (``lora_a [rank, in]``
    kaiming-uniform, ``lora_b [out, rank]`` zeros, output scaled by ``alpha / rank``) and
    every other parameter is frozen (``requires_grad=False``). The model config is modified
    in place where possible; use the returned root.

    Args:
        lora: a :class:`forge_ext.engine.config.LoRAConfig`.

    Raises:
        ValueError: a target the model has no layer for, naming ``lora.target_modules``.
    """
    from torchtitan.components.lora import LoRAConverter

    split_qkv(model_config)
    targets = lora.targets
    titan_targets = [TITAN_NAMES[name] for name in targets]
    present = {fqn.rsplit(".", 1)[-1] for fqn, *_ in model_config.traverse(Linear.Config)}
    missing = [hf for hf, titan in zip(targets, titan_targets) if titan not in present]
    if missing:
        raise ValueError(
            f"lora.target_modules names {missing}, which this model has no linear layer for; "
            f"it has {[hf for hf, t in TITAN_NAMES.items() if t in present]}"
        )
    converter = LoRAConverter(LoRAConverter.Config(
        rank=lora.rank, alpha=float(lora.alpha), target_modules=titan_targets,
    ))
    return converter.convert(model_config)
