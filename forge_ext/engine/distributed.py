"""Process-group environment helpers for running the engine outside a launcher."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """An unused TCP port on localhost (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
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
