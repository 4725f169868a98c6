"""Monarch's log of a run, with the run (issue 38).

Monarch 0.7 writes its internal log to ``/tmp/<user>/monarch_log<_suffix>.log``, one file
shared by every run of the user; the folder is fixed (``hyperactor_telemetry``'s
``log_file_path``: ``/tmp/{username}``), only the name follows ``MONARCH_LOG_SUFFIX`` (read by
the controller and inherited by every proc). :func:`start` gives the run a file of its own
there, links it as ``<output_dir>/logs/monarch.log``; :func:`start_monarch` starts Monarch's
context with its one console line ("Monarch internal logs are being written to ...", which
names the default file whatever the suffix) sent to ``<output_dir>/logs/monarch_console.log``;
:func:`finish` replaces the link with the file itself once the run's procs are stopped (an
earlier attempt's copy is kept as ``monarch.previous.log``). The file in ``/tmp`` is left:
this process's Monarch still writes to it (a test session runs the app several times in one
process, each run's copy holding the lines so far).
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
from pathlib import Path

SUFFIX_ENV = "MONARCH_LOG_SUFFIX"


def monarch_log_file(suffix: str) -> Path:
    """Where Monarch 0.7 writes its log for ``MONARCH_LOG_SUFFIX=suffix``."""
    user = pwd.getpwuid(os.geteuid()).pw_name or "monarch"
    return Path("/tmp") / user / (f"monarch_log_{suffix}.log" if suffix else "monarch_log.log")


def start(output_dir: str | os.PathLike) -> Path:
    """Before Monarch starts (no ``this_host()`` yet): a log file of the run's own (unless
    ``MONARCH_LOG_SUFFIX`` is set already), linked from ``<output_dir>/logs/monarch.log``.
    Then :func:`start_monarch`, once Monarch's transport is set.

    Returns:
        ``<output_dir>/logs``.
    """
    logs = Path(output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run = hashlib.sha1(os.path.abspath(output_dir).encode()).hexdigest()[:12]
    suffix = os.environ.setdefault(SUFFIX_ENV, f"run-{run}")
    link = logs / "monarch.log"
    if link.is_symlink():
        link.unlink()
    elif link.exists():  # an earlier attempt's (a resumed run): kept beside
        link.replace(logs / "monarch.previous.log")
    link.symlink_to(monarch_log_file(suffix))
    return logs


def start_monarch(output_dir: str | os.PathLike) -> None:
    """Start Monarch's context in this process (``this_host()``) with its one console line
    ("Monarch internal logs are being written to ...") sent to
    ``<output_dir>/logs/monarch_console.log``. Call it after the hosts are started: the
    ``slurm`` and ``attach`` launchers set Monarch's transport (TCP, which workers dial) before
    any channel opens, and the context opens channels. A no-op if the context runs already.
    """
    logs = Path(output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "monarch_console.log", "a") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            from monarch.actor import this_host

            this_host()  # starts Monarch's context: it prints where its log goes
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def finish(output_dir: str | os.PathLike) -> None:
    """After the run's procs are stopped: ``logs/monarch.log`` becomes a copy of the file
    it linked."""
    link = Path(output_dir) / "logs" / "monarch.log"
    if not link.is_symlink():
        return
    target = Path(os.readlink(link))
    link.unlink()
    if target.is_file():
        shutil.copyfile(target, link)
