"""Let torchstore 0.1.2 move tensors over Monarch 0.7's RDMA TCP fallback, when asked.

Why: torchstore 0.1.2 picks its transport with ``torchstore.transport.buffers
.rdma_available()``, which asks Monarch's ``is_rdma_available()``; in torchmonarch 0.7 that
function is deprecated and means "ibverbs hardware present" (``monarch/_src/rdma/rdma.py``).
But Monarch 0.7 has a second RDMA backend, a TCP fallback (``monarch.rdma.get_rdma_backend()
== "tcp"``, on unless ``monarch.configure(rdma_allow_tcp_fallback=False)``), with which
``RDMABuffer`` works on any machine. So torchstore's RDMA branch (``RDMATransportBuffer``)
and ours (``weights.transport=direct`` chunks as ``uint8`` tensors,
``forge_ext.weights.transports.direct.pack_chunk``) only ever ran on InfiniBand/EFA
clusters, never in CI. With the switch on they run here, over TCP: the code a GPU cluster runs is tested. On one
host it is slower than Monarch RPC (docs/benchmarks.md), so it is off unless asked for.

Switch it on in every process that puts or gets (spawned procs inherit the environment):
``FORGE_EXT_TORCHSTORE_RDMA=tcp``, or :func:`use_tcp_fallback` in one process (tests).
Unset, torchstore sees RDMA exactly where ibverbs is (as before, minus Monarch's deprecation
warning on every put and get). Applied by :func:`forge_ext.compat.torchstore_monarch.apply`
in every Monarch proc.
"""

from __future__ import annotations

import os

from monarch.rdma import get_rdma_backend, is_ibverbs_available
from torchstore.transport import buffers

ENV = "FORGE_EXT_TORCHSTORE_RDMA"
_forced: bool | None = None  # use_tcp_fallback's setting; None: read ENV


def tcp_fallback_enabled() -> bool:
    """Whether torchstore may use the TCP fallback here (:func:`use_tcp_fallback`, else
    ``FORGE_EXT_TORCHSTORE_RDMA=tcp``)."""
    return os.environ.get(ENV) == "tcp" if _forced is None else _forced


def use_tcp_fallback(enabled: bool | None) -> None:
    """Turn the fallback on or off in this process (None: follow the environment)."""
    global _forced
    _forced = enabled


def monarch_rdma_available() -> bool:
    """What torchstore's ``rdma_available()`` asks Monarch: ibverbs, or with the switch on
    any RDMA backend Monarch has (the TCP fallback)."""
    if tcp_fallback_enabled():
        return get_rdma_backend() != "none"
    return is_ibverbs_available()


def apply() -> None:
    """Make torchstore ask :func:`monarch_rdma_available` (``rdma_available`` reads the
    module global on every call). Idempotent."""
    buffers.monarch_rdma_available = monarch_rdma_available
