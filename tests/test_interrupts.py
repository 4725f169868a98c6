"""A stop from outside, one handling for every app (:mod:`forge_ext.runtime.interrupts`): a
Ctrl-C (SIGINT) or a SIGTERM (``timeout``, ``kill``, a scheduler) stops what runs, its
``finally`` blocks run, and the command exits 128 + the signal's number, as a shell reports a
program that signal ended: 130 and 143. Real signals to this process. The RL loop's own
handling is tested in tests/test_loop.py, the GRPO command's in tests/test_quiet_output.py."""

import asyncio
import os
import signal
import time

import pytest

from forge_ext.runtime.interrupts import (
    Interrupted,
    exit_status,
    run_until_stopped,
    stop_signals_raise,
)


def test_a_bare_ctrl_c_exits_130():
    assert exit_status(KeyboardInterrupt()) == exit_status(asyncio.CancelledError()) == 130


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_event_loops_command_is_cancelled_at_once_and_exits_with_the_signal(signum, status):
    stopped = []

    async def work():
        try:
            os.kill(os.getpid(), signum)
            await asyncio.sleep(3600)
        finally:
            stopped.append(True)  # what it started is stopped

    with pytest.raises(Interrupted) as stop:
        asyncio.run(run_until_stopped(work()))
    assert (stopped, stop.value.signum, exit_status(stop.value)) == ([True], signum, status)
    # The handlers were removed: SIGINT is Python's own again.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_synchronous_command_stops_where_it_is_and_exits_with_the_signal(signum, status):
    stopped = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stop:
        with stop_signals_raise():
            try:
                os.kill(os.getpid(), signum)
                time.sleep(10)
            finally:
                stopped.append(True)
    assert (stopped, exit_status(stop.value)) == ([True], status)
    assert signal.getsignal(signal.SIGTERM) is before
