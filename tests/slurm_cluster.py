"""A real Slurm cluster on this machine, for testing ``hosts.launcher: slurm``.

Debian's Slurm (22.05 on Debian 12) with munge: one ``slurmctld`` and one ``slurmd`` per
simulated node, all on this machine, each node named after a loopback address of its own
(``127.0.1.<i>``). Monarch's workers listen on ``tcp://<node name>:<port>`` (see
:mod:`forge_ext.compat.monarch_slurm`), so the nodes' workers have distinct addresses although
they share one host. Partitions: ``all`` (every node, the default) and ``one`` (the first node:
a job asking for more nodes than that stays pending forever, ``Reason=PartitionConfig``).

Everything lives in a fresh folder under /tmp (munged, which runs as user ``munge``, cannot
reach pytest's root-only temporary folders) on free ports. :meth:`SlurmCluster.stop` cancels
every job, waits until their step daemons are gone and stops the daemons by pid; should the
process that started them die first (a killed test session), a watchdog holding a pipe from
it (forge_ext/runtime/reaper.py) stops the daemons and removes the folder.

Installing: :func:`ensure_slurm` installs ``slurm-wlm`` and ``munge`` from the distribution's
package registry (``apt-get``, about a minute) when they are missing and this is root; where
that is impossible (not root, no apt-get) it says why, for the tests to skip with that reason.

Run by hand: ``python tests/slurm_cluster.py [NODES]`` starts a cluster, prints its
``SLURM_CONF`` and waits for Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scancel", "mungekey")


def slurm_unavailable() -> str | None:
    """Why this machine cannot run a Slurm cluster for the tests, or None once it can
    (installing the packages first where they are missing and this is root).

    Raises:
        RuntimeError: the install was possible but failed (its output says why).
    """
    if all(shutil.which(d) or os.path.exists(f"/usr/sbin/{d}") for d in DAEMONS):
        return None if os.geteuid() == 0 else (
            "Slurm's daemons must run as root (slurmd starts jobs as their user) and this is "
            f"uid {os.geteuid()}")
    if os.geteuid() != 0:
        return (f"Slurm is not installed and installing it needs root: apt-get install "
                f"{' '.join(PACKAGES)}")
    if shutil.which("apt-get") is None:
        return f"Slurm is not installed and there is no apt-get: install {' '.join(PACKAGES)}"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n"
                               f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return None


def _free_ports(count: int) -> list[int]:
    """``count`` TCP ports free on this machine now (bound together, so distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SlurmCluster:
    """``nodes`` simulated Slurm nodes on this machine (module docstring).

    Attributes:
        root: the cluster's folder (config, state, logs).
        env: this process's environment plus ``SLURM_CONF``: give it to every Slurm command
            and controller that should talk to this cluster.
        node_names: ``127.0.1.1``, ``127.0.1.2``, ...
    """

    def __init__(self, nodes: int = 3):
        self.nodes = nodes
        self.node_names = [f"127.0.1.{i}" for i in range(1, nodes + 1)]
        self.root = Path(tempfile.mkdtemp(prefix="forge_ext_slurm_"))
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: dict[str, subprocess.Popen] = {}
        self.reaper: subprocess.Popen | None = None
        self.seconds_to_idle: float | None = None

    # ---- start --------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Start munged, slurmctld and the nodes' slurmd; return once every node is idle.

        Raises:
            RuntimeError: a daemon exited or the nodes were not idle within ``timeout`` s
                (the daemons' logs are quoted).
        """
        began = time.perf_counter()
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir()
        try:
            self._start_munge()
            self._write_config()
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for name in self.node_names:
                (self.root / "spool" / name).mkdir()
                self._spawn(f"slurmd_{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
            self._start_reaper()
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        self.seconds_to_idle = time.perf_counter() - began
        return self

    def _spawn(self, name: str, argv: list[str], **kwargs) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")
        with log:
            self.daemons[name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True, **kwargs)

    def _start_reaper(self) -> None:
        import psutil

        script = Path(__file__).resolve().parent.parent / "forge_ext/runtime/reaper.py"
        args = ["--rmtree", str(self.root)]
        for daemon in self.daemons.values():  # each leads a session of its own
            args += ["--session", f"{daemon.pid}:{psutil.Process(daemon.pid).create_time()}"]
        self.reaper = subprocess.Popen([sys.executable, str(script), *args],
                                       stdin=subprocess.PIPE, start_new_session=True)

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True,
                       capture_output=True)
        # munged refuses a key or socket folder that is not its own, or a key others can read.
        shutil.chown(munge, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        key.chmod(0o600)
        self.munge_socket = munge / "munge.socket"
        self._spawn("munged", [
            "setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "munged", "-F",
            f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}"])
        for _ in range(200):
            if self.munge_socket.exists():
                return
            if self.daemons["munged"].poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"munged did not start: {self._log('munged')}")

    def _write_config(self) -> None:
        ctld_port, slurmd_port, *node_ports = _free_ports(2 + self.nodes)
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        memory = max(1024, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
                     - 1024)
        r = self.root
        # Each node: its own slurmd port, all reached at 127.0.0.1; the node's *name* is an
        # address of its own (what Monarch's workers listen on and the controller dials).
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
            f"RealMemory={memory} State=UNKNOWN" for name, port in zip(self.node_names, node_ports))
        self.conf.write_text(f"""\
ClusterName=forge_ext_test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd'}.%n.pid
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd'}.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=60
KillWait=5
{nodes}
PartitionName=all Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=one Nodes={self.node_names[0]} MaxTime=INFINITE State=UP OverSubscribe=NO
""")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, daemon in self.daemons.items():
                if daemon.poll() is not None:
                    raise RuntimeError(f"{name} exited ({daemon.returncode}): {self._log(name)}")
            idle = self.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False)
            if len(set(idle.stdout.split())) >= self.nodes:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the Slurm nodes were not idle within {timeout} s: "
                           f"{self._log('slurmctld')}")

    def _log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.stdout"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    # ---- use ----------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster (``squeue``, ``scontrol`` ...), run in the
        cluster's folder (where ``sbatch`` puts a job's output by default)."""
        return subprocess.run(argv, env=self.env, cwd=self.root, capture_output=True, text=True,
                              check=check)

    def jobs(self) -> dict[str, str]:
        """``{job id: state}`` of the jobs Slurm still lists (finished ones for MinJobAge)."""
        out = self.run("squeue", "-h", "-t", "all", "-o", "%i %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def active_jobs(self) -> dict[str, str]:
        """The jobs not yet ended: pending, running, completing."""
        ended = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                 "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
        return {j: s for j, s in self.jobs().items() if s not in ended}

    def job_processes(self) -> list[int]:
        """Pids of the processes this cluster's jobs run: its step daemons (``slurmstepd``,
        known by the cluster's ``SLURM_CONF`` in their environment, inherited from its
        slurmd) and everything they started."""
        import psutil

        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for process in psutil.process_iter(["name"]):
            if not (process.info["name"] or "").startswith("slurmstepd"):
                continue
            try:
                with open(f"/proc/{process.pid}/environ", "rb") as f:
                    if marker not in f.read().split(b"\0"):
                        continue
                found += [process.pid, *(c.pid for c in process.children(recursive=True))]
            except (OSError, psutil.Error):
                pass
        return found

    def cancel_all(self, timeout: float = 60.0) -> None:
        """scancel every job; return once none is active and their processes are gone."""
        for job in self.active_jobs():
            self.run("scancel", job, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.active_jobs() and not self.job_processes():
                return
            time.sleep(0.2)

    # ---- stop ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, then stop the daemons (slurmd, slurmctld, munged) by pid:
        SIGTERM, SIGKILL after 10 s. Job processes still there after that are killed."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.cancel_all()
        for name in reversed(list(self.daemons)):
            if self.daemons[name].poll() is None:
                self.daemons[name].send_signal(signal.SIGTERM)
        for name, daemon in self.daemons.items():
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for pid in self.job_processes():  # step daemons orphaned by a slurmd stopped first
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.daemons.clear()
        if self.reaper is not None:  # nothing left for it but the folder
            self.reaper.stdin.close()
            self.reaper.wait()
            self.reaper = None
        shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    reason = slurm_unavailable()
    if reason:
        sys.exit(reason)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop on SIGTERM too
    cluster = SlurmCluster(int(sys.argv[1]) if len(sys.argv) > 1 else 3).start()
    print(f"up in {cluster.seconds_to_idle:.2f} s\nexport SLURM_CONF={cluster.conf}", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
