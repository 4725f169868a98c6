"""Watchdog that kills a process's helper processes once that process is gone.

Why: ``vllm.LLM`` starts an engine-core process and worker processes that outlive the process
that started them when it is killed (``SIGKILL``, e.g. an out-of-memory kill, or Monarch
stopping the generator's proc): each vLLM worker holds a copy of the model, so orphans pile
up. The owner starts this script with a pipe on its standard input (:func:`start_reaper`);
the pipe reaches end-of-file when the owner exits for any reason, and the script then kills
the listed processes and removes the listed files.

Run as a file (``python reaper.py``), not as a module: it imports nothing of forge_ext (or
torch), so it starts in milliseconds.

Its owners: the vLLM engine (:class:`forge_ext.rollout.engines.vllm.VLLMEngine`: its engine
and worker processes, its shared-memory files and LoRA folder) and the placement of roles on
worker processes (:mod:`forge_ext.runtime.placement`, ``processes`` launcher): ``--session``
kills every process of a worker's session (the worker and the procs it spawned, which sit in
process groups of their own but keep its session), and ``--rmtree`` removes the job's socket
folder.

Usage: ``python reaper.py [--unlink GLOB ...] [--session PID:CREATE_TIME ...] [--rmtree DIR
...] PID:CREATE_TIME ...`` (``CREATE_TIME`` as ``psutil.Process.create_time()``, so that a
reused pid is never killed; a session is that of the process ``PID`` started).
"""

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

import psutil

GRACE_SECONDS = 5.0


def main(argv: list[str]) -> None:
    unlink, targets, sessions, trees = [], [], [], []
    args = iter(argv)
    for arg in args:
        if arg == "--unlink":
            unlink.append(next(args))
        elif arg == "--rmtree":
            trees.append(next(args))
        elif arg == "--session":
            pid, created = next(args).split(":")
            sessions.append((int(pid), float(created)))
        else:
            pid, created = arg.split(":")
            targets.append((int(pid), float(created)))
    sys.stdin.buffer.read()  # returns at end-of-file: the owner has exited or let go
    processes = []
    for pid, created in targets:
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - created) < 1e-3:
                processes.append(process)
        except psutil.NoSuchProcess:
            pass
    processes += _session_members(sessions)
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=GRACE_SECONDS)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    for pattern in unlink:
        for path in glob.glob(pattern):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    for tree in trees:
        shutil.rmtree(tree, ignore_errors=True)


def _session_members(sessions: list[tuple[int, float]]) -> list:
    """The live processes of each session ``(leader pid, leader create time)``, started no
    earlier than its leader (so a session id reused after the leader's death is spared)."""
    members = []
    for process in psutil.process_iter(["create_time"]):
        try:
            sid = os.getsid(process.pid)
        except OSError:
            continue
        for leader, created in sessions:
            if sid == leader and process.info["create_time"] >= created - 1e-3 and (
                process.pid != os.getpid()
            ):
                members.append(process)
    return members


def start_reaper(pids: Sequence[int] = (), *, unlink: Sequence[str] = (),
                 rmtree: Sequence[str] = (), sessions: Sequence[int] = ()) -> subprocess.Popen:
    """Start this watchdog for ``pids`` (and their children) and the sessions led by
    ``sessions`` (pids): when this process exits (however it exits) or closes the returned
    process's standard input, it kills them and removes the files matching the ``unlink``
    globs and the folders ``rmtree``. A pid already gone is skipped."""
    targets = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for p in [process, *process.children(recursive=True)]:
                targets.append(f"{p.pid}:{p.create_time()}")
        except psutil.NoSuchProcess:
            pass
    args = []
    for pid in sessions:
        try:
            args += ["--session", f"{pid}:{psutil.Process(pid).create_time()}"]
        except psutil.NoSuchProcess:
            pass
    args += [a for pattern in unlink for a in ("--unlink", pattern)]
    args += [a for folder in rmtree for a in ("--rmtree", folder)]
    # A session of its own: a Ctrl-C sent to the terminal's process group does not end it
    # before it has done its work.
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args, *targets], stdin=subprocess.PIPE,
        start_new_session=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
