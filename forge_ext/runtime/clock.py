"""How long a role or an engine worked: :class:`BusyClock`, seconds with at least one call
running, overlapping calls counted once. The RL loop times its roles with it
(:meth:`forge_ext.rl.loop.RLLoop.busy`), a sampling engine its requests
(:class:`forge_ext.rollout.engines.base.Engine`); an interval's idle time is its length minus
the growth of :meth:`BusyClock.total`."""

from __future__ import annotations

import time


class BusyClock:
    """Seconds with at least one call running, overlapping calls counted once.

    ``with clock: ...`` marks a call (a role's step, an engine's request); calls may nest or
    overlap (concurrent tasks), and the clock runs from the first one's start to the last
    one's end. Times are :func:`time.perf_counter` seconds.
    """

    def __init__(self) -> None:
        self._open = 0
        self._since = 0.0
        self._closed = 0.0

    def __enter__(self) -> BusyClock:
        if self._open == 0:
            self._since = time.perf_counter()
        self._open += 1
        return self

    def __exit__(self, *_: object) -> None:
        self._open -= 1
        if self._open == 0:
            self._closed += time.perf_counter() - self._since

    @property
    def running(self) -> int:
        """The calls running now."""
        return self._open

    def total(self) -> float:
        """Busy seconds so far, the calls still running included."""
        return self._closed + (time.perf_counter() - self._since if self._open else 0.0)
