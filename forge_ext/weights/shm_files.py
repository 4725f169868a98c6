"""Names, free space and orphan removal of forge_ext's shared-memory files (standard library
only, so that ``make clean`` runs it as a file without the project's environment).

Every shared-memory file forge_ext creates (the trainer's weight slots,
:mod:`forge_ext.weights.transports.slots`; the generator's buffer,
:mod:`forge_ext.weights.shared_buffer`) is named
``forge_ext-<tag>-<pid>-<n>-p<pid namespace>`` in ``/dev/shm``: ``pid`` is the creating
process, ``n`` a counter, and the pid namespace (the inode of ``/proc/self/ns/pid``) tells
whose ``pid`` it is. Why the namespace: containers that share ``/dev/shm`` (``docker
--ipc=host``) each have their own pids, so a live writer in another container looks dead from
here; :func:`remove_orphans` only judges files of its own namespace.

Run as a file to remove orphans now (``make clean`` does)::

    python forge_ext/weights/shm_files.py [DIRECTORY]
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import sys

SHM_DIR = "/dev/shm"
PREFIX = "forge_ext"

_counter = itertools.count()
# Names without the namespace suffix were written before it existed: same namespace.
_NAME = re.compile(rf"^{PREFIX}-(?P<tag>[\w.]+)-(?P<pid>\d+)-\d+(?:-p(?P<ns>\d+))?$")
TAG = re.compile(r"[\w.]+")


def pid_namespace() -> str:
    """This process's pid namespace as a number (``/proc/self/ns/pid`` is ``pid:[N]``)."""
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid"))
    except OSError:  # no /proc (not Linux): one namespace
        return "0"


def check_tag(tag: str) -> str:
    """``tag`` if it may be part of a file name (``[\\w.]+``); raises ValueError otherwise."""
    if not TAG.fullmatch(tag):
        raise ValueError(f"tag={tag!r} must be letters, digits, '_' or '.'")
    return tag


def new_name(tag: str) -> str:
    """A fresh file name for a file this process creates, tagged ``tag`` (``[\\w.]+``)."""
    check_tag(tag)
    return f"{PREFIX}-{tag}-{os.getpid()}-{next(_counter)}-p{pid_namespace()}"


def owner_pid(name: str) -> int | None:
    """The pid that created the file ``name`` (a base name), or None if the name is not one
    of forge_ext's or belongs to another pid namespace."""
    match = _NAME.match(name)
    if match is None or (match["ns"] is not None and match["ns"] != pid_namespace()):
        return None
    return int(match["pid"])


def check_free_space(nbytes: int, directory: str, what: str, fix: str) -> None:
    """Raise OSError unless ``directory`` (a tmpfs) has ``nbytes`` free.

    Args:
        what: what needs the bytes (starts the message).
        fix: how to make room (ends the message).
    """
    free = shutil.disk_usage(directory).free
    if nbytes > free:
        raise OSError(
            f"{what} needs {nbytes / 2**20:,.0f} MiB in {directory}, which has "
            f"{free / 2**20:,.0f} MiB free; {fix}"
        )


def remove_orphans(directory: str = SHM_DIR) -> list[str]:
    """Delete forge_ext's files (and folders: a vLLM generator's LoRA adapters) in
    ``directory`` whose creating process no longer exists
    (left by a crash or a ``kill -9``). Files of live processes, of other pid namespaces and
    files that are not forge_ext's are left alone.

    Returns:
        The paths removed.
    """
    removed = []
    for name in os.listdir(directory):
        pid = owner_pid(name)
        if pid is None or pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):  # a generator's LoRA folder
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    for path in remove_orphans(*sys.argv[1:2]):
        print(f"removed {path}")
