"""Convert decoder weights between the HF layout and vLLM's fused, tensor-parallel layout.

The HF layout is what ``transformers``' ``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM`` /
``LlamaForCausalLM`` return from ``state_dict()`` (and what torchtitan's state-dict adapters
produce with ``to_hf``). The vLLM layout is the set of parameters of vLLM's models of the same
names, whose projections are fused and, under tensor parallelism (TP), split per rank (shapes
on rank ``r`` of ``T``):

- ``model.embed_tokens.weight [Vp/T, h]`` <- same key ``[V, h]``: ``VocabParallelEmbedding``
- ``...self_attn.qkv_proj.weight [(Hq/T + 2*Hkv_r) * d, h]`` (and ``.bias``, Qwen2) <-
  ``q_proj``, ``k_proj``, ``v_proj``: ``QKVParallelLinear``
- ``...self_attn.o_proj.weight [h, Hq*d/T]`` <- same key: ``RowParallelLinear``
- ``...mlp.gate_up_proj.weight [2*I/T, h]`` <- ``gate_proj``, ``up_proj``:
  ``MergedColumnParallelLinear``
- ``...mlp.down_proj.weight [h, I/T]`` <- same key: ``RowParallelLinear``
- norms, ``o_proj.bias``, ``down_proj.bias`` <- same key, full on every rank (vLLM adds a
  row-parallel bias once, on rank 0)
- ``lm_head.weight [Vp/T, h]`` <- same key: ``ParallelLMHead``; absent when the embeddings are
  tied (vLLM's ``lm_head`` is then ``embed_tokens``)

(``h`` hidden_size, ``d`` head_dim, ``Hq``/``Hkv`` attention / key-value heads, ``I``
intermediate_size, ``V`` vocab_size, ``Vp`` vocab_size padded to a multiple of 64.)

Sources of the layout, read from vLLM's code (vLLM itself is never imported here):
``vllm/model_executor/models/qwen2.py`` (``stacked_params_mapping``: q/k/v -> ``qkv_proj``
shards "q", "k", "v"; gate/up -> ``gate_up_proj`` shards 0, 1; tied models skip ``lm_head``),
``vllm/model_executor/layers/linear.py`` (``QKVParallelLinear``: each rank holds
``[q_r; k_r; v_r]`` with ``Hq/T`` query heads; when ``T >= Hkv`` it holds one KV head,
number ``r // (T // Hkv)``, i.e. KV heads are *replicated*, otherwise ``Hkv/T`` KV heads;
``MergedColumnParallelLinear``: ``[gate_r; up_r]``; ``RowParallelLinear``: input columns split,
bias full on every rank) and ``vllm/model_executor/layers/vocab_parallel_embedding.py``
(``pad_vocab_size`` to ``DEFAULT_VOCAB_PADDING_SIZE = 64``, then ``Vp/T`` rows per rank).

Vocabulary padding: with a ``tp_rank`` the embedding and ``lm_head`` shards are returned as
vLLM's parameters hold them: rank ``r`` gets rows ``[r*Vp/T, (r+1)*Vp/T)`` of the padded
vocabulary, and rows at or beyond ``vocab_size`` are zero (vLLM's ``weight_loader`` zero-fills
them too). With ``tp_rank=None`` vocabulary tensors stay unpadded ``[V, h]``. ``vllm_to_hf``
accepts ``V`` or ``Vp`` rows and drops the padding.

Use on the vLLM side: copy each tensor into the parameter of the same name
(``dict(model.named_parameters())[key].data.copy_(tensor)``). Do not pass the fused names to
vLLM's ``model.load_weights``: it expects HF names and matches them by substring, so
``...qkv_proj.weight`` would match the "v_proj" entry and be renamed ``...qkqkv_proj.weight``.
vLLM's Qwen3 has no ``o_proj`` bias: a Qwen3 config with ``attention_bias=True`` yields an
``o_proj.bias`` that vLLM has no parameter for (no released Qwen3 sets it).

Storage: an output that is an input tensor unchanged (a norm, an unsharded ``o_proj``, ...) is
returned as that very tensor, without a copy. Every other output is freshly allocated,
contiguous and owns its storage; no output is a view of part of an input (torchstore serialises
a view's whole base storage; see the shared FINDINGS). Inputs are never modified, and outputs
stay on their inputs' device.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from forge_ext.weights.model_config import (
    VOCAB_PADDING_SIZE, ModelConfig, as_model_config, padded_vocab_size,
)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed
    DTensor = None

__all__ = [
    "check_tensor_parallel",
    "hf_to_vllm",
    "iter_hf_to_vllm",
    "iter_vllm_to_hf",
    "merge_vllm_shards",
    "vllm_layers",
    "vllm_to_hf",
]

@dataclass(frozen=True, slots=True)
class _TensorParallelPlan:
    """Per-rank sizes of vLLM's TP layout for one ``tp_size`` (see the module docstring)."""

    tp_size: int
    q_rows: int  # q_proj rows per rank: query heads per rank * head_dim
    kv_rows: (
        int  # k_proj (and v_proj) rows per rank: KV heads per rank (1 if replicated) * head_dim
    )
    kv_replicas: int  # ranks holding the same KV head
    intermediate: int  # gate (and up) rows per rank
    vocab_padded: int
    vocab_rows: int  # padded vocabulary rows per rank

    @classmethod
    def build(cls, cfg: ModelConfig, tp_size: int) -> _TensorParallelPlan:
        """Raises ValueError listing every size that ``tp_size`` does not divide."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r} must be a positive int")
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        problems = []
        if heads % tp_size:
            problems.append(f"num_attention_heads={heads} is not divisible by tp_size={tp_size}")
        if tp_size >= kv and tp_size % kv:
            problems.append(
                f"tp_size={tp_size} >= num_key_value_heads={kv} but is not a multiple of it "
                "(vLLM replicates each KV head on tp_size // num_key_value_heads ranks)"
            )
        if tp_size < kv and kv % tp_size:
            problems.append(f"num_key_value_heads={kv} is not divisible by tp_size={tp_size}")
        if cfg.intermediate_size % tp_size:
            problems.append(
                f"intermediate_size={cfg.intermediate_size} is not divisible by tp_size={tp_size}"
            )
        vocab_padded = padded_vocab_size(cfg.vocab_size)
        if vocab_padded % tp_size:
            problems.append(
                f"vocab_size={cfg.vocab_size} padded to {vocab_padded} (a multiple of "
                f"{VOCAB_PADDING_SIZE}, as vLLM pads it) is not divisible by tp_size={tp_size}"
            )
        if problems:
            raise ValueError("cannot shard this model for vLLM: " + "; ".join(problems))
        replicated = tp_size >= kv
        return cls(
            tp_size=tp_size,
            q_rows=heads // tp_size * cfg.head_dim,
            kv_rows=(1 if replicated else kv // tp_size) * cfg.head_dim,
            kv_replicas=tp_size // kv if replicated else 1,
            intermediate=cfg.intermediate_size // tp_size,
            vocab_padded=vocab_padded,
            vocab_rows=vocab_padded // tp_size,
        )


class _Kind(enum.Enum):
    """How vLLM splits a parameter across TP ranks."""

    REPLICATED = "replicated"  # norms, row-parallel biases: every rank holds the full tensor
    QKV = "qkv"  # QKVParallelLinear: [q_r; k_r; v_r] along dim 0
    MERGED_COLUMN = "merged_column"  # MergedColumnParallelLinear: [gate_r; up_r] along dim 0
    ROW = "row"  # RowParallelLinear weight: input columns (dim 1)
    VOCAB = "vocab"  # VocabParallelEmbedding / ParallelLMHead: padded rows (dim 0)


@dataclass(frozen=True, slots=True)
class _Param:
    """One vLLM parameter and the HF tensors it is made of (in fusion order)."""

    vllm_key: str
    hf_keys: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    kind: _Kind


def _params(cfg: ModelConfig) -> list[_Param]:
    """Every vLLM parameter of the model described by ``cfg``, in model order."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def same(key: str, shape: tuple[int, ...], kind: _Kind = _Kind.REPLICATED) -> _Param:
        return _Param(key, (key,), (shape,), kind)

    def fused(prefix: str, names: Sequence[str], suffix: str, rows: Sequence[int], kind: _Kind):
        shapes = tuple((n, h) if suffix == "weight" else (n,) for n in rows)
        keys = tuple(f"{prefix}{name}.{suffix}" for name in names)
        fused_name = "qkv_proj" if kind is _Kind.QKV else "gate_up_proj"
        return _Param(f"{prefix}{fused_name}.{suffix}", keys, shapes, kind)

    params = [same("model.embed_tokens.weight", (cfg.vocab_size, h), _Kind.VOCAB)]
    for i in range(cfg.num_hidden_layers):
        layer, attn, mlp = (
            f"model.layers.{i}.",
            f"model.layers.{i}.self_attn.",
            f"model.layers.{i}.mlp.",
        )
        qkv_names, qkv_rows = ("q_proj", "k_proj", "v_proj"), (q, kv, kv)
        params.append(same(layer + "input_layernorm.weight", (h,)))
        params.append(fused(attn, qkv_names, "weight", qkv_rows, _Kind.QKV))
        if cfg.qkv_bias:
            params.append(fused(attn, qkv_names, "bias", qkv_rows, _Kind.QKV))
        if cfg.qk_norm:
            params.append(same(attn + "q_norm.weight", (d,)))
            params.append(same(attn + "k_norm.weight", (d,)))
        params.append(same(attn + "o_proj.weight", (h, q), _Kind.ROW))
        if cfg.o_proj_bias:
            params.append(same(attn + "o_proj.bias", (h,)))
        params.append(same(layer + "post_attention_layernorm.weight", (h,)))
        gate_up, gate_up_rows = ("gate_proj", "up_proj"), (inter, inter)
        params.append(fused(mlp, gate_up, "weight", gate_up_rows, _Kind.MERGED_COLUMN))
        if cfg.mlp_bias:
            params.append(fused(mlp, gate_up, "bias", gate_up_rows, _Kind.MERGED_COLUMN))
        params.append(same(mlp + "down_proj.weight", (h, inter), _Kind.ROW))
        if cfg.mlp_bias:
            params.append(same(mlp + "down_proj.bias", (h,)))
    params.append(same("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        params.append(same("lm_head.weight", (cfg.vocab_size, h), _Kind.VOCAB))
    return params


_FUSED = (_Kind.QKV, _Kind.MERGED_COLUMN)


def _vllm_shape(param: _Param, plan: _TensorParallelPlan | None) -> tuple[int, ...]:
    """Shape of ``param`` in vLLM layout: whole and unpadded if ``plan`` is None, else per rank."""
    first, *rest = param.hf_shapes[0]
    if param.kind in _FUSED:
        rows = [shape[0] for shape in param.hf_shapes] if plan is None else _shard_rows(param, plan)
        return (sum(rows), *rest)
    if plan is None or param.kind is _Kind.REPLICATED:
        return param.hf_shapes[0]
    if param.kind is _Kind.ROW:
        return (first, rest[0] // plan.tp_size)
    return (plan.vocab_rows, *rest)


def _shard_rows(param: _Param, plan: _TensorParallelPlan) -> list[int]:
    """Rows each HF source contributes to one rank's shard of a fused parameter."""
    if param.kind is _Kind.MERGED_COLUMN:
        return [plan.intermediate] * len(param.hf_keys)
    return [plan.q_rows, plan.kv_rows, plan.kv_rows]


def _shard_starts(param: _Param, plan: _TensorParallelPlan, tp_rank: int) -> list[int]:
    """First row of each HF source taken into rank ``tp_rank``'s shard of a fused parameter."""
    if param.kind is _Kind.MERGED_COLUMN:
        return [tp_rank * plan.intermediate] * len(param.hf_keys)
    kv_rank = tp_rank // plan.kv_replicas  # QKVParallelLinear's shard_rank for "k" and "v"
    return [tp_rank * plan.q_rows, kv_rank * plan.kv_rows, kv_rank * plan.kv_rows]


# --------------------------------------------------------------------------------------------
# Tensor helpers


def _is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of ``t`` as a plain tensor.

    A DTensor that is replicated on every mesh dimension gives its local tensor (no
    communication); any other DTensor is gathered with ``full_tensor()``, a collective that
    every rank of its mesh must reach in the same order.
    """
    if not _is_dtensor(t):
        return t
    if all(placement.is_replicate() for placement in t.placements):
        return t.to_local()
    return t.full_tensor()


def _owned(view: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``view`` with storage of its own."""
    return view.clone(memory_format=torch.contiguous_format)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values: the same memory, or equal (local) data."""
    if _is_dtensor(a) or _is_dtensor(b):
        a = a.to_local() if _is_dtensor(a) else a
        b = b.to_local() if _is_dtensor(b) else b
    if a.shape != b.shape:
        return False
    if (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
    ):
        return True
    return bool(torch.equal(a, b))


# --------------------------------------------------------------------------------------------
# Validation


def vllm_layers(model_config: Any) -> dict[str, tuple[str, ...]]:
    """Each vLLM layer (module) of the model and the HF tensors it loads from, in model
    order: ``{"model.layers.0.self_attn.qkv_proj": ("...q_proj.weight", "...k_proj.weight",
    "...v_proj.weight", and the biases if any), "model.norm": ("model.norm.weight",), ...}``.
    vLLM processes a layer once all its tensors arrived (``reload/layerwise.py``): a reload
    passes all of a layer's tensors or none.

    Args:
        model_config: as for :func:`hf_to_vllm`.

    Raises:
        ValueError: a model family this module does not convert (``ModelConfig.from_hf``).
    """
    layers: dict[str, tuple[str, ...]] = {}
    for param in _params(as_model_config(model_config)):
        module = param.vllm_key.rpartition(".")[0]
        layers[module] = layers.get(module, ()) + param.hf_keys
    return layers


def check_tensor_parallel(model_config: Any, tp_size: int) -> None:
    """Check that vLLM can shard this model over ``tp_size`` ranks.

    Args:
        model_config: as for :func:`hf_to_vllm`.

    Raises:
        ValueError: naming each size ``tp_size`` does not divide (attention heads, KV heads,
            intermediate_size, padded vocabulary).
    """
    _TensorParallelPlan.build(as_model_config(model_config), tp_size)


def _check_rank(tp_rank: int | None, tp_size: int) -> None:
    if tp_rank is not None and not (isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise ValueError(f"tp_rank={tp_rank!r} must be None or an int in [0, tp_size={tp_size})")


_LISTED = 20  # items named in an error message; the rest are counted


def _more(items: Sequence[str]) -> str:
    return f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""


def _listed(keys: Sequence[str]) -> str:
    return f"{list(keys[:_LISTED])}{_more(keys)}"


def _check_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    expected: Mapping[str, Sequence[tuple[int, ...]]],
    cfg: ModelConfig,
    layout: str,
) -> None:
    """Check keys and shapes of ``state_dict`` against ``expected`` (key -> allowed shapes).

    A tied model may still carry ``lm_head.weight`` (``nn.Module.state_dict()`` lists a tied
    weight under both names); it is accepted when it holds the embedding's values.

    Raises:
        ValueError: listing every missing key, unexpected key and wrong shape, or an
            ``lm_head.weight`` that differs from the embedding of a tied model.
    """
    allowed = set(expected)
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in state_dict
    if tied_head:
        allowed.add("lm_head.weight")
    missing = [key for key in expected if key not in state_dict]
    unexpected = sorted(key for key in state_dict if key not in allowed)
    wrong_shapes = [
        f"{key}: {tuple(state_dict[key].shape)}, expected {' or '.join(map(str, shapes))}"
        for key, shapes in expected.items()
        if key in state_dict and tuple(state_dict[key].shape) not in shapes
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_listed(unexpected)}")
    if wrong_shapes:
        problems.append(f"wrong shapes [{'; '.join(wrong_shapes[:_LISTED])}]{_more(wrong_shapes)}")
    if problems:
        raise ValueError(
            f"state dict does not match the {layout} layout of this model_config ({cfg}): "
            + "; ".join(problems)
        )
    embed = "model.embed_tokens.weight"
    if tied_head and not _same_values(state_dict["lm_head.weight"], state_dict[embed]):
        raise ValueError(
            f"tie_word_embeddings=True but lm_head.weight differs from {embed}; set "
            "tie_word_embeddings=False in model_config if the model has its own lm_head"
        )


# --------------------------------------------------------------------------------------------
# HF -> vLLM


def iter_hf_to_vllm(
    state_dict: Mapping[str, torch.Tensor],
    model_config: Any,
    tp_size: int = 1,
    tp_rank: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(vllm_key, tensor)`` pairs one parameter at a time (see :func:`hf_to_vllm`).

    Keys, shapes and sizes are checked when this is called, before anything is yielded. Each
    tensor is built only when asked for, so a caller that sends it on (e.g. to torchstore) and
    drops it holds at most one converted parameter beside the input. DTensor inputs are
    gathered lazily, in model order, so every rank of their mesh must consume the iterator to
    the end in the same order.
    """
    cfg = as_model_config(model_config)
    plan = _TensorParallelPlan.build(cfg, tp_size)
    _check_rank(tp_rank, tp_size)
    params = _params(cfg)
    expected = {k: (s,) for p in params for k, s in zip(p.hf_keys, p.hf_shapes, strict=True)}
    _check_state_dict(state_dict, expected, cfg, "HF")
    return _hf_to_vllm(state_dict, params, cfg, plan, tp_rank)


@torch.no_grad()
def _hf_to_vllm(state_dict, params, cfg, plan, tp_rank) -> Iterator[tuple[str, torch.Tensor]]:
    for param in params:
        sources = [_full(state_dict[key]) for key in param.hf_keys]
        yield param.vllm_key, _to_vllm(param, sources, cfg, plan, tp_rank)


def _to_vllm(
    param: _Param,
    sources: list[torch.Tensor],
    cfg: ModelConfig,
    plan: _TensorParallelPlan,
    tp_rank: int | None,
) -> torch.Tensor:
    if param.kind in _FUSED:
        if tp_rank is not None:
            rows = _shard_rows(param, plan)
            starts = _shard_starts(param, plan, tp_rank)
            sources = [t.narrow(0, s, n) for t, s, n in zip(sources, starts, rows, strict=True)]
        return torch.cat(sources, dim=0)  # one copy, into fresh storage
    (source,) = sources
    if tp_rank is None or param.kind is _Kind.REPLICATED:
        return source
    if param.kind is _Kind.VOCAB:
        return _vocab_shard(source, cfg.vocab_size, plan.vocab_rows, tp_rank)
    if plan.tp_size == 1:  # a ROW weight, whole
        return source
    cols = source.shape[1] // plan.tp_size
    return _owned(source.narrow(1, tp_rank * cols, cols))


def _vocab_shard(weight: torch.Tensor, vocab_size: int, rows: int, tp_rank: int) -> torch.Tensor:
    """Rows ``[tp_rank*rows, (tp_rank+1)*rows)`` of ``weight`` padded with zero rows.

    Args:
        weight: ``[vocab_size, hidden]``.
    Returns:
        ``[rows, hidden]``; rows at or past ``vocab_size`` are zero.
    """
    start = tp_rank * rows
    if start == 0 and rows == vocab_size:
        return weight
    real = max(0, min(vocab_size - start, rows))
    shard = weight.new_empty((rows, *weight.shape[1:]))
    if real:  # a rank may hold padding only (small vocab, large TP)
        shard[:real].copy_(weight.narrow(0, start, real))
    shard[real:].zero_()
    return shard


def hf_to_vllm(
    state_dict: Mapping[str, torch.Tensor],
    model_config: Any,
    tp_size: int = 1,
    tp_rank: int | None = None,
) -> dict[str, torch.Tensor]:
    """Convert an HF-layout state dict to vLLM's layout, whole or for one TP rank.

    Args:
        state_dict: HF keys (``model.layers.{i}.self_attn.q_proj.weight``, ...) to tensors or
            DTensors; exactly the keys of ``model_config``'s model (``lm_head.weight`` absent
            or equal to the embedding when ``tie_word_embeddings``). Not modified.
        model_config: a :class:`ModelConfig`, or anything :meth:`ModelConfig.from_hf` takes
            (an HF config object, a ``config.json`` dict or path).
        tp_size: vLLM's tensor-parallel size. Also checked when ``tp_rank`` is None.
        tp_rank: None for the full fused tensors (vocabulary unpadded); a rank in
            ``[0, tp_size)`` for exactly the tensors that rank's vLLM parameters hold
            (vocabulary padded to a multiple of 64, padding rows zero).

    Returns:
        vLLM keys (``...qkv_proj.weight``, ``...gate_up_proj.weight``, ...) to plain tensors, in
        model order, on the inputs' devices and dtypes. No ``lm_head.weight`` for tied models:
        vLLM uses the embedding there.

    Raises:
        ValueError: listing missing / unexpected keys or wrong shapes; naming each size that
            ``tp_size`` does not divide (heads, KV heads, intermediate_size, padded vocab);
            for a ``tp_rank`` out of range.
    """
    return dict(iter_hf_to_vllm(state_dict, model_config, tp_size=tp_size, tp_rank=tp_rank))


# --------------------------------------------------------------------------------------------
# vLLM -> HF


def iter_vllm_to_hf(
    state_dict: Mapping[str, torch.Tensor], model_config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_key, tensor)`` pairs one at a time (see :func:`vllm_to_hf`).

    Keys and shapes are checked when this is called, before anything is yielded.
    """
    cfg = as_model_config(model_config)
    params = _params(cfg)
    padded = padded_vocab_size(cfg.vocab_size)
    expected = {}
    for p in params:
        shape = _vllm_shape(p, None)
        expected[p.vllm_key] = (shape, (padded, *shape[1:])) if p.kind is _Kind.VOCAB else (shape,)
    _check_state_dict(state_dict, expected, cfg, "vLLM (full, unsharded)")
    return _vllm_to_hf(state_dict, params, cfg)


@torch.no_grad()
def _vllm_to_hf(state_dict, params, cfg) -> Iterator[tuple[str, torch.Tensor]]:
    for param in params:
        tensor = _full(state_dict[param.vllm_key])
        if param.kind in _FUSED:
            sizes = [shape[0] for shape in param.hf_shapes]
            for key, piece in zip(param.hf_keys, torch.split(tensor, sizes, dim=0), strict=True):
                yield key, _owned(piece)
        elif param.kind is _Kind.VOCAB and tensor.shape[0] != cfg.vocab_size:
            yield param.hf_keys[0], _owned(tensor.narrow(0, 0, cfg.vocab_size))
        else:
            yield param.hf_keys[0], tensor


def vllm_to_hf(
    state_dict: Mapping[str, torch.Tensor], model_config: Any
) -> dict[str, torch.Tensor]:
    """Convert a full (unsharded) vLLM-layout state dict back to the HF layout.

    The inverse of ``hf_to_vllm(..., tp_rank=None)``: ``vllm_to_hf(hf_to_vllm(sd, c), c)`` has
    the same keys and bit-identical tensors as ``sd`` (less a tied ``lm_head.weight``). For
    per-rank shards, combine them with :func:`merge_vllm_shards` first.

    Args:
        state_dict: vLLM keys to tensors or DTensors; embedding / ``lm_head`` with
            ``vocab_size`` rows or padded to a multiple of 64 (padding rows are dropped).
            Not modified.
        model_config: as for :func:`hf_to_vllm`.

    Returns:
        HF keys to plain tensors; ``lm_head.weight`` absent for tied models.

    Raises:
        ValueError: listing missing / unexpected keys or wrong shapes.
    """
    return dict(iter_vllm_to_hf(state_dict, model_config))


def merge_vllm_shards(
    shards: Sequence[Mapping[str, torch.Tensor]], model_config: Any
) -> dict[str, torch.Tensor]:
    """Combine the per-rank vLLM state dicts of one TP group into the full vLLM layout.

    The inverse of sharding: ``merge_vllm_shards([hf_to_vllm(sd, c, T, r) for r in range(T)], c)``
    equals ``hf_to_vllm(sd, c)``. Replicated tensors (norms, row-parallel biases, replicated
    KV heads) are taken from the first rank that holds them, without checking the others.

    Args:
        shards: ``shards[r]`` is rank ``r``'s state dict, as :func:`hf_to_vllm` returns it
            with ``tp_size=len(shards), tp_rank=r``. Not modified.
        model_config: as for :func:`hf_to_vllm`.

    Returns:
        The full vLLM layout with an unpadded vocabulary; all tensors freshly allocated
        except replicated ones, which are rank 0's tensors.

    Raises:
        ValueError: for an empty ``shards``, sizes ``len(shards)`` does not divide, or a shard
            whose keys or shapes do not match.
    """
    cfg = as_model_config(model_config)
    if not shards:
        raise ValueError("merge_vllm_shards needs at least one shard")
    plan = _TensorParallelPlan.build(cfg, len(shards))
    params = _params(cfg)
    expected = {p.vllm_key: (_vllm_shape(p, plan),) for p in params}
    for rank, shard in enumerate(shards):
        try:
            _check_state_dict(shard, expected, cfg, f"vLLM tp_size={plan.tp_size} rank {rank}")
        except ValueError as error:
            raise ValueError(f"shard {rank}: {error}") from None
    with torch.no_grad():
        return {
            p.vllm_key: _merge(p, [_full(s[p.vllm_key]) for s in shards], cfg, plan) for p in params
        }


def _merge(
    param: _Param, pieces: list[torch.Tensor], cfg: ModelConfig, plan: _TensorParallelPlan
) -> torch.Tensor:
    if param.kind is _Kind.REPLICATED:
        return pieces[0]
    if param.kind is _Kind.ROW:
        return torch.cat(pieces, dim=1)
    if param.kind is _Kind.VOCAB:
        starts = range(0, plan.vocab_padded, plan.vocab_rows)
        real = [max(0, min(cfg.vocab_size - s, plan.vocab_rows)) for s in starts]
        return torch.cat([t.narrow(0, 0, n) for t, n in zip(pieces, real, strict=True)], dim=0)
    rows = _shard_rows(param, plan)
    per_rank = [torch.split(t, rows, dim=0) for t in pieces]  # [rank][source]
    holders = [range(plan.tp_size)] * len(rows)
    if param.kind is _Kind.QKV:  # one rank per KV-head replica group
        holders[1] = holders[2] = range(0, plan.tp_size, plan.kv_replicas)
    return torch.cat([per_rank[r][i] for i in range(len(rows)) for r in holders[i]], dim=0)
