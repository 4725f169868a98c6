"""Publish policy weights as a numbered version that generators fetch (issue 4, library side).

A trainer calls :meth:`WeightsPublisher.publish` on every rank of its process group with its
HF-layout state dict (torchtitan's ``to_hf`` output; values are plain tensors or DTensors).
How the data travel is the transport's (:mod:`forge_ext.weights.transports`), chosen from
``WeightsConfig.transport`` at the first publish
(:func:`~forge_ext.weights.transports.registry.transport_for`):

- ``direct``, when every rank of the group runs on one host and ``weights.same_host=auto``
  (the default): shared-memory slots on that host
  (:mod:`~forge_ext.weights.transports.same_host`); torchstore carries only the commit record;
- ``direct`` otherwise: every rank's owned bytes as chunks in torchstore, over Monarch RPC or
  RDMA (:mod:`~forge_ext.weights.transports.direct`);
- ``dcp``: ``torch.distributed.checkpoint`` files under ``weights.dcp_path`` and their handle
  in torchstore (:mod:`~forge_ext.weights.transports.dcp`).

This module holds what every transport shares: the multi-rank protocol, the commit, and
retention. "Rank 0" is the group's rank 0; each "exchange" is one ``all_gather_object`` of a
small status, after which every rank takes the same decision (so a failure on one rank never
leaves others hanging in a later collective, and every rank raises the same
``WeightsPublishError``).

0. Every rank checks its input, rank 0 checks that the version is new; then
   :meth:`Transport.prepare <forge_ext.weights.transports.base.Transport.prepare>` (rank 0
   reserves the DCP folder or a free same-host slot). Exchange, and
   :meth:`~forge_ext.weights.transports.base.Transport.check_prepared`.
1. Every rank writes its part (:meth:`~forge_ext.weights.transports.base.Transport.write`).
   Exchange: an error, or a manifest of what it wrote. If any rank failed, each rank deletes
   the keys it wrote and the transport frees what it reserved (:meth:`~forge_ext.weights
   .transports.base.Transport.abort`), and every rank raises: the version stays absent,
   earlier ones are untouched.
2. Every rank builds the commit record from the manifests
   (:meth:`~forge_ext.weights.transports.base.Transport.record`, which checks that they
   cover each tensor exactly once); rank 0 writes it (the version becomes visible), then
   applies retention: for each version it published beyond the newest ``keep_versions``
   (counting this one), it deletes the commit record first (readers then see "missing",
   never a partial dict), then the data keys, then the transport releases the rest (the DCP
   folder it created, the same-host slot). Nothing is found by listing keys or directories,
   so nothing this publisher did not create is touched. Exchange, so that when ``publish``
   returns on any rank the version is fetchable and the retired ones are gone.
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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torchstore as ts
from torchstore.api import DEFAULT_TORCHSTORE_NAME

from forge_ext.runtime import disk
from forge_ext.weights import shm_files
from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.delta import DeltaStats
from forge_ext.weights.errors import WeightsPublishError, WeightsWriteError
from forge_ext.weights.store import commit_key, missing_key, put_recorded
from forge_ext.weights.transports.base import (
    TRANSPORT_ERRORS, CommitRecord, Group, ProgressHook, Tensors, Transport,
)
from forge_ext.weights.transports.registry import transport_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What ``publish`` did on this rank."""

    policy_version: int
    transport: str
    bytes_written: int  # by this rank (direct: chunk bytes; dcp: its share of tensor bytes)
    seconds: float
    rdma: bool  # torchstore moved data over Monarch RDMA (direct only)
    same_host: bool = False  # direct through the shared-memory slots (no data in torchstore)
    delta: DeltaStats | None = None  # weights.delta: this rank's changed elements and bytes


@dataclass(slots=True)
class _Published:
    """What this publisher stored in torchstore for one committed version (rank 0)."""

    version: int
    keys: list[str]  # commit record first


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

    State (what was published, for retention; the transport with its same-host slots) lives
    in the instance, so keep one per rank for the trainer's lifetime and :meth:`close` it at
    the end (it unlinks the slots; also done at interpreter exit). Every rank of
    ``process_group`` must call :meth:`publish` with the same ``policy_version``, the same
    names in the same order, and same-placement values.
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
        self._group = Group(process_group)
        self._transport: Transport | None = None  # chosen at the first publish
        self._published: deque[_Published] = deque()
        self._last_version: int | None = None
        # Rank 0: versions in _published whose commit outcome could not be learnt (the put of
        # the record failed and the store did not answer whether it holds it); every rank:
        # the version whose data a failed publish kept for that reason.
        self._unresolved: set[int] = set()
        self._kept_version: int | None = None

    def close(self) -> None:
        """Free what the transport holds (rank 0's same-host slots are unlinked: committed
        same-host versions can no longer be fetched afterwards). Idempotent; the publisher
        may publish again (new slots are made)."""
        if self._transport is not None:
            self._transport.close()

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
        reader_base: int | None = None,
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
                after each chunk is stored (direct), after each ``chunk_mb`` of tensors is
                copied into the slot (same host), or after the DCP save (dcp). An exception
                it raises fails the publish like a transport error would.
            metadata: plain values (JSON-like) stored in the commit record with the tensors,
                whatever the transport, and handed to readers (``OpenedWeights.metadata``,
                :func:`~forge_ext.weights.fetch.fetch_metadata`); rank 0's is stored. A LoRA
                version carries ``{"adapter_config": <adapter_config.json mapping>}``.
            reader_base: with ``weights.delta``, the version every live reader holds (the
                oldest one a reader confirmed loading): when it is the version this
                publisher published last, the new version is a delta on it; None (no
                reader, one that restarted or reported a mismatch) publishes a full
                version. Ignored otherwise.

        Returns:
            PublishResult for this rank.

        Raises:
            WeightsPublishError: on every rank, if any rank failed, whatever the transport
                raised (including DCP's ``CheckpointException``, a ``BaseException``);
                ``policy_version`` is then absent (its chunks or DCP folder removed), earlier
                versions are untouched, and the same version may be published again.
        """
        start = time.perf_counter()
        exclude = self._first_checks(exclude_from_cast, metadata)
        self._transport.set_reader_base(reader_base)
        version, what = policy_version, f"publish of policy_version={policy_version}"
        tensors, prepared = await self._prepare(state_dict, version, exclude, what)
        stored: list[str] = []  # torchstore keys this rank wrote
        written, manifests, error = await self._write(
            version, state_dict, tensors, prepared, on_progress, stored
        )
        await self._commit_version(version, manifests, error, metadata, stored, what)
        return PublishResult(
            policy_version=version, transport=self.config.transport, bytes_written=written,
            seconds=time.perf_counter() - start, rdma=self._transport.uses_rdma(),
            same_host=self._transport.shared_memory, delta=self._transport.stats(),
        )

    # -- the phases -----------------------------------------------------------------------
    def _first_checks(
        self, exclude_from_cast: Collection[str], metadata: Mapping[str, Any] | None
    ) -> frozenset[str]:
        """The arguments every phase relies on; at the first publish, the transport."""
        if self._transport is None:
            self._remove_orphans()
        if isinstance(exclude_from_cast, str):
            raise TypeError(
                f"exclude_from_cast={exclude_from_cast!r} is a str: pass a collection of "
                f"names, e.g. [{exclude_from_cast!r}]"
            )
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata is a {type(metadata).__name__}, not a mapping")
        if self._transport is None:
            self._transport = transport_for(self.config, self._group, self.store_name)
        return frozenset(exclude_from_cast)

    async def _prepare(
        self, state_dict: Mapping[str, torch.Tensor], version: int, exclude: frozenset[str],
        what: str,
    ) -> tuple[Tensors, list[dict[str, Any]]]:
        """Phase 0: every rank checks its input, rank 0 checks that the version is new (and
        finishes what an interrupted publish left to retire), then the transport prepares,
        so that no rank writes anything for a rejected version. Returns ``({name: (published
        dtype, shape)}, every rank's prepared fields)``."""
        group, transport = self._group, self._transport
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        fields: dict[str, Any] = {}
        error: BaseException | None = None
        prepared = False
        try:
            _check_values(state_dict)
            tensors = self._published_tensors(state_dict, exclude)
            if group.rank == 0:
                await self._resolve_unknown_commits(version)
                await self._retire_excess()  # what an interrupted publish left to retire
                await self._check_new_version(version)
            fields = await transport.prepare(version, tensors)
            prepared = True
        except Exception as e:  # noqa: BLE001 - every rank must reach the exchange below
            error = e
        try:
            statuses = group.all_gather(_status(error, **fields))
            _raise_if_any_failed(statuses, what, error)
            transport.check_prepared(statuses)
        except BaseException:
            if prepared:
                transport.abort(version)
            raise
        return tensors, statuses

    async def _write(
        self, version: int, state_dict: Mapping[str, torch.Tensor], tensors: Tensors,
        prepared: list[dict[str, Any]], on_progress: ProgressHook | None, stored: list[str],
    ) -> tuple[int, list[dict[str, Any]], BaseException | None]:
        """Phase 1: every rank writes its part; then all learn whether every rank succeeded.
        Returns (this rank's bytes, every rank's manifest, this rank's error)."""
        written, manifest, error = 0, {}, None
        try:
            written, manifest = await self._transport.write(
                version, state_dict, tensors, prepared, on_progress, stored
            )
        except TRANSPORT_ERRORS as e:  # noqa: BLE001 - every rank must reach the exchange
            error = e
        except BaseException:
            # Interrupted (Ctrl-C, task cancelled): no exchange, but leave nothing behind; the
            # transport's own abort (a slot freed, a folder removed) even if the deletes are
            # interrupted in turn.
            try:
                await self._delete_keys(stored)
            finally:
                self._transport.abort(version)
            raise
        return written, self._group.all_gather(_status(error, **manifest)), error

    async def _commit_version(
        self, version: int, manifests: list[dict[str, Any]], error: BaseException | None,
        metadata: Mapping[str, Any] | None, stored: list[str], what: str,
    ) -> None:
        """Phase 2: rank 0 writes the commit record, then retires; all learn whether the
        commit worked. Unless the record was stored (then the version is committed, even if
        what follows was interrupted), nothing of this version is left behind on failure."""
        transport = self._transport
        try:
            _raise_if_any_failed(manifests, what, error)
            record = transport.record(version, manifests)
            published = None
            if self._group.rank == 0:
                record = record.with_metadata(metadata)
                keys = [commit_key(self.config.key_prefix, version)]
                published = _Published(version, keys + transport.data_keys(version, manifests))
            transport.commit(version)
            await self._commit(record, version, published, stored)
        except BaseException:
            if self._last_version != version and self._kept_version != version:
                # The record first (readers then see "missing"), then what it points at.
                commit = commit_key(self.config.key_prefix, version)
                try:
                    await self._delete_keys([key for key in stored if key == commit])
                    await self._delete_keys([key for key in stored if key != commit])
                finally:
                    transport.abort(version)
            raise

    # -- steps --------------------------------------------------------------------------
    def _remove_orphans(self) -> None:
        """At the first publish, whatever the transport: remove the shared-memory files of
        forge_ext processes that died on this host (an earlier trainer killed with
        ``kill -9`` that published into slots; see :func:`~forge_ext.weights.shm_files
        .remove_orphans`)."""
        try:
            removed = shm_files.remove_orphans()
        except OSError:  # no /dev/shm here
            return
        if removed:
            logger.info("removed %d shared-memory file(s) of stopped processes", len(removed))

    def _published_tensors(
        self, state_dict: Mapping[str, torch.Tensor], exclude: frozenset[str]
    ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``{name: (published dtype, full shape)}``."""
        return {
            name: (self._publish_dtype(name, value, exclude), tuple(value.shape))
            for name, value in state_dict.items()
        }

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

    async def _commit(
        self, record: CommitRecord | None, version: int, published: _Published | None,
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
                await put_recorded(key, record.to_stored(), stored, self.store_name)
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
            self._published.popleft()

    async def _retire(self, old: _Published) -> None:
        """Rank 0: delete what this publisher created for ``old``: the commit record first
        (readers then see the version as missing, never a partial dict), then its data keys,
        then the transport frees the rest (its DCP folder, its same-host slot). Never raises
        but for an interruption (deletion is best effort; what is already gone is skipped, so
        it may run again)."""
        await self._delete_keys(old.keys[:1])
        await self._delete_keys(old.keys[1:])
        self._transport.release(old.version)


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
