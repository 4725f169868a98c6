"""``weights.delta``: after a full version, each rank publishes only the elements of its
blocks whose bits changed since the version every reader holds (issue 48).

A publisher with ``weights.delta: true`` (``transport: direct``) publishes two kinds of
versions:

- an **anchor**, a full version through the transport ``direct`` would use (a ``direct``
  version in torchstore chunks, :class:`~forge_ext.weights.transports.direct.DirectRecord`;
  with ``same_host: auto`` and every rank on one host, a shared-memory slot,
  :class:`~forge_ext.weights.transports.same_host.SameHostRecord`, with that transport's
  guarantee that no reader sees a slot half-written), read by any reader: the first version,
  every ``weights.delta_anchor_every`` versions, whenever the caller's ``reader_base`` (the
  version every live reader holds, :meth:`~forge_ext.weights.publish.WeightsPublisher
  .publish`) is not the version this publisher last published (a reader that joined,
  restarted, lags, or reported a mismatch), and for ``delta_anchor_every`` versions after a
  delta that did not pay (:data:`PAYS_BELOW`; a warning says so once);
- a **delta** (:class:`DeltaRecord`), each block encoded by :mod:`forge_ext.weights.delta`
  against the publisher's snapshot of the base version, with the checksum of its whole new
  data, as torchstore chunks (on one host too: a delta is small, and a reader applies it
  onto tensors of its own, not onto a slot). A reader applies it onto the tensors that hold
  the base (:func:`~forge_ext.weights.fetch.fetch_weights` with ``holding=base``), checks
  every block's checksum, and is refused (:class:`WeightsDeltaBaseError`) if it holds
  another version.

The snapshot of the base is each rank's own blocks in the published dtype (a DTensor's local
shard; plain tensors on rank 0 only): ``sum(local bytes)`` per rank, the same bytes a full
version of that rank puts, never the full model per rank. It advances at each commit (a
failed or interrupted publish leaves it on the last committed version); every rank decides
delta or anchor alike (one exchange of :meth:`DeltaTransport.prepare`'s fields).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torchstore.transport.buffers import rdma_available

from forge_ext.weights import delta
from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.delta import DeltaStats
from forge_ext.weights.errors import WeightsDeltaBaseError
from forge_ext.weights.store import chunk_key
from forge_ext.weights.transports.base import (
    CommitRecord, Group, OpenedWeights, ProgressHook, Specs, StoreLocation, Tensors,
    Transport, fillable,
)
from forge_ext.weights.transports.direct import (
    DirectTransport, StreamBlock, align, get_chunks, plan_copy, put_stream,
)
from forge_ext.weights.transports.shards import Piece, covered_pieces, owned_block

logger = logging.getLogger(__name__)

#: A delta pays while its bytes stay below this share of a full version's: above it, the
#: pass that encodes every element (and the reader's apply and checksum) costs more than the
#: bytes it saves (an fp32 version at the demo's learning rate changes nearly every element,
#: so nearly every block goes ``dense``: ~100% of a full version).
PAYS_BELOW = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaRecord(CommitRecord):
    """A delta version on ``base_version``: ``tensors[name]`` is ``{"dtype", "shape",
    "pieces", "codes"}``, each piece the fields of a :class:`~forge_ext.weights.transports
    .shards.Piece` (its ``stream_offset`` where the encoded block starts) and its code
    ``(encoding, count, checksum)`` (:class:`~forge_ext.weights.delta.EncodedBlock`)."""

    transport = "delta"
    chunk_bytes: int
    base_version: int
    tensors: dict[str, dict[str, Any]]

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        meta = self.tensors[name]
        return tuple(meta["shape"]), meta["dtype"]


class DeltaTransport(Transport):
    """Anchors through ``anchor`` (a :class:`DirectTransport`, or with ``weights.same_host``
    on one host a :class:`~forge_ext.weights.transports.same_host.SameHostTransport`),
    deltas in between as torchstore chunks (see the module docstring)."""

    name = "delta"
    Record = DeltaRecord

    def __init__(self, config: WeightsConfig, group: Group, store_name: str,
                 anchor: Transport | None = None) -> None:
        super().__init__(config, group, store_name)
        self.anchor = anchor if anchor is not None else DirectTransport(config, group, store_name)
        self.shared_memory = self.anchor.shared_memory  # where this publisher's anchors go
        self._snapshot: dict[str, torch.Tensor] = {}  # name -> flat owned block, published dtype
        self._snapshot_version: int | None = None
        self._snapshot_tensors: dict[str, Any] = {}  # its {name: (dtype, shape)}
        self._deltas_since_anchor = 0
        self._reader_base: int | None = None
        self._base: int | None = None  # this version's base, None: an anchor
        self._pending: dict[str, Any] = {}  # what the snapshot becomes at commit
        self._pending_tensors: dict[str, Any] = {}
        self._stats: DeltaStats | None = None
        # Full versions still to send because a delta did not pay (:data:`PAYS_BELOW`).
        self._full_left = 0
        self._skipping = False  # this version is full for that reason
        self._warned = False

    def set_reader_base(self, reader_base: int | None) -> None:
        self._reader_base = reader_base

    def stats(self) -> DeltaStats | None:
        return self._stats

    async def prepare(self, version: int, tensors: Tensors) -> dict[str, Any]:
        """Shares the base this rank can encode against (None: an anchor is due: no reader
        holds the last version, ``delta_anchor_every`` is reached, the tensors' names,
        dtypes or shapes are not the snapshot's, or a recent delta did not pay), and the
        anchor transport's fields (a same-host slot is taken on rank 0 either way, and given
        back by :meth:`check_prepared` if the version is a delta)."""
        can = (
            self._reader_base is not None and self._reader_base == self._snapshot_version
            and self._deltas_since_anchor + 1 < self.config.delta_anchor_every
            and dict(tensors) == self._snapshot_tensors
        )
        self._skipping = can and self._full_left > 0
        fields = await self.anchor.prepare(version, tensors)
        return {**fields, "delta_base": self._reader_base if can and not self._skipping
                else None}

    def check_prepared(self, statuses: list[dict[str, Any]]) -> None:
        bases = {status["delta_base"] for status in statuses}
        self._base = bases.pop() if len(bases) == 1 else None
        if self._base is None:
            self.anchor.check_prepared(statuses)
        else:
            self.anchor.abort(-1)  # the slot a same-host anchor would have taken: free again

    async def write(
        self, version: int, state_dict: Mapping[str, torch.Tensor], tensors: Tensors,
        prepared: list[dict[str, Any]], on_progress: ProgressHook | None, stored: list[str],
    ) -> tuple[int, dict[str, Any]]:
        """An anchor: the anchor transport's write, the snapshot copied from it; a delta:
        every owned block encoded against the snapshot, its payload put as ``direct`` puts
        blocks. The manifest adds ``codes`` ``[(name, (encoding, count, checksum))]`` and
        ``sizes`` (bytes sent, a full version's bytes, changed elements, elements)."""
        rank, prefix = self.group.rank, self.where.key_prefix
        owned = _owned(state_dict, rank)
        full_bytes = sum(new.numel() * tensors[name][0].itemsize
                         for name, (new, _, _) in owned.items())
        elements = sum(new.numel() for new, _, _ in owned.values())
        if self._base is None:
            copies: dict[tuple, torch.Tensor] = {}  # tied names share one snapshot
            self._pending = {
                name: copies.setdefault(
                    _memory(new), new.to(device="cpu", dtype=tensors[name][0], copy=True))
                for name, (new, _, _) in owned.items()
            }
            self._pending_tensors = dict(tensors)
            self._stats = DeltaStats(None, elements, elements, full_bytes,
                                     skipped=self._skipping)
            return await self.anchor.write(version, state_dict, tensors, prepared, on_progress,
                                           stored)
        blocks, codes, pieces = [], [], []
        offset = 0
        encoded = self._encode(owned)
        at: dict[int, int] = {}  # id(code) -> its stream offset: a tied group's travels once
        for name, (new, local_shape, global_offset) in owned.items():
            code = encoded[name]
            if id(code) not in at:
                at[id(code)] = offset
                blocks.append(StreamBlock(name, code.payload, torch.uint8, local_shape,
                                          global_offset, offset))
                offset += align(code.payload.numel())
            codes.append((name, (code.encoding, code.count, code.checksum)))
            pieces.append((name, (rank, at[id(code)], local_shape, global_offset)))
        await put_stream(
            blocks, self.config.chunk_mb << 20, lambda i: chunk_key(prefix, version, rank, i),
            stored, on_progress, self.where.store_name,
        )
        self._pending = encoded
        changed = sum(c.changed for c in encoded.values())
        self._stats = DeltaStats(self._base, changed, elements, full_bytes)
        sent = sum(b.nbytes for b in blocks)
        manifest = {"tensors": dict(tensors), "pieces": pieces, "codes": codes,
                    "chunks": len(stored), "sizes": (sent, full_bytes, changed, elements)}
        return sent, manifest

    def record(self, version: int, manifests: list[dict[str, Any]]) -> CommitRecord | None:
        if self._base is None:
            return self.anchor.record(version, manifests)
        self._check_pays(version, [m["sizes"] for m in manifests])
        tensors, pieces = covered_pieces(manifests)
        codes: dict[str, list[tuple]] = {name: [] for name in tensors}
        for manifest in manifests:
            for name, code in manifest["codes"]:
                codes[name].append(code)
        return DeltaRecord(
            version=version, names=list(tensors), chunk_bytes=self.config.chunk_mb << 20,
            base_version=self._base,
            tensors={name: {"dtype": dtype, "shape": shape, "pieces": pieces[name],
                            "codes": codes[name]}
                     for name, (dtype, shape) in tensors.items()},
        )

    def _check_pays(self, version: int, sizes: list[tuple[int, int, int, int]]) -> None:
        """Every rank, from every rank's sizes (so alike everywhere): a delta whose bytes are
        above :data:`PAYS_BELOW` of a full version's did not pay; the next
        ``delta_anchor_every`` versions are then full (a warning says so the first time)."""
        sent, full, changed, elements = (sum(column) for column in zip(*sizes))
        if sent <= PAYS_BELOW * full:
            return
        self._full_left = self.config.delta_anchor_every
        if self._warned:
            return
        self._warned = True
        warning = (
            f"weights.delta: the delta of policy_version={version} took {sent / full:.0%} of "
            f"a full version's bytes ({changed / max(elements, 1):.1%} of the elements changed "
            "bit for bit): with fp32 published weights or a large learning rate nearly every "
            f"element changes at each step, so a delta does not pay; the next "
            f"weights.delta_anchor_every={self.config.delta_anchor_every} versions are sent "
            "full, then a delta is tried again (weights/delta_skipped counts the full ones). "
            "Publish in bf16 (weights.dtype) or set weights.delta=false"
        )
        logger.warning("%s", warning)
        self._stats = dataclasses.replace(self._stats, warning=warning)

    def data_keys(self, version: int, manifests: list[dict[str, Any]]) -> list[str]:
        if self._base is None:
            return self.anchor.data_keys(version, manifests)
        return [chunk_key(self.where.key_prefix, version, rank, i)
                for rank, manifest in enumerate(manifests) for i in range(manifest["chunks"])]

    def commit(self, version: int) -> None:
        """The snapshot becomes ``version``'s blocks (a delta is applied onto it)."""
        if self._base is None:
            self.anchor.commit(version)
            self._snapshot, self._deltas_since_anchor = self._pending, 0
            self._snapshot_tensors = self._pending_tensors
            self._full_left = max(self._full_left - self._skipping, 0)
        else:
            advanced = set()
            for name, code in self._pending.items():
                snapshot = self._snapshot[name]
                if id(snapshot) not in advanced:  # tied names share it (see _encode)
                    advanced.add(id(snapshot))
                    delta.advance(snapshot, code)
            self._deltas_since_anchor += 1
        self._snapshot_version, self._pending = version, {}

    def _encode(self, owned: Mapping[str, tuple]) -> dict[str, delta.EncodedBlock]:
        """Each owned block encoded against its snapshot, a tied group once: names whose
        blocks are the same memory (a tied embedding and LM head) and share one snapshot
        (from the anchor) get one encoding. A group whose names no longer share memory gets
        snapshots of its own first (same data: they hold one base)."""
        groups: dict[tuple, list[str]] = {}
        owners: dict[int, tuple] = {}  # snapshot id -> the group that advances it
        for name, (new, _, _) in owned.items():
            snapshot = self._snapshot[name]
            key = (_memory(new), id(snapshot))
            if owners.setdefault(id(snapshot), key) != key:
                self._snapshot[name] = snapshot = snapshot.clone()
                key = (_memory(new), id(snapshot))
                owners[id(snapshot)] = key
            groups.setdefault(key, []).append(name)
        codes = delta.encode_blocks(
            [(self._snapshot[names[0]], owned[names[0]][0]) for names in groups.values()])
        return {name: code for names, code in zip(groups.values(), codes) for name in names}

    def abort(self, version: int) -> None:
        self._pending = {}
        if self._base is None:
            self.anchor.abort(version)

    def release(self, version: int) -> None:
        self.anchor.release(version)  # a same-host anchor's slot; nothing for a delta's

    def uses_rdma(self) -> bool:
        return self.anchor.uses_rdma() if self._base is None else rdma_available()

    def close(self) -> None:
        self._snapshot, self._snapshot_version, self._pending = {}, None, {}
        self._snapshot_tensors = {}
        self.anchor.close()

    # -- fetch side: a delta's reading (anchors are read by their own transport) ----------
    @classmethod
    def check_base(cls, record: DeltaRecord, holding: int | None) -> None:
        if holding != record.base_version:
            raise WeightsDeltaBaseError(record.version, record.base_version, holding)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, record: DeltaRecord, specs: Specs, allocate: Callable[[], dict[str, torch.Tensor]],
        where: StoreLocation,
    ) -> AsyncIterator[OpenedWeights]:
        """:meth:`read`'s tensors, with the names of those the delta changed (a block of
        ``count`` 0 changed nothing; a ``dense`` block is counted as changed)."""
        tensors = await cls.read(record, specs, allocate, where)
        changed = frozenset(name for name in tensors
                            if any(count for _, count, _ in record.tensors[name]["codes"]))
        yield OpenedWeights(tensors, None, dict(record.metadata or {}), changed)

    @classmethod
    async def read(
        cls, record: DeltaRecord, specs: Specs, allocate: Callable[[], dict[str, torch.Tensor]],
        where: StoreLocation,
    ) -> dict[str, torch.Tensor]:
        """Apply the delta onto ``allocate()``'s tensors, which hold the base version (the
        caller checked it, :meth:`check_base`), and check each block's checksum.

        Raises:
            WeightsChecksumError: a block's data after applying differ from the published
                (the tensor is then neither the base nor the new version).
        """
        result = allocate()
        copies: dict[tuple[int, int], list] = defaultdict(list)
        staged = []
        for name, full in result.items():
            meta = record.tensors[name]
            for raw, (encoding, count, expected) in zip(meta["pieces"], meta["codes"]):
                piece = Piece(*raw)
                numel = torch.Size(piece.local_shape).numel()
                nbytes = delta.payload_nbytes(encoding, count, numel, full.dtype)
                payload = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    plan_copy(copies, record.chunk_bytes, piece.rank, piece.stream_offset, payload)
                staged.append((name, fillable(full), piece, len(meta["pieces"]) == 1,
                               (encoding, count, payload, expected)))
        await get_chunks(record.version, record.chunk_bytes, copies, where)
        for name, full, piece, whole, (encoding, count, payload, expected) in staged:
            region = full.view(-1) if whole else full[piece.index].contiguous().view(-1)
            delta.apply(region, encoding, count, payload, expected, name)
            if not whole:
                full[piece.index] = region.view(piece.local_shape)
        return result


def _memory(block: torch.Tensor) -> tuple:
    """What tells two blocks apart in memory: equal for views of the same data."""
    return (block.device, block.data_ptr(), block.dtype, block.numel(), block.stride())


def _owned(
    state_dict: Mapping[str, torch.Tensor], rank: int
) -> dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """``{name: (this rank's block, its local shape, its global offset)}``, the block flat in
    its own dtype and device (:func:`~forge_ext.weights.transports.shards.owned_block`)."""
    blocks = {}
    for name, value in state_dict.items():
        owned = owned_block(value, rank)
        if owned is not None:
            local, local_shape, global_offset = owned
            blocks[name] = (local.reshape(-1), local_shape, global_offset)
    return blocks
