"""Read published policy weights back from torchstore (and, for ``dcp``, from disk).

Store layout written by :mod:`forge_ext.weights.publish` for version ``N`` under
``key_prefix`` (keys use ``.`` between parts because torchstore 0.1.2 lists keys by prefix
only at ``.``-separated boundaries, see ``torchstore/storage_utils/trie.py``):

- ``{key_prefix}.v{N}.commit``: the commit record, written last, by rank 0 of the publishing
  group, after every rank stored its part. A version without it does not exist for readers.
- ``direct`` only: ``{key_prefix}.v{N}.r{rank}.c{i}``: chunk ``i`` of rank ``rank``'s byte
  stream, at most ``chunk_bytes`` long: ``bytes`` over Monarch RPC, a ``uint8`` tensor over
  RDMA (see ``forge_ext.weights.publish._pack_chunk``). The stream is the concatenation of
  the rank's tensors (each a DTensor's local shard or a whole tensor), each starting at a
  multiple of :data:`ALIGN` bytes.
- ``dcp`` only: the commit record holds the ``torch.distributed.checkpoint`` id (a folder) and
  its :class:`~torch.distributed.checkpoint.metadata.Metadata`.
- same host (``direct`` with every publishing rank on one host, ``weights.same_host=auto``):
  the commit record is the only key; it names the shared-memory slot file holding the full
  tensors, their offsets in it and the publisher's host (:mod:`forge_ext.weights.same_host`).
  Readers on that host copy out of the slot under a lease; elsewhere they get a
  :class:`WeightsFetchError` naming ``weights.same_host=off``.

Two ways to read a version, whatever the transport: :func:`fetch_weights` returns tensors of
this process's own; :func:`open_weights` lends tensors for the time of an ``async with``
block, without a copy where the version is in shared memory on this host (a generator loads
its model from them).

The commit record is a dict of builtins, torch dtypes and (for dcp) DCP metadata, so the
storage volume that holds it never has to import forge_ext.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import re
import warnings
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torchstore as ts
from torchstore.api import DEFAULT_TORCHSTORE_NAME

from forge_ext.compat import torchstore_monarch
from forge_ext.weights import same_host
from forge_ext.weights.config import DEFAULT_KEY_PREFIX  # noqa: F401  (imported from here too)

torchstore_monarch.apply()

FORMAT = "forge_ext.weights/1"
# Commit-record key of the publisher's ``metadata`` (not "metadata": a dcp record holds DCP's
# own Metadata under that name).
METADATA_KEY = "version_metadata"
# Byte alignment of every tensor in a rank's stream: a chunk boundary (a multiple of ALIGN)
# then never splits an element, and a uint8 slice can be viewed as any dtype.
ALIGN = 64
# Concurrent torchstore gets per fetch: several messages in flight hide per-call latency.
MAX_INFLIGHT_GETS = 8


#: ``allocate`` of :func:`fetch_weights`: ``{name: (shape, dtype)}`` -> ``{name: tensor}``.
Allocator = Callable[
    [Mapping[str, tuple[tuple[int, ...], torch.dtype]]], Mapping[str, torch.Tensor]
]


class WeightsVersionNotFoundError(KeyError):
    """The requested policy version has no commit record: never published, still being
    published, failed half-way, or already deleted by retention."""

    def __init__(self, version: int, key_prefix: str, committed: list[int]) -> None:
        self.version = version
        self.key_prefix = key_prefix
        self.committed = committed
        super().__init__(
            f"policy_version={version} is not committed under key_prefix={key_prefix!r} "
            f"(committed versions: {committed}); it was never published, is still being "
            "published, failed, or was deleted by retention"
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])

    def __reduce__(self):  # picklable, so it reaches the controller from an actor intact
        return type(self), (self.version, self.key_prefix, self.committed)


class WeightsFetchError(RuntimeError):
    """A committed version could not be read back: its transport failed (for ``dcp``, the
    checkpoint folder was removed or damaged after the commit; for a same-host version, this
    process is on another host or sees another ``/dev/shm``, or the publisher stopped).
    Derives from ``Exception``, unlike DCP's own ``CheckpointException``, so callers'
    ``except Exception`` catch it."""


def commit_key(key_prefix: str, version: int) -> str:
    return f"{key_prefix}.v{version}.commit"


def chunk_key(key_prefix: str, version: int, rank: int, index: int) -> str:
    return f"{key_prefix}.v{version}.r{rank}.c{index}"


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for contiguous CPU ``uint8`` tensors of equal length, as one
    single-threaded memcpy. Why not ``dst.copy_(src)``: torch splits the copy across its
    intra-op (OpenMP) threads, and on a host whose cores are shared with other processes
    (trainer ranks, generators, storage volumes) those threads wait for each other: measured
    5-20x slower per chunk than one memcpy on the project's 2-core CPU hosts."""
    dst.numpy()[:] = src.numpy()


def chunk_tensor(payload: bytes | torch.Tensor) -> torch.Tensor:
    """A ``uint8`` tensor view of a chunk read back from torchstore (see
    ``forge_ext.weights.publish._pack_chunk``). Read-only: copy out of it, never write into
    it (a ``bytes`` object is immutable)."""
    if isinstance(payload, torch.Tensor):
        return payload
    with warnings.catch_warnings():  # "The given buffer is not writable": we only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored block of a tensor: ``local_shape`` elements at ``global_offset`` of the full
    tensor, stored in rank ``rank``'s byte stream from ``stream_offset`` on."""

    rank: int
    stream_offset: int
    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]


async def committed_versions(
    *, key_prefix: str = DEFAULT_KEY_PREFIX, store_name: str = DEFAULT_TORCHSTORE_NAME
) -> list[int]:
    """Committed policy versions under ``key_prefix``, ascending."""
    client = await ts.client(store_name)
    pattern = re.compile(rf"^{re.escape(key_prefix)}\.v(\d+)\.commit$")
    found = (pattern.match(key) for key in await client.keys(key_prefix))
    return sorted(int(m.group(1)) for m in found if m)


async def latest_version(
    *, key_prefix: str = DEFAULT_KEY_PREFIX, store_name: str = DEFAULT_TORCHSTORE_NAME
) -> int | None:
    """The newest committed policy version, or None if there is none."""
    versions = await committed_versions(key_prefix=key_prefix, store_name=store_name)
    return versions[-1] if versions else None


async def fetch_commit_record(
    version: int, *, key_prefix: str, store_name: str
) -> dict[str, Any]:
    """The commit record of ``version``. Raises WeightsVersionNotFoundError if absent."""
    key = commit_key(key_prefix, version)
    try:
        record = await ts.get(key, store_name=store_name)
    except Exception as e:  # noqa: BLE001 - re-raised unless the key is missing
        if not missing_key(e):
            raise
        committed = await committed_versions(key_prefix=key_prefix, store_name=store_name)
        raise WeightsVersionNotFoundError(version, key_prefix, committed) from None
    if record.get("format") != FORMAT:
        raise ValueError(f"{key} holds {record.get('format')!r}, expected {FORMAT!r}")
    return record


def missing_key(error: BaseException) -> bool:
    """Whether a torchstore ``get`` or ``delete`` failed because the key is not there:
    torchstore raises KeyError for a key its controller does not index; a key deleted between the controller's
    lookup and the storage volume's read (a version retired while a reader fetches it) comes
    back as Monarch's ``ActorError`` wrapping the volume's KeyError."""
    return isinstance(error, KeyError) or isinstance(getattr(error, "exception", None), KeyError)


async def fetch_weights(
    version: int,
    names: Iterable[str] | None = None,
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    store_name: str = DEFAULT_TORCHSTORE_NAME,
    allocate: Allocator | None = None,
) -> dict[str, torch.Tensor]:
    """Fetch published policy weights (HF layout, as published) onto this process's CPU.

    Usable from the controller or from any actor on any proc that can reach the store. Every
    tensor comes back whole (DTensor shards written by several ranks are reassembled), in
    the dtype it was published in.

    Args:
        version: the ``policy_version`` passed to ``WeightsPublisher.publish``.
        names: parameter names to fetch; None fetches all. Only the chunks (``direct``) or
            DCP byte ranges (``dcp``) holding these tensors are read.
        key_prefix: ``WeightsConfig.key_prefix`` of the publisher.
        store_name: the torchstore instance.
        allocate: where the result goes: called once with ``{name: (shape, dtype)}`` of every
            tensor fetched, returns a mapping with a contiguous CPU tensor of that shape and
            dtype per name (e.g. views of a reused shared-memory buffer,
            :mod:`forge_ext.weights.shared_buffer`); default: fresh tensors. The same for
            every transport: names beyond those asked for are ignored (neither filled nor
            returned), and tensors that require grad are filled as under
            ``torch.no_grad()`` (in place, no autograd history; they still require grad).

    Returns:
        ``{name: tensor}`` of exactly the requested names, in their order: contiguous CPU
        tensors, those ``allocate`` returned (the same objects), or fresh ones that own their
        memory.

    Raises:
        WeightsVersionNotFoundError: ``version`` has no commit record (or, same host, was
            retired, and its slot reused or replaced, while this call read the record).
        TypeError: ``names`` is a str (pass a list of names), or ``allocate`` returned no
            mapping.
        ValueError: ``allocate`` returned no fitting tensor for a name.
        KeyError: a name in ``names`` is not part of the version.
        WeightsFetchError: reading the committed data failed (``dcp``: any failure inside
            ``dcp.load``, which DCP raises as a ``BaseException``; same host: this process
            cannot map the publisher's shared memory, the message names
            ``weights.same_host=off``, or the publisher has stopped).
    """
    _check_names(names)
    record = await fetch_commit_record(version, key_prefix=key_prefix, store_name=store_name)
    specs = _specs(record, names)
    if record["transport"] == "same_host":
        async with _same_host_lease(record, key_prefix, store_name) as mapped:
            views = same_host.slot_views(mapped, same_host.record_entries(record, specs))
            result = _allocate(specs, allocate)
            for name, view in views.items():
                if view.numel():  # torch's intra-op threads, as for the writer's copy
                    _fillable(result[name]).copy_(view)
        return result
    return await _read(record, specs, _allocate(specs, allocate), key_prefix, store_name)


@dataclass(frozen=True, slots=True)
class OpenedWeights:
    """What :func:`open_weights` lends for the time of its block.

    Attributes:
        tensors: ``{name: tensor}``, contiguous CPU tensors in HF layout (read them; do not
            keep them past the block: they may be views of a shared-memory slot that the
            publisher reuses afterwards).
        shared_handle: where the tensors are views of a shared-memory file, its
            :func:`forge_ext.weights.shared_buffer.open_shared_tensors` handle (plain values)
            for other processes on this host (vLLM's workers), valid inside the block;
            None where the tensors are this process's own memory.
        metadata: what the publisher stored with the version (``WeightsPublisher.publish``'s
            ``metadata``; a LoRA adapter's ``{"adapter_config": {...}}``), ``{}`` if nothing.
    """

    tensors: dict[str, torch.Tensor]
    shared_handle: dict[str, Any] | None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


@contextlib.asynccontextmanager
async def open_weights(
    version: int,
    names: Iterable[str] | None = None,
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    store_name: str = DEFAULT_TORCHSTORE_NAME,
    allocate: Allocator | None = None,
) -> AsyncIterator[OpenedWeights]:
    """``async with open_weights(N) as weights:`` lends version ``N``'s tensors for the
    block: for a same-host version, views of the publisher's slot, held so that no publisher
    overwrites it before the block ends (no copy: a generator loads its model straight from
    them); otherwise fetched as :func:`fetch_weights` does (into ``allocate``'s tensors).

    Arguments, errors: as :func:`fetch_weights` (``allocate`` is not called for a same-host
    version: the tensors are the slot's views).
    """
    _check_names(names)
    record = await fetch_commit_record(version, key_prefix=key_prefix, store_name=store_name)
    specs = _specs(record, names)
    if record["transport"] == "same_host":
        entries = same_host.record_entries(record, specs)
        async with _same_host_lease(record, key_prefix, store_name) as mapped:
            yield OpenedWeights(
                same_host.slot_views(mapped, entries), same_host.slot_handle(record, entries),
                dict(record.get(METADATA_KEY) or {}),
            )
        return
    result = await _read(record, specs, _allocate(specs, allocate), key_prefix, store_name)
    yield OpenedWeights(result, None, dict(record.get(METADATA_KEY) or {}))


async def fetch_metadata(
    version: int, *, key_prefix: str = DEFAULT_KEY_PREFIX,
    store_name: str = DEFAULT_TORCHSTORE_NAME,
) -> dict[str, Any]:
    """What the publisher stored with ``version`` (``WeightsPublisher.publish``'s
    ``metadata``), ``{}`` if nothing; reads only the commit record.

    Raises:
        WeightsVersionNotFoundError: ``version`` has no commit record.
    """
    record = await fetch_commit_record(version, key_prefix=key_prefix, store_name=store_name)
    return dict(record.get(METADATA_KEY) or {})


def _check_names(names: Iterable[str] | None) -> None:
    """A str is iterable too: its characters would be read as names."""
    if isinstance(names, (str, bytes)):
        raise TypeError(
            f"names={names!r} is a {type(names).__name__}: pass a list of tensor names, "
            f"e.g. [{names!r}] (or None for all)"
        )


def _specs(
    record: Mapping[str, Any], names: Iterable[str] | None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of the wanted tensors (all when ``names`` is None)."""
    wanted = list(record["names"]) if names is None else list(names)
    missing = sorted(set(wanted) - set(record["names"]))
    if missing:
        raise KeyError(f"policy_version={record['version']} has no tensors named {missing[:5]}")
    return {name: _spec(record, name) for name in wanted}


def _allocate(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], allocate: Allocator | None
) -> dict[str, torch.Tensor]:
    """``allocate(specs)`` checked, restricted to the names of ``specs`` (in their order)."""
    allocated = (allocate or _allocate_fresh)(specs)
    if not isinstance(allocated, Mapping):
        raise TypeError(
            f"allocate returned a {type(allocated).__name__}, not a mapping {{name: tensor}}"
        )
    result = {}
    for name, (shape, dtype) in specs.items():
        tensor = allocated.get(name)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or (
            tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu"
        ):
            raise ValueError(
                f"allocate returned no contiguous CPU tensor of shape {shape} and {dtype} for "
                f"{name!r}"
            )
        result[name] = tensor
    return result


async def _read(
    record: Mapping[str, Any], specs, result: dict[str, torch.Tensor], key_prefix: str,
    store_name: str,
) -> dict[str, torch.Tensor]:
    """Fill ``result`` from a ``direct`` (torchstore chunks) or ``dcp`` record (through
    detached aliases: tensors that require grad are filled without autograd)."""
    targets = {name: _fillable(tensor) for name, tensor in result.items()}
    if record["transport"] == "direct":
        await _fetch_direct(record, targets, key_prefix, store_name)
        return result
    if record["transport"] == "dcp":
        await asyncio.to_thread(_load_dcp, record, targets)
        return result
    raise ValueError(f"unknown transport {record['transport']!r} in commit record")


@contextlib.asynccontextmanager
async def _same_host_lease(
    record: Mapping[str, Any], key_prefix: str, store_name: str
) -> AsyncIterator[Any]:
    """:func:`forge_ext.weights.same_host.lease`, its errors as this module's."""
    try:
        async with same_host.lease(record) as mapped:
            yield mapped
    except (same_host.SlotReusedError, same_host.SlotGoneError) as e:
        # Retired between reading its commit record and taking its slot (the slot reused, or
        # replaced by a bigger one): as if the record had already been gone. A slot gone
        # while the record is still there: its publisher stopped.
        committed = await committed_versions(key_prefix=key_prefix, store_name=store_name)
        if isinstance(e, same_host.SlotGoneError) and record["version"] in committed:
            raise WeightsFetchError(str(e)) from None
        raise WeightsVersionNotFoundError(record["version"], key_prefix, committed) from None
    except same_host.SegmentUnavailableError as e:
        raise WeightsFetchError(str(e)) from None


def _spec(record: Mapping[str, Any], name: str) -> tuple[tuple[int, ...], torch.dtype]:
    if record["transport"] == "dcp":
        meta = record["metadata"].state_dict_metadata[name]
        return tuple(meta.size), meta.properties.dtype
    meta = record["tensors"][name]
    return tuple(meta["shape"]), meta["dtype"]


def _fillable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or where it requires grad (an ``allocate`` may return parameters) its
    detached alias: the same memory, filled in place without autograd."""
    return tensor.detach() if tensor.requires_grad else tensor


def _allocate_fresh(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
    return {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}


async def _fetch_direct(
    record: Mapping[str, Any], result: Mapping[str, torch.Tensor], key_prefix: str,
    store_name: str,
) -> None:
    """Get the chunks (a few in flight) and copy each one's bytes into ``result`` as it
    arrives, so that received chunks are freed as we go (peak memory: the result plus the
    chunks in flight)."""
    chunk_bytes: int = record["chunk_bytes"]
    tensors: Mapping[str, dict[str, Any]] = record["tensors"]
    version: int = record["version"]

    # (rank, chunk index) -> [(destination uint8 tensor, offset in it, stream offset, bytes)]
    copies: dict[tuple[int, int], list[tuple[torch.Tensor, int, int, int]]] = defaultdict(list)
    # Pieces of tensors stored in several pieces (DTensor shards): placed once complete.
    staged: list[tuple[torch.Tensor, torch.Tensor, Piece]] = []
    for name, full in result.items():
        meta = tensors[name]
        pieces = [Piece(*raw) for raw in meta["pieces"]]
        for piece in pieces:
            nbytes = math.prod(piece.local_shape) * full.element_size()
            if nbytes == 0:
                continue
            if len(pieces) == 1:  # the piece is the whole tensor: copy straight into it
                destination = full.view(-1).view(torch.uint8)
            else:
                destination = torch.empty(nbytes, dtype=torch.uint8)
                staged.append((full, destination, piece))
            start, stop = piece.stream_offset, piece.stream_offset + nbytes
            for index in range(start // chunk_bytes, (stop - 1) // chunk_bytes + 1):
                lo, hi = max(start, index * chunk_bytes), min(stop, (index + 1) * chunk_bytes)
                copies[(piece.rank, index)].append((destination, lo - start, lo, hi - lo))

    limit = asyncio.Semaphore(MAX_INFLIGHT_GETS)

    async def get_and_scatter(rank: int, index: int) -> None:
        async with limit:
            key = chunk_key(key_prefix, version, rank, index)
            try:
                chunk = chunk_tensor(await ts.get(key, store_name=store_name))
            except Exception as e:  # noqa: BLE001 - re-raised unless the chunk is missing
                if not missing_key(e):
                    raise
                # Retired (commit record first, then chunks) while this fetch read it.
                committed = await committed_versions(key_prefix=key_prefix, store_name=store_name)
                raise WeightsVersionNotFoundError(version, key_prefix, committed) from None
        base = index * chunk_bytes
        for destination, offset, lo, nbytes in copies[(rank, index)]:
            copy_bytes(destination[offset : offset + nbytes], chunk[lo - base : lo - base + nbytes])

    await asyncio.gather(*(get_and_scatter(rank, index) for rank, index in sorted(copies)))
    for full, destination, piece in staged:
        index = tuple(slice(o, o + n) for o, n in zip(piece.global_offset, piece.local_shape))
        full[index] = destination.view(full.dtype).view(piece.local_shape)


def _load_dcp(record: Mapping[str, Any], state_dict: dict[str, torch.Tensor]) -> None:
    # no_dist: this reader loads alone even if its process is part of a process group.
    with warnings.catch_warnings():  # no_dist's "assuming ... a single process" notice
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(state_dict, checkpoint_id=record["checkpoint_id"], no_dist=True)
        except CheckpointException as e:
            raise WeightsFetchError(
                f"policy_version={record['version']}: reading its dcp checkpoint "
                f"{record['checkpoint_id']!r} failed ({_first_line(e)}); the folder was "
                "removed or damaged after the version was committed"
            ) from e


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
