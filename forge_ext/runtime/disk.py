"""Writes of a run's outputs (checkpoints, metric files) that run out of space or hit any
other OSError, reported in one line (issue 26, fault 3).

A full disk used to surface as a dead trainer host and a traceback: DCP raised its
``CheckpointException`` (a ``BaseException``), which ended the trainer's process. Such
failures become an :class:`OutputWriteError` (a ``RuntimeError``: the actor survives and
the caller gets it), whose message is the one line the app prints
(:func:`find_output_write_error` finds it behind a remote call's error). A checkpoint save
is wrapped by :func:`forge_ext.engine.checkpoint.write_checkpoint` with these helpers: it
refuses early when the free space is short of the last complete save, and turns an
``OSError`` during the write into a :class:`CheckpointWriteError`.

Every file a run writes follows the process's umask (rw-r--r-- under umask 022), so that a
colleague on a shared filesystem can load the model: :func:`follow_umask` puts a file written
by a library that creates its files 0600 (safetensors' ``save_file``) back to that mode.
Secrets (the agent endpoint's key, :mod:`forge_ext.rollout.agents`) stay 0600.
"""

from __future__ import annotations

import errno
import os
import shutil


def umask() -> int:
    """The process's umask, read without changing it (Linux: ``/proc/self/status``); else
    set and restored at once (``os.umask`` has no read-only form)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> None:
    """Give the file ``path`` the mode a plain ``open(path, "w")`` would have given it:
    ``0o666 & ~umask``. safetensors 0.8's ``save_file`` writes through a temporary file and
    leaves ``model.safetensors`` 0600 whatever the umask (seen 2026-12-07). A filesystem
    that refuses modes (some network and FAT mounts) keeps its own: the file is written."""
    try:
        os.chmod(path, 0o666 & ~umask())
    except PermissionError:
        pass


class OutputWriteError(RuntimeError):
    """An output of the run could not be written; the message is the one line to show.

    Attributes: ``path`` (what was being written), ``errno`` (None for a refusal before
    writing), ``free_bytes``, ``needed_bytes`` (None when unknown), ``last_complete``
    (path of the newest complete checkpoint, or None)."""

    def __init__(self, message: str, *, path: str, errno: int | None = None,
                 free_bytes: int | None = None, needed_bytes: int | None = None,
                 last_complete: str | None = None) -> None:
        super().__init__(message)
        self.path, self.errno = path, errno
        self.free_bytes, self.needed_bytes, self.last_complete = (
            free_bytes, needed_bytes, last_complete)

    def __reduce__(self):  # picklable with its fields, so it reaches the controller intact
        return (_rebuild, (type(self), str(self), self.path, self.errno, self.free_bytes,
                           self.needed_bytes, self.last_complete))


class CheckpointWriteError(OutputWriteError):
    """A checkpoint could not be written (see
    :func:`forge_ext.engine.checkpoint.write_checkpoint`)."""


def _rebuild(cls, message, path, errno_, free, needed, last):
    return cls(message, path=path, errno=errno_, free_bytes=free, needed_bytes=needed,
               last_complete=last)


def find_output_write_error(error: BaseException) -> OutputWriteError | None:
    """The :class:`OutputWriteError` behind ``error``: itself, its cause or context, or the
    exception a remote call's error carries (Monarch's ``ActorError.exception``)."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OutputWriteError):
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "exception", None)]
    return None


def describe(os_error: OSError) -> str:
    """``ENOSPC (No space left on device)``: the errno's name and its text."""
    if os_error.errno is None:
        return f"{type(os_error).__name__} ({os_error})"
    name = errno.errorcode.get(os_error.errno, str(os_error.errno))
    return f"{name} ({os_error.strerror or os_error})"


def write_failed(what: str, path: str, os_error: OSError) -> OutputWriteError:
    """The one-line error of a write of ``what`` to ``path`` that raised ``os_error``."""
    return OutputWriteError(
        f"writing {what} to {path} failed: {describe(os_error)}; "
        f"{mib(free_bytes(path))} free", path=path, errno=os_error.errno,
        free_bytes=free_bytes(path),
    )


def refuse_if_short(what: str, path: str, needed_bytes: int) -> None:
    """Raise before writing ``what`` (``needed_bytes``, known in advance) to ``path`` when its
    filesystem has measurably less free space.

    Raises:
        OutputWriteError: one line naming what, where, the free and the needed space.
    """
    free = free_bytes(path)
    if free is not None and free < needed_bytes:
        raise OutputWriteError(
            f"not writing {what} to {path}: {mib(free)} free on its filesystem, "
            f"{mib(needed_bytes)} needed; free space or write it to a larger filesystem",
            path=path, free_bytes=free, needed_bytes=needed_bytes,
        )


def free_bytes(path: str) -> int | None:
    """Free bytes for an unprivileged writer on the filesystem that holds (or will hold)
    ``path``; None if it cannot be measured."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError that caused ``error``: itself, one it was raised from, or (DCP) one in a
    ``CheckpointException``'s per-rank failures."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        # DCP's CheckpointException: {rank: (exception, traceback)}; not imported here, so
        # that writers of small files need not import torch.distributed.
        for failure in (getattr(e, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [e.__cause__, e.__context__]
    return None


def mib(n: int | None) -> str:
    """``n`` bytes as ``"12.3 MiB"``; ``"unknown"`` for None."""
    return "unknown" if n is None else f"{n / 2**20:.1f} MiB"
