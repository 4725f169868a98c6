"""Helpers shared by the benchmarks: a causal-LM batch and saved-activation memory."""

from __future__ import annotations

import weakref

import torch

from forge_ext.engine import IGNORE_INDEX



def make_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """A causal-LM batch: ``input_ids [B, S]``, shifted ``labels [B, S]`` (last one ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


class SavedActivations:
    """Context manager that tracks the bytes of tensors autograd saves for backward.

    Each saved tensor is wrapped in a small holder; the holder dies when autograd releases the
    saved variable (after that node's backward, or when the graph is dropped), which a
    ``weakref.finalize`` turns into a decrement. Storages are counted once however many saved
    tensors view them. Parameters, and views of them, are skipped (leaf tensors that require
    grad): they are weights, not activations. That includes FSDP2's unsharded parameters,
    which torchtitan creates even on one rank and frees by resizing their storage to zero.
    ``peak`` is the largest number of bytes alive at once.
    """

    class _Holder:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor):
            self.tensor = tensor

    def __init__(self):
        self.refs: dict[int, list[int]] = {}
        self.live = 0
        self.peak = 0

    @staticmethod
    def _is_parameter(t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return base.is_leaf and base.requires_grad

    def _pack(self, t: torch.Tensor):
        holder = self._Holder(t)
        if self._is_parameter(t):
            return holder
        local = t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> local
        storage = local.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return holder
        entry = self.refs.setdefault(ptr, [0, nbytes])
        entry[0] += 1
        if entry[0] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
