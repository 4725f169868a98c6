"""One clear error when a role's process or host dies mid-run, instead of Monarch's defaults.

What Monarch 0.7.0 does by default when a proc dies (e.g. ``kill -9``, as the kernel's
out-of-memory killer does): the client's root actor receives one supervision report per actor
of the dead proc (the role's actor, its logger, ...) and calls
``monarch.actor.unhandled_fault_hook``, whose default is ``sys.exit(1)`` delivered to the main
thread as a KeyboardInterrupt (a SIGINT: the RL loop took it for a Ctrl-C), and the awaited
endpoint call fails with a ``SupervisionError`` whose text is the report. A dead *host* (a
worker process, a node) is reported only after about a minute, as "no status received from
process", without the signal. A proc killed while Monarch's poll of its state is in flight
(more likely on a loaded host), or one that hangs, is reported about 30 s later by its
proc's name and rank only ("timeout waiting for message from proc mesh agent"), without the
signal.

:class:`FailureWatch` replaces that for a run: it installs a fault hook that never exits
(:func:`install_fault_hook`), turns the first report of a dead process, a dead ``processes``
worker (:class:`forge_ext.runtime.placement.HostDeath`, at once and with its signal) or a
``SupervisionError`` into one :class:`RoleFailure` naming the role, the rank and host, the
signal and its likely cause, and hands it to the run (``on_failure``), which stops everything
and raises it.

A generator *replica* (``generator.replicas > 1``: actors and proc meshes ``generator<i>``,
:mod:`forge_ext.rollout.replicas`) is not a role: its death costs only its requests in flight,
which the other replicas serve. Its reports go to ``on_replica_death`` instead, so that it is
taken out of service at once (not only when a request to it fails); the run fails only when
none is left. A lone generator (``generator``) is a role like the others.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from collections.abc import Callable, Collection, Mapping
from typing import Any

logger = logging.getLogger(__name__)

# Likely causes of a process's death by signal, for the message.
SIGNAL_CAUSES = {
    signal.SIGKILL: "most often the kernel's out-of-memory killer (see `dmesg` or the node's "
                    "memory), else a `kill -9` or the scheduler",
    signal.SIGTERM: "stopped from outside: the scheduler (preemption, time limit) or a `kill`",
    signal.SIGINT: "interrupted (a Ctrl-C on the host's terminal)",
    signal.SIGSEGV: "a crash in native code (CUDA, NCCL, gloo or a compiled extension)",
    signal.SIGABRT: "an abort in native code (a failed assertion or an uncaught C++ exception;"
                    " the host's log has it)",
    signal.SIGBUS: "a bad memory access, often a full /dev/shm",
}

# "<actor mesh name>{'hosts': 1/2, 'procs': 0/1}" in Monarch's reports; the mesh name is the
# name the actor was spawned under (the role's name) or an internal one ("logger-<id>").
_POINT = re.compile(r"(?P<name>[\w.-]+)\{(?P<coords>[^{}]*)\}")
_COORD = re.compile(r"'(?P<dim>\w+)': (?P<index>\d+)/(?P<size>\d+)")
_KILLED = re.compile(r"Killed\(sig=(?P<sig>\d+)")
_EXITED = re.compile(r"exited with non-zero code (?P<code>-?\d+)")
_NO_STATUS = "no status received from process"
# What Monarch 0.7.0 reports instead when its poll of a proc's state goes unanswered (the proc
# was killed while the query was in flight, or it hangs): no point, no signal, only the proc
# ("<proc mesh name>-<rank><id>@<address>") and the actor mesh it asked about
# ("<actor mesh name>-<id>"), about 30 s later. Seen on the local and processes launchers.
_UNANSWERED = re.compile(
    r"The actor (?P<proc>[\w.-]+?)-(?P<rank>\d+)<\w+>@\S*?,proc_agent and all its descendants "
    r"have failed:\s*timeout waiting for message from proc mesh agent while querying for "
    r"\"(?P<mesh>[\w.-]+)-\w+\""
)
# torchstore 0.1.2 names its storage volume actor "StorageVolumes_<id>" (torchstore/utils.py).
TORCHSTORE_VOLUME = "StorageVolumes"


class RoleFailure(RuntimeError):
    """A role's process or host died; the run was stopped.

    Attributes:
        role: ``trainer``, ``reference``, ``generator`` (or the actor's name when it is none
            of them, e.g. torchstore's volume); roles sharing a dead host are joined by
            " and ".
        rank: the rank of the dead process in its role's proc mesh; None when a whole host
            died.
        where: the host, e.g. ``host 1 of 2 (worker pid 1234)``.
        cause: e.g. ``was killed by SIGKILL (signal 9)``.
        hint: the likely cause.
    """

    def __init__(self, role: str, rank: int | None, where: str, cause: str, hint: str = ""):
        self.role, self.rank, self.where, self.cause, self.hint = role, rank, where, cause, hint
        hint_text = f": {hint}" if hint else ""
        what = f"the {role}'s {where}" if rank is None else f"the {role}'s rank {rank} on {where}"
        super().__init__(f"{what} {cause}{hint_text}")


def describe_exit(*, signum: int | None = None, code: int | None = None) -> tuple[str, str]:
    """``(cause, likely cause)`` of a process that ended by ``signum`` or with exit ``code``."""
    if signum is not None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"was killed by {name} (signal {signum})", SIGNAL_CAUSES.get(signum, "")
    if code is not None:
        return f"exited with code {code}", "its log says why"
    return "stopped answering", "its host died or cannot be reached (node failure, network)"


# The cause of a proc that Monarch's state poll got no answer from while its host is up.
UNANSWERED = (
    "stopped answering",
    "Monarch's poll of its state timed out, so it crashed or hangs while its host is up: its "
    "log says why, and `dmesg` whether the out-of-memory killer ended it",
)


def parse_report(text: str) -> dict[str, Any] | None:
    """The dead actor's mesh name, rank and cause in a Monarch failure report (a
    ``MeshFailure.report()`` or a ``SupervisionError``'s text); None if it names none.

    Returns:
        ``{"name", "proc", "rank", "host", "signum", "code", "no_status", "unanswered"}``:
        ``name`` the actor mesh's, ``proc`` the proc mesh's (None where the report names no
        proc), ``host`` the host's index in the mesh, None when the report does not say (a
        poll that went unanswered names the proc's rank only).
    """
    match = None
    for candidate in _POINT.finditer(text):
        if _COORD.search(candidate.group("coords")):
            match = candidate
            break
    if match is None:
        unanswered = _UNANSWERED.search(text)
        if unanswered is None:
            return None
        return {"name": unanswered.group("mesh"), "proc": unanswered.group("proc"),
                "rank": int(unanswered.group("rank")), "host": None, "signum": None,
                "code": None, "no_status": False, "unanswered": True}
    coords = {
        c.group("dim"): (int(c.group("index")), int(c.group("size")))
        for c in _COORD.finditer(match.group("coords"))
    }
    name = match.group("name").rsplit(" ", 1)[-1]
    killed, exited = _KILLED.search(text), _EXITED.search(text)
    return {
        "name": name,
        "proc": None,
        "rank": rank_of(coords),
        "host": coords.get("hosts", (0, 1))[0],
        "signum": int(killed.group("sig")) if killed else None,
        "code": int(exited.group("code")) if exited else None,
        "no_status": _NO_STATUS in text,
        "unanswered": False,
    }


def cause_of(parsed: Mapping[str, Any]) -> tuple[str, str]:
    """``(cause, likely cause)`` of a :func:`parse_report` result."""
    if parsed["unanswered"]:
        return UNANSWERED
    if parsed["no_status"] and parsed["signum"] is None:
        return describe_exit()
    return describe_exit(signum=parsed["signum"], code=parsed["code"])


def describe_death(text: str) -> tuple[str, str] | None:
    """``(cause, likely cause)`` of the death a Monarch report or ``SupervisionError`` text
    describes (``("was killed by SIGKILL (signal 9)", "most often ...")``); None if the
    text names no dead actor."""
    parsed = parse_report(text)
    return None if parsed is None else cause_of(parsed)


def rank_of(coords: Mapping[str, tuple[int, int]]) -> int:
    """Row-major rank of a point (``{"hosts": (1, 2), "procs": (0, 4)}`` -> 4)."""
    rank = 0
    for index, size in coords.values():
        rank = rank * size + index
    return rank


_watches: list[FailureWatch] = []
_installed = False


def _fault_hook(failure) -> None:
    """Monarch's ``unhandled_fault_hook`` while forge_ext runs: the active watches get the
    report; it never raises (a raising hook is Monarch's ``sys.exit``, see the module
    docstring). Without an active watch (after a run, while its meshes are torn down) the
    report is logged and dropped."""
    try:
        if not _watches:
            logger.debug("after the run: %s", failure.report().splitlines()[0])
        for watch in list(_watches):
            watch.mesh_failure(failure)
    except Exception:  # noqa: BLE001 - a raising hook would end the process
        logger.exception("reading a Monarch failure report failed")


def install_fault_hook() -> None:
    """Replace ``monarch.actor.unhandled_fault_hook`` for the rest of the process (reports
    of a dead proc keep arriving after the run that saw it has ended). Idempotent."""
    global _installed
    import monarch.actor

    if not _installed:
        monarch.actor.unhandled_fault_hook = _fault_hook
        _installed = True


class SpawnedMeshes:
    """The actor meshes this process's Monarch client spawns from the moment this is made:
    ``mesh_name in spawned`` says whether a ``MeshFailure.mesh_name`` is one of them.

    Why: Monarch reports a dead proc once per actor mesh on it, some of them long after
    the death (a dead host about a minute later; a poll that timed out about 30 s later),
    and the report of a mesh names it by its spawn name (``trainer``), which every run
    reuses. A report of an earlier run's proc (the same process running runs one after
    another: tests, a notebook) arriving during the next run was taken for the next run's
    failure (seen in CI: "the reference's rank 0 ... stopped answering" as the next run
    started). ``mesh_name`` is unique per mesh ("trainer-kR84y8PSp2"); Monarch's docs say
    to compare it with existing meshes' names to determine identity.

    How (Monarch 0.7.0, ``monarch/_src/actor/proc_mesh.py`` and ``actor_mesh.py``, private
    API): the client's root instance appends every actor mesh it spawns (the roles' actors,
    Monarch's set-up actor on each proc, torchstore's volume) to its ``_children``, a list
    only ever appended to; the meshes from this object's creation on are those past its
    length then, and a mesh's unique name is ``ActorMesh._name``. Meshes spawned by an actor
    (not the client) and Monarch's per-proc loggers are not among them: their reports count
    for no run (the role's own mesh on that proc is reported too).

    ``in`` may be asked from any thread.
    """

    def __init__(self) -> None:
        client = self._client()  # None before Monarch's client starts: nothing spawned yet
        self._start = 0 if client is None else len(client._children or ())
        self._names: dict[int, str] = {}  # position in _children -> the mesh's unique name

    @staticmethod
    def _client() -> Any:
        """The client's root instance, None until Monarch's client has started (never
        started here: ``context()`` would start it, before the run set Monarch's transport
        and console line, :func:`forge_ext.runtime.run_logs.start_monarch`)."""
        from monarch._src.actor.actor_mesh import _client_context

        context = _client_context.try_get()
        return None if context is None else context.actor_instance

    def __contains__(self, mesh_name: str) -> bool:
        from monarch._src.actor.actor_mesh import ActorMesh

        children = list(getattr(self._client(), "_children", None) or ())
        for position in range(self._start, len(children)):
            child = children[position]
            if position in self._names or not isinstance(child, ActorMesh):
                continue
            try:  # resolved once the spawn has been sent; a failed spawn may never resolve
                self._names[position] = child._name.get(timeout=2.0)
            except Exception:  # noqa: BLE001 - not (yet) named: not the mesh reported
                continue
        return mesh_name in self._names.values()


class FailureWatch:
    """Turns reports of dead processes and hosts into one :class:`RoleFailure` for a run.

    Args:
        roles: the role of each actor mesh name the run spawns (``{"trainer": "trainer",
            ...}``); reports of other actors (Monarch's loggers, torchstore) are matched to
            a role by the host they ran on when possible.
        describe_host: ``(role, host index) -> text`` (:meth:`Placement.describe_host`).
        on_failure: called on the event loop's thread with the first failure.
        groups: ``{host group: its roles}``; a dead host is reported by all of its roles.
        procs_per_host: each role's procs per host, to find the host of a rank where a
            report names the rank only (default 1).
        replicas: actor (and proc mesh) names of generator replicas (module docstring): a
            report of one is not the run's failure, it is handed to ``on_replica_death(name,
            cause, likely cause)`` on the event loop's thread, once per replica.
        spawned: ``mesh_name -> bool``, whether a reported mesh is one of the run's (a
            report of another is dropped); default: a :class:`SpawnedMeshes` made on
            entering, i.e. the meshes spawned from then on. Pass one (``lambda name: True``)
            only to feed the watch reports by hand.

    Use as ``with FailureWatch(...) as watch:`` inside the running loop, before the run
    spawns anything.
    """

    def __init__(
        self, roles: Mapping[str, str], describe_host: Callable[[str, int], str],
        on_failure: Callable[[RoleFailure], None],
        groups: Mapping[str, list[str]] | None = None,
        procs_per_host: Mapping[str, int] | None = None,
        replicas: Collection[str] = (),
        on_replica_death: Callable[[str, str, str], None] | None = None,
        spawned: Callable[[str], bool] | None = None,
    ) -> None:
        self.roles = dict(roles)
        self.spawned = spawned
        self.replicas = set(replicas)
        self.on_replica_death = on_replica_death
        self.dead_replicas: set[str] = set()
        self.describe_host = describe_host
        self.on_failure = on_failure
        self.groups = dict(groups or {})
        self.procs_per_host = dict(procs_per_host or {})
        self.failure: RoleFailure | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> FailureWatch:
        install_fault_hook()
        self.loop = asyncio.get_running_loop()
        if self.spawned is None:
            self.spawned = SpawnedMeshes().__contains__
        _watches.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self in _watches:
            _watches.remove(self)

    # ---- reports (any thread) ------------------------------------------------------------
    def mesh_failure(self, failure) -> None:
        """A Monarch supervision report (the fault hook). Only reports of the roles' own
        actors (and torchstore's volume) count: the helper actors of a dead proc (its
        logger, Monarch's SPMD set-up actor) are reported too but name no role. Reports of
        a replica (its actor, or a helper actor on its proc) go to ``on_replica_death``.
        Reports of a mesh the run did not spawn (``spawned``: an earlier run's) are
        dropped."""
        if self.spawned is not None and not self.spawned(failure.mesh_name):
            logger.debug("not this run's: %s", failure.report().splitlines()[0])
            return
        if self._replica_report(failure.report()):
            return
        found = self.explain_text(failure.report(), roles_only=True)
        if found is not None:
            self._report(found)
        else:
            logger.debug("Monarch reported: %s", failure.report().splitlines()[0])

    def host_death(self, death) -> None:
        """A ``processes`` worker ended (:class:`forge_ext.runtime.placement.HostDeath`)."""
        roles = self.groups.get(death.group, [death.group])
        signum = -death.returncode if death.returncode < 0 else None
        cause, hint = describe_exit(signum=signum, code=None if signum else death.returncode)
        self._report(RoleFailure(
            " and ".join(roles), None, self.describe_host(roles[0], death.host), cause, hint
        ))

    def explain(self, error: BaseException) -> RoleFailure | None:
        """The :class:`RoleFailure` behind an endpoint call's error: the failure already
        reported, or one read from a ``SupervisionError``'s text; None for other errors."""
        if self.failure is not None:
            return self.failure
        if type(error).__name__ == "SupervisionError":
            return self.explain_text(str(error))
        return None

    def explain_text(self, text: str, roles_only: bool = False) -> RoleFailure | None:
        """The :class:`RoleFailure` a report describes; with ``roles_only`` None unless it
        names a role's actor or torchstore's storage volume."""
        parsed = parse_report(text)
        if parsed is None:
            return None
        name = parsed["name"]
        if name not in self.roles and parsed["proc"] in self.roles:
            # An unanswered poll of a helper actor (its logger, Monarch's set-up actor) on a
            # role's proc: proc meshes are named after their role too (Placement.spawn_procs).
            name = parsed["proc"]
        if name.startswith(TORCHSTORE_VOLUME):
            name = "torchstore"
        elif roles_only and name not in self.roles:
            return None
        role = self.roles.get(name, name)
        rank, host = parsed["rank"], parsed["host"]
        if host is None:
            host = rank // self.procs_per_host.get(role, 1)
        return RoleFailure(role, rank, self.describe_host(role, host), *cause_of(parsed))

    def _replica_report(self, text: str) -> bool:
        """Hand a report of a replica's death to ``on_replica_death``; whether it was one."""
        parsed = parse_report(text)
        if parsed is None:
            return False
        name = next((n for n in (parsed["name"], parsed["proc"]) if n in self.replicas), None)
        if name is None:
            return False
        if name in self.dead_replicas or self.loop is None or self.on_replica_death is None:
            return True
        self.dead_replicas.add(name)
        try:
            self.loop.call_soon_threadsafe(self.on_replica_death, name, *cause_of(parsed))
        except RuntimeError:  # the loop has closed: the run is over
            pass
        return True

    def _report(self, failure: RoleFailure) -> None:
        if self.failure is not None or self.loop is None:
            return
        self.failure = failure

        def deliver() -> None:
            self.on_failure(failure)

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop has closed: the run is over
            pass


def watch_run(run: Any, placement: Any, replicas: Collection[str] = (),
              on_replica_death: Callable[[str, str, str], None] | None = None
              ) -> FailureWatch:
    """Start a :class:`FailureWatch` for ``run`` (an :class:`forge_ext.rl.loop.RLLoop` during
    its ``setup``) over the roles of ``placement`` (:class:`forge_ext.runtime.placement.Placement`):
    a dead process or host of any role calls ``run.fail`` with its :class:`RoleFailure`; a
    dead one of ``replicas`` calls ``on_replica_death`` (:class:`FailureWatch`).
    The watch ends at the very end of the run's teardown (``run.track``), after every role
    was stopped. Call before anything is spawned.
    """
    roles = list(placement.layout)
    groups: dict[str, list[str]] = {}
    for role in roles:
        groups.setdefault(placement.group_of(role), []).append(role)
    watch = FailureWatch(
        {r: r for r in roles}, placement.describe_host, run.fail, groups=groups,
        procs_per_host={r: placement.procs_per_host(r) for r in roles},
        replicas=replicas, on_replica_death=on_replica_death,
    ).__enter__()

    async def stop_watch() -> None:
        watch.__exit__()

    run.track("failure watch", stop_watch)
    placement.on_host_death = watch.host_death
    return watch


def shutdown_monarch(host_timeout_s: float = 0.5, timeout_s: float = 60.0) -> float | None:
    """Shut down this process's Monarch client (``monarch.actor.shutdown_context``, the
    supported call for a controller that has finished with Monarch) and wait for it; returns
    the seconds it took, None if Monarch was never imported (nothing to shut down).

    Why: Monarch's own ``atexit`` hook gives the shutdown one second
    (``shutdown_context(host_timeout=0.3).get(timeout=1.0)`` in
    ``monarch/_src/actor/actor_mesh.py``), and on a loaded machine it took longer:
    interpreter exit printed a ``TimeoutError`` traceback after a successful run or test
    session. Once this has run, that hook finds the shutdown claimed and returns at once.
    The client cannot be restarted afterwards: call it last, with every mesh stopped.

    Args:
        host_timeout_s: bounds each of the shutdown's two final gateway flushes (host, then
            root client), which wait that long when the peer has already gone, as
            torchstore's stopped controller has: measured here, the whole shutdown took
            10.4 s with Monarch's default (10 s), 2.1 s with 1 s.
        timeout_s: how long to wait for the shutdown as a whole.
    """
    import sys
    import time

    if "monarch.actor" not in sys.modules:
        return None
    from monarch.actor import shutdown_context

    start = time.perf_counter()
    try:
        shutdown_context(host_timeout=host_timeout_s).get(timeout=timeout_s)
    except TimeoutError:
        print(f"warning: Monarch's client did not shut down within {timeout_s:.0f} s",
              file=sys.stderr)
    return time.perf_counter() - start
