"""Same-host shared-memory slots: the files a same-host publisher writes each policy version
into, and the leases its readers take (:mod:`forge_ext.weights.transports.same_host`).

Slots (one file each, ``/dev/shm/forge_ext-weights.<key_prefix>-<pid>-<n>-p<ns>``, created by
rank 0 of the group, at most ``keep_versions + 1`` of them, reused version after version so
their pages stay warm): a header page, then the *full* HF tensors of one version, each at a
64-byte aligned offset (:func:`forge_ext.weights.shared_buffer.layout`). Every rank writes
the pieces it owns (DTensor shards, or plain tensors on rank 0) at their global offsets, so a
reader (a vLLM worker in particular) takes whole tensors without reassembling shards.

Header: two int64, :data:`MAGIC` and the *stamp*, the version whose tensors the slot holds
completely, or :data:`WRITING` while a writer overwrites it.

Why readers never see a slot being overwritten (``flock`` on the slot file; the kernel drops
a dead process's locks):

- reader (:func:`lease`): opens the slot file (a descriptor of its own per lease: ``flock``
  locks belong to the open file description), checks it is the file the record names,
  ``LOCK_SH``, then checks ``stamp == version`` (otherwise the version was retired and its
  slot reused: the reader reports it missing, as for any retired version), reads or loads,
  closes its descriptor;
- writer, before overwriting a slot: ``LOCK_EX`` (waits until no reader holds the slot),
  ``stamp = WRITING``, ``LOCK_UN``; then every rank writes; rank 0 sets ``stamp = version``
  before it writes the commit record. A slot too small for the next version is replaced by a
  new file at once; the old one is unlinked once no reader holds it (``LOCK_EX`` without
  waiting, tried at every later :meth:`SlotRing.acquire`), so a lease's path stays valid.

A slot is only chosen once its version has been retired (its commit record deleted), so new
readers of that version get "not committed" from torchstore, and those that read the record
just before see the stamp. Why locks and not only a stamp re-checked after reading (a
seqlock): ``flock`` is a system call on both sides, which orders the stamp and data accesses
on any CPU (a seqlock needs memory fences Python cannot issue), and a reader that keeps
views for a while (vLLM's workers during a reload) holds the slot instead of finding out
afterwards that it was overwritten.

Lifetime: rank 0 unlinks its slots in :meth:`SlotRing.close` (``WeightsPublisher.close``, the
trainer's ``cleanup``, interpreter exit). Slots of a publisher that was killed are removed by
the next publisher's first publish, whatever its transport
(:func:`forge_ext.weights.shm_files.remove_orphans`), and by ``make clean``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from forge_ext.weights.shared_buffer import (
    MappedFile,
    create_file,
    layout,
    map_file,
)
from forge_ext.weights.shm_files import (
    SHM_DIR,
    check_free_space,
    check_tag,
    new_name,
)

# The header: int64 [MAGIC, stamp]; tensors start after one page.
HEADER_BYTES = 4096
MAGIC = int.from_bytes(b"fx-wts1\0", "little")
WRITING = -1
# How long a writer waits for readers to release the slot it needs (seconds): readers hold a
# slot for one copy or one vLLM reload of a version at least keep_versions versions old.
LEASE_TIMEOUT_S = 300.0
POLL_S = 0.002


@functools.cache
def host_id() -> str:
    """Who can map this process's ``/dev/shm`` files: ``<hostname>/<boot id>`` (the boot id
    of ``/proc/sys/kernel/random/boot_id`` tells a rebooted or cloned machine apart); read
    once per process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


# Longest tag of a slot file name: with forge_ext-<tag>-<pid>-<n>-p<pid namespace> it stays
# far below the 255 bytes a file name may have.
MAX_TAG = 120


def slot_tag(key_prefix: str) -> str:
    """The file-name tag of the slots of a publisher of ``key_prefix``: ``weights.`` and the
    prefix with every character but ASCII letters, digits, ``_`` and ``.`` replaced by ``_``;
    a longer one is cut and ends with a digest of the whole prefix, so that any
    ``weights.key_prefix`` torchstore takes makes valid file names."""
    tag = "weights." + re.sub(r"[^A-Za-z0-9_.]", "_", key_prefix)
    if len(tag) <= MAX_TAG:
        return tag
    digest = hashlib.sha256(key_prefix.encode()).hexdigest()[:16]
    return f"{tag[:MAX_TAG - len(digest) - 1]}.{digest}"


class SegmentUnavailableError(RuntimeError):
    """The slot a commit record names cannot be mapped here (another host, another
    ``/dev/shm``, or its publisher stopped)."""


class SlotGoneError(SegmentUnavailableError):
    """The slot file a commit record names is gone, or the path names another file now:
    the publisher stopped (its slots go with it), or it retired the version and replaced its
    slot by a bigger one (the record is then gone from the store too)."""


class SlotReusedError(RuntimeError):
    """The slot no longer holds the version: it was retired and its slot is being reused."""


def _stamp_view(file: MappedFile) -> torch.Tensor:
    return file.bytes[:16].view(torch.int64)


def read_stamp(file: MappedFile) -> int:
    return int(_stamp_view(file)[1])


def write_stamp(file: MappedFile, value: int) -> None:
    _stamp_view(file)[1] = value


def entries_of(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]):
    """Slot layout of ``{name: (dtype, shape)}``: :func:`~forge_ext.weights.shared_buffer
    .layout` entries after the header, and the slot size in bytes."""
    return layout({name: (shape, dtype) for name, (dtype, shape) in tensors.items()}, HEADER_BYTES)


async def _flock(
    fd: int, operation: int, timeout: float, waiting_for: Callable[[], str]
) -> None:
    """``flock(fd, operation)`` without blocking the event loop (other tasks of this process,
    e.g. a reader of the same slot, must go on); raises TimeoutError after ``timeout`` s,
    ``waiting_for()`` saying for whom and what to do."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {waiting_for()}") from None
            await asyncio.sleep(POLL_S)


def lock_holders(fd: int) -> list[int]:
    """Pids of the processes holding a ``flock`` on the file open as ``fd`` (from
    ``/proc/locks``, whose device is ``MAJOR:MINOR:INODE``, the first two in hex; see
    proc(5)); empty where that cannot be read."""
    stat = os.fstat(fd)
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    pids = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                # "N: FLOCK ADVISORY READ <pid> <device> 0 EOF"; waiters have "->" after N:.
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:
                    pids.append(int(fields[4]))
    except (OSError, ValueError):
        return []
    return sorted(set(pids))


def _readers_of(slot: Slot) -> str:
    """Who holds ``slot`` (the writer waited for them) and what to do, for a TimeoutError."""
    version = read_stamp(slot.file)
    pids = [f"{pid} (this process)" if pid == os.getpid() else str(pid)
            for pid in lock_holders(slot.file.fd)]
    held_by = f" (held by pid {', '.join(pids)})" if pids else ""
    return (
        f"readers of the retired policy_version={version} to leave its shared-memory slot "
        f"{slot.path}{held_by}: a process on this host is still inside open_weights({version}) "
        f"(e.g. a generator loading it) or fetch_weights({version}). End that block sooner "
        "(open_weights lends the tensors for the block only: copy what must outlive it, or use "
        "fetch_weights), or raise weights.keep_versions so that the slot is reused later"
    )


@dataclass(eq=False)
class Slot:
    """One slot file of a :class:`SlotRing` and the committed version it holds (None: free)."""

    file: MappedFile
    version: int | None = None

    @property
    def path(self) -> str:
        return self.file.path


class SlotRing:
    """The slots of one publisher (rank 0 of its group creates and owns them).

    Args:
        tag: file-name tag (``weights.<key_prefix>``).
        slots: how many slots at most (``keep_versions + 1``: the versions kept plus the one
            being written).
        directory: a tmpfs.
    """

    def __init__(self, tag: str, slots: int, directory: str = SHM_DIR) -> None:
        check_tag(tag)
        self.tag, self.max_slots, self.directory = tag, slots, directory
        self.slots: list[Slot] = []
        # Replaced slot files that a reader still held: unlinked once none holds them (their
        # path must stay valid for as long as a lease: open_weights hands it to vLLM's workers).
        self._draining: list[MappedFile] = []
        self._registered = False

    def _create(self, size: int, replacing: Slot | None) -> MappedFile:
        if not self._registered:
            # What crashed publishers left was removed by WeightsPublisher's first publish.
            atexit.register(self.close)
            self._registered = True
        # Check for every slot still to be made, so that a too-small /dev/shm fails at the
        # first publish, not versions later.
        missing = self.max_slots - len(self.slots)
        if replacing is None:
            needed = size * missing
        else:  # a replaced file still held by a reader keeps its memory for now
            needed = size - (0 if replacing.file in self._draining else replacing.file.size)
        try:
            check_free_space(
                needed, self.directory,
                f"weights.transport=direct with weights.same_host=auto (keeps weights."
                f"keep_versions + 1 = {self.max_slots} copies of the weights, "
                f"{size / 2**20:,.0f} MiB each)",
                "enlarge /dev/shm (e.g. docker --shm-size), lower weights.keep_versions, or set "
                "weights.same_host=off",
            )
            file = create_file(os.path.join(self.directory, new_name(self.tag)), size)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise OSError(  # ENOSPC from posix_fallocate: another process took the space
                f"weights.same_host=auto: could not reserve {size / 2**20:,.0f} MiB in "
                f"{self.directory} ({e.strerror}); set weights.same_host=off or make room"
            ) from e
        write_stamp(file, WRITING)
        _stamp_view(file)[0] = MAGIC
        return file

    async def acquire(self, size: int) -> Slot:
        """A free slot of at least ``size`` bytes, marked :data:`WRITING` once no reader holds
        it (waits up to :data:`LEASE_TIMEOUT_S`).

        Raises:
            OSError: too little room in the tmpfs (naming the bytes and the fields).
            TimeoutError: a reader held the slot for too long.
        """
        self._unlink_drained()
        free = [s for s in self.slots if s.version is None]
        if not free and len(self.slots) < self.max_slots:
            slot = Slot(self._create(size, None))
            self.slots.append(slot)
            return slot
        if not free:
            raise RuntimeError(f"all {self.max_slots} slots hold committed versions")
        # The least recently written free slot; readers of its old version are the oldest.
        slot = free[0]
        if slot.file.size < size:  # the tensors grew: a bigger file in its place
            if slot.file not in self._draining:
                self._draining.append(slot.file)
            self._unlink_drained()  # now, unless a reader holds it
            slot.file = self._create(size, slot)
            return slot
        await _flock(slot.file.fd, fcntl.LOCK_EX, LEASE_TIMEOUT_S, lambda: _readers_of(slot))
        try:
            write_stamp(slot.file, WRITING)
        finally:
            fcntl.flock(slot.file.fd, fcntl.LOCK_UN)
        return slot

    def commit(self, slot: Slot, version: int) -> None:
        """``slot`` holds ``version`` completely (every rank has written): stamp it, and move
        it to the end of the reuse order."""
        write_stamp(slot.file, version)
        slot.version = version
        self.slots.remove(slot)
        self.slots.append(slot)

    def abort(self, slot: Slot) -> None:
        """The version written into ``slot`` was not committed: the slot is free again."""
        write_stamp(slot.file, WRITING)
        slot.version = None

    def release(self, version: int) -> None:
        """``version`` was retired: its slot may be reused."""
        for slot in self.slots:
            if slot.version == version:
                slot.version = None

    def _unlink_drained(self) -> None:
        """Unlink the replaced slot files that no reader holds any more. The ``LOCK_EX`` is
        held until the file is unlinked: a reader that opens it meanwhile then finds it gone
        (:class:`SlotGoneError`; its version was retired)."""
        for file in list(self._draining):
            if file.fd >= 0:  # (closed: unlinked already)
                try:
                    fcntl.flock(file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
            self._unlink(file)
            self._draining.remove(file)

    @staticmethod
    def _unlink(file: MappedFile) -> None:
        try:
            os.unlink(file.path)
        except FileNotFoundError:
            pass
        file.close()

    def close(self) -> None:
        """Unlink every slot, including replaced ones still held (readers that map one keep
        its pages until they unmap). Idempotent."""
        for file in [slot.file for slot in self.slots] + self._draining:
            self._unlink(file)
        self.slots, self._draining = [], []


def slot_record(slot: Slot, entries) -> dict[str, Any]:
    """What a commit record says about the slot and the tensors' offsets in it."""
    stat = os.fstat(slot.file.fd)
    return {
        "path": slot.path,
        "size": slot.file.size,
        "host": host_id(),
        "inode": [stat.st_dev, stat.st_ino],
        "tensors": {name: offset for name, _, _, offset in entries},
    }


def _check_host(version: int, segment: Mapping[str, Any]) -> None:
    if segment["host"] != host_id():
        raise SegmentUnavailableError(
            f"policy_version={version} was published into shared memory on host "
            f"{segment['host']!r} (weights.same_host=auto: the trainer's ranks share a host), "
            f"but this process runs on {host_id()!r}; set weights.same_host=off when the "
            "trainer and its readers are on different hosts"
        )


def _gone(version: int, segment: Mapping[str, Any]) -> SlotGoneError:
    return SlotGoneError(
        f"policy_version={version}: its shared-memory slot {segment['path']} "
        "is not in this process's /dev/shm: its publisher stopped (the slots go with it), or "
        "this process sees another /dev/shm (a container without --ipc=host); in that case "
        "set weights.same_host=off"
    )


@contextlib.asynccontextmanager
async def lease(version: int, segment: Mapping[str, Any]) -> AsyncIterator[MappedFile]:
    """Hold the slot that holds ``version`` (``segment``: :func:`slot_record`'s output):
    while inside, no writer overwrites it and its file stays linked (its path, handed to
    other processes, stays valid).

    Each lease takes its ``LOCK_SH`` on a descriptor of its own: ``flock`` locks belong to
    an open file description, so leases sharing one (e.g. the descriptor of the cached
    mapping, :func:`~forge_ext.weights.shared_buffer.map_file`) would all be dropped by the
    first one's ``LOCK_UN``. Any number of leases in one process, nested or concurrent, thus
    each keep the writer out until they end (a writer in the same process too: its slot file
    is another open file description).

    Yields:
        The slot's mapping (this process's cached one; views of it stay valid after the
        block, but the writer may then overwrite them).

    Raises:
        SegmentUnavailableError: the slot cannot be mapped from this process (another host,
            see :func:`host_id`; or not a forge_ext slot).
        SlotGoneError: the slot file is gone, or another file has its path now.
        SlotReusedError: the slot no longer holds ``version``.
    """
    _check_host(version, segment)
    path = segment["path"]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _gone(version, segment) from None
    try:
        stat = os.fstat(fd)
        inode = (stat.st_dev, stat.st_ino)
        if list(inode) != list(segment["inode"]):
            raise _gone(version, segment)
        await _flock(fd, fcntl.LOCK_SH, LEASE_TIMEOUT_S, lambda: f"the writer of {path}")
        try:
            mapped = map_file(path, segment["size"])
        except FileNotFoundError:
            raise _gone(version, segment) from None
        if mapped.inode != inode:  # replaced between our open and the lock
            raise _gone(version, segment)
        if int(_stamp_view(mapped)[0]) != MAGIC:
            raise SegmentUnavailableError(f"{path} is not a forge_ext weights slot")
        stamp = read_stamp(mapped)
        if stamp != version:
            raise SlotReusedError(
                f"the slot of policy_version={version} now holds "
                f"{'a version being written' if stamp == WRITING else f'version {stamp}'}"
            )
        yield mapped
    finally:
        os.close(fd)  # drops this lease's lock, and only this one's
