"""Where each role's processes run: :class:`Placement` starts the Monarch host meshes the
YAML ``hosts:`` section chooses (:class:`forge_ext.runtime.hosts.HostsConfig`, its launchers
and groups described there), spawns each role's procs on them, and stops what it started.

Environment: on ``local`` the procs inherit the controller's environment (and the app's
``procs.<role>.env``). On the other launchers procs start from their worker's environment,
and :meth:`Placement.spawn_procs` applies the role's ``env`` in each proc before any actor
runs (:func:`forge_ext.config.apply_env`). Variables that a process reads when it starts
(``CUDA_VISIBLE_DEVICES`` for roles that share a node) are set that way before the role's
actors touch CUDA.

No orphans: :meth:`Placement.stop` kills the job (``job.kill()``: every worker and every proc
it spawned; ``slurm``: ``scancel``). ProcessJob workers run in sessions of their own and
outlive a controller killed with SIGKILL, so a watchdog (:mod:`forge_ext.runtime.reaper`,
holding a pipe from the controller) kills their sessions when the controller dies in any way.
Monarch 0.7's workers keep their procs when the controller is gone (seen on Slurm), so a Slurm
job cancels itself once the controller's heartbeat file has not changed for
``slurm.heartbeat_timeout_s`` (:mod:`forge_ext.compat.monarch_slurm`); attached workers are
the user's to stop (docs/hosts.md).

Exposure: Monarch 0.7's workers accept any connection and run the code they are sent
(``ca="trust_all_connections"`` is the only value it takes). So ``local`` and ``processes``
listen on loopback and Unix sockets only; a Slurm run's workers listen on their node's
address (not every interface) on a port drawn for the run; and the run prints every port it
opened beyond loopback once, at its start (:meth:`Placement.exposed_ports`).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from forge_ext.runtime.hosts import ROLES, SLURM_PORTS, HostsConfig
from forge_ext.runtime.reaper import start_reaper

logger = logging.getLogger(__name__)


def _is_loopback(address: str) -> bool:
    """Whether a worker address (``[proc id@]tcp://host:port``) is on this machine's
    loopback interface."""
    host = address.split("@")[-1].split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _set_env(env: Mapping[str, str]) -> None:
    """Proc bootstrap: ``env`` into this proc's environment (and torch's thread count)."""
    from forge_ext.config import apply_env

    apply_env(env)


@dataclass(frozen=True, slots=True)
class HostDeath:
    """A host's worker process ended while the run used it (``processes`` launcher)."""

    group: str
    host: int
    pid: int
    returncode: int


class PlacementError(RuntimeError):
    """The hosts could not be started (a Slurm job that did not start, a controller address
    workers cannot reach); the message names the config field and the fix."""


class Placement:
    """The host meshes of a run's roles, from :class:`HostsConfig` (module docstring).

    Usage (controller)::

        placement = Placement(config.hosts, {"trainer": 2, "generator": 1})  # validates
        await placement.start()            # the job's workers (nothing for `local`)
        procs = placement.spawn_procs("trainer", env={...})
        ...
        placement.stop()                   # kills every worker and proc of the job

    Args:
        config: the ``hosts:`` section.
        processes: ``{role: process count}`` of the roles this run spawns.
        on_host_death: called (from a watcher thread) when a ``processes`` worker exits
            before :meth:`stop`; the run's failure watch turns it into one error.
        output_dir: the run's output folder (``slurm``: the default ``hosts.slurm.log_dir``
            is its ``slurm`` subfolder).

    Raises:
        ValueError: from :meth:`HostsConfig.layout`, before anything starts.
    """

    def __init__(
        self, config: HostsConfig, processes: Mapping[str, int],
        on_host_death: Callable[[HostDeath], None] | None = None,
        output_dir: str | None = None,
    ) -> None:
        self.config = config
        self.layout = config.layout(processes)
        self.on_host_death = on_host_death
        self.output_dir = output_dir
        self.job = None
        self.reaper: subprocess.Popen | None = None
        self.heartbeat: _Heartbeat | None = None
        self.meshes: dict[str, Any] = {}
        self.stopping = False

    @property
    def launcher(self) -> str:
        return self.config.launcher

    @property
    def groups(self) -> dict[str, int]:
        """``{group: hosts}`` in role order (the order Slurm nodes are handed out)."""
        return {self.config.group_of(role): hosts for role, (hosts, _) in self.layout.items()}

    def group_of(self, role: str) -> str:
        return self.config.group_of(role) if role in ROLES else role

    @property
    def master_addr(self) -> str | None:
        """``MASTER_ADDR`` of the roles' torch.distributed worlds: 127.0.0.1 where every host
        is this machine (``local``, ``processes``), so that their stores and gloo listen on
        loopback only; None elsewhere (the first proc's host name)."""
        return "127.0.0.1" if self.launcher in ("local", "processes") else None

    @property
    def owns_workers(self) -> bool:
        """Whether :meth:`stop` kills the workers and all their procs (``processes``,
        ``slurm``), rather than leaving the roles' proc meshes to their handles."""
        return self.job is not None

    async def start(self) -> None:
        """Start (``processes``, ``slurm``) or reach (``attach``) the hosts; ``local`` needs
        nothing. Call in the controller before any other Monarch use (``slurm`` and
        ``attach`` switch the controller to TCP, which workers on other machines dial).

        ``slurm`` waits for the job on the event loop: a Ctrl-C or SIGTERM (or any
        cancellation) during the wait cancels the job.

        Raises:
            PlacementError: the Slurm job did not start within
                ``hosts.slurm.start_timeout_s`` (it was cancelled), or the controller's host
                name resolves only to loopback and ``hosts.transport`` is not set.
        """
        launcher = self.launcher
        if launcher == "local" or self.meshes:
            self._start_monarch()
            return
        if launcher == "attach":
            from monarch.actor import attach_to_workers
            from monarch.config import configure

            # Workers dial the controller back: over TCP at its host name, or at 127.0.0.1
            # when every worker is on this machine (a loopback-only host name has no other
            # address, and Monarch refuses it for TcpWithHostname); hosts.transport decides.
            loopback = all(
                _is_loopback(a) for group in self.groups for a in self.config.attach[group]
            )
            configure(default_transport=self._transport("localhost" if loopback else "hostname"))
            self.meshes = {
                group: attach_to_workers(
                    name=group, ca="trust_all_connections", workers=self.config.attach[group]
                )
                for group in self.groups
            }
            self._start_monarch()
            return
        # Monarch's job modules log each step at INFO on the console ("Applying current
        # job", "ProcessJob: spawned worker ..."); the run prints its own summary line. (They
        # set their level when imported: import first.)
        import monarch.job  # noqa: F401

        for name in ("monarch._src.job.job", "monarch._src.job.process",
                     "monarch._src.job.slurm"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            if launcher == "processes":
                self.job = _WatchedProcessJob(self.groups, on_exit=self._worker_exited)
            else:
                await self._start_slurm_job()
            state = self.job.state(cached_path=None)
            self.meshes = {group: getattr(state, group) for group in self.groups}
            if launcher == "processes":
                # Its workers run in sessions of their own: killed with the controller.
                self.reaper = start_reaper(
                    sessions=[worker.pid for worker in self.job._host_to_pid.values()],
                    rmtree=[self.job._tmpdir] if self.job._tmpdir else [])
        except BaseException:
            self.stop()
            raise
        self._start_monarch()

    def _start_monarch(self) -> None:
        """This process's Monarch context, once the transport is set (``slurm`` and
        ``attach`` set it above, before any channel opens; the context opens channels), its
        console line in ``<output_dir>/logs`` (:func:`forge_ext.runtime.run_logs.start_monarch`)."""
        if self.output_dir is not None:
            from forge_ext.runtime import run_logs

            run_logs.start_monarch(self.output_dir)

    def _transport(self, default: str):
        """Monarch's ``default_transport`` from ``hosts.transport`` (or ``default``).

        Raises:
            PlacementError: ``hostname`` where this machine's host name resolves only to
                loopback (Monarch would panic: "hostname resolved to no non-loopback,
                non-link-local address").
        """
        from monarch.actor import ChannelTransport

        transport = self.config.transport or default
        if transport == "hostname":
            name, addresses = socket.gethostname(), _host_name_addresses()
            if not any(_reachable(a) for a in addresses):
                others = [a for a in _interface_addresses() if _reachable(a)]
                example = f"tcp://{others[0]}:0" if others else "tcp://<its cluster address>:0"
                raise PlacementError(
                    f"this machine's host name {name!r} resolves only to "
                    f"{', '.join(addresses) or 'nothing'}, which workers on other nodes cannot "
                    f"dial: set hosts.transport={example} (this machine's address on the "
                    "cluster network), or hosts.transport=localhost when every worker is on "
                    "this machine")
            return ChannelTransport.TcpWithHostname
        if transport == "localhost":
            return ChannelTransport.TcpWithLocalhost
        return transport

    async def _start_slurm_job(self) -> None:
        """Submit the job (one node per host of every group), start the heartbeat and wait
        until it runs (module docstring of :mod:`forge_ext.compat.monarch_slurm`)."""
        from monarch.config import configure

        from forge_ext.compat.monarch_slurm import JobNotStarted, SlurmJob

        s = self.config.slurm
        transport = self._transport("hostname")  # before anything is submitted
        log_dir = os.path.abspath(s.log_dir or os.path.join(self.output_dir or ".", "slurm"))
        os.makedirs(log_dir, exist_ok=True)
        if s.heartbeat_timeout_s > 0:
            self.heartbeat = _Heartbeat(
                os.path.join(log_dir, f"heartbeat-{os.getpid()}-{secrets.token_hex(4)}"),
                s.heartbeat_timeout_s)
        self.job = SlurmJob(
            dict(self.groups), python_exe=s.python_exe or sys.executable,
            slurm_args=list(s.sbatch_args),
            monarch_port=s.port if s.port is not None else secrets.choice(SLURM_PORTS),
            job_name=s.job_name, time_limit=s.time, partition=s.partition, log_dir=log_dir,
            exclusive=s.exclusive, gpus_per_node=s.gpus_per_host, account=s.account, qos=s.qos,
            heartbeat=self.heartbeat.path if self.heartbeat else None,
            heartbeat_timeout_s=s.heartbeat_timeout_s,
        )
        # After SlurmJob's own configure(TcpWithHostname), before any Monarch channel opens.
        configure(default_transport=transport)
        self.job.apply()  # sbatch
        try:
            await self.job.wait_running(s.start_timeout_s)
        except JobNotStarted as error:
            state = error.info.why() if error.info is not None else "no longer in squeue"
            if error.timed_out:
                raise PlacementError(
                    f"Slurm job {error.job_id} did not start within hosts.slurm.start_timeout_s"
                    f"={s.start_timeout_s:g}: {state}; it was cancelled. Raise "
                    "hosts.slurm.start_timeout_s to wait longer, or ask for fewer nodes or "
                    "another partition (`sinfo`, `scontrol show partition`)") from None
            raise PlacementError(
                f"Slurm job {error.job_id} ended before it started: {state}; its log: "
                f"{self.job.log_paths()[1]}") from None

    async def exposed_ports(self, procs: Mapping[str, Sequence[Any]]) -> str | None:
        """The line a run prints once, when its roles are up: every port it listens on that
        another machine could reach, all unauthenticated (Monarch 0.7's workers run any code
        they are sent; docs/hosts.md, "Security"). None when there is none (``local`` and
        ``processes`` listen on loopback and Unix sockets only).

        Lists the workers (``slurm``, ``attach``: always, they are there to be dialed), this
        process's and its children's listeners beyond loopback, and (``slurm``, ``attach``)
        those of each role's procs, asked by a probe actor on ``procs``' meshes.

        Args:
            procs: ``{role: [proc mesh, ...]}`` of the run's roles.
        """
        from forge_ext.runtime.ports import ListeningPorts, beyond_loopback, listening, show

        parts = [f"{group} workers {', '.join(a.split('@')[-1] for a in addresses)}"
                 for group, addresses in self.worker_addresses.items()]
        mine = beyond_loopback(listening())
        if mine:
            parts.append(f"controller {', '.join(show(*s) for s in mine)}")
        if self.launcher in ("slurm", "attach"):
            for role, meshes in procs.items():
                for i, mesh in enumerate(meshes):
                    found = await mesh.spawn("listening_ports", ListeningPorts).sockets.call()
                    for rank, sockets in enumerate(found.values()):
                        sockets = beyond_loopback(sockets)
                        if sockets:
                            where = f"replica {i}" if len(meshes) > 1 else f"rank {rank}"
                            parts.append(f"{role} {where} {', '.join(show(*s) for s in sockets)}")
        if not parts:
            return None
        return ("listening beyond loopback, unauthenticated (whoever reaches these ports can "
                "run code as this user: see docs/hosts.md, \"Security\"): " + "; ".join(parts))

    @property
    def worker_addresses(self) -> dict[str, list[str]]:
        """``{group: [tcp://host:port, ...]}`` of workers reached over TCP (``slurm``,
        ``attach``); empty for the launchers whose workers are on this machine."""
        if self.launcher == "attach":
            return {g: list(self.config.attach[g]) for g in self.groups}
        if self.launcher == "slurm" and self.job is not None:
            return self.job.worker_addresses()
        return {}

    def host_mesh(self, role: str):
        """The role's ``HostMesh`` (``this_host()`` for ``local``)."""
        if self.launcher == "local":
            from monarch.actor import this_host

            return this_host()
        if not self.meshes:
            raise RuntimeError("Placement.start() must run before spawning")
        return self.meshes[self.group_of(role)]

    def procs_per_host(self, role: str) -> int:
        return self.layout[role][1]

    def num_procs(self, role: str) -> int:
        """The role's processes: hosts x procs per host."""
        hosts, per_host = self.layout[role]
        return hosts * per_host

    def spawn_procs(self, role: str, env: Mapping[str, str] | None = None):
        """The role's proc mesh: ``procs_per_host`` procs on each of its hosts, named after
        the role (Monarch's failure reports then name it). ``env`` is applied in each proc
        before any actor runs, on every launcher but ``local`` (whose procs inherit the
        controller's environment at spawn), with the run's log folder
        (:data:`forge_ext.runtime.run_logs.LOG_DIR_ENV`)."""
        bootstrap = self._bootstrap(env)
        return self.host_mesh(role).spawn_procs(
            per_host={"procs": self.procs_per_host(role)}, bootstrap=bootstrap, name=role
        )

    def spawn_replica_procs(self, role: str, host: int, name: str,
                            env: Mapping[str, str] | None = None):
        """One proc on host ``host`` of the role's mesh, named ``name`` (a generator replica:
        each its own proc mesh, so one dying leaves the others' meshes whole). ``env`` as in
        :meth:`spawn_procs`."""
        bootstrap = self._bootstrap(env)
        mesh = self.host_mesh(role)
        if self.launcher != "local":
            mesh = mesh.slice(hosts=host)
        return mesh.spawn_procs(per_host={"procs": 1}, bootstrap=bootstrap, name=name)

    def _bootstrap(self, env: Mapping[str, str] | None):
        """What a proc on another host runs first: ``env`` and the run's log folder set in
        its environment (None on ``local``: its procs inherit the controller's)."""
        if self.launcher == "local":
            return None
        from forge_ext.runtime.run_logs import LOG_DIR_ENV

        env = {**(env or {}), **({LOG_DIR_ENV: os.environ[LOG_DIR_ENV]}
                                 if LOG_DIR_ENV in os.environ else {})}
        return functools.partial(_set_env, {k: str(v) for k, v in env.items()}) if env else None

    def same_host(self, writer: str, readers: list[str]) -> bool:
        """Whether ``writer`` and every reader run on the same hosts (same host mesh), so
        that a same-host shortcut between them is possible."""
        if self.launcher == "local":
            return True
        return all(self.group_of(r) == self.group_of(writer) for r in readers)

    def describe_host(self, role: str, host: int) -> str:
        """Where host ``host`` of ``role`` is, for messages."""
        if self.launcher == "local":
            return "this machine"
        hosts = self.layout[role][0] if role in self.layout else None
        where = f"host {host}" + (f" of {hosts}" if hosts else "")
        if self.launcher == "processes" and self.job is not None:
            state = self.job._host_to_pid.get(f"{self.group_of(role)}_{host}")
            if state is not None:
                where += f" (worker pid {state.pid})"
        elif self.launcher == "attach":
            addresses = self.config.attach.get(self.group_of(role), [])
            if host < len(addresses):
                where += f" ({addresses[host]})"
        return where

    def _worker_exited(self, group: str, host: int, pid: int, returncode: int) -> None:
        if self.stopping or self.on_host_death is None:
            return
        self.on_host_death(HostDeath(group=group, host=host, pid=pid, returncode=returncode))

    def stop(self) -> None:
        """Kill the job: every worker and every proc it spawned (``slurm``: ``scancel``;
        ``local``: nothing to do, the roles' proc meshes are stopped by their handles).
        Idempotent."""
        self.stopping = True
        job, self.job = self.job, None
        self.meshes = {}
        try:
            if job is not None:
                job.kill()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()
                self.heartbeat = None
            if self.reaper is not None:
                self.reaper.stdin.close()  # the job is gone: the watchdog has nothing to do
                self.reaper.wait()
                self.reaper = None


class _Heartbeat:
    """The controller's side of a Slurm job's watchdog: a thread that rewrites ``path``
    with a counter every :func:`~forge_ext.compat.monarch_slurm.heartbeat_period` seconds
    while this process lives; :meth:`stop` removes the file."""

    def __init__(self, path: str, timeout_s: float):
        from forge_ext.compat.monarch_slurm import heartbeat_period

        self.path, self.period = path, heartbeat_period(timeout_s)
        self._stopped = threading.Event()
        self._beat(0)
        self._thread = threading.Thread(target=self._run, daemon=True, name="slurm-heartbeat")
        self._thread.start()

    def _beat(self, count: int) -> None:
        # In place (not a rename): a reader's open after this close sees it on NFS too.
        with open(self.path, "w") as f:
            f.write(f"{count}\n")

    def _run(self) -> None:
        count = 0
        while not self._stopped.wait(self.period):
            count += 1
            try:
                self._beat(count)
            except OSError as error:  # a full or unmounted disk: the job will cancel itself
                logger.warning("could not write the Slurm heartbeat %s: %s", self.path, error)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


def _host_name_addresses() -> list[str]:
    """The addresses this machine's host name resolves to."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos})


def _interface_addresses() -> list[str]:
    """This machine's IPv4 and IPv6 interface addresses."""
    import psutil

    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)]


def _reachable(address: str) -> bool:
    """Whether another machine could dial ``address``: neither loopback nor link-local
    (what Monarch's TcpWithHostname accepts)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


@functools.cache
def _process_job_class():
    from monarch.job import ProcessJob

    class WatchedProcessJob(ProcessJob):
        """``ProcessJob`` that also tells the run when a worker exits.

        Why: ProcessJob only logs a worker's death, and Monarch's own supervision reports a
        dead host after about a minute (``get_proc_state_max_idle``) as "no status received
        from process", without the signal. Overrides ProcessJob's per-worker waiter thread
        (``_watch_process``, monarch/_src/job/process.py, 0.7.0) to also call ``on_exit``.
        """

        def __init__(self, meshes, env=None, on_exit=None):
            super().__init__(dict(meshes), env)
            self._on_exit = on_exit

        def _watch_process(self, proc, mesh_name, rank, addr):
            def wait() -> None:
                code = proc.wait()
                if self._on_exit is not None:
                    self._on_exit(mesh_name, rank, proc.pid, code)

            threading.Thread(target=wait, daemon=True, name=f"watch-{mesh_name}_{rank}").start()

    return WatchedProcessJob


def _WatchedProcessJob(meshes, on_exit=None):
    # Built on first use: importing monarch.job here at module import would pull Monarch's
    # job machinery into every process that only reads a config.
    return _process_job_class()(meshes, on_exit=on_exit)
