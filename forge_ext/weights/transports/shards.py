"""Which rank writes which block of a tensor, and the check that the ranks' blocks make
every tensor whole: shared by the transports whose ranks write their own blocks
(:mod:`~forge_ext.weights.transports.direct`, :mod:`~forge_ext.weights.transports.same_host`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from forge_ext.weights.errors import WeightsPublishError


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored block of a tensor: ``local_shape`` elements at ``global_offset`` of the full
    tensor, stored in rank ``rank``'s byte stream from ``stream_offset`` on."""

    rank: int
    stream_offset: int
    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    @property
    def index(self) -> tuple[slice, ...]:
        """The block's place in the full tensor (``full[piece.index]``)."""
        return tuple(slice(o, o + n) for o, n in zip(self.global_offset, self.local_shape))


def owned_block(
    value: torch.Tensor, group_rank: int
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | None:
    """(local data, local shape, global offset) of the part of ``value`` this rank writes,
    or None if another rank writes it."""
    if not isinstance(value, DTensor):
        # Plain tensors are the same on every rank: rank 0 writes them.
        if group_rank != 0:
            return None
        local = value.detach() if value.requires_grad else value
        return local, tuple(value.shape), (0,) * value.dim()
    if not all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and not isinstance(p, _StridedShard))
        for p in value.placements
    ):
        # Partial sums and strided shards are not contiguous blocks of the full tensor.
        value = value.redistribute(placements=[Replicate()] * value.device_mesh.ndim)
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return None
    if any(c != 0 for c, p in zip(coordinate, value.placements) if isinstance(p, Replicate)):
        return None  # a replica: the rank at coordinate 0 of each replicated mesh dim writes
    local_shape, global_offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return value.to_local().detach(), tuple(local_shape), tuple(global_offset)


def local_nbytes(value: torch.Tensor, group_rank: int) -> int:
    """Bytes of ``value`` held by this rank (plain tensors count on rank 0 only)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    elif group_rank != 0:
        return 0
    return value.numel() * value.element_size()


def covered_pieces(manifests: list[dict[str, Any]]) -> tuple[dict, dict]:
    """``(tensors, pieces by name)`` from every rank's manifest (``{"tensors": {name:
    (dtype, shape)}, "pieces": [(name, piece fields)]}``); checks that the ranks agree on the
    tensors and that their pieces cover each tensor exactly once.

    Raises:
        WeightsPublishError: the same on every rank, naming the rank or the tensor.
    """
    tensors = manifests[0]["tensors"]
    for rank, manifest in enumerate(manifests):
        if manifest["tensors"] != tensors:
            raise WeightsPublishError(
                f"rank {rank} and rank 0 publish different names, shapes or dtypes"
            )
    pieces: dict[str, list[tuple]] = {name: [] for name in tensors}
    for manifest in manifests:
        for name, piece in manifest["pieces"]:
            pieces[name].append(piece)
    for name, (_, shape) in tensors.items():
        covered = sum(math.prod(Piece(*p).local_shape) for p in pieces[name])
        if covered != math.prod(shape):
            raise WeightsPublishError(
                f"{name}: the ranks wrote {covered} elements of {math.prod(shape)}; every "
                "element must be written once (are all ranks in the tensor's device mesh?)"
            )
    return tensors, pieces


class Coverage:
    """:func:`covered_pieces` of the ranks' manifests, checked once for as long as they stay
    the same (they do from version to version: same names, placements, offsets)."""

    def __init__(self) -> None:
        self._last: tuple[list, tuple[dict, dict]] | None = None

    def __call__(self, manifests: list[dict[str, Any]]) -> tuple[dict, dict]:
        key = [(list(m["tensors"].items()), m["pieces"]) for m in manifests]
        if self._last is None or self._last[0] != key:
            self._last = (key, covered_pieces(manifests))
        return self._last[1]
