"""The delta codec of ``weights.delta`` (issue 48): which elements of a block of weights changed
bit for bit since a base version, how they travel, and how a reader applies them and checks
the result.

A block is the flat data one rank owns of one tensor, in the dtype it is published in. Its
delta compares the raw bits of the new and the base data (an integer view of the same bytes:
no tolerance, ``-0.0`` vs ``0.0`` and NaN payloads count as changes), and is encoded as one of:

- ``sparse``: the changed elements' flat indices (``int32``, or ``int64`` for a block of
  2**31 elements or more), padded to a multiple of 8 bytes, then their new values;
- ``dense``: every element's new value, the block's bytes, when the sparse encoding would not
  be smaller (a block whose every fourth bf16 element or more changed: ``6 * changed >= 2 * n``).

Both are "overwrite" encodings (slime's term, ``docs/en/advanced/delta-weight-sync.md``): the
new values, not an XOR with the old, so applying a delta twice gives the same result as
applying it once. Each block carries the xxh3-64 checksum of its whole new data, which the
reader checks after applying (:func:`apply`): a lost or flipped value, a delta applied onto
another base, are errors, never silently wrong weights. The same design as verl's
``delta_sharded`` and NeMo-RL's sparse refit (indices + values of changed elements, exact
comparison, the base the receivers hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import xxhash

from forge_ext.weights.errors import WeightsChecksumError

Encoding = Literal["sparse", "dense"]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class EncodedBlock:
    """One block's delta.

    Attributes:
        encoding: ``"sparse"`` or ``"dense"`` (see the module docstring).
        count: the elements that changed (all of them for ``dense``, whatever changed).
        changed: the elements whose bits changed (for metrics; ``count`` for ``sparse``).
        numel: the elements of the block.
        payload: flat ``uint8`` bytes as they travel.
        checksum: xxh3-64 of the block's new data (:func:`checksum`).
    """

    encoding: Encoding
    count: int
    changed: int
    numel: int
    payload: torch.Tensor
    checksum: int


def bits(flat: torch.Tensor) -> torch.Tensor:
    """The integer view of a contiguous 1-D tensor's bytes (same element size)."""
    return flat.view(_BITS[flat.element_size()])


def checksum(flat: torch.Tensor) -> int:
    """xxh3-64 of a contiguous CPU tensor's bytes."""
    return xxhash.xxh3_64_intdigest(memoryview(flat.reshape(-1).view(torch.uint8).numpy()))


def index_dtype(numel: int) -> torch.dtype:
    """``int32`` indices for blocks under 2**31 elements, ``int64`` beyond."""
    return torch.int32 if numel < 2**31 else torch.int64


def encode(base: torch.Tensor, new: torch.Tensor) -> EncodedBlock:
    """The delta that turns ``base`` into ``new``.

    Args:
        base: flat contiguous CPU tensor, the block as the readers hold it.
        new: flat contiguous CPU tensor of the same dtype and length, the block to publish.

    Raises:
        ValueError: the two differ in dtype or length.
    """
    if base.dtype != new.dtype or base.shape != new.shape:
        raise ValueError(
            f"delta base {tuple(base.shape)} {base.dtype} does not match the new block "
            f"{tuple(new.shape)} {new.dtype}"
        )
    numel, item = new.numel(), new.element_size()
    changed = torch.nonzero(bits(new) != bits(base)).squeeze(1)
    idx = index_dtype(numel)
    count = changed.numel()
    if payload_nbytes("sparse", count, numel, new.dtype) < numel * item:
        split = _index_bytes(count, numel)
        payload = torch.zeros(split + count * item, dtype=torch.uint8)
        payload[: count * idx.itemsize] = changed.to(idx).view(torch.uint8)
        payload[split:] = new[changed].view(torch.uint8)
        return EncodedBlock("sparse", count, count, numel, payload, checksum(new))
    return EncodedBlock("dense", numel, count, numel, new.view(torch.uint8), checksum(new))


def payload_nbytes(encoding: Encoding, count: int, numel: int, dtype: torch.dtype) -> int:
    """Bytes of an encoded block's payload."""
    if encoding == "dense":
        return numel * dtype.itemsize
    return _index_bytes(count, numel) + count * dtype.itemsize


def _index_bytes(count: int, numel: int) -> int:
    """Bytes of a sparse payload's indices, padded to 8 (so that the values that follow can
    be viewed as any dtype)."""
    return -(-count * index_dtype(numel).itemsize // 8) * 8


def apply(
    target: torch.Tensor, encoding: Encoding, count: int, payload: torch.Tensor, expected: int,
    name: str,
) -> None:
    """Apply an encoded block onto ``target`` (flat, contiguous, CPU, the base data) in place,
    then check the checksum of the result.

    Raises:
        WeightsChecksumError: the result's checksum is not ``expected`` (``target`` then holds
            neither the base nor the new data).
    """
    numel, dtype = target.numel(), target.dtype
    if encoding == "dense":
        target.view(torch.uint8).copy_(payload)
    else:
        split = _index_bytes(count, numel)
        indices = payload[: count * index_dtype(numel).itemsize].view(index_dtype(numel)).long()
        target[indices] = payload[split:].view(dtype)
    got = checksum(target)
    if got != expected:
        raise WeightsChecksumError(
            f"{name}: the weights after applying the delta do not match the published "
            f"checksum ({got:#018x} != {expected:#018x}): a value was lost or corrupted, or "
            "the delta was applied onto another version; fetch a full version"
        )


@dataclass(frozen=True, slots=True)
class DeltaStats:
    """What one rank's last version sent, for metrics.

    Attributes:
        base_version: the delta's base, None for an anchor.
        changed: elements whose bits changed since the base (this rank's blocks; all of them
            for an anchor).
        elements: elements of this rank's blocks.
        full_bytes: bytes a full version of this rank's blocks takes.
    """

    base_version: int | None
    changed: int
    elements: int
    full_bytes: int
