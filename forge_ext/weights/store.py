"""Where published weights live in torchstore: key names, the commit-record format, and the
few store calls every transport and both sides (:mod:`~forge_ext.weights.publish`,
:mod:`~forge_ext.weights.fetch`) share.

Store layout for version ``N`` under ``key_prefix`` (keys use ``.`` between parts because
torchstore 0.1.2 lists keys by prefix only at ``.``-separated boundaries, see
``torchstore/storage_utils/trie.py``):

- ``{key_prefix}.v{N}.commit``: the commit record (:class:`~forge_ext.weights.transports.base
  .CommitRecord` as builtins), written last, by rank 0 of the publishing group, after every
  rank stored its part. A version without it does not exist for readers.
- what the version's transport stores besides (``direct``: its chunks,
  :func:`chunk_key`; see :mod:`forge_ext.weights.transports`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import torchstore as ts
from torchstore.api import DEFAULT_TORCHSTORE_NAME

from forge_ext.compat import torchstore_monarch
from forge_ext.weights.config import DEFAULT_KEY_PREFIX

torchstore_monarch.apply()

FORMAT = "forge_ext.weights/1"
# Commit-record key of the publisher's ``metadata`` (not "metadata": a dcp record holds DCP's
# own Metadata under that name).
METADATA_KEY = "version_metadata"


def commit_key(key_prefix: str, version: int) -> str:
    return f"{key_prefix}.v{version}.commit"


def chunk_key(key_prefix: str, version: int, rank: int, index: int) -> str:
    return f"{key_prefix}.v{version}.r{rank}.c{index}"


def missing_key(error: BaseException) -> bool:
    """Whether a torchstore ``get`` or ``delete`` failed because the key is not there:
    torchstore raises KeyError for a key its controller does not index; a key deleted between
    the controller's lookup and the storage volume's read (a version retired while a reader fetches it) comes
    back as Monarch's ``ActorError`` wrapping the volume's KeyError."""
    return isinstance(error, KeyError) or isinstance(getattr(error, "exception", None), KeyError)


async def committed_versions(
    *, key_prefix: str = DEFAULT_KEY_PREFIX, store_name: str = DEFAULT_TORCHSTORE_NAME
) -> list[int]:
    """Committed policy versions under ``key_prefix``, ascending."""
    client = await ts.client(store_name)
    pattern = re.compile(rf"^{re.escape(key_prefix)}\.v(\d+)\.commit$")
    found = (pattern.match(key) for key in await client.keys(key_prefix))
    return sorted(int(m.group(1)) for m in found if m)


async def put_recorded(key: str, value: Any, stored: list[str], store_name: str) -> None:
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
