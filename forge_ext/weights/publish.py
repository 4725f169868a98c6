"""Publish policy weights as a numbered version that generators fetch (issue 4, library side).

A trainer calls :meth:`WeightsPublisher.publish` on every rank of its process group with its
HF-layout state dict (torchtitan's ``to_hf`` output; values are plain tensors or DTensors).
Two transports, chosen by ``WeightsConfig.transport``:

- ``direct``, when every rank of the group runs on one host and ``weights.same_host=auto``
  (the default): each rank copies what it owns into a reused shared-memory slot that holds
  the full tensors (:mod:`forge_ext.weights.same_host`); torchstore carries only the commit
  record naming the slot, the tensors' offsets and the publisher's host. Readers on that
  host copy or load straight from the slot; a reader on another host gets a clear
  ``WeightsFetchError`` (set ``weights.same_host=off`` when trainer and generators are on
  different hosts).
- ``direct`` otherwise (``weights.same_host=off``, or a group spanning hosts): each rank
  writes only what it owns (a DTensor's local shard, or, on rank 0, a
  plain tensor) into one byte stream, cut into owned chunks of ``chunk_mb`` that are put into
  torchstore concurrently. Why not one ``ts.put`` per tensor (torchforge's seed) or
  torchstore's DTensor path: both send one message per tensor (and torchstore's DTensor
  ``get`` fetches shards one by one); on Monarch RPC each message has a fixed cost of a few
  ms, and messages much larger than ~16 MB are slower per byte, so fixed-size chunks of
  owned memory win (see ``bench/push_weights.py``). Torchstore moves each chunk over Monarch
  RDMA (as a ``uint8`` tensor) when ``torchstore.transport.buffers.rdma_available()``, over
  RPC otherwise (as ``bytes``, which Monarch sends without the copies a tensor takes; see
  ``_pack_chunk``).
- ``dcp``: ``torch.distributed.checkpoint.save`` into ``<dcp_path>/<version>`` (every rank
  writes its shards; DCP de-duplicates replicas), then rank 0 puts a handle (checkpoint id,
  DCP metadata, names) as the commit record. Readers need the folder on a shared filesystem.

Multi-rank protocol: every rank of the process group calls ``publish``; "rank 0" is the
group's rank 0; each "exchange" is one ``all_gather_object`` of a small status, after which
every rank takes the same decision (so a failure on one rank never leaves others hanging in
a later collective, and every rank raises the same ``WeightsPublishError``).
0. Rank 0 checks that the version is new (and, for dcp, creates ``<dcp_path>/<version>``,
   refusing an existing folder unless an earlier process of the same run left it, see
   ``_create_version_dir``); every rank checks its input. Exchange.
   Same host: rank 0 also takes a free slot (one whose version was retired) once no reader
   holds it, and every rank checks that all publish the same names, shapes and dtypes.
1. Every rank writes its part (direct: its chunks; same host: its pieces into the slot; dcp:
   the collective ``dcp.save``).
   Exchange: an error, or (direct) a manifest of the pieces written.
   If any rank failed, each rank deletes the keys it wrote (dcp: rank 0 deletes the folder
   it created) and raises: the version stays absent, earlier ones are untouched.
2. Every rank checks that the manifests cover each tensor exactly once; rank 0 (same host:
   stamps the slot with the version and) writes the commit record (the version becomes
   visible), then applies retention: for each version it published beyond the newest
   ``keep_versions`` (counting this one), it deletes the commit record first (readers then
   see "missing", never a partial dict), then the chunks or the DCP folder it recorded
   creating (same host: the slot becomes reusable). Nothing is found by listing keys or
   directories, so nothing this publisher did not create is touched. Exchange, so that when
   ``publish`` returns on any rank the version is fetchable and the retired ones are gone.
   If the commit record's put fails, nothing is retired, and rank 0 asks the store whether
   the record is there anyway (a put can fail after the store wrote it: a timeout on the
   reply, a connection dropped after the write): listed, the version is committed and
   ``publish`` succeeds; not listed, the version is cleaned up as after any failure and may
   be published again; if the store cannot be asked, ``publish`` fails saying the outcome is
   unknown and deletes nothing the record may point at (the next publish asks again and
   retires the version if it is absent; publishing the same version again replaces it).

Interruptions (Ctrl-C, a cancelled task, a caller's deadline): every torchstore put that was
started is waited for before the cancellation goes on (its messages are sent, so it lands
anyway), then what this version stored is deleted (its commit record too, if the interruption
came while it was being put), unless the commit had completed: then the version stays
committed, and the retention an interruption cut short is finished by the next ``publish``.

Which path ``direct`` takes is decided once, at the first publish (an exchange of
:func:`~forge_ext.weights.same_host.host_id`); :attr:`PublishResult.same_host` reports it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import shutil
import time
import warnings
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchstore as ts
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torchstore.api import DEFAULT_TORCHSTORE_NAME
from torchstore.transport.buffers import rdma_available

from forge_ext.runtime import disk
from forge_ext.compat import torchstore_monarch
from forge_ext.weights import same_host, shared_buffer, shm_files
from forge_ext.weights.fetch import (
    DEFAULT_KEY_PREFIX,
    FORMAT,
    METADATA_KEY,
    Piece,
    align,
    chunk_key,
    commit_key,
    missing_key,
)

torchstore_monarch.apply()

logger = logging.getLogger(__name__)

from forge_ext.weights.config import (  # noqa: E402, F401  (imported from here too)
    SAME_HOST, TRANSPORTS, WeightsConfig,
)
# File in each <dcp_path>/<version> folder a publisher creates, naming its run (run_id).
DCP_MARKER = ".forge_ext_weights.json"
# Chunk puts in flight per rank: enough to overlap one chunk's copy with others' sends while
# bounding the extra host memory to MAX_INFLIGHT_PUTS * chunk_mb.
MAX_INFLIGHT_PUTS = 4

ProgressHook = Callable[[int, int], None]
# What a failing transport raises. DCP reports any failure inside dcp.save (on any rank) as
# CheckpointException, which derives from BaseException, not Exception: an ``except
# Exception`` around the write would let it escape the exchange and the cleanup.
TRANSPORT_ERRORS = (Exception, CheckpointException)


class WeightsPublishError(RuntimeError):
    """A publish failed on at least one rank; nothing of that version is visible."""


class WeightsWriteError(WeightsPublishError, disk.OutputWriteError):
    """A publish failed because a rank could not write its data (dcp: a full disk, a
    read-only or unwritable ``weights.dcp_path``, a quota); ``path`` is what it wrote."""


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What ``publish`` did on this rank."""

    policy_version: int
    transport: str
    bytes_written: int  # by this rank (direct: chunk bytes; dcp: its share of tensor bytes)
    seconds: float
    rdma: bool  # torchstore moved data over Monarch RDMA (direct only)
    same_host: bool = False  # direct through the shared-memory slots (no data in torchstore)


@dataclass(slots=True)
class _Block:
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


@dataclass(slots=True)
class _Published:
    """What this publisher created for one committed version (rank 0 keeps these)."""

    version: int
    keys: list[str]  # torchstore keys, commit record first
    dcp_dir: str | None  # created by this publisher


class _Group:
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


def _status(error: BaseException | None, **fields: Any) -> dict[str, Any]:
    path = error.path if isinstance(error, disk.OutputWriteError) else None
    return {"error": None if error is None else f"{type(error).__name__}: {error}",
            "write_path": path, **fields}


def _raise_if_any_failed(
    statuses: list[dict[str, Any]], what: str, own: BaseException | None
) -> None:
    """Raise the same WeightsPublishError on every rank if any status holds an error; the
    failing rank chains its own exception."""
    failed = {rank: s["error"] for rank, s in enumerate(statuses) if s["error"] is not None}
    if failed:
        paths = [s["write_path"] for s in statuses if s["write_path"] is not None]
        if paths:  # one line naming the file, the error and the free space (the app shows it)
            raise WeightsWriteError(f"{what} failed on rank(s) {failed}", path=paths[0]) from own
        raise WeightsPublishError(f"{what} failed on rank(s) {failed}") from own


class WeightsPublisher:
    """Publishes state dicts as policy versions; one instance per trainer rank.

    State (what was published, for retention; the same-host slots) lives in the instance, so
    keep one per rank for the trainer's lifetime and :meth:`close` it at the end (it unlinks
    the slots; also done at interpreter exit). Every rank of ``process_group`` must call
    :meth:`publish` with the same ``policy_version``, the same names in the same order, and
    same-placement values.
    """

    Config = WeightsConfig

    def __init__(
        self,
        config: WeightsConfig,
        *,
        process_group: dist.ProcessGroup | None = None,
        store_name: str = DEFAULT_TORCHSTORE_NAME,
    ) -> None:
        """``process_group``: the ranks that hold the state dict; None = the default group
        if torch.distributed is initialized, else this process alone."""
        config.validate()
        self.config = config
        self.store_name = store_name
        self._group = _Group(process_group)
        self._published: deque[_Published] = deque()
        self._last_version: int | None = None
        self._same_host: bool | None = None  # decided at the first publish
        self._orphans_removed = False
        self._slots: same_host.SlotRing | None = None  # rank 0, same host
        # Rank 0: versions in _published whose commit outcome could not be learnt (the put of
        # the record failed and the store did not answer whether it holds it); every rank:
        # the version whose data a failed publish kept for that reason.
        self._unresolved: set[int] = set()
        self._kept_version: int | None = None
        self._mapped_slots: set[str] = set()  # slot files other ranks mapped
        # Same host, reused while the published names, dtypes and shapes stay the same:
        # (tensors, slot layout entries, slot bytes, digest), and the slots' tensor views.
        self._layout: tuple[dict, list, int, str] | None = None
        self._slot_views: dict[tuple[str, str], dict[str, Any]] = {}
        # What stays the same from version to version while the layout does: the commit
        # record of a slot but for its version, and the last manifests found to cover every
        # tensor once, with the result of that check.
        self._record_parts: dict[tuple[str, str], dict[str, Any]] = {}
        self._coverage: tuple[list, tuple[dict, dict]] | None = None

    def close(self) -> None:
        """Unlink this publisher's shared-memory slots (rank 0) and drop their mappings.
        Committed same-host versions can no longer be fetched afterwards. Idempotent; the
        publisher may publish again (new slots are made)."""
        if self._slots is not None:
            self._slots.close()
        for path in self._mapped_slots:
            shared_buffer.forget(path)
        self._mapped_slots.clear()
        self._slot_views.clear()
        self._record_parts.clear()

    @property
    def published_versions(self) -> list[int]:
        """Versions this publisher committed and has not deleted (rank 0; empty elsewhere)."""
        return [p.version for p in self._published]

    async def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        policy_version: int,
        *,
        exclude_from_cast: Collection[str] = frozenset(),
        on_progress: ProgressHook | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> PublishResult:
        """Store ``state_dict`` as ``policy_version`` and make it visible to ``fetch_weights``.

        Collective over the process group (see the module docstring for the protocol).

        Args:
            state_dict: HF-layout ``{name: tensor}``; values are ``torch.Tensor`` (assumed
                identical on every rank; rank 0 writes them) or ``DTensor`` (each rank writes
                the shards it owns; replicas are written once). Partial or strided-shard
                DTensors are first redistributed to ``Replicate`` (a collective).
            policy_version: an int greater than any version this publisher published.
            exclude_from_cast: names that keep their dtype when ``config.dtype`` is set
                (e.g. buffers such as rotary ``inv_freq``). Non-floating tensors always keep
                theirs.
            on_progress: called as ``on_progress(stored_bytes, total_bytes)`` for this rank
                after each chunk is stored (direct), after each ``chunk_mb`` of tensors is copied
                into the slot (same host), or after the DCP save (dcp). An exception
                it raises fails the publish like a transport error would: a fault-injection
                point for tests, or a progress report.
            metadata: plain values (JSON-like: dicts, lists, str, numbers) stored in the
                commit record with the tensors, whatever the transport, and handed to
                readers (``OpenedWeights.metadata``, :func:`~forge_ext.weights.fetch
                .fetch_metadata`); rank 0's is stored. A LoRA version carries
                ``{"adapter_config": <adapter_config.json mapping>}`` (:mod:`forge_ext.engine.lora`).

        Returns:
            PublishResult for this rank.

        Raises:
            WeightsPublishError: on every rank, if any rank failed, whatever the transport
                raised (including DCP's ``CheckpointException``, a ``BaseException``);
                ``policy_version`` is then absent (its chunks or DCP folder removed), earlier
                versions are untouched, and the same version may be published again.
        """
        start = time.perf_counter()
        group, version = self._group, policy_version
        if not self._orphans_removed:
            self._remove_orphans()
        if isinstance(exclude_from_cast, str):
            raise TypeError(
                f"exclude_from_cast={exclude_from_cast!r} is a str: pass a collection of "
                f"names, e.g. [{exclude_from_cast!r}]"
            )
        exclude = frozenset(exclude_from_cast)
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata is a {type(metadata).__name__}, not a mapping")
        what = f"publish of policy_version={version}"
        transport = self.config.transport
        if transport == "direct" and self._uses_same_host():
            transport = "same_host"
        dcp_dir = self._dcp_dir(version) if transport == "dcp" else None
        # Phase 0: every rank checks its input, rank 0 checks the version is new (and creates
        # the DCP folder, or takes a free same-host slot), so that no rank writes anything for
        # a rejected version.
        created_dir = False
        slot: same_host.Slot | None = None
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        error: BaseException | None = None
        try:
            _check_values(state_dict)
            tensors = self._published_tensors(state_dict, exclude)
            if group.rank == 0:
                await self._resolve_unknown_commits(version)
                await self._retire_excess()  # what an interrupted publish left to retire
                await self._check_new_version(version)
                if dcp_dir is not None:
                    _create_version_dir(dcp_dir, self._marker())
                    created_dir = True
                if transport == "same_host":
                    slot = await self._slots.acquire(self._slot_layout(tensors)[1])
        except Exception as e:  # noqa: BLE001 - every rank must reach the exchange below
            error = e
        fields = {}
        if transport == "same_host":
            digest = self._slot_layout(tensors)[2] if tensors else None
            fields = {"layout": digest, "slot": slot and (slot.path, slot.file.size)}
        try:
            statuses = group.all_gather(_status(error, **fields))
            _raise_if_any_failed(statuses, what, error)
            if transport == "same_host":
                _check_same_layout(statuses)
        except BaseException:
            if created_dir:
                shutil.rmtree(dcp_dir, ignore_errors=True)
            raise

        # Phase 1: every rank writes its part; then all learn whether every rank succeeded.
        stored: list[str] = []  # torchstore keys this rank wrote
        manifest: dict[str, Any] = {}
        written = 0
        try:
            if transport == "same_host":
                file = slot.file if slot is not None else self._map_slot(*statuses[0]["slot"])
                written, manifest = self._write_same_host(state_dict, tensors, file, on_progress)
            elif dcp_dir is None:
                written, manifest = await self._write_direct(
                    state_dict, tensors, version, on_progress, stored
                )
            else:
                written, manifest = self._write_dcp(state_dict, dcp_dir, exclude, on_progress)
            error = None
        except TRANSPORT_ERRORS as e:  # noqa: BLE001 - every rank must reach the exchange
            error = e
        except BaseException:
            # Interrupted (Ctrl-C, task cancelled): no exchange, but leave nothing behind.
            await self._delete_keys(stored)
            if created_dir:
                shutil.rmtree(dcp_dir, ignore_errors=True)
            raise
        statuses = group.all_gather(_status(error, **manifest))

        # Phase 2: rank 0 writes the commit record, then retires; all learn whether the commit
        # worked.
        try:
            _raise_if_any_failed(statuses, what, error)
            if transport == "same_host":
                record = self._same_host_record(statuses, version, slot)
            elif dcp_dir is None:
                record = _direct_record(self._covered_pieces(statuses), version,
                                        self.config.chunk_mb << 20)
            else:
                record = _dcp_record(statuses[0], version, dcp_dir)
            if record is not None and metadata is not None:
                record = {**record, METADATA_KEY: dict(metadata)}
            published = None
            if group.rank == 0:
                keys = [commit_key(self.config.key_prefix, version)]
                if transport == "direct":
                    keys += [
                        chunk_key(self.config.key_prefix, version, rank, i)
                        for rank, status in enumerate(statuses)
                        for i in range(status["chunks"])
                    ]
                published = _Published(version, keys, dcp_dir)
            if slot is not None:  # every rank has written its pieces
                self._slots.commit(slot, version)
            await self._commit(record, version, published, stored)
        except BaseException:
            # Unless the commit record was stored (then the version is committed, even if
            # what follows was interrupted): leave nothing of this version behind.
            if self._last_version != version and self._kept_version != version:
                if slot is not None:
                    self._slots.abort(slot)
                # The record first (readers then see "missing"), then what it points at.
                commit = commit_key(self.config.key_prefix, version)
                await self._delete_keys([key for key in stored if key == commit])
                await self._delete_keys([key for key in stored if key != commit])
                if created_dir:
                    shutil.rmtree(dcp_dir, ignore_errors=True)
            raise
        return PublishResult(
            policy_version=version,
            transport=self.config.transport,
            bytes_written=written,
            seconds=time.perf_counter() - start,
            rdma=transport == "direct" and rdma_available(),
            same_host=transport == "same_host",
        )

    # -- steps --------------------------------------------------------------------------
    def _remove_orphans(self) -> None:
        """At the first publish, whatever the transport: remove the shared-memory files of
        forge_ext processes that died on this host (an earlier trainer killed with
        ``kill -9`` that published into slots; see :func:`~forge_ext.weights.shm_files
        .remove_orphans`)."""
        self._orphans_removed = True
        try:
            removed = shm_files.remove_orphans()
        except OSError:  # no /dev/shm here
            return
        if removed:
            logger.info("removed %d shared-memory file(s) of stopped processes", len(removed))

    def _uses_same_host(self) -> bool:
        """Whether ``direct`` goes through shared memory: ``weights.same_host=auto`` and every
        rank on one host. Decided at the first publish (a collective), kept afterwards (the
        slots persist)."""
        if self._same_host is None:
            hosts = [None]
            if self.config.same_host == "auto":
                hosts = self._group.all_gather(same_host.host_id())
            self._same_host = self.config.same_host == "auto" and len(set(hosts)) == 1
            if self._same_host and self._group.rank == 0:
                self._slots = same_host.SlotRing(
                    same_host.slot_tag(self.config.key_prefix), self.config.keep_versions + 1
                )
            logger.info(
                "weights.transport=direct publishes %s (weights.same_host=%s%s)",
                "into shared memory" if self._same_host else "through torchstore",
                self.config.same_host,
                f", group on hosts {sorted(set(hosts))}" if hosts != [None] else "",
            )
        return self._same_host

    def _slot_layout(
        self, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> tuple[list, int, str]:
        """(slot layout entries, slot bytes, digest) of ``tensors``, computed once for as
        long as the published names, dtypes and shapes stay the same."""
        if self._layout is None or list(self._layout[0].items()) != list(tensors.items()):
            entries, size = same_host.entries_of(tensors)
            self._layout = (dict(tensors), entries, size, _digest(tensors))
            self._slot_views.clear()
            self._record_parts.clear()
        return self._layout[1:]

    def _map_slot(self, path: str, size: int) -> shared_buffer.MappedFile:
        """A slot file rank 0 made, mapped on another rank of the group (same host)."""
        self._mapped_slots.add(path)
        return shared_buffer.map_file(path, size)

    def _published_tensors(
        self, state_dict: Mapping[str, torch.Tensor], exclude: frozenset[str]
    ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``{name: (published dtype, full shape)}``."""
        return {
            name: (self._publish_dtype(name, value, exclude), tuple(value.shape))
            for name, value in state_dict.items()
        }

    def _marker(self) -> dict[str, Any]:
        """What this publisher writes into the version folders it creates (DCP_MARKER)."""
        c = self.config
        return {"format": FORMAT, "key_prefix": c.key_prefix, "run_id": c.run_id}


    def _dcp_dir(self, version: int) -> str:
        return os.path.join(os.path.abspath(self.config.dcp_path), str(version))

    async def _check_new_version(self, version: int) -> None:
        """Rank 0: the version is new for this publisher and not committed by anyone."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"policy_version={version!r} must be an int >= 0")
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(
                f"policy_version={version} must be greater than the last published "
                f"version {self._last_version}"
            )
        key = commit_key(self.config.key_prefix, version)
        # Not ts.exists: for a missing key (the usual case) torchstore 0.1.2's controller
        # raises and Monarch ships the traceback back (~3 ms here, keys() ~0.5 ms).
        client = await ts.client(self.store_name)
        if key in await client.keys(key):
            raise ValueError(
                f"policy_version={version} is already committed under "
                f"weights.key_prefix={self.config.key_prefix!r} by another publisher"
            )

    def _publish_dtype(
        self, name: str, tensor: torch.Tensor, exclude: frozenset[str]
    ) -> torch.dtype:
        target = self.config.torch_dtype
        if target is None or name in exclude or not tensor.dtype.is_floating_point:
            return tensor.dtype
        return target

    async def _write_direct(
        self,
        state_dict: Mapping[str, torch.Tensor],
        tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        version: int,
        on_progress: ProgressHook | None,
        stored: list[str],
    ) -> tuple[int, dict[str, Any]]:
        """Put this rank's chunks; returns (bytes, manifest of what it wrote)."""
        rank, prefix = self._group.rank, self.config.key_prefix
        blocks: list[_Block] = []
        offset = 0
        for name, value in state_dict.items():
            dtype = tensors[name][0]
            owned = _owned_block(value, rank)
            if owned is not None:
                local, local_shape, global_offset = owned
                blocks.append(
                    _Block(name, local.reshape(-1), dtype, local_shape, global_offset, offset)
                )
                offset += align(blocks[-1].nbytes)
        await _put_stream(
            blocks,
            self.config.chunk_mb << 20,
            lambda i: chunk_key(prefix, version, rank, i),
            stored,
            on_progress,
            self.store_name,
        )
        pieces = [
            (b.name, (rank, b.stream_offset, b.local_shape, b.global_offset)) for b in blocks
        ]
        manifest = {"tensors": dict(tensors), "pieces": pieces, "chunks": len(stored)}
        return sum(b.nbytes for b in blocks), manifest

    def _write_same_host(
        self,
        state_dict: Mapping[str, torch.Tensor],
        tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        file: shared_buffer.MappedFile,
        on_progress: ProgressHook | None,
    ) -> tuple[int, dict[str, Any]]:
        """Copy this rank's pieces into the slot ``file`` at their places in the full
        tensors, ``chunk_mb`` at a time (one ``torch._foreach_copy_`` per group, then
        ``on_progress``); returns (bytes, manifest of what it wrote)."""
        rank = self._group.rank
        entries, _, digest = self._slot_layout(tensors)
        key = (file.path, digest)
        if key not in self._slot_views:
            self._slot_views[key] = same_host.slot_views(file, entries)
        views = self._slot_views[key]
        groups: list[tuple[list[torch.Tensor], list[torch.Tensor], int]] = []
        destinations: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        pieces, written, group_bytes = [], 0, self.config.chunk_mb << 20
        for name, value in state_dict.items():
            owned = _owned_block(value, rank)
            if owned is None:
                continue
            local, local_shape, global_offset = owned
            destination = views[name]
            if local_shape != destination.shape:  # a shard: its place in the full tensor
                destination = destination[
                    tuple(slice(o, o + n) for o, n in zip(global_offset, local_shape))
                ]
            destinations.append(destination)
            sources.append(local)
            pieces.append((name, (rank, 0, local_shape, global_offset)))
            written += local.numel() * tensors[name][0].itemsize
            if written >= (len(groups) + 1) * group_bytes:
                groups.append((destinations, sources, written))
                destinations, sources = [], []
        if sources:
            groups.append((destinations, sources, written))
        for destinations, sources, done in groups:
            _copy_into(destinations, sources)
            if on_progress is not None:
                on_progress(done, written)
        return written, {"tensors": dict(tensors), "pieces": pieces}

    def _write_dcp(
        self,
        state_dict: Mapping[str, torch.Tensor],
        dcp_dir: str,
        exclude: frozenset[str],
        on_progress: ProgressHook | None,
    ) -> tuple[int, dict[str, Any]]:
        """Collective ``dcp.save``; returns (this rank's bytes, {"metadata", "names"})."""
        group = self._group
        staged = {}
        for name, value in state_dict.items():
            dtype = self._publish_dtype(name, value, exclude)
            staged[name] = value if value.dtype == dtype else value.to(dtype)
        # DCP reports a failure on any rank to every rank, so all ranks leave together.
        with warnings.catch_warnings():  # no_dist's "assuming ... a single process" notice
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            try:
                metadata = dcp.save(
                    staged, checkpoint_id=dcp_dir, process_group=group.group,
                    no_dist=group.size == 1,
                )
            except TRANSPORT_ERRORS as e:  # an OSError (full disk...) inside DCP's exception
                os_error = disk.os_error_in(e)
                if os_error is None:
                    raise
                raise disk.write_failed("the DCP weights", dcp_dir, os_error) from None
        written = sum(_local_nbytes(t, group.rank) for t in staged.values())
        if on_progress is not None:
            on_progress(written, written)
        return written, {"metadata": metadata if group.rank == 0 else None, "names": list(staged)}

    def _covered_pieces(self, statuses: list[dict[str, Any]]) -> tuple[dict, dict]:
        """:func:`_covered_pieces` of the ranks' manifests, checked once for as long as they
        stay the same (they do from version to version: same names, placements, offsets)."""
        manifests = [(list(status["tensors"].items()), status["pieces"]) for status in statuses]
        if self._coverage is None or self._coverage[0] != manifests:
            self._coverage = (manifests, _covered_pieces(statuses))
        return self._coverage[1]

    def _same_host_record(
        self, statuses: list[dict[str, Any]], version: int, slot: same_host.Slot | None
    ) -> dict[str, Any] | None:
        """The commit record on rank 0, which holds ``slot`` (the other ranks only check the
        pieces): names, dtypes and shapes, and the slot with the tensors' offsets in it."""
        tensors, _ = self._covered_pieces(statuses)
        if slot is None:
            return None
        key = (slot.path, self._layout[3])
        if key not in self._record_parts:
            self._record_parts[key] = {
                "format": FORMAT,
                "transport": "same_host",
                "names": list(tensors),
                "tensors": {
                    name: {"dtype": d, "shape": shape} for name, (d, shape) in tensors.items()
                },
                "segment": same_host.slot_record(slot, self._layout[1]),
            }
        return {**self._record_parts[key], "version": version}

    async def _commit(
        self, record: dict[str, Any] | None, version: int, published: _Published | None,
        stored: list[str],
    ) -> None:
        """Rank 0 puts the commit record (the version becomes visible; its key joins
        ``stored`` once stored), then retires the versions beyond ``keep_versions``
        (:meth:`_retire_excess`); every rank raises if the put failed, and the earlier
        versions are then untouched. Why not the put and the deletes at once (3 ms sooner
        after a 60 MB copy here): a failed or cancelled put would take the retired versions
        with it, leaving none at ``keep_versions=1``.

        A put that raised may still have stored the record, so rank 0 asks the store
        (:meth:`_record_listed`) before anyone deletes data: listed, the version is
        committed; unknown, every rank raises and keeps its data (``_kept_version``)."""
        error: BaseException | None = None
        unknown = False
        if self._group.rank == 0:
            key = commit_key(self.config.key_prefix, version)
            try:
                await _put_recorded(key, record, stored, self.store_name)
            except asyncio.CancelledError:
                if key not in stored:  # it may land anyway: the cleanup deletes it first
                    stored.append(key)
                raise
            except Exception as e:  # noqa: BLE001 - every rank must reach the exchange
                listed = await self._record_listed(key)
                if listed:
                    logger.warning(
                        "the put of %s raised %s: %s, but the store holds the record: "
                        "policy_version=%d is committed", key, type(e).__name__, e, version,
                    )
                else:
                    error, unknown = e, listed is None
                    if unknown:  # the record may point at the data: keep them, ask later
                        self._published.append(published)
                        self._unresolved.add(version)
            if error is None:
                self._last_version = version  # committed, whatever interrupts what follows
                self._published.append(published)
                await self._retire_excess()
        statuses = self._group.all_gather(_status(error, unknown=unknown))
        if statuses[0]["unknown"]:
            self._kept_version = version
            raise WeightsPublishError(
                f"commit of policy_version={version}: the outcome is unknown: the put of its "
                f"record failed ({statuses[0]['error']}) and the store could not be asked "
                "whether it holds the record; its data are kept (readers may see the version "
                "as committed). The next publish asks again and removes the version if it is "
                "absent; publishing the same policy_version again replaces it."
            ) from error
        _raise_if_any_failed(statuses, f"commit of policy_version={version}", error)
        self._last_version = version

    async def _record_listed(self, key: str) -> bool | None:
        """Rank 0: whether the store lists ``key`` (a commit record), None if it cannot be
        asked. Listed means stored: torchstore indexes a key (``notify_put``) only after its
        value is written."""
        try:
            client = await ts.client(self.store_name)
            return key in await client.keys(key)
        except Exception as e:  # noqa: BLE001 - the caller reports the outcome as unknown
            logger.warning("could not ask the store whether it holds %s: %s: %s",
                           key, type(e).__name__, e)
            return None

    async def _resolve_unknown_commits(self, version: int) -> None:
        """Rank 0, before publishing ``version``: for each version whose commit outcome was
        unknown, ask the store again. Absent, its data are deleted; present, it stays
        committed (retention retires it in turn), unless it is ``version`` itself, published
        again: then it is retired first (record, then data) and replaced."""
        for old in [p for p in self._published if p.version in self._unresolved]:
            listed = await self._record_listed(commit_key(self.config.key_prefix, old.version))
            if listed is None:
                continue  # still unknown: keep the data
            self._unresolved.discard(old.version)
            if listed and old.version != version:
                self._last_version = max(self._last_version or old.version, old.version)
                continue
            await self._retire(old)
            self._published.remove(old)
            if self._slots is not None:
                self._slots.release(old.version)

    async def _delete_keys(self, keys: list[str]) -> None:
        """Best effort, all at once: a key that is already gone (or never got indexed) is
        skipped."""

        async def delete(key: str) -> None:
            try:
                await ts.delete(key, store_name=self.store_name)
            except Exception as e:  # noqa: BLE001
                if not missing_key(e):
                    logger.warning("could not delete %s: %s: %s", key, type(e).__name__, e)

        await asyncio.gather(*(delete(key) for key in keys))

    async def _retire_excess(self) -> None:
        """Rank 0: retire the oldest versions this publisher committed until
        ``keep_versions`` remain: the one the last commit pushed out, and any whose retirement
        an interrupted publish left unfinished. A version leaves :attr:`published_versions`
        (and its same-host slot becomes reusable) only once :meth:`_retire` has deleted it,
        so an interruption leaves it to be retired again at the next publish."""
        while len(self._published) > self.config.keep_versions:
            await self._retire(self._published[0])
            old = self._published.popleft()
            if self._slots is not None:  # once no reader holds it
                self._slots.release(old.version)

    async def _retire(self, old: _Published) -> None:
        """Rank 0: delete what this publisher created for ``old``: the commit record first
        (readers then see the version as missing, never a partial dict), then its chunks or
        its DCP folder. Never raises but for an interruption (deletion is best effort; what is
        already gone is skipped, so it may run again)."""
        await self._delete_keys(old.keys[:1])
        await self._delete_keys(old.keys[1:])
        if old.dcp_dir is not None:
            shutil.rmtree(old.dcp_dir, ignore_errors=True)


async def _put_recorded(key: str, value: Any, stored: list[str], store_name: str) -> None:
    """``ts.put(key, value)``, appending ``key`` to ``stored`` once the store holds it. If the
    caller is cancelled meanwhile, waits for the put to end before the cancellation goes on:
    the put's messages are sent, so the value lands whether or not anyone waits, and cleanup
    after a cancelled publish must see it in ``stored`` to delete it."""
    put = asyncio.ensure_future(ts.put(key, value, store_name=store_name))
    put.add_done_callback(
        lambda done: done.cancelled() or done.exception() is not None or stored.append(key)
    )
    try:
        await asyncio.shield(put)
    except asyncio.CancelledError:
        await asyncio.wait([put])
        raise


def _check_values(state_dict: Mapping[str, Any]) -> None:
    if not state_dict:
        raise ValueError("state_dict is empty: there are no weights to publish")
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(value).__name__}, not a tensor")
        if value.device.type == "meta":
            raise ValueError(
                f"state_dict[{name!r}] is on the meta device (no data): materialise the model "
                "(e.g. load its weights) before publishing"
            )


def _create_version_dir(path: str, marker: dict[str, Any]) -> None:
    """Create ``path`` holding ``marker`` (:data:`DCP_MARKER`: format, key_prefix, run_id).

    A folder that exists already is refused (retention will delete it later), unless it holds
    the same marker with a run_id: then an earlier process of this run left it (a trainer
    that crashed and resumes from its checkpoint publishes the checkpoint's version again;
    the caller has checked that the version is not committed in this run's store), and it is
    replaced."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mkdir(path)
    except FileExistsError:
        if marker["run_id"] is None or _read_marker(path) != marker:
            raise FileExistsError(
                f"{path} already exists and this run did not create it (weights.run_id="
                f"{marker['run_id']!r}); remove it or set weights.dcp_path to a fresh folder"
            ) from None
        logger.info("replacing %s, left by an earlier process of this run", path)
        shutil.rmtree(path)
        os.mkdir(path)
    with open(os.path.join(path, DCP_MARKER), "w") as f:
        json.dump(marker, f)


def _read_marker(path: str) -> dict[str, Any] | None:
    """The marker in ``path``, or None without a readable one."""
    try:
        with open(os.path.join(path, DCP_MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _dcp_record(rank0: dict[str, Any], version: int, dcp_dir: str) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": version,
        "transport": "dcp",
        "checkpoint_id": dcp_dir,
        "metadata": rank0["metadata"],
        # Every tensor DCP saved, from any rank: under pipeline parallelism each stage
        # publishes its own names, and the collective save merges them.
        "names": list(rank0["metadata"].state_dict_metadata),
    }


def _owned_block(
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


def _local_nbytes(value: torch.Tensor, group_rank: int) -> int:
    """Bytes of ``value`` held by this rank (plain tensors count on rank 0 only)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    elif group_rank != 0:
        return 0
    return value.numel() * value.element_size()


async def _put_stream(
    blocks: list[_Block],
    chunk_bytes: int,
    key_of: Callable[[int], str],
    stored: list[str],
    on_progress: ProgressHook | None,
    store_name: str,
) -> None:
    """Cut this rank's byte stream into chunks and put them, at most MAX_INFLIGHT_PUTS in
    flight, appending each stored key to ``stored``. On an error, starts no new put, waits
    for those in flight (so ``stored`` lists exactly what is in the store) and raises it; so
    does a cancellation (see :func:`_put_recorded`)."""
    total = blocks[-1].stream_offset + blocks[-1].nbytes if blocks else 0
    rdma = rdma_available()
    limit = asyncio.Semaphore(MAX_INFLIGHT_PUTS)
    errors: list[BaseException] = []
    stored_bytes = 0

    async def put(index: int, payload: bytes | torch.Tensor) -> None:
        nonlocal stored_bytes
        try:
            await _put_recorded(key_of(index), payload, stored, store_name)
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
            payload = _pack_chunk(_chunk_parts(blocks, first, lo, hi), rdma)
            tasks.append(asyncio.create_task(put(index, payload)))
    finally:  # also when interrupted: every started put ends first (``stored`` is complete)
        await asyncio.gather(*tasks, return_exceptions=True)
    if errors:
        raise errors[0]


def _pack_chunk(parts: list[memoryview], rdma: bool) -> bytes | torch.Tensor:
    """One chunk to put, the concatenation of ``parts``, copied once.

    Over RDMA a ``uint8`` tensor (torchstore moves tensors through registered memory). Over
    Monarch RPC immutable ``bytes``: Monarch's pickler hands a ``bytes`` object to the channel
    without copying it, while a tensor's storage goes through ``torch.save`` into a temporary
    buffer and ``torch.load`` on the other side (``monarch/_src/actor/pickle.py``,
    ``_torch_storage``) and a ``bytearray`` is copied into the message. Measured on the
    project's CPU host, 16 MB puts: ``bytes`` ~2x the GB/s of a tensor (with the notify-put
    fix in :mod:`forge_ext.compat.torchstore_monarch`)."""
    if not rdma:
        return b"".join(parts)  # one single-threaded memcpy per part, see fetch.copy_bytes
    chunk = torch.empty(sum(p.nbytes for p in parts), dtype=torch.uint8)
    out, offset = chunk.numpy(), 0
    for part in parts:
        data = np.frombuffer(part, dtype=np.uint8)
        out[offset : offset + data.size] = data
        offset += data.size
    return chunk


def _chunk_parts(blocks: list[_Block], first: int, lo: int, hi: int) -> list[memoryview]:
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


def _copy_into(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``destination[...] = source`` for each pair (casting, gathering strides, copying from a
    device) in one ``torch._foreach_copy_``: per tensor ``Tensor.copy_``, which splits a large
    copy over torch's intra-op threads as this process is configured (a trainer rank with
    ``OMP_NUM_THREADS=1`` copies on one core), without a Python call per tensor (~0.8 ms of
    311 tensors here). Unlike the chunk packing of the RPC path (see
    :func:`forge_ext.weights.fetch.copy_bytes`), nothing else in this process competes for
    the cores meanwhile: measured into a warm slot, 1.2 GB of fp32 with 2 threads, 8.4 GB/s
    vs 5.4 GB/s for one memcpy per tensor."""
    with torch.no_grad():
        if all(source.device.type == "cpu" for source in sources):
            torch._foreach_copy_(destinations, sources)
        else:  # from an accelerator: copy_ per tensor (foreach kernels want one device)
            for destination, source in zip(destinations, sources):
                destination.copy_(source)


def _digest(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> str:
    """A fingerprint of the published names, dtypes and shapes, in order (the slot layout)."""
    return hashlib.sha256(repr([(n, str(d), s) for n, (d, s) in tensors.items()]).encode()).hexdigest()


def _check_same_layout(statuses: list[dict[str, Any]]) -> None:
    """Every rank raises the same error if the ranks would lay the slot out differently."""
    for rank, status in enumerate(statuses):
        if status["layout"] != statuses[0]["layout"]:
            raise WeightsPublishError(
                f"rank {rank} and rank 0 publish different names, shapes or dtypes"
            )


def _covered_pieces(statuses: list[dict[str, Any]]):
    """``(tensors, pieces by name)`` from every rank's manifest; checks that the ranks agree
    on the tensors and that their pieces cover each tensor exactly once."""
    tensors = statuses[0]["tensors"]
    for rank, status in enumerate(statuses):
        if status["tensors"] != tensors:
            raise WeightsPublishError(
                f"rank {rank} and rank 0 publish different names, shapes or dtypes"
            )
    pieces: dict[str, list[tuple]] = {name: [] for name in tensors}
    for status in statuses:
        for name, piece in status["pieces"]:
            pieces[name].append(piece)
    for name, (_, shape) in tensors.items():
        covered = sum(math.prod(Piece(*p).local_shape) for p in pieces[name])
        if covered != math.prod(shape):
            raise WeightsPublishError(
                f"{name}: the ranks wrote {covered} elements of {math.prod(shape)}; every "
                "element must be written once (are all ranks in the tensor's device mesh?)"
            )
    return tensors, pieces


def _direct_record(
    covered: tuple[dict, dict], version: int, chunk_bytes: int
) -> dict[str, Any]:
    """The commit record from the ranks' manifests, as :func:`_covered_pieces` returned
    them."""
    tensors, pieces = covered
    return {
        "format": FORMAT,
        "version": version,
        "transport": "direct",
        "chunk_bytes": chunk_bytes,
        "names": list(tensors),
        "tensors": {
            name: {"dtype": dtype, "shape": shape, "pieces": pieces[name]}
            for name, (dtype, shape) in tensors.items()
        },
    }
