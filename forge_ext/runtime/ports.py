"""The TCP ports a run's processes listen on, for the line the run prints at its start
(:meth:`forge_ext.runtime.placement.Placement.exposed_ports`): Monarch 0.7's workers and procs
accept any connection, so a user should know what is open, and where (docs/hosts.md,
"Security").
"""

from __future__ import annotations

import ipaddress
import os

import psutil
from monarch.actor import Actor, endpoint


def listening(pids=None) -> list[tuple[str, int]]:
    """``(address, port)`` of the TCP sockets in LISTEN state of ``pids`` (default: this
    process and its descendants), sorted."""
    if pids is None:
        me = psutil.Process()
        pids = [me.pid, *(c.pid for c in me.children(recursive=True))]
    found = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        found |= {(c.laddr.ip, c.laddr.port) for c in connections
                  if c.status == psutil.CONN_LISTEN}
    return sorted(found)


def beyond_loopback(sockets) -> list[tuple[str, int]]:
    """Those of ``sockets`` another machine could reach: not on a loopback address."""
    out = []
    for address, port in sockets:
        ip = ipaddress.ip_address(address.split("%")[0])
        if getattr(ip, "ipv4_mapped", None):
            ip = ip.ipv4_mapped
        if not ip.is_loopback:
            out.append((address, port))
    return out


def show(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


class ListeningPorts(Actor):
    """Spawned on a role's procs: each proc's own listening sockets (its store, gloo ...)."""

    @endpoint
    async def sockets(self) -> list[tuple[str, int]]:
        return listening([os.getpid()])
