"""``weights.transport=direct`` through torchstore: each rank puts the bytes it owns as
chunks, readers get the chunks holding the tensors they want.

Each rank writes only what it owns (a DTensor's local shard, or, on rank 0, a plain tensor)
into one byte stream, cut into owned chunks of ``chunk_mb`` that are put into torchstore
concurrently, as ``{key_prefix}.v{N}.r{rank}.c{i}`` (:func:`~forge_ext.weights.store
.chunk_key`): chunk ``i`` of rank ``rank``'s stream, at most ``chunk_bytes`` long. The stream
is the concatenation of the rank's tensors, each starting at a multiple of :data:`ALIGN`
bytes. Why not one ``ts.put`` per tensor (torchforge's seed) or torchstore's DTensor path:
both send one message per tensor (and torchstore's DTensor ``get`` fetches shards one by
one); on Monarch RPC each message has a fixed cost of a few ms, and messages much larger
than ~16 MB are slower per byte, so fixed-size chunks of owned memory win (see
``bench/push_weights.py``). Torchstore moves each chunk over Monarch RDMA (as a ``uint8``
tensor) when ``torchstore.transport.buffers.rdma_available()``, over RPC otherwise (as
``bytes``, which Monarch sends without the copies a tensor takes; see :func:`pack_chunk`).
"""

from __future__ import annotations

import asyncio
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torchstore as ts
from torchstore.transport.buffers import rdma_available

from forge_ext.weights.errors import WeightsVersionNotFoundError
from forge_ext.weights.store import chunk_key, committed_versions, missing_key, put_recorded
from forge_ext.weights.transports.base import (
    CommitRecord, ProgressHook, Specs, StoreLocation, Tensors, Transport, fillable,
)
from forge_ext.weights.transports.shards import Coverage, Piece, owned_block

# Byte alignment of every tensor in a rank's stream: a chunk boundary (a multiple of ALIGN)
# then never splits an element, and a uint8 slice can be viewed as any dtype.
ALIGN = 64
# Chunk puts in flight per rank: enough to overlap one chunk's copy with others' sends while
# bounding the extra host memory to MAX_INFLIGHT_PUTS * chunk_mb.
MAX_INFLIGHT_PUTS = 4
# Concurrent torchstore gets per fetch: several messages in flight hide per-call latency.
MAX_INFLIGHT_GETS = 8


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectRecord(CommitRecord):
    """A ``direct`` version: ``tensors[name]`` is ``{"dtype", "shape", "pieces"}``, each
    piece the fields of a :class:`~forge_ext.weights.transports.shards.Piece` in the
    chunks of ``chunk_bytes`` bytes."""

    transport = "direct"
    chunk_bytes: int
    tensors: dict[str, dict[str, Any]]

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        meta = self.tensors[name]
        return tuple(meta["shape"]), meta["dtype"]


@dataclass(slots=True)
class StreamBlock:
    """A block of tensor data this rank writes into its byte stream."""

    name: str
    source: torch.Tensor  # flat view of the local data, any device, source dtype
    dtype: torch.dtype  # published dtype
    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    stream_offset: int

    @property
    def nbytes(self) -> int:
        return self.source.numel() * self.dtype.itemsize


class DirectTransport(Transport):
    """Chunks of every rank's owned bytes in torchstore (Monarch RPC, or RDMA)."""

    name = "direct"
    Record = DirectRecord

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._coverage = Coverage()

    async def write(
        self, version: int, state_dict: Mapping[str, torch.Tensor], tensors: Tensors,
        prepared: list[dict[str, Any]], on_progress: ProgressHook | None, stored: list[str],
    ) -> tuple[int, dict[str, Any]]:
        """Put this rank's chunks; the manifest: ``tensors``, ``pieces``, ``chunks``."""
        rank, prefix = self.group.rank, self.where.key_prefix
        blocks: list[StreamBlock] = []
        offset = 0
        for name, value in state_dict.items():
            owned = owned_block(value, rank)
            if owned is not None:
                local, local_shape, global_offset = owned
                blocks.append(StreamBlock(name, local.reshape(-1), tensors[name][0], local_shape,
                                     global_offset, offset))
                offset += align(blocks[-1].nbytes)
        await put_stream(
            blocks, self.config.chunk_mb << 20, lambda i: chunk_key(prefix, version, rank, i),
            stored, on_progress, self.where.store_name,
        )
        pieces = [
            (b.name, (rank, b.stream_offset, b.local_shape, b.global_offset)) for b in blocks
        ]
        manifest = {"tensors": dict(tensors), "pieces": pieces, "chunks": len(stored)}
        return sum(b.nbytes for b in blocks), manifest

    def record(self, version: int, manifests: list[dict[str, Any]]) -> DirectRecord:
        tensors, pieces = self._coverage(manifests)
        return DirectRecord(
            version=version, names=list(tensors), chunk_bytes=self.config.chunk_mb << 20,
            tensors={name: {"dtype": dtype, "shape": shape, "pieces": pieces[name]}
                     for name, (dtype, shape) in tensors.items()},
        )

    def data_keys(self, version: int, manifests: list[dict[str, Any]]) -> list[str]:
        return [chunk_key(self.where.key_prefix, version, rank, i)
                for rank, manifest in enumerate(manifests) for i in range(manifest["chunks"])]

    def uses_rdma(self) -> bool:
        return rdma_available()

    @classmethod
    async def read(
        cls, record: DirectRecord, specs: Specs, allocate: Callable[[], dict[str, torch.Tensor]],
        where: StoreLocation,
    ) -> dict[str, torch.Tensor]:
        """Get the chunks (a few in flight) and copy each one's bytes into the tensors as it
        arrives, so that received chunks are freed as we go (peak memory: the result plus
        the chunks in flight)."""
        result = allocate()
        copies, staged = _scatter_plan(record, {name: fillable(t) for name, t in result.items()})
        await get_chunks(record.version, record.chunk_bytes, copies, where)
        for full, destination, piece in staged:
            full[piece.index] = destination.view(full.dtype).view(piece.local_shape)
        return result


async def put_stream(
    blocks: list[StreamBlock],
    chunk_bytes: int,
    key_of: Callable[[int], str],
    stored: list[str],
    on_progress: ProgressHook | None,
    store_name: str,
) -> None:
    """Cut this rank's byte stream into chunks and put them, at most MAX_INFLIGHT_PUTS in
    flight, appending each stored key to ``stored``. On an error, starts no new put, waits
    for those in flight (so ``stored`` lists exactly what is in the store) and raises it; so
    does a cancellation (see :func:`~forge_ext.weights.store.put_recorded`)."""
    total = blocks[-1].stream_offset + blocks[-1].nbytes if blocks else 0
    rdma = rdma_available()
    limit = asyncio.Semaphore(MAX_INFLIGHT_PUTS)
    errors: list[BaseException] = []
    stored_bytes = 0

    async def put(index: int, payload: bytes | torch.Tensor) -> None:
        nonlocal stored_bytes
        try:
            await put_recorded(key_of(index), payload, stored, store_name)
            stored_bytes += len(payload)
            if on_progress is not None and not errors:
                on_progress(stored_bytes, total)
        except Exception as e:  # noqa: BLE001 - raised below, after the other puts
            errors.append(e)
        finally:
            limit.release()

    tasks = []
    first = 0  # first block that may overlap the current chunk
    try:
        for index in range(math.ceil(total / chunk_bytes)):
            await limit.acquire()
            if errors:
                limit.release()
                break
            lo, hi = index * chunk_bytes, min(total, (index + 1) * chunk_bytes)
            while first < len(blocks) and blocks[first].stream_offset + blocks[first].nbytes <= lo:
                first += 1
            payload = pack_chunk(_chunk_parts(blocks, first, lo, hi), rdma)
            tasks.append(asyncio.create_task(put(index, payload)))
    finally:  # also when interrupted: every started put ends first (``stored`` is complete)
        await asyncio.gather(*tasks, return_exceptions=True)
    if errors:
        raise errors[0]


def pack_chunk(parts: list[memoryview], rdma: bool) -> bytes | torch.Tensor:
    """One chunk to put, the concatenation of ``parts``, copied once.

    Over RDMA a ``uint8`` tensor (torchstore moves tensors through registered memory). Over
    Monarch RPC immutable ``bytes``: Monarch's pickler hands a ``bytes`` object to the channel
    without copying it, while a tensor's storage goes through ``torch.save`` into a temporary
    buffer and ``torch.load`` on the other side (``monarch/_src/actor/pickle.py``,
    ``_torch_storage``) and a ``bytearray`` is copied into the message. Measured on the
    project's CPU host, 16 MB puts: ``bytes`` ~2x the GB/s of a tensor (with the notify-put
    fix in :mod:`forge_ext.compat.torchstore_monarch`)."""
    if not rdma:
        return b"".join(parts)  # one single-threaded memcpy per part, see copy_bytes
    chunk = torch.empty(sum(p.nbytes for p in parts), dtype=torch.uint8)
    out, offset = chunk.numpy(), 0
    for part in parts:
        data = np.frombuffer(part, dtype=np.uint8)
        out[offset : offset + data.size] = data
        offset += data.size
    return chunk


def _chunk_parts(blocks: list[StreamBlock], first: int, lo: int, hi: int) -> list[memoryview]:
    """The bytes ``[lo, hi)`` of the stream, as views of the blocks' data where it is on the
    CPU in its published dtype (a cast or a device-to-host copy otherwise) and zeros for the
    alignment gaps between blocks; ``blocks[first]`` is the first block ending after ``lo``."""
    parts: list[memoryview] = []
    at = lo  # stream offset up to which parts are filled
    for block in blocks[first:]:
        if block.stream_offset >= hi:
            break
        a, z = max(lo, block.stream_offset), min(hi, block.stream_offset + block.nbytes)
        if a > at:
            parts.append(memoryview(bytes(a - at)))
        # a and z fall on element boundaries: blocks start ALIGN-aligned, chunks are multiples
        item = block.dtype.itemsize
        source = block.source[(a - block.stream_offset) // item : (z - block.stream_offset) // item]
        if source.device.type != "cpu" or source.dtype != block.dtype:
            source = source.to(device="cpu", dtype=block.dtype)
        # A conjugate or negative view (complex .conj(), .neg() views) has no bytes of its own.
        source = source.resolve_conj().resolve_neg()
        # A strided view (e.g. of an expanded or sliced tensor) has no flat bytes to share.
        parts.append(memoryview(source.contiguous().view(torch.uint8).numpy()))
        at = z
    if hi > at:
        parts.append(memoryview(bytes(hi - at)))
    return parts


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for contiguous CPU ``uint8`` tensors of equal length, as one
    single-threaded memcpy. Why not ``dst.copy_(src)``: torch splits the copy across its
    intra-op (OpenMP) threads, and on a host whose cores are shared with other processes
    (trainer ranks, generators, storage volumes) those threads wait for each other: measured
    5-20x slower per chunk than one memcpy on the project's 2-core CPU hosts."""
    dst.numpy()[:] = src.numpy()


def chunk_tensor(payload: bytes | torch.Tensor) -> torch.Tensor:
    """A ``uint8`` tensor view of a chunk read back from torchstore (see :func:`pack_chunk`).
    Read-only: copy out of it, never write into it (a ``bytes`` object is immutable)."""
    if isinstance(payload, torch.Tensor):
        return payload
    with warnings.catch_warnings():  # "The given buffer is not writable": we only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


def _scatter_plan(record: DirectRecord, result: Mapping[str, torch.Tensor]):
    """Where each chunk's bytes go (:data:`CopyPlan`), and the pieces of tensors stored in
    several pieces (DTensor shards), staged to be placed once complete."""
    copies: dict[tuple[int, int], list[tuple[torch.Tensor, int, int, int]]] = defaultdict(list)
    staged: list[tuple[torch.Tensor, torch.Tensor, Piece]] = []
    for name, full in result.items():
        pieces = [Piece(*raw) for raw in record.tensors[name]["pieces"]]
        for piece in pieces:
            nbytes = math.prod(piece.local_shape) * full.element_size()
            if nbytes == 0:
                continue
            if len(pieces) == 1:  # the piece is the whole tensor: copy straight into it
                destination = full.view(-1).view(torch.uint8)
            else:
                destination = torch.empty(nbytes, dtype=torch.uint8)
                staged.append((full, destination, piece))
            plan_copy(copies, record.chunk_bytes, piece.rank, piece.stream_offset, destination)
    return copies, staged


def plan_copy(
    copies: dict[tuple[int, int], list], chunk_bytes: int, rank: int, stream_offset: int,
    destination: torch.Tensor,
) -> None:
    """Add to ``copies`` the copies that fill ``destination`` (flat ``uint8``) from rank
    ``rank``'s stream, from ``stream_offset`` on."""
    start, stop = stream_offset, stream_offset + destination.numel()
    for index in range(start // chunk_bytes, (stop - 1) // chunk_bytes + 1):
        lo, hi = max(start, index * chunk_bytes), min(stop, (index + 1) * chunk_bytes)
        copies[(rank, index)].append((destination, lo - start, lo, hi - lo))


#: ``{(rank, chunk index): [(destination uint8 tensor, offset in it, stream offset, bytes)]}``:
#: where each chunk's bytes go.
CopyPlan = Mapping[tuple[int, int], list[tuple[torch.Tensor, int, int, int]]]


async def get_chunks(
    version: int, chunk_bytes: int, copies: CopyPlan, where: StoreLocation
) -> None:
    """Get the chunks ``copies`` names (at most MAX_INFLIGHT_GETS in flight) and copy each
    one's bytes where ``copies`` says as it arrives, so that received chunks are freed as we
    go (peak memory: the destinations plus the chunks in flight).

    Raises:
        WeightsVersionNotFoundError: a chunk is missing: the version was retired (commit
            record first, then chunks) while this call read it.
    """
    limit = asyncio.Semaphore(MAX_INFLIGHT_GETS)

    async def get_and_scatter(rank: int, index: int) -> None:
        async with limit:
            key = chunk_key(where.key_prefix, version, rank, index)
            try:
                chunk = chunk_tensor(await ts.get(key, store_name=where.store_name))
            except Exception as e:  # noqa: BLE001 - re-raised unless the chunk is missing
                if not missing_key(e):
                    raise
                committed = await committed_versions(
                    key_prefix=where.key_prefix, store_name=where.store_name
                )
                raise WeightsVersionNotFoundError(version, where.key_prefix, committed) from None
        base = index * chunk_bytes
        for destination, offset, lo, nbytes in copies[(rank, index)]:
            copy_bytes(destination[offset : offset + nbytes], chunk[lo - base : lo - base + nbytes])

    await asyncio.gather(*(get_and_scatter(rank, index) for rank, index in sorted(copies)))

