"""Named tensors in one shared-memory file that other processes on the same host map.

The generator fetches a policy version into a :class:`SharedTensorBuffer` and hands its
:meth:`~SharedTensorBuffer.handle` (a small dict of plain values) to the vLLM workers it
started; each worker maps the same file (:func:`open_shared_tensors`) and reads the tensors
without a byte travelling through a pipe or RPC. The file lives in ``/dev/shm`` (a tmpfs),
is created once and reused for every later version of the same layout, so its pages stay
resident ("warm") and a refill runs at memory-copy speed (shared FINDINGS, "Weight
transport").

Mapping is :func:`torch.from_file` with ``shared=True`` (``MAP_SHARED`` of the file), not
``multiprocessing.shared_memory``: Python 3.11's ``SharedMemory`` registers every segment a
process *attaches* to with its resource tracker, which unlinks it when that process exits.

Lifetime: the writer owns the file and unlinks it in :meth:`~SharedTensorBuffer.close`
(also at interpreter exit). File names carry a prefix, the writer's pid and a counter
(``forge_ext-<tag>-<pid>-<n>``); :func:`remove_orphans` deletes files of dead writers.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import torch

SHM_DIR = "/dev/shm"
PREFIX = "forge_ext"
# Every tensor starts at a multiple of this many bytes, so any slice can be viewed as its dtype.
ALIGN = 64

_counter = itertools.count()
_NAME = re.compile(rf"^{PREFIX}-(?P<tag>[\w.]+)-(?P<pid>\d+)-\d+$")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a shared tensor handle")
    return dtype


def _layout(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]):
    """``[(name, shape, dtype, byte offset)]`` and the total size in bytes."""
    entries, offset = [], 0
    for name, (shape, dtype) in specs.items():
        shape = tuple(int(s) for s in shape)
        entries.append((name, shape, dtype, offset))
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def _views(storage: torch.Tensor, entries) -> dict[str, torch.Tensor]:
    views = {}
    for name, shape, dtype, offset in entries:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        views[name] = storage[offset : offset + nbytes].view(dtype).view(shape)
    return views


class SharedTensorBuffer:
    """A reusable shared-memory file holding a set of named tensors (the writer's side).

    Args:
        tag: a word in the file name (e.g. ``generator``) to tell buffers apart.
        directory: where the file lives; a tmpfs (``/dev/shm``) keeps it in memory.

    Usage::

        buffer = SharedTensorBuffer("generator")
        views = buffer.allocate({"w": ((4, 8), torch.float32)})   # [4, 8] view of the file
        views["w"].copy_(...)
        handle = buffer.handle()           # plain dict: send it to readers on this host
        ...
        buffer.close()                     # unlinks the file
    """

    def __init__(self, tag: str, directory: str = SHM_DIR) -> None:
        if not re.fullmatch(r"[\w.]+", tag):
            raise ValueError(f"tag={tag!r} must be letters, digits, '_' or '.'")
        self.tag = tag
        self.directory = directory
        self.path: str | None = None
        self._capacity = 0
        self._storage: torch.Tensor | None = None
        self._entries: list = []
        self._views: dict[str, torch.Tensor] = {}
        atexit.register(self.close)

    def allocate(
        self, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> dict[str, torch.Tensor]:
        """Lay out ``specs`` (``{name: (shape, dtype)}``) in the file and return a view per
        name. The file is reused when it is large enough (its pages stay warm), and replaced
        by a larger one otherwise. Earlier views must not be used after this call.

        Raises:
            OSError: naming the bytes needed when the file system (``/dev/shm``) has too
                little free space.
        """
        entries, nbytes = _layout(specs)
        if self._storage is None or nbytes > self._capacity:
            self._create(max(nbytes, ALIGN))
        self._entries = entries
        self._views = _views(self._storage, entries)
        return dict(self._views)

    def _create(self, nbytes: int) -> None:
        free = shutil.disk_usage(self.directory).free + self._capacity
        if nbytes > free:
            raise OSError(
                f"{self.directory} has {free / 2**20:.0f} MiB free, {nbytes / 2**20:.0f} MiB "
                "are needed for one copy of the weights; enlarge it (e.g. docker "
                "--shm-size) or free memory"
            )
        self.close()
        path = os.path.join(self.directory, f"{PREFIX}-{self.tag}-{os.getpid()}-{next(_counter)}")
        with open(path, "wb") as f:
            f.truncate(nbytes)
        self.path, self._capacity = path, nbytes
        self._storage = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    def views(self) -> dict[str, torch.Tensor]:
        """The views of the latest :meth:`allocate` (empty before the first)."""
        return dict(self._views)

    def handle(self) -> dict[str, Any]:
        """What a reader needs to map the current tensors: ``{"path", "size", "tensors":
        [[name, dtype name, shape, byte offset], ...]}`` (plain values, picklable and
        JSON-able)."""
        if self.path is None:
            raise RuntimeError("nothing allocated yet")
        return {
            "path": self.path,
            "size": self._capacity,
            "tensors": [
                [name, _dtype_name(dtype), list(shape), offset]
                for name, shape, dtype, offset in self._entries
            ],
        }

    def close(self) -> None:
        """Drop the mapping and unlink the file (readers that still map it keep their pages
        until they unmap). Idempotent."""
        self._storage, self._views, self._entries = None, {}, []
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path, self._capacity = None, 0


def open_shared_tensors(handle: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Map a :meth:`SharedTensorBuffer.handle` on the reader's side.

    Returns:
        ``{name: tensor}``, views of the shared file (CPU, read them, do not write). Pages are
        read only where a view is touched, so a reader that narrows a tensor (a tensor-
        parallel rank's rows) reads about its share.

    Raises:
        FileNotFoundError: the writer has closed (unlinked) the buffer.
    """
    storage = torch.from_file(handle["path"], shared=True, size=handle["size"], dtype=torch.uint8)
    entries = [
        (name, tuple(shape), _dtype(dtype), offset)
        for name, dtype, shape, offset in handle["tensors"]
    ]
    return _views(storage, entries)


def remove_orphans(directory: str = SHM_DIR) -> list[str]:
    """Delete buffer files whose writer process no longer exists (left by a crash).

    Returns:
        The paths removed.
    """
    removed = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match is None or _pid_alive(int(match["pid"])):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
