"""A run stopped from outside, one handling for every app: Ctrl-C (SIGINT) and SIGTERM (what
``timeout``, ``kill``, Slurm and Kubernetes send before they kill, often to the whole process
group).

A command stopped by a signal exits with the status a shell gives a program that signal
killed: 128 + the signal's number (bash's ``$?`` convention, which ``timeout``, schedulers
and CI runners test): 130 after Ctrl-C, 143 after SIGTERM. The RL loop
(:meth:`forge_ext.rl.loop.RLLoop.run`), :func:`run_until_stopped` (an event loop's command)
and :func:`stop_signals_raise` (a synchronous command's) raise
:class:`Interrupted` naming the signal that asked first; an app prints what was stopped and
exits with :func:`exit_status` of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Iterator
from typing import TypeVar

T = TypeVar("T")

# The signals that ask a run to stop (and let it stop its roles first).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A run stopped by ``signum`` (SIGINT or SIGTERM), after its teardown.

    A KeyboardInterrupt, so that what catches a Ctrl-C catches any stop from outside.

    Attributes:
        signum: the signal that asked first.
    """

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)


def exit_status(stop: BaseException) -> int:
    """The exit status of a command that ``stop`` ended: 128 + its signal (an
    :class:`Interrupted`'s ``signum``; a bare KeyboardInterrupt or asyncio's CancelledError
    is Python's own Ctrl-C: SIGINT). 130 for SIGINT, 143 for SIGTERM."""
    return 128 + getattr(stop, "signum", signal.SIGINT)


async def run_until_stopped(work: Awaitable[T]) -> T:
    """Await ``work`` in the current task with SIGINT and SIGTERM routed to it: the first
    cancels it at once (its ``finally`` blocks run: what it started is stopped), then
    :class:`Interrupted` is raised naming that signal. For a command without an RL loop
    (``apps.eval``); the loop handles its own (it first stops at a step boundary).

    Raises:
        Interrupted: a stop signal arrived.
    """
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    received: list[int] = []

    def stop(signum: int) -> None:
        if not received:
            task.cancel()
        received.append(signum)

    handled = []
    for signum in STOP_SIGNALS:
        try:
            loop.add_signal_handler(signum, stop, signum)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            break
        handled.append(signum)
    try:
        return await work
    except asyncio.CancelledError:
        if not received:
            raise
        task.uncancel()  # the cancellation was ours: it becomes the Interrupted below
        name = signal.Signals(received[0]).name
        raise Interrupted(f"{name}: stopped", received[0]) from None
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """For a synchronous command (``apps.sft``): SIGINT and SIGTERM raise
    :class:`Interrupted` in the main thread where it is, as Python raises KeyboardInterrupt
    for a Ctrl-C (so ``finally`` blocks run; SIGTERM's default would end the process at
    once); the previous handlers are back on leaving."""

    def stop(signum: int, frame: object) -> None:
        raise Interrupted(f"{signal.Signals(signum).name}: stopped", signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
