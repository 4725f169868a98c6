"""Read published policy weights back: find a version's commit record in torchstore, and let
the transport that wrote it read the data (:mod:`forge_ext.weights.transports`).

Two ways to read a version, whatever the transport: :func:`fetch_weights` returns tensors of
this process's own; :func:`open_weights` lends tensors for the time of an ``async with``
block, without a copy where the version is in shared memory on this host (a generator loads
its model from them). Where the keys are: :mod:`forge_ext.weights.store`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import torch
import torchstore as ts
from torchstore.api import DEFAULT_TORCHSTORE_NAME

from forge_ext.weights.config import DEFAULT_KEY_PREFIX
from forge_ext.weights.errors import WeightsVersionNotFoundError
from forge_ext.weights.store import (
    FORMAT, METADATA_KEY, commit_key, committed_versions, missing_key,
)
from forge_ext.weights.transports.base import CommitRecord, OpenedWeights, StoreLocation
from forge_ext.weights.transports.registry import transport_of

#: ``allocate`` of :func:`fetch_weights`: ``{name: (shape, dtype)}`` -> ``{name: tensor}``.
Allocator = Callable[
    [Mapping[str, tuple[tuple[int, ...], torch.dtype]]], Mapping[str, torch.Tensor]
]


async def latest_version(
    *, key_prefix: str = DEFAULT_KEY_PREFIX, store_name: str = DEFAULT_TORCHSTORE_NAME
) -> int | None:
    """The newest committed policy version, or None if there is none."""
    versions = await committed_versions(key_prefix=key_prefix, store_name=store_name)
    return versions[-1] if versions else None


async def fetch_commit_record(
    version: int, *, key_prefix: str, store_name: str
) -> dict[str, Any]:
    """The commit record of ``version`` as the store holds it (builtins, see
    :meth:`~forge_ext.weights.transports.base.CommitRecord.to_stored`).

    Raises:
        WeightsVersionNotFoundError: the version has no commit record.
        ValueError: the record is of another format.
    """
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


async def fetch_weights(
    version: int,
    names: Iterable[str] | None = None,
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    store_name: str = DEFAULT_TORCHSTORE_NAME,
    allocate: Allocator | None = None,
    holding: int | None = None,
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
        holding: the version the tensors ``allocate`` returns hold, if any. A delta version
            (``weights.delta``) is applied onto them in place and needs its base there.

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
        WeightsDeltaBaseError: ``version`` is a delta on a version other than ``holding``
            (a :class:`WeightsFetchError`; nothing was read: fetch a full version).
        WeightsChecksumError: a delta, once applied, does not give the published data (a
            :class:`WeightsFetchError`; the tensors are then wrong: fetch a full version).
        WeightsFetchError: reading the committed data failed (``dcp``: any failure inside
            ``dcp.load``, which DCP raises as a ``BaseException``; same host: this process
            cannot map the publisher's shared memory, the message names
            ``weights.same_host=off``, or the publisher has stopped).
    """
    transport, record, specs, where = await _find(version, names, key_prefix, store_name)
    transport.check_base(record, holding)
    return await transport.read(record, specs, lambda: _allocate(specs, allocate), where)


@contextlib.asynccontextmanager
async def open_weights(
    version: int,
    names: Iterable[str] | None = None,
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    store_name: str = DEFAULT_TORCHSTORE_NAME,
    allocate: Allocator | None = None,
    holding: int | None = None,
) -> AsyncIterator[OpenedWeights]:
    """``async with open_weights(N) as weights:`` lends version ``N``'s tensors for the
    block: for a same-host version, views of the publisher's slot, held so that no publisher
    overwrites it before the block ends (no copy: a generator loads its model straight from
    them); otherwise fetched as :func:`fetch_weights` does (into ``allocate``'s tensors).

    Arguments, errors: as :func:`fetch_weights` (``allocate`` is not called for a same-host
    version: the tensors are the slot's views).
    """
    transport, record, specs, where = await _find(version, names, key_prefix, store_name)
    transport.check_base(record, holding)
    async with transport.open(record, specs, lambda: _allocate(specs, allocate), where) as lent:
        yield lent


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


async def _find(version: int, names: Iterable[str] | None, key_prefix: str, store_name: str):
    """(the transport that wrote ``version``, its typed record, the wanted ``{name: (shape,
    dtype)}``, where its keys are)."""
    _check_names(names)
    stored = await fetch_commit_record(version, key_prefix=key_prefix, store_name=store_name)
    transport, record = transport_of(stored)
    return transport, record, _specs(record, names), StoreLocation(key_prefix, store_name)


def _check_names(names: Iterable[str] | None) -> None:
    """A str is iterable too: its characters would be read as names."""
    if isinstance(names, (str, bytes)):
        raise TypeError(
            f"names={names!r} is a {type(names).__name__}: pass a list of tensor names, "
            f"e.g. [{names!r}] (or None for all)"
        )


def _specs(
    record: CommitRecord, names: Iterable[str] | None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of the wanted tensors (all when ``names`` is None)."""
    wanted = list(record.names) if names is None else list(names)
    missing = sorted(set(wanted) - set(record.names))
    if missing:
        raise KeyError(f"policy_version={record.version} has no tensors named {missing[:5]}")
    return {name: record.spec(name) for name in wanted}


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


def _allocate_fresh(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
    return {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
