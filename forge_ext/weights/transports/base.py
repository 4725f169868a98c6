"""The one interface every weight transport implements, and its typed commit record.

A transport moves one policy version from the ranks of a trainer's process group to its
readers. :class:`~forge_ext.weights.publish.WeightsPublisher` walks its publish side in
order, every rank of the group calling each phase (the exchanges between them are the
publisher's, see its module docstring):

1. :meth:`Transport.prepare`: rank 0 reserves what the version needs (a DCP folder, a
   shared-memory slot); every rank returns the fields it shares in the next exchange, and
   :meth:`Transport.check_prepared` checks them on every rank;
2. :meth:`Transport.write`: every rank writes the part it owns, returns a manifest of it;
3. :meth:`Transport.record`: the :class:`CommitRecord` built from every rank's manifest
   (rank 0 stores it, which makes the version visible); :meth:`Transport.commit` runs just
   before that, :meth:`Transport.abort` instead when the version does not get committed,
   :meth:`Transport.release` when retention retires a committed version.

The fetch side has no publisher: :meth:`Transport.read` and :meth:`Transport.open` are class
methods that read a version through its record (:func:`~forge_ext.weights.fetch
.fetch_weights`, :func:`~forge_ext.weights.fetch.open_weights`).

The record travels through torchstore as builtins (:meth:`CommitRecord.to_stored`: a dict
of builtins, torch dtypes and, for dcp, DCP metadata), so the storage volume that holds it
never imports forge_ext.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.delta import DeltaStats
from forge_ext.weights.store import FORMAT, METADATA_KEY

#: ``on_progress(stored_bytes, total_bytes)`` of one rank's write.
ProgressHook = Callable[[int, int], None]
#: ``{name: (published dtype, full shape)}`` of the tensors of a version.
Tensors = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
#: ``{name: (shape, dtype)}`` of the tensors a reader asked for.
Specs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
# What a failing transport raises. DCP reports any failure inside dcp.save (on any rank) as
# CheckpointException, which derives from BaseException, not Exception: an ``except
# Exception`` around the write would let it escape the exchange and the cleanup.
TRANSPORT_ERRORS = (Exception, CheckpointException)


class Group:
    """The publishing process group, or a single process when torch.distributed is off."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.size = 1 if group is None else dist.get_world_size(group)

    def all_gather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


@dataclass(frozen=True, slots=True)
class StoreLocation:
    """Where a version's keys are: the torchstore instance and ``weights.key_prefix``."""

    key_prefix: str
    store_name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitRecord(ABC):
    """What makes a version visible: its names and what its transport needs to read it.

    Attributes:
        version: the policy version.
        names: every tensor of the version, in publish order.
        metadata: the publisher's ``metadata`` (plain values), None if it gave none.
    """

    transport: ClassVar[str]
    # The stored key of a transport's own field where it is not the field's name.
    stored_as: ClassVar[Mapping[str, str]] = {}
    version: int
    names: list[str]
    metadata: dict[str, Any] | None = None

    @classmethod
    def _own_fields(cls) -> dict[str, str]:
        """``{field name: stored key}`` of the transport's own fields."""
        common = {field.name for field in dataclasses.fields(CommitRecord)}
        return {field.name: cls.stored_as.get(field.name, field.name)
                for field in dataclasses.fields(cls) if field.name not in common}

    def to_stored(self) -> dict[str, Any]:
        """The record as torchstore holds it (``format``, ``version``, ``transport``,
        ``names``, the transport's fields, and the metadata under ``version_metadata``)."""
        stored = {"format": FORMAT, "version": self.version, "transport": self.transport,
                  "names": list(self.names)}
        stored.update({key: getattr(self, name) for name, key in self._own_fields().items()})
        if self.metadata is not None:
            stored[METADATA_KEY] = dict(self.metadata)
        return stored

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> CommitRecord:
        """The typed record of :meth:`to_stored`'s output."""
        own = {name: stored[key] for name, key in cls._own_fields().items()}
        return cls(version=stored["version"], names=list(stored["names"]),
                   metadata=stored.get(METADATA_KEY), **own)

    def with_metadata(self, metadata: Mapping[str, Any] | None) -> CommitRecord:
        return self if metadata is None else dataclasses.replace(self, metadata=dict(metadata))

    @abstractmethod
    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``(shape, dtype)`` of tensor ``name`` as published."""


@dataclass(frozen=True, slots=True)
class OpenedWeights:
    """What :func:`~forge_ext.weights.fetch.open_weights` lends for the time of its block.

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
        changed: for a delta version (``weights.delta``), the names of the tensors whose data
            it changed (the others hold the base's data, bit for bit); None: a full version.
    """

    tensors: dict[str, torch.Tensor]
    shared_handle: dict[str, Any] | None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    changed: frozenset[str] | None = None


class Transport(ABC):
    """One way of moving a version; one instance per publisher (per trainer rank).

    Args:
        config: the validated ``weights:`` config.
        group: the publishing process group.
        store_name: the torchstore instance.
    """

    name: ClassVar[str]  # the commit record's ``transport``
    Record: ClassVar[type[CommitRecord]]
    shared_memory: ClassVar[bool] = False  # readers map the data (no copy through the store)

    def __init__(self, config: WeightsConfig, group: Group, store_name: str) -> None:
        self.config = config
        self.group = group
        self.where = StoreLocation(config.key_prefix, store_name)

    # -- publish side: every rank of the group, phase after phase -------------------------
    async def prepare(self, version: int, tensors: Tensors) -> dict[str, Any]:
        """Before anything is written: rank 0 reserves what ``version`` needs; returns the
        fields this rank shares in the exchange that follows (plain values)."""
        return {}

    def check_prepared(self, statuses: list[dict[str, Any]]) -> None:
        """Every rank, with every rank's :meth:`prepare` fields: raise
        ``WeightsPublishError`` (the same on every rank) if the ranks cannot go on."""

    @abstractmethod
    async def write(
        self, version: int, state_dict: Mapping[str, torch.Tensor], tensors: Tensors,
        prepared: list[dict[str, Any]], on_progress: ProgressHook | None, stored: list[str],
    ) -> tuple[int, dict[str, Any]]:
        """Write this rank's part of ``version``; returns (bytes written, manifest: plain
        values the ranks exchange). Appends every torchstore key it stored to ``stored``
        (also when it raises or is interrupted: the publisher deletes them then)."""

    @abstractmethod
    def record(self, version: int, manifests: list[dict[str, Any]]) -> CommitRecord | None:
        """The commit record from every rank's manifest (None on ranks that cannot build
        it; rank 0 always can); raises ``WeightsPublishError`` on every rank alike if the
        manifests do not make a whole version."""

    def data_keys(self, version: int, manifests: list[dict[str, Any]]) -> list[str]:
        """Rank 0: the torchstore keys ``version``'s data took (retention deletes them)."""
        return []

    def commit(self, version: int) -> None:
        """Every rank, right before rank 0 stores the record: every rank's part is written."""

    def abort(self, version: int) -> None:
        """``version`` will not be committed: free what :meth:`prepare` reserved (the
        publisher deletes the torchstore keys)."""

    def release(self, version: int) -> None:
        """Rank 0: committed ``version`` was retired (its keys deleted): free the rest."""

    def set_reader_base(self, reader_base: int | None) -> None:
        """Before :meth:`prepare`: the version every reader holds (``publish``'s
        ``reader_base``). Only ``weights.delta``'s transport uses it."""

    def stats(self) -> DeltaStats | None:
        """What the last :meth:`write` sent against what a full version takes (delta
        transport only; None otherwise)."""
        return None

    def uses_rdma(self) -> bool:
        """Whether torchstore moves this transport's data over Monarch RDMA."""
        return False

    def close(self) -> None:
        """Free what the transport holds for its publisher. Idempotent."""

    # -- fetch side: no publisher, only the record ----------------------------------------
    @classmethod
    def check_base(cls, record: CommitRecord, holding: int | None) -> None:
        """Before :meth:`read` or :meth:`open`: raise if a reader holding version ``holding``
        (None: none) cannot read ``record``. Every version is whole but a delta's."""

    @classmethod
    @abstractmethod
    async def read(
        cls, record: CommitRecord, specs: Specs, allocate: Callable[[], dict[str, torch.Tensor]],
        where: StoreLocation,
    ) -> dict[str, torch.Tensor]:
        """Fill the tensors ``allocate()`` returns (``specs``' names and places) with the
        version's data and return them.

        Raises:
            WeightsVersionNotFoundError: the version was retired while this call read it.
            WeightsFetchError: the committed data cannot be read from here.
        """

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, record: CommitRecord, specs: Specs, allocate: Callable[[], dict[str, torch.Tensor]],
        where: StoreLocation,
    ) -> AsyncIterator[OpenedWeights]:
        """Lend the version's tensors for the block: by default :meth:`read`'s."""
        tensors = await cls.read(record, specs, allocate, where)
        yield OpenedWeights(tensors, None, dict(record.metadata or {}))


def fillable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or where it requires grad (an ``allocate`` may return parameters) its
    detached alias: the same memory, filled in place without autograd."""
    return tensor.detach() if tensor.requires_grad else tensor
