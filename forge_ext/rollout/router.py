"""Which generator replica serves a request: the least-loaded one, sticky per session.

The peers' rule (SkyRL's ``sticky_least_loaded``, verl's agent loop: least requests with
sticky sessions): a request of a *session* already routed goes to that session's replica, so
its prefix cache serves the prompt the session's earlier requests computed (an episode's
turns extend one another; a GRPO group's episodes share their prompt); the first request of a
session, or a request without one, goes to the live replica with the least outstanding load.

Load is counted in tokens a request may still cost: its prompt plus ``n`` times the longest
response (``generator.sampling.max_new_tokens``), from when it is sent until it is answered;
ties go to the replica with fewer requests in flight, then the lower index. A session whose
replica died is routed again as a new one. The router remembers the most recent
``max_sessions`` sessions (an episode's turns come within seconds of one another).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class NoReplicaError(RuntimeError):
    """Every replica is gone."""


class Router:
    """Least-loaded routing with sticky sessions over ``replicas`` replicas (module
    docstring). Not thread-safe: one event loop calls it."""

    def __init__(self, replicas: int, max_sessions: int = 65_536) -> None:
        if replicas < 1:
            raise ValueError(f"replicas={replicas} must be >= 1")
        self.tokens = [0] * replicas
        """Outstanding token cost per replica."""
        self.requests = [0] * replicas
        """Requests in flight per replica."""
        self.routed = [0] * replicas
        """Requests sent to each replica so far."""
        self.alive = [True] * replicas
        self._sessions: OrderedDict[Hashable, int] = OrderedDict()
        self._max_sessions = max_sessions

    @property
    def live(self) -> list[int]:
        """Indices of the replicas still serving."""
        return [r for r, alive in enumerate(self.alive) if alive]

    def route(self, session: Hashable | None, cost: int) -> int:
        """The replica for a request of ``cost`` tokens in ``session`` (None: no session);
        its load counts the request until :meth:`done`.

        Raises:
            NoReplicaError: no replica is alive.
        """
        replica = None if session is None else self._sessions.get(session)
        if replica is None or not self.alive[replica]:
            live = self.live
            if not live:
                raise NoReplicaError("no generator replica is alive")
            replica = min(live, key=lambda r: (self.tokens[r], self.requests[r], r))
        if session is not None:
            self._sessions[session] = replica
            self._sessions.move_to_end(session)
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        self.tokens[replica] += cost
        self.requests[replica] += 1
        self.routed[replica] += 1
        return replica

    def done(self, replica: int, cost: int) -> None:
        """The request routed to ``replica`` with ``cost`` was answered (or failed)."""
        self.tokens[replica] -= cost
        self.requests[replica] -= 1

    def remove(self, replica: int) -> None:
        """``replica`` died: no request goes there again; its sessions move on their next
        request."""
        self.alive[replica] = False
