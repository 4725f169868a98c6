"""Where each role's processes run: Monarch host meshes chosen by the YAML ``hosts:`` section.

A role (``trainer``, ``reference``, ``critic``, ``generator``) runs on a host mesh; its procs are
``procs_per_host`` processes on each of its ``hosts``. The launcher says where hosts come from;
every launcher is Monarch's own, this module only chooses one, validates the layout before
anything starts, and stops what it started::

    hosts:
      launcher: processes              # local (default) | processes | slurm | attach
      trainer:   {hosts: 2, procs_per_host: 1}
      reference: {hosts: 1}
      generator: {hosts: 1}

- ``local``: ``monarch.actor.this_host()``; every role on the controller's machine (one host
  per role, the behaviour before multi-host support).
- ``processes``: ``monarch.job.ProcessJob``; each host is a worker process on this machine
  (``run_worker_loop_forever`` on a Unix socket). For trying a layout, and for testing
  multi-host code, on one box.
- ``slurm``: ``monarch.job.SlurmJob`` (through :mod:`forge_ext.compat.monarch_slurm`); one
  ``sbatch`` allocation of every group's hosts (``hosts.slurm``: partition, time, GPUs per
  host, ...), a worker per node on TCP port ``slurm.port`` (drawn for each run by default).
- ``attach``: ``monarch.actor.attach_to_workers``; workers already running
  ``run_worker_loop_forever`` (Kubernetes pods, hand-started nodes) at the addresses listed
  per role in ``hosts.attach``.

Roles with the same ``group`` share one host mesh (e.g. reference and generator on one node,
each with its own GPUs through ``procs.<role>.env``); by default every role is its own group.
Roles in different groups are on different hosts, so a same-host shortcut between them (the
weight transport's ``weights.same_host``) must be off: :meth:`Placement.same_host`.

Environment: on ``local`` the procs inherit the controller's environment (and the app's
``procs.<role>.env``). On the other launchers procs start from their worker's environment,
and :meth:`Placement.spawn_procs` applies the role's ``env`` in each proc before any actor
runs (:func:`forge_ext.config.apply_env`). Variables that a process reads when it starts
(``CUDA_VISIBLE_DEVICES`` for roles that share a node) are set that way before the role's
actors touch CUDA.

No orphans: :meth:`Placement.stop` kills the job (``job.kill()``: every worker and every proc
it spawned; ``slurm``: ``scancel``). ProcessJob workers run in sessions of their own and
outlive a controller killed with SIGKILL, so a watchdog (:mod:`forge_ext.rollout.engines._reaper`,
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
import re
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

LAUNCHERS = ("local", "processes", "slurm", "attach")
ROLES = ("trainer", "reference", "critic", "generator")
# A worker address: a ZMQ-style channel URL (tcp://host:port, ipc://path), optionally as a
# Monarch ProcAddr (<proc id>@<url>); see monarch.actor.attach_to_workers.
_ADDRESS = re.compile(r"^(\S+@)?(tcp|metatls|ipc)://\S+$")
# hosts.transport's explicit form: an address (IPv6 in brackets) and a port.
_TRANSPORT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}$")
# hosts.slurm.port's default: drawn from these for each run (Linux's ephemeral ports, what
# outgoing connections take, begin at 32768).
SLURM_PORTS = range(20000, 32768)


@dataclass(kw_only=True, slots=True)
class RoleHosts:
    """YAML ``hosts.<role>``: how many hosts a role spans and how many procs on each."""

    hosts: int = 1
    """Hosts of the role's mesh."""
    procs_per_host: int | None = None
    """Procs on each host (default: the role's processes / ``hosts``; the trainer's and
    reference's processes are the product of their parallelism degrees)."""
    group: str | None = None
    """Roles with the same group share one host mesh (default: the role's own name)."""


@dataclass(kw_only=True, slots=True)
class SlurmHosts:
    """YAML ``hosts.slurm``: the ``sbatch`` allocation (``monarch.job.SlurmJob``, through
    :mod:`forge_ext.compat.monarch_slurm`)."""

    partition: str | None = None
    """Partition to submit to (required; ``sinfo`` lists them)."""
    time: str | None = None
    """Time limit, ``HH:MM:SS`` (default: the partition's)."""
    gpus_per_host: int | None = None
    """GPUs requested on every node (``--gpus-per-node``)."""
    account: str | None = None
    """Account to charge (``--account``; default: yours)."""
    qos: str | None = None
    """Quality of service (``--qos``; default: the partition's)."""
    python_exe: str | None = None
    """Interpreter the workers run (default: the controller's own, ``sys.executable``, which
    every node must reach at the same path: the project's ``.venv`` on a shared filesystem)."""
    port: int | None = None
    """TCP port the workers listen on (default: drawn at random for each run from
    20000-32767, below Linux's ephemeral ports)."""
    job_name: str = "forge_ext"
    """The job's name in ``squeue``."""
    log_dir: str | None = None
    """Folder of the job's Slurm logs and of the controller's heartbeat file (default:
    ``<output_dir>/slurm``); the controller and the job's first node must both see it."""
    exclusive: bool = True
    """Whole nodes (``--exclusive``)."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra ``#SBATCH`` lines, e.g. ``["--constraint=h100"]``."""
    start_timeout_s: float = 600.0
    """Seconds the job may wait in the queue before it is cancelled and the run stops,
    naming the job, its state and Slurm's reason (0: no limit; Ctrl-C and SIGTERM stop the
    wait either way)."""
    heartbeat_timeout_s: float = 60.0
    """The job cancels itself (every worker and proc) once the controller's heartbeat file
    has not changed for this long: a controller killed by SIGKILL, or its machine gone.
    0: no watchdog (the job then ends at ``time`` or by ``scancel``)."""


@dataclass(kw_only=True, slots=True)
class HostsConfig:
    """YAML ``hosts:`` (module docstring)."""

    launcher: str = "local"
    """Who starts the hosts: ``local`` (this machine, one mesh per role), ``processes``
    (worker processes on this machine, one per simulated host), ``slurm`` (an ``sbatch``
    allocation) or ``attach`` (workers already running, addresses in ``hosts.attach``)."""
    trainer: RoleHosts = field(default_factory=RoleHosts)
    reference: RoleHosts = field(default_factory=RoleHosts)
    critic: RoleHosts = field(default_factory=RoleHosts)
    """The critic's hosts (PPO, ``algorithm.advantage: gae``)."""
    generator: RoleHosts = field(default_factory=RoleHosts)
    slurm: SlurmHosts = field(default_factory=SlurmHosts)
    attach: dict[str, list[str]] = field(default_factory=dict)
    """``launcher: attach``: worker addresses per group (or role), e.g.
    ``{trainer: [tcp://node0:26600, tcp://node1:26600], generator: [tcp://node2:26600]}``."""
    transport: str | None = None
    """``slurm`` and ``attach``: where the controller listens for its workers (Monarch's
    ``default_transport``). ``hostname``: the address this machine's host name resolves to;
    ``localhost``: 127.0.0.1 (every worker on this machine); ``tcp://<address>:<port>``: that
    interface (port 0: any), e.g. the controller's cluster address where its host name
    resolves only to loopback. Default: ``hostname``, or ``localhost`` on ``attach`` when
    every worker address is on loopback."""

    def __post_init__(self) -> None:
        self.validate_launcher()

    def validate_launcher(self) -> None:
        """What can be checked without the roles' process counts.

        Raises:
            ValueError: naming the ``hosts.<field>`` and the fix.
        """
        if self.launcher not in LAUNCHERS:
            allowed = ", ".join(repr(x) for x in LAUNCHERS)
            raise ValueError(f"hosts.launcher={self.launcher!r} must be one of {allowed}")
        for role in ROLES:
            spec = self.role(role)
            for name in ("hosts", "procs_per_host"):
                value = getattr(spec, name)
                if value is not None and (isinstance(value, bool) or value < 1):
                    raise ValueError(f"hosts.{role}.{name}={value!r} must be an int >= 1")
            if self.launcher == "local" and spec.hosts != 1:
                raise ValueError(
                    f"hosts.{role}.hosts={spec.hosts} needs a multi-host launcher: set "
                    "hosts.launcher=processes (worker processes on this machine), slurm or "
                    "attach"
                )
        if self.launcher == "slurm":
            if not self.slurm.partition:
                raise ValueError(
                    "hosts.launcher=slurm needs hosts.slurm.partition: set it to the "
                    "partition to submit to (`sinfo` lists them)"
                )
            if self.slurm.time is not None and not re.fullmatch(
                r"(\d+-)?\d+(:\d\d){0,2}", self.slurm.time
            ):
                raise ValueError(
                    f"hosts.slurm.time={self.slurm.time!r} must be a Slurm time limit such "
                    "as '04:00:00' or '1-00:00:00'"
                )
        if self.launcher == "slurm":
            for name in ("start_timeout_s", "heartbeat_timeout_s"):
                value = getattr(self.slurm, name)
                if value < 0:
                    raise ValueError(f"hosts.slurm.{name}={value} must be >= 0 (0: no limit)")
            if 0 < self.slurm.heartbeat_timeout_s < 5:
                raise ValueError(
                    f"hosts.slurm.heartbeat_timeout_s={self.slurm.heartbeat_timeout_s} is "
                    "shorter than a few heartbeats: set it to 5 or more (or 0: no watchdog)")
            port = self.slurm.port
            if port is not None and not 1 <= port <= 65535:
                raise ValueError(f"hosts.slurm.port={port} must be a TCP port, 1-65535 "
                                 "(or unset: one drawn at random for each run)")
        if self.transport is not None:
            if self.launcher not in ("slurm", "attach"):
                raise ValueError(
                    f"hosts.transport={self.transport!r} is for the slurm and attach launchers "
                    f"(hosts.launcher={self.launcher!r} listens on this machine only): remove it")
            if self.transport not in ("hostname", "localhost") and not _TRANSPORT.match(
                    self.transport):
                raise ValueError(
                    f"hosts.transport={self.transport!r} must be 'hostname', 'localhost' or "
                    "tcp://<address>:<port> (an address of this machine; port 0: any)")
        if self.attach and self.launcher != "attach":
            raise ValueError(
                f"hosts.attach is set but hosts.launcher={self.launcher!r}: set "
                "hosts.launcher=attach or remove hosts.attach"
            )
        for group, addresses in self.attach.items():
            for address in addresses:
                if not _ADDRESS.match(str(address)):
                    raise ValueError(
                        f"hosts.attach.{group}: {address!r} is not a worker address; use "
                        "tcp://<host>:<port> (what run_worker_loop_forever listens on)"
                    )

    def role(self, role: str) -> RoleHosts:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        return getattr(self, role)

    def group_of(self, role: str) -> str:
        return self.role(role).group or role

    def layout(self, processes: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """``{role: (hosts, procs_per_host)}`` of the roles in ``processes``, checked.

        Args:
            processes: each role's process count (trainer/reference: the product of the
                parallelism degrees, :func:`forge_ext.actors.trainer.world_size_of`;
                generator: ``generator.replicas``, one process each).

        Raises:
            ValueError: hosts x procs_per_host differs from a role's process count (naming
                both and the fix); roles of one group with different host counts; with
                ``launcher: attach``, a group without addresses or with a number of
                addresses other than its hosts.
        """
        self.validate_launcher()
        layout = {}
        for role, count in processes.items():
            spec = self.role(role)
            if spec.procs_per_host is None:
                if count % spec.hosts:
                    raise ValueError(
                        f"{role}: {count} processes do not split over hosts.{role}.hosts="
                        f"{spec.hosts}; set hosts.{role}.procs_per_host or change the "
                        f"{role}'s parallelism degrees"
                    )
                per_host = count // spec.hosts
            else:
                per_host = spec.procs_per_host
            if spec.hosts * per_host != count:
                what = "its parallelism degrees (DP x PP x TP x CP)" if role != "generator" \
                    else "generator.replicas (one process each; vLLM starts its own workers)"
                raise ValueError(
                    f"hosts.{role}.hosts={spec.hosts} x hosts.{role}.procs_per_host={per_host} "
                    f"= {spec.hosts * per_host} processes, but {what} need {count}; make "
                    "them equal"
                )
            layout[role] = (spec.hosts, per_host)
        groups: dict[str, list[str]] = {}
        for role in layout:
            groups.setdefault(self.group_of(role), []).append(role)
        for group, roles in groups.items():
            counts = {layout[r][0] for r in roles}
            if len(counts) > 1:
                raise ValueError(
                    f"roles {roles} share group {group!r} but ask for different numbers of "
                    "hosts; give them the same hosts.<role>.hosts or separate groups"
                )
        if self.launcher == "attach":
            for group, roles in groups.items():
                addresses = self.attach.get(group)
                if addresses is None:
                    raise ValueError(
                        f"hosts.launcher=attach: hosts.attach.{group} lists no worker "
                        f"addresses for {', '.join(roles)}; add one per host"
                    )
                if len(addresses) != layout[roles[0]][0]:
                    raise ValueError(
                        f"hosts.attach.{group} lists {len(addresses)} workers but "
                        f"hosts.{roles[0]}.hosts={layout[roles[0]][0]}; list one address per host"
                    )
            unknown = sorted(set(self.attach) - set(groups))
            if unknown:
                raise ValueError(
                    f"hosts.attach has addresses for {unknown}, which is no role's group "
                    f"(groups: {sorted(groups)})"
                )
        return layout


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
                self.reaper = _start_session_reaper(self.job)
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


def _start_session_reaper(job) -> subprocess.Popen:
    """The watchdog of a ProcessJob's workers: when this process exits in any way (a
    SIGKILL included), it kills every process in each worker's session (the worker and the
    procs it spawned, as ``ProcessJob.kill`` does) and removes the job's socket folder."""
    import psutil

    script = os.path.join(os.path.dirname(__file__), "rollout", "engines", "_reaper.py")
    args = []
    for state in job._host_to_pid.values():
        try:
            args += ["--session", f"{state.pid}:{psutil.Process(state.pid).create_time()}"]
        except psutil.NoSuchProcess:
            pass
    if job._tmpdir:
        args += ["--rmtree", job._tmpdir]
    # A session of its own: a Ctrl-C sent to the terminal's process group does not end it
    # before it has done its work.
    return subprocess.Popen(
        [sys.executable, script, *args], stdin=subprocess.PIPE, start_new_session=True
    )


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
