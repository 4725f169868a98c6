"""Process-group environment helpers: the environment of a world of one, and where a
world's rendezvous and gloo listen."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket

logger = logging.getLogger(__name__)



def free_port(address: str = "127.0.0.1") -> int:
    """An unused TCP port of ``address`` (for ``MASTER_PORT``)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def init_single_process_env() -> None:
    """Set the torchrun environment for a world of one process, unless already set.

    ``TitanEngine`` initialises ``torch.distributed`` from ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` and ``LOCAL_RANK``; tests, benchmarks and the SFT app
    call this to run a single-process engine without torchrun.
    """
    if "RANK" in os.environ:
        return
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
    )


@contextlib.contextmanager
def rendezvous_on_master_addr():
    """Around ``init_process_group`` (``env://``): the world listens on ``MASTER_ADDR``'s
    address only.

    Why: torch.distributed's ``TCPStore`` server (the rendezvous of ``env://``, rank 0) binds
    every interface (``::``, torch 2.13, libuv and classic backends alike) whatever
    ``MASTER_ADDR`` says, and anyone who reaches it can read and write the world's keys. Its
    constructor takes ``master_listen_fd``, a socket already listening, and ``env://`` opens
    rank 0's store as ``multi_tenant``, which shares the server this process already runs on
    that port: rank 0 starts it here, on a socket bound to ``MASTER_ADDR``'s address, and
    lets go of it on leaving (the world's store keeps it for the world's life, as torch's own
    would). Where ``MASTER_ADDR`` is a loopback address (every rank on this machine), gloo's
    pairs listen on the loopback interface too (``GLOO_SOCKET_IFNAME``, unless set), instead
    of the address of the host name.

    Nothing to do off rank 0 (but gloo's interface), without ``MASTER_ADDR``/``MASTER_PORT``,
    or once the world exists. If the address cannot be bound (``MASTER_ADDR`` is not this
    machine's), torch's own store starts, on every interface, with a warning.
    """
    import torch.distributed as dist

    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    store = None
    if address and port and not dist.is_initialized():
        if _is_loopback(address) and "GLOO_SOCKET_IFNAME" not in os.environ:
            interface = _loopback_interface()
            if interface:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
        if os.environ.get("RANK") == "0":
            store = _serve_store(address, int(port), int(os.environ.get("WORLD_SIZE", "1")))
    try:
        yield
    finally:
        del store  # the world's own store holds the server now


def _serve_store(address: str, port: int, world_size: int):
    import torch.distributed as dist

    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            address, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(1024)
    except OSError as error:
        logger.warning("torch.distributed's store listens on every interface: could not bind "
                       "MASTER_ADDR=%s:%s (%s)", address, port, error)
        return None
    # detach(): the store's server owns the descriptor from now on.
    return dist.TCPStore(address, port, world_size, is_master=True, multi_tenant=True,
                         master_listen_fd=listener.detach(), wait_for_workers=False)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _loopback_interface() -> str | None:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None
