"""A run's roles as a declarative list: each :class:`RoleSpec` says how a role is spawned and
in which environment; :meth:`Roles.start` spawns them (at once where they may, one at a time
where a role's environment must be set in this process), times each part of the start-up,
and stops them all at once at the end.

The start-up lines (:meth:`Roles.startup_lines`, issue 38) say what the start-up spent: the
parts timed with :meth:`Roles.timed` (the hosts, torchstore), then each role's time from the
call that spawns its procs to its actor ready, split into its processes' start and imports
and its own setup (model built and loaded, engine started) where the role reports the
latter, and last the whole start-up::

    start-up: hosts 0.1s
    start-up: trainer 21.4s (processes and imports 14.2s, setup 7.2s)
    start-up: all roles ready 25.0s after setup began
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from forge_ext.config import scoped_env


def trainer_meshes(handle: Any) -> list[Any]:
    """The proc meshes of a role that runs on one trainer (``handle.procs``, or its
    ``handle.trainer``'s: the reference, the critic, a reward model)."""
    return [getattr(handle, "trainer", handle).procs]


def trainer_setup_seconds(handle: Any) -> float | None:
    """The slowest rank's setup seconds of a role on one trainer (its ``startup``'s
    ``"setup"``), None if not reported."""
    return getattr(handle, "trainer", handle).startup.get("setup")


@dataclass(kw_only=True)
class RoleSpec:
    """One role of a run: how it is spawned, and what the run reads of it once it is up."""

    name: str
    """Its name in the start-up lines (its proc mesh's name)."""
    spawn: Callable[[], Awaitable[Any]]
    """Spawns the role's procs and actor and returns its handle, which has an async
    ``stop()``."""
    env: Mapping[str, Any] = field(default_factory=dict)
    """Environment variables set in this process while ``spawn`` runs (procs started on this
    machine read the environment when they start): a role with any is spawned alone, after
    the roles without."""
    label: str | None = None
    """Its name in messages and the port listing (default ``name``)."""
    ready: Callable[[Any], None] | None = None
    """Called with the handle once the role is up (the app keeps it, attaches it)."""
    meshes: Callable[[Any], list[Any]] = trainer_meshes
    """The handle's proc meshes (for the ports it listens on)."""
    setup_seconds: Callable[[Any], float | None] = trainer_setup_seconds
    """The handle's own setup seconds (the rest of its start-up is its processes' start and
    imports), None if it does not report them."""


class Roles:
    """The spawned roles of a run, by name, with the seconds each part of the start-up took.

    Attributes:
        handles: ``{name: handle}`` of the roles spawned so far.
        startup: ``{part: seconds}`` of the timed parts and the spawned roles.
    """

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.handles: dict[str, Any] = {}
        self.startup: dict[str, float] = {}
        self._specs: dict[str, RoleSpec] = {}
        self._timed: list[str] = []

    async def timed(self, part: str, work: Awaitable[Any]) -> Any:
        """Await ``work`` and record its seconds as ``part`` of the start-up."""
        start = time.perf_counter()
        result = await work
        self.startup[part] = time.perf_counter() - start
        self._timed.append(part)
        return result

    async def start(self, specs: Sequence[RoleSpec]) -> None:
        """Spawn ``specs``: those without an environment of their own at once, then each of
        the others alone with its ``env`` set in this process.

        Raises:
            the first spawn's error, once every concurrent spawn has ended (the roles
            spawned so far are in :attr:`handles`, for :meth:`stop`).
        """
        self._specs.update((spec.name, spec) for spec in specs)
        results = await asyncio.gather(*(self._spawn(s) for s in specs if not s.env),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for spec in specs:
            if spec.env:
                with scoped_env(spec.env):
                    await self._spawn(spec)

    async def _spawn(self, spec: RoleSpec) -> None:
        start = time.perf_counter()
        handle = await spec.spawn()
        self.handles[spec.name] = handle
        if spec.ready is not None:
            spec.ready(handle)
        self.startup[spec.name] = time.perf_counter() - start

    def label(self, name: str) -> str:
        """The role's name in messages (:attr:`RoleSpec.label`)."""
        return self._specs[name].label or name

    async def stop(self, write: Callable[[str], None]) -> None:
        """Stop every spawned role at once (they do not depend on each other); a stop that
        fails is one line through ``write`` naming the role, and the others go on."""
        results = await asyncio.gather(*(h.stop() for h in self.handles.values()),
                                       return_exceptions=True)
        for name, result in zip(self.handles, results):
            if isinstance(result, BaseException):
                write(f"stopping the {self.label(name)} failed: {result!r}")

    def meshes(self, first: Sequence[str] = ()) -> dict[str, list[Any]]:
        """``{label: [proc mesh, ...]}`` of the spawned roles, those named in ``first``
        first (in spec order otherwise)."""
        spawned = [name for name in self._specs if name in self.handles]
        names = sorted(spawned, key=lambda name: name not in first)  # stable: spec order
        return {self.label(n): self._specs[n].meshes(self.handles[n]) for n in names}

    def startup_lines(self) -> list[str]:
        """What the start-up spent, one line per part (module docstring)."""
        lines = []
        spawned = [name for name in self._specs if name in self.startup]
        for part in (*self._timed, *spawned):
            total = self.startup[part]
            setup = (self._specs[part].setup_seconds(self.handles[part])
                     if part in self._specs else None)
            lines.append(f"start-up: {part} {total:.1f}s" + (
                f" (processes and imports {max(total - setup, 0.0):.1f}s, setup {setup:.1f}s)"
                if setup else ""))
        lines.append(f"start-up: all roles ready {time.perf_counter() - self.began:.1f}s "
                     "after setup began")
        return lines
