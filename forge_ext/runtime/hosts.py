"""The YAML ``hosts:`` section: where each role's processes run (:class:`HostsConfig`), checked
before anything starts; :class:`forge_ext.runtime.placement.Placement` starts what it names.

A role (``trainer``, ``reference``, ``critic``, ``generator``) runs on a host mesh; its procs are
``procs_per_host`` processes on each of its ``hosts``. The launcher says where hosts come from;
every launcher is Monarch's own: this section only chooses one, and the layout is validated
before anything starts::

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
weight transport's ``weights.same_host``) must be off:
:meth:`forge_ext.runtime.placement.Placement.same_host`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

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
                parallelism degrees, :func:`forge_ext.engine.schema.world_size_of`;
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
