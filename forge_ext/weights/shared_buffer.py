"""Named tensors in shared-memory files that other processes on the same host map.

Two users:

- the trainer's publisher writes each policy version into one of a few reused slot files
  (:mod:`forge_ext.weights.transports.slots`) that generators on the same host read;
- a generator that fetched a version over torchstore (a trainer on another host) puts it in a
  :class:`SharedTensorBuffer` and hands its :meth:`~SharedTensorBuffer.handle` (a small dict
  of plain values) to the vLLM workers it started.

Either way a reader maps the same file (:func:`open_shared_tensors`, :func:`map_file`) and
reads the tensors without a byte travelling through a pipe or RPC. The files live in
``/dev/shm`` (a tmpfs), are created once and reused for every later version of the same
layout, so their pages stay resident ("warm") and a refill runs at memory-copy speed (shared
FINDINGS, "Weight transport").

Mapping is ``mmap.mmap(MAP_SHARED)`` of the file viewed with :func:`torch.frombuffer`, not
``multiprocessing.shared_memory``: Python 3.11's ``SharedMemory`` registers every segment a
process *attaches* to with its resource tracker, which unlinks it when that process exits.
A process keeps its mappings (:func:`map_file` caches them by path): mapping a file again for
every version would page-fault every page again (~0.3 s per GB here), which is the cost the
reused files exist to avoid. A cached mapping of a file that was since unlinked is dropped at
the next :func:`map_file` call (its memory is freed once no tensor views it).

Lifetime: the writer owns each file and unlinks it when it closes (also at interpreter exit).
File names: :func:`forge_ext.weights.shm_files.new_name`;
:func:`~forge_ext.weights.shm_files.remove_orphans` deletes files of dead writers.
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from forge_ext.weights.shm_files import (
    SHM_DIR,
    check_free_space,
    check_tag,
    new_name,
)

__all__ = [
    "ALIGN", "MappedFile", "SharedTensorBuffer", "create_file", "layout", "forget", "map_file",
    "open_shared_tensors", "shared_handle", "views_of",
]

# Every tensor starts at a multiple of this many bytes, so any slice can be viewed as its dtype.
ALIGN = 64


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a shared tensor handle")
    return dtype


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def layout(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], start: int = 0
) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype, int]], int]:
    """``[(name, shape, dtype, byte offset)]`` of ``specs`` packed from byte ``start`` on, each
    tensor at a multiple of :data:`ALIGN`, and the end offset (bytes)."""
    entries, offset = [], start
    for name, (shape, dtype) in specs.items():
        shape = tuple(int(s) for s in shape)
        entries.append((name, shape, dtype, offset))
        offset += -(-_nbytes(shape, dtype) // ALIGN) * ALIGN
    return entries, offset


def views_of(storage: torch.Tensor, entries) -> dict[str, torch.Tensor]:
    """``{name: view}`` of a ``uint8`` tensor at the ``(name, shape, dtype, offset)``
    entries of :func:`layout`."""
    views = {}
    for name, shape, dtype, offset in entries:
        views[name] = storage[offset : offset + _nbytes(shape, dtype)].view(dtype).view(shape)
    return views


@dataclass(eq=False)
class MappedFile:
    """A shared-memory file mapped into this process, with an open descriptor of it (for
    ``fstat``, and the creator's ``flock``).

    Attributes:
        path: the file.
        fd: descriptor opened read-write; -1 once closed (a cached mapping is closed when
            its file is unlinked or mapped again). Readers' ``flock`` leases never use it:
            they open their own (:func:`forge_ext.weights.transports.slots.lease`).
        bytes: ``uint8`` tensor over the whole mapping (``[size]``).
        inode: ``(st_dev, st_ino)`` of the file when it was mapped.
    """

    path: str
    fd: int
    bytes: torch.Tensor
    inode: tuple[int, int]

    @property
    def size(self) -> int:
        return self.bytes.numel()

    def unlinked(self) -> bool:
        """Whether the file has been removed since it was mapped."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def close(self) -> None:
        """Close the descriptor; the mapping lives on while tensors view it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _map(path: str, fd: int, size: int, populate: bool) -> MappedFile:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    mapping = mmap.mmap(fd, size, flags=flags)
    stat = os.fstat(fd)
    return MappedFile(path, fd, torch.frombuffer(mapping, dtype=torch.uint8),
                      (stat.st_dev, stat.st_ino))


def create_file(path: str, size: int) -> MappedFile:
    """Create ``path`` with ``size`` bytes of memory reserved (``posix_fallocate``: a full
    tmpfs fails here with ``ENOSPC``, not later with a ``SIGBUS`` on first write) and map it
    with every page faulted in (``MAP_POPULATE``), so that the first write runs at copy speed
    too. Not cached: the creator keeps it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return _map(path, fd, size, populate=True)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


# Mappings this process made of other processes' files, by path (see the module docstring).
_mapped: dict[str, MappedFile] = {}


def map_file(path: str, size: int) -> MappedFile:
    """Map ``path`` (at least ``size`` bytes), reusing this process's earlier mapping of the
    same file; drops cached mappings of files that were unlinked since.

    Raises:
        FileNotFoundError: there is no such file (its writer closed it).
    """
    for cached_path, cached in list(_mapped.items()):
        if cached.unlinked():
            cached.close()
            del _mapped[cached_path]
    stat = os.stat(path)
    cached = _mapped.get(path)
    if cached is not None and cached.inode == (stat.st_dev, stat.st_ino) and cached.size >= size:
        return cached
    fd = os.open(path, os.O_RDWR)
    try:
        mapped = _map(path, fd, size, populate=False)
    except BaseException:
        os.close(fd)
        raise
    if cached is not None:
        cached.close()
    _mapped[path] = mapped
    return mapped


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
        check_tag(tag)
        self.tag = tag
        self.directory = directory
        self.path: str | None = None
        self._file: MappedFile | None = None
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
        entries, nbytes = layout(specs)
        if self._file is None or nbytes > self._file.size:
            self._create(max(nbytes, ALIGN))
        self._entries = entries
        self._views = views_of(self._file.bytes, entries)
        return dict(self._views)

    def _create(self, nbytes: int) -> None:
        held = 0 if self._file is None else self._file.size
        check_free_space(
            nbytes - held, self.directory, "one copy of the weights",
            "enlarge it (e.g. docker --shm-size) or free memory",
        )
        self.close()
        path = os.path.join(self.directory, new_name(self.tag))
        self._file, self.path = create_file(path, nbytes), path

    def views(self) -> dict[str, torch.Tensor]:
        """The views of the latest :meth:`allocate` (empty before the first)."""
        return dict(self._views)

    def handle(self) -> dict[str, Any]:
        """What a reader needs to map the current tensors: ``{"path", "size", "tensors":
        [[name, dtype name, shape, byte offset], ...]}`` (plain values, picklable and
        JSON-able)."""
        if self._file is None:
            raise RuntimeError("nothing allocated yet")
        return shared_handle(self.path, self._file.size, self._entries)

    def close(self) -> None:
        """Drop the mapping and unlink the file (readers that still map it keep their pages
        until they unmap). Idempotent."""
        self._views, self._entries = {}, []
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def shared_handle(path: str, size: int, entries) -> dict[str, Any]:
    """The handle :func:`open_shared_tensors` takes, for the :func:`layout` ``entries`` of
    the file ``path`` (``size`` bytes)."""
    return {
        "path": path,
        "size": size,
        "tensors": [
            [name, _dtype_name(dtype), list(shape), offset] for name, shape, dtype, offset in entries
        ],
    }


def open_shared_tensors(handle: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Map a :meth:`SharedTensorBuffer.handle` (or a policy version's slot handle,
    :mod:`forge_ext.weights.transports.slots`) on the reader's side.

    Returns:
        ``{name: tensor}``, views of the shared file (CPU, read them, do not write). Pages are
        read only where a view is touched, so a reader that narrows a tensor (a tensor-
        parallel rank's rows) reads about its share.

    Raises:
        FileNotFoundError: the writer has closed (unlinked) the file.
    """
    mapped = map_file(handle["path"], handle["size"])
    entries = [
        (name, tuple(shape), _dtype(dtype), offset)
        for name, dtype, shape, offset in handle["tensors"]
    ]
    return views_of(mapped.bytes, entries)



def forget(path: str) -> None:
    """Drop this process's cached mapping of ``path`` (its memory is freed once no tensor
    views it and the file is unlinked)."""
    cached = _mapped.pop(path, None)
    if cached is not None:
        cached.close()
