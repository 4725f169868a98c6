"""Monarch's log, the roles' own logs and the console of a run, with the run (issues 38, 50).

The app's console (what it printed on screen: its plan, the step lines, the closing summary
"warm-start X% | after GRPO Y%", a final error) is kept in ``<output_dir>/logs/console.log``
(:func:`keep_console`).

Each role's process (trainer, reference, critic and reward-model ranks, generator replicas)
writes its Python logging at INFO (torchtitan's lines, forge_ext's; vLLM's logger keeps its
own console handler) to ``<output_dir>/logs/<role>-<rank>.log`` (:func:`log_role`); the
console gets WARNING and above, as before. :func:`start` names the folder for the procs (``FORGE_EXT_LOG_DIR``, inherited,
or passed with a launcher's environment to procs on other hosts).

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

import contextlib
import hashlib
import logging
import os
import pwd
import shutil
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

SUFFIX_ENV = "MONARCH_LOG_SUFFIX"
LOG_DIR_ENV = "FORGE_EXT_LOG_DIR"
"""The folder of the roles' log files (``<output_dir>/logs``), set by :func:`start`."""


CONSOLE_LOG = "console.log"
"""The app's console transcript in ``<output_dir>/logs`` (:func:`keep_console`)."""


class _Tee:
    """A text stream that writes to the console stream it replaces and to the log file; the
    rest (``isatty``, ``fileno``, ``encoding``) is the console's, so a progress bar and
    colour choices stay what they were. A progress bar's redraws (writes that begin with a
    carriage return) are left out of the file: the lines written between them stay."""

    def __init__(self, console: TextIO, log: TextIO) -> None:
        self._console, self._log = console, log

    def write(self, text: str) -> int:
        if not text.startswith("\r"):
            try:
                self._log.write(text)
            except (OSError, ValueError):  # a full disk or a closed file: the screen goes on
                pass
        return self._console.write(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._log.flush()
        self._console.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._console, name)


@contextlib.contextmanager
def keep_console(output_dir: str | os.PathLike) -> Iterator[Path]:
    """Within: what this process writes to ``sys.stdout`` and ``sys.stderr`` goes to the
    screen and to ``<output_dir>/logs/console.log`` (appended: a resumed run adds to it);
    on leaving with an error, what the interpreter will print for it too (``sys.exit``'s
    message, or the traceback). The roles' processes write their own files
    (:func:`log_role`).

    Yields:
        The log file's path.
    """
    path = Path(output_dir) / "logs" / CONSOLE_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = sys.stdout, sys.stderr
    with open(path, "a", encoding="utf-8", errors="replace", buffering=1) as log:
        sys.stdout, sys.stderr = _Tee(saved[0], log), _Tee(saved[1], log)
        try:
            yield path
        except SystemExit as done:
            if isinstance(done.code, str):  # printed by the interpreter on the way out
                log.write(done.code + "\n")
            raise
        except BaseException as error:
            log.write("".join(traceback.format_exception(error)))
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = saved


def monarch_log_file(suffix: str) -> Path:
    """Where Monarch 0.7 writes its log for ``MONARCH_LOG_SUFFIX=suffix``."""
    user = pwd.getpwuid(os.geteuid()).pw_name or "monarch"
    return Path("/tmp") / user / (f"monarch_log_{suffix}.log" if suffix else "monarch_log.log")


def start(output_dir: str | os.PathLike) -> Path:
    """Before Monarch starts (no ``this_host()`` yet): a log file of the run's own (unless
    ``MONARCH_LOG_SUFFIX`` is set already), linked from ``<output_dir>/logs/monarch.log``.
    Then :func:`start_monarch`, once Monarch's transport is set. Also sets
    ``FORGE_EXT_LOG_DIR`` for the procs spawned after it (:func:`log_role`).

    Returns:
        ``<output_dir>/logs``.
    """
    logs = Path(output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    os.environ[LOG_DIR_ENV] = str(logs.resolve())  # the roles' files (log_role)
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
    it linked; ``FORGE_EXT_LOG_DIR`` is unset."""
    if os.environ.get(LOG_DIR_ENV) == str((Path(output_dir) / "logs").resolve()):
        del os.environ[LOG_DIR_ENV]  # roles spawned after the run log elsewhere, or not
    link = Path(output_dir) / "logs" / "monarch.log"
    if not link.is_symlink():
        return
    target = Path(os.readlink(link))
    link.unlink()
    if target.is_file():
        shutil.copyfile(target, link)


def log_role(name: str, rank: int) -> Path | None:
    """In a role's process, at its setup: Python logging at INFO and above to
    ``<FORGE_EXT_LOG_DIR>/<name>-<rank>.log`` (appended: a resumed run adds to it), WARNING
    and above to the console (stderr). Without ``FORGE_EXT_LOG_DIR`` (a role spawned outside
    an app) only the console part: WARNING and above.

    Monarch starts procs with the root logger at INFO, and the first module-level
    ``logging.info()`` gives it ``basicConfig``'s stderr handler: torchtitan's INFO lines
    (three per checkpoint save) then reached the console from every rank.

    Returns:
        The log file, or None.
    """
    root = logging.getLogger()
    streams = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
               and not isinstance(h, logging.FileHandler)]
    if not streams:  # what basicConfig would add, at WARNING
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
        root.addHandler(console)
        streams = [console]
    for handler in streams:
        handler.setLevel(max(handler.level, logging.WARNING))
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        root.setLevel(logging.WARNING)
        return None
    path = Path(folder) / f"{name}-{rank}.log"
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path
               for h in root.handlers):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(path)
        except OSError as e:  # a log file is not worth the run
            logging.getLogger(__name__).warning("no log file for %s: %s", name, e)
            root.setLevel(logging.WARNING)
            return None
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path


def startup_phases(infos: list[dict]) -> dict[str, float]:
    """``{"setup": s}`` of a role: the slowest rank's setup (model and engine built,
    checkpoint or weights loaded), from the setup replies' ``"setup_seconds"``; empty if none
    has it. The rest of a role's start-up, as the controller times it, is its processes'
    start and imports (torch, torchtitan, vLLM)."""
    times = [info["setup_seconds"] for info in infos
             if isinstance(info, dict) and "setup_seconds" in info]
    return {"setup": max(times)} if times else {}
