"""The delta codec of ``weights.delta`` (issue 48): which elements of a block of weights changed
bit for bit since a base version, how they travel, and how a reader applies them and checks
the result.

A block is the flat data one rank owns of one tensor, in the dtype it is published in. Its
delta compares the raw bits of the new and the base data (an integer view of the same bytes:
no tolerance, ``-0.0`` vs ``0.0`` and NaN payloads count as changes), and is encoded as one of:

- ``sparse``: the changed elements' flat indices (``int32``, or ``int64`` for a block of
  2**31 elements or more), then their new values: ``4 + itemsize`` bytes per changed element;
- ``sparse8``: the block cut into segments of :data:`SEGMENT` (256) elements, a ``uint16``
  count of changed elements per segment, then each changed element's ``uint8`` offset in its
  segment, then the new values: ``1 + itemsize`` bytes per changed element and ``2 / 256``
  bytes per element (0.4% of a bf16 block), the smaller one from about 0.1% changed on;
- ``dense``: every element's new value, the block's bytes, when neither is smaller.

Each part of a payload starts at a multiple of 8 bytes (so that it can be viewed as any
dtype); :func:`encode` picks the smallest encoding (:func:`payload_nbytes`).

Both are "overwrite" encodings (slime's term, ``docs/en/advanced/delta-weight-sync.md``): the
new values, not an XOR with the old, so applying a delta twice gives the same result as
applying it once. Each block carries the xxh3-64 checksum of its whole new data, which the
reader checks after applying (:func:`apply`): a lost or flipped value, a delta applied onto
another base, are errors, never silently wrong weights. The same design as verl's
``delta_sharded`` and NeMo-RL's sparse refit (indices + values of changed elements, exact
comparison, the base the receivers hold).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import xxhash

from forge_ext.weights.errors import WeightsChecksumError

Encoding = Literal["sparse", "sparse8", "dense"]
ENCODINGS: tuple[Encoding, ...] = ("sparse", "sparse8", "dense")
#: Elements per segment of the ``sparse8`` encoding (offsets fit a ``uint8``).
SEGMENT = 256
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Elements :func:`encode` casts and compares at a time (1 MiB of fp32).
SLICE = 1 << 18


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
        indices: the changed elements' flat indices (``int64``, ``changed`` of them), kept
            by the publisher to advance its snapshot (:func:`advance`) without decoding.
        values: their new values as raw bits (the integer view of the published dtype).
    """

    encoding: Encoding
    count: int
    changed: int
    numel: int
    payload: torch.Tensor
    checksum: int
    indices: np.ndarray
    values: np.ndarray


def bits(flat: torch.Tensor) -> torch.Tensor:
    """The integer view of a contiguous 1-D tensor's bytes (same element size)."""
    return flat.view(_BITS[flat.element_size()])


def checksum(flat: torch.Tensor) -> int:
    """xxh3-64 of a contiguous CPU tensor's bytes."""
    return xxhash.xxh3_64_intdigest(memoryview(flat.reshape(-1).view(torch.uint8).numpy()))


def index_dtype(numel: int) -> torch.dtype:
    """``int32`` indices for blocks under 2**31 elements, ``int64`` beyond."""
    return torch.int32 if numel < 2**31 else torch.int64


def encode(base: torch.Tensor, source: torch.Tensor) -> EncodedBlock:
    """The delta that turns ``base`` into ``source`` cast to ``base``'s dtype.

    The cast, the comparison and the checksum go through ``source`` in slices of
    :data:`SLICE` elements (each cast slice is compared while it is in the CPU's cache), so
    the new block is never materialised whole in the published dtype unless the dense
    encoding is chosen. Many blocks: :func:`encode_blocks`.

    Args:
        base: flat contiguous CPU tensor, the block as the readers hold it (published dtype).
        source: flat tensor of the same length, the block to publish, any floating dtype and
            device (e.g. the trainer's fp32 parameter shard).

    Raises:
        ValueError: the two differ in length.
    """
    if base.shape != source.shape:
        raise ValueError(
            f"delta base {tuple(base.shape)} does not match the new block {tuple(source.shape)}"
        )
    numel, dtype = base.numel(), base.dtype
    digest = xxhash.xxh3_64()
    indices, values = [], []
    base_bits = bits(base).numpy()
    for lo in range(0, numel, SLICE):
        new = source[lo : lo + SLICE].to(device="cpu", dtype=dtype).contiguous()
        new_bits = bits(new).numpy()
        digest.update(memoryview(new.view(torch.uint8).numpy()))
        changed = np.flatnonzero(new_bits != base_bits[lo : lo + SLICE])
        indices.append(changed + lo)
        values.append(new_bits[changed])
    changed = np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64)
    new_values = np.concatenate(values) if values else base_bits[:0].copy()
    count = changed.size
    encoding = min(ENCODINGS, key=lambda e: payload_nbytes(e, count, numel, dtype))
    if encoding == "dense":
        new = source.to(device="cpu", dtype=dtype).contiguous()
        return EncodedBlock("dense", numel, count, numel, new.view(torch.uint8),
                            digest.intdigest(), changed, new_values)
    if encoding == "sparse":
        parts = [changed.astype(np.int32 if index_dtype(numel) == torch.int32 else np.int64)]
    else:
        segments = np.bincount(changed // SEGMENT, minlength=_segments(numel))
        parts = [segments.astype(np.uint16), (changed % SEGMENT).astype(np.uint8)]
    parts.append(new_values)
    payload = torch.zeros(payload_nbytes(encoding, count, numel, dtype), dtype=torch.uint8)
    out, at = payload.numpy(), 0
    for part in parts:
        data = part.view(np.uint8)
        out[at : at + data.size] = data
        at += _pad8(data.size)
    return EncodedBlock(encoding, count, count, numel, payload, digest.intdigest(), changed,
                        new_values)


def advance(snapshot: torch.Tensor, block: EncodedBlock) -> None:
    """Write ``block``'s changed elements into ``snapshot`` (flat, contiguous, CPU: the base
    ``block`` was encoded against), in place: the publisher's own snapshot moving to the
    version it committed. It uses the indices and values :func:`encode` kept (no payload
    decoded, no checksum: encode checksummed these data already), so it costs the changed
    elements only."""
    bits(snapshot).numpy()[block.indices] = block.values


def encode_blocks(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[EncodedBlock]:
    """:func:`encode` of each ``(base, source)`` pair, with torch's intra-op threads off
    meanwhile. Why off: :func:`encode` casts slices of :data:`SLICE` elements, and torch
    splits each cast across its OpenMP threads, which on a host whose cores are shared
    (trainer ranks, generators, storage volumes) wait for each other: measured on the
    project's 2-core host, a 155M-element fp32 block encoded in 0.16 s on one intra-op
    thread, 2.3 s on two. (Blocks encoded in two Python threads at once were no faster
    there while other processes ran.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [encode(base, source) for base, source in pairs]
    finally:
        torch.set_num_threads(threads)


def payload_nbytes(encoding: Encoding, count: int, numel: int, dtype: torch.dtype) -> int:
    """Bytes of the payload of a block of ``numel`` elements of ``dtype``, ``count`` of them
    changed, in ``encoding``."""
    values = _pad8(count * dtype.itemsize)
    if encoding == "dense":
        return numel * dtype.itemsize
    if encoding == "sparse":
        return _pad8(count * index_dtype(numel).itemsize) + values
    return _pad8(2 * _segments(numel)) + _pad8(count) + values


def _pad8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _segments(numel: int) -> int:
    return -(-numel // SEGMENT)


def _changed_indices(encoding: Encoding, count: int, numel: int, payload: torch.Tensor,
                     name: str) -> tuple[torch.Tensor, int]:
    """(the changed elements' flat indices, int64; where the values start in ``payload``).

    Raises:
        WeightsChecksumError: the indices cannot be those of a block of ``numel`` elements
            with ``count`` changed (a corrupted payload).
    """
    if encoding == "sparse":
        idx = index_dtype(numel)
        nbytes = count * idx.itemsize
        indices = payload[:nbytes].view(idx).long()
        if count and not 0 <= int(indices.min()) <= int(indices.max()) < numel:
            raise _corrupted(name, f"an index outside the block's {numel} elements")
        return indices, _pad8(nbytes)
    segments = _segments(numel)
    counts = payload[: 2 * segments].numpy().view(np.uint16)
    if int(counts.sum(dtype=np.int64)) != count:
        raise _corrupted(name, f"segment counts that sum to {int(counts.sum())}, not {count}")
    at = _pad8(2 * segments)
    offsets = payload[at : at + count].numpy()
    indices = np.repeat(np.arange(segments, dtype=np.int64) * SEGMENT, counts) + offsets
    if count and int(indices.max()) >= numel:
        raise _corrupted(name, f"an index outside the block's {numel} elements")
    return torch.from_numpy(indices), at + _pad8(count)


def _corrupted(name: str, what: str) -> WeightsChecksumError:
    return WeightsChecksumError(
        f"{name}: the delta's payload holds {what}: it was corrupted; fetch a full version")


def apply(
    target: torch.Tensor, encoding: Encoding, count: int, payload: torch.Tensor, expected: int,
    name: str,
) -> None:
    """Apply an encoded block onto ``target`` (flat, contiguous, CPU, the base data) in place,
    then check the checksum of the result.

    Raises:
        WeightsChecksumError: the result's checksum is not ``expected`` (``target`` then holds
            neither the base nor the new data), or the payload's indices are impossible
            (``target`` untouched).
    """
    numel, dtype = target.numel(), target.dtype
    if encoding == "dense":
        target.view(torch.uint8).copy_(payload)
    elif count:
        indices, at = _changed_indices(encoding, count, numel, payload, name)
        target[indices] = payload[at : at + count * dtype.itemsize].view(dtype)
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
        skipped: a full version sent because a recent delta did not pay (its bytes above
            :data:`~forge_ext.weights.transports.delta.PAYS_BELOW` of a full version's).
        warning: the once-per-publisher warning that deltas do not pay, on the version
            that found it (None otherwise).
    """

    base_version: int | None
    changed: int
    elements: int
    full_bytes: int
    skipped: bool = False
    warning: str | None = None
