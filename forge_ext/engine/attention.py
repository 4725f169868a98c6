"""Inner attention for ``model.attn_backend: sdpa`` with document masks for packed rows.

torchtitan's ``ScaledDotProductAttention`` (``torchtitan/models/common/attention.py``) is
causal only and refuses ``attention_masks``; its document-masked backends need CUDA for
backward (``VarlenAttention``: flash; ``FlexAttention``: compiled kernels, no CPU backward).
:class:`DocumentMaskedSDPA` keeps torchtitan's path for unpacked rows and, for packed rows,
passes a boolean block-causal mask (:func:`forge_ext.engine.microbatch.block_causal_mask`)
to ``F.scaled_dot_product_attention``, which has a backward on CPU (flash or math kernels)
and on CUDA (memory-efficient or cuDNN kernels). A masked SDPA computes every query-key pair
of the row and discards cross-document ones, so it costs ``T^2`` per packed row of ``T``
tokens where flex/varlen cost the sum of the documents' squares; the mask itself is ``T^2``
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchtitan.models.common.attention import ScaledDotProductAttention

_MASKED_BACKENDS = [
    SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
"""In order of preference: with an explicit ``attn_mask`` the CPU flash kernel runs (with a
backward; 3.4x faster than math at 2,048 tokens here, and no ``T^2`` scores kept), CUDA's
flash does not and falls through to cuDNN or memory-efficient attention."""


class DocumentMask:
    """A packed microbatch's block-causal mask, shared by every layer of a kind (the hf
    backend builds one per attention window, :func:`forge_ext.engine.hf.packed_attention_mask`).

    ``allowed`` is ``[b, 1, T, T]`` bool (:func:`forge_ext.engine.microbatch.block_causal_mask`).
    :meth:`additive` gives it as a float ``0 / -inf`` mask in the queries' dtype, built once
    per dtype: SDPA saves a boolean mask converted to float for backward in every layer
    (``T^2`` floats each), while one float mask is saved once for all layers.
    """

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed
        self._additive: dict[torch.dtype, torch.Tensor] = {}

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._additive:
            zeros = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            self._additive[dtype] = zeros.masked_fill_(~self.allowed, float("-inf"))
        return self._additive[dtype]


class DocumentMaskedSDPA(ScaledDotProductAttention):
    """``ScaledDotProductAttention`` that also takes ``attention_masks``: a
    :class:`DocumentMask` (True where a query may attend to a key, causality included)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None,
                enable_gqa=False, is_causal=True, **kwargs) -> torch.Tensor:
        if attention_masks is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa,
                                   is_causal=is_causal, **kwargs)
        if not isinstance(attention_masks, DocumentMask):
            raise TypeError(
                "model.attn_backend=sdpa takes a forge_ext DocumentMask as attention mask, got "
                f"{type(attention_masks).__name__}"
            )
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(_MASKED_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_masks.additive(q.dtype), scale=scale,
                enable_gqa=enable_gqa,
            )
        return out.transpose(1, 2)
