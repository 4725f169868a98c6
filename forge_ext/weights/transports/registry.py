"""The transports by name: the publisher's choice from ``weights:`` (:func:`transport_for`)
and the reader's from a commit record (:func:`transport_of`).

``weights.transport`` names what a user asks for (``direct``, ``dcp``); a commit record names
the transport that wrote it (``direct``, ``same_host``, ``dcp``, ``delta``): ``direct`` runs as
``same_host`` when ``weights.same_host=auto`` and every rank of the group is on one host, and
as ``delta`` with ``weights.delta`` (whose anchors are ``direct`` or ``same_host`` versions).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.transports.base import CommitRecord, Group, Transport
from forge_ext.weights.transports.dcp import DcpTransport
from forge_ext.weights.transports.delta import DeltaTransport
from forge_ext.weights.transports.direct import DirectTransport
from forge_ext.weights.transports import slots
from forge_ext.weights.transports.same_host import SameHostTransport

logger = logging.getLogger(__name__)

TRANSPORTS: dict[str, type[Transport]] = {
    cls.name: cls for cls in (DirectTransport, SameHostTransport, DcpTransport, DeltaTransport)
}


def transport_for(config: WeightsConfig, group: Group, store_name: str) -> Transport:
    """The transport a publisher uses, decided once (a collective over ``group`` when
    ``weights.same_host=auto``: every rank's :func:`~forge_ext.weights.transports.slots
    .host_id`), kept afterwards (the same-host slots persist)."""
    if config.transport != "direct":
        return TRANSPORTS[config.transport](config, group, store_name)
    hosts = [None]
    if config.same_host == "auto":
        hosts = group.all_gather(slots.host_id())
    same_host = config.same_host == "auto" and len(set(hosts)) == 1
    logger.info(
        "weights.transport=direct publishes %s (weights.same_host=%s%s)",
        "into shared memory" if same_host else "through torchstore",
        config.same_host,
        f", group on hosts {sorted(set(hosts))}" if hosts != [None] else "",
    )
    direct = (SameHostTransport if same_host else DirectTransport)(config, group, store_name)
    if config.delta:  # full versions (anchors) as direct publishes them, deltas between
        return DeltaTransport(config, group, store_name, anchor=direct)
    return direct


def transport_of(stored: Mapping[str, Any]) -> tuple[type[Transport], CommitRecord]:
    """The transport that wrote a stored commit record, and the record typed.

    Raises:
        ValueError: the record names no known transport.
    """
    cls = TRANSPORTS.get(stored.get("transport"))
    if cls is None:
        raise ValueError(f"unknown transport {stored.get('transport')!r} in commit record")
    return cls, cls.Record.from_stored(stored)
