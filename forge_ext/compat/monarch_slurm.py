"""Monarch 0.7.0's ``SlurmJob`` on the Slurm versions users run, with workers that end with
their run.

Why, each seen on Debian 12's Slurm 22.05.8 (tests/test_slurm.py runs a real cluster):

1. **squeue's JSON.** ``SlurmJob`` reads ``squeue --job ID --json`` in the shape of Slurm
   >= 23.02's data_parser: ``job_state`` a list, nodes in ``job_resources.nodes.allocation[]
   .name``. Slurm 22.05 ignores ``--job`` with ``--json`` (every job of the cluster comes
   back, so ``jobs[0]`` may be another user's), gives ``job_state`` as a string and nodes as
   ``job_resources.allocated_nodes[].nodename``; ``SlurmJob`` then raises ``RuntimeError: SLURM
   job is no longer active`` or ``SLURM job 5 failed with status: CANCELLED`` (an older job's)
   for a running job, or ``AttributeError: 'str' object has no attribute 'get'``.
   :func:`job_info` reads squeue's plain format (``-o "%T|%r|%N"``: long-standing fields whose
   output did not change shape with the JSON plugins) for the one job, and expands the node
   list with ``scontrol show hostnames``; :class:`SlurmJob` hands Monarch that in the shape
   it reads.
2. **Waiting for the job to start.** ``SlurmJob.state()`` polls in a blocking loop (no
   timeout by default, no reason given): a job that can never start (more nodes than the
   partition has) kept a controller waiting forever, deaf to Ctrl-C and SIGTERM, whose asyncio
   handlers never ran. :meth:`SlurmJob.wait_running` waits on the event loop (cancellable)
   with a time limit, and :class:`JobNotStarted` names the job id, its state and Slurm's
   reason.
3. **Workers that outlive their controller.** The workers ``SlurmJob`` starts
   (``run_worker_loop_forever``) and the procs they spawned stayed alive after a ``kill -9``
   of the controller, until the job's time limit (often INFINITE). The batch script here
   runs a watchdog beside the workers that cancels the job once the controller's heartbeat
   file (written by :mod:`forge_ext.runtime.placement` every few seconds) stops changing for
   ``heartbeat_timeout_s``. A file, not a socket: it opens no port, and it tells a dead
   controller process and a dead controller machine alike. The controller must see the
   same file as the job's first node (the shared filesystem ``output_dir`` is on).
4. **Where workers listen.** ``SlurmJob`` starts each worker on
   ``tcp://<socket.gethostname()>:<port>`` and dials ``tcp://<Slurm node name>:<port>``:
   the two differ where a node's host name is not its Slurm name. Workers here listen on
   their node name's address (``$SLURMD_NODENAME``), the address the controller dials, on
   one interface (Monarch binds the address the name resolves to, never every interface).

Monarch's own parts are kept: ``JobTrait``'s apply/state/kill, the service proc ids, the
host meshes of ``attach_to_workers`` and ``scancel``. Remove this module once Monarch's
``SlurmJob`` reads Slurm 22.05 and takes a start timeout and a worker lifetime.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import time
from dataclasses import dataclass

from monarch._src.job.service_identity import SERVICE_PROC_IDS_ENV, serialize_service_proc_ids
from monarch.job import SlurmJob as _MonarchSlurmJob

# Job states after which a job never runs (Slurm's JOB_STATE_BASE names, squeue's %T).
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                   "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"})

# What the reasons a job most often waits on mean (squeue(1), "JOB REASON CODES").
REASONS = {
    "PartitionConfig": "the job asks for more than its partition has (nodes, GPUs, time)",
    "PartitionNodeLimit": "the job's node count is outside its partition's limits, or nodes "
                          "it needs are down or drained",
    "PartitionTimeLimit": "the job's time limit exceeds its partition's",
    "Resources": "the nodes it needs are busy with other jobs",
    "Priority": "jobs of higher priority are ahead of it",
    "ReqNodeNotAvail": "nodes it needs are down, drained or reserved",
    "QOSMaxNodePerJobLimit": "the job asks for more nodes than its QOS allows",
    "AssocGrpNodeLimit": "its account's node limit is reached",
    "InvalidAccount": "the account does not exist or is not yours",
    "InvalidQOS": "the QOS does not exist or is not allowed",
}

# The worker each node runs: Monarch's run_worker_loop_forever on the node's Slurm name (the
# address the controller dials) and the run's port, with the service identity SlurmJob
# allocates (monarch/_src/job/_slurm_batch.py builds the same with socket.gethostname()).
# `ca` is the only value Monarch 0.7.0 accepts (monarch/_src/actor/bootstrap.py); a CA and a
# private key would go here, and to attach_to_workers in placement.py, once it takes them.
_WORKER = (
    "import os; from monarch.actor import run_worker_loop_forever; "
    "from monarch._src.job.service_identity import service_proc_addr, "
    "ranked_service_proc_id_from_env; "
    "run_worker_loop_forever(address=service_proc_addr("
    "'tcp://' + os.environ['SLURMD_NODENAME'] + ':{port}', "
    "ranked_service_proc_id_from_env(rank_env='SLURM_NODEID')), ca='trust_all_connections')"
)

# The watchdog of the controller's heartbeat, run by the batch script beside srun: the file's
# content changes every few seconds while the controller lives; once it has not changed for
# the timeout, the job cancels itself (every worker and proc on every node). Content, not
# mtime: the nodes' clocks need not agree with the controller's, and NFS's close-to-open
# consistency makes a fresh open see the latest write.
_WATCHDOG = """\
forge_ext_watchdog() {{
    local last= now quiet=0
    while sleep {poll}; do
        now=$(cat {path} 2>/dev/null)
        if [ -n "$now" ] && [ "$now" != "$last" ]; then last=$now; quiet=0
        else quiet=$((quiet + {poll})); fi
        if [ "$quiet" -ge {timeout} ]; then
            echo "forge_ext: no heartbeat from the controller for {timeout} s ({path}):" \\
                 "cancelling job $SLURM_JOB_ID" >&2
            scancel "$SLURM_JOB_ID"
            return
        fi
    done
}}
forge_ext_watchdog &
"""


def heartbeat_period(timeout_s: float) -> int:
    """Seconds between heartbeats (and between the watchdog's reads): a fifth of the
    timeout, 1 to 5 s."""
    return int(max(1, min(5, timeout_s // 5)))


@dataclass(frozen=True, slots=True)
class JobInfo:
    """A job as squeue lists it."""

    job_id: str
    state: str
    """``PENDING``, ``RUNNING``, ``COMPLETING``, ``CANCELLED`` ... (squeue's ``%T``)."""
    reason: str
    """Why it waits or ended (``PartitionConfig``, ``Resources``, ``None`` ...; ``%r``)."""
    nodes: tuple[str, ...]
    """Its nodes in Slurm's order (``SLURM_NODEID``); empty before it starts."""

    def monarch_json(self) -> dict:
        """The entry of ``squeue --json`` that Monarch 0.7.0's ``SlurmJob`` reads (Slurm >=
        23.02's shape)."""
        return {"job_id": self.job_id, "job_state": [self.state],
                "state_reason": self.reason,
                "job_resources": {"nodes": {"allocation": [{"name": n} for n in self.nodes]}}}

    def why(self) -> str:
        """``PENDING (Reason=PartitionConfig: the job asks for ...)``."""
        meaning = REASONS.get(self.reason)
        return f"{self.state} (Reason={self.reason}" + (f": {meaning})" if meaning else ")")


class JobNotStarted(RuntimeError):
    """The job did not reach RUNNING: the time limit passed, or it ended first.

    Attributes:
        info: the job as squeue last listed it (None: it had left the queue).
        waited_s: seconds waited.
        timed_out: the time limit passed (else the job ended or left the queue).
    """

    def __init__(self, job_id: str, info: JobInfo | None, waited_s: float, timed_out: bool):
        self.job_id, self.info, self.waited_s, self.timed_out = job_id, info, waited_s, timed_out
        state = info.why() if info is not None else "no longer listed by squeue"
        super().__init__(f"Slurm job {job_id} did not start in {waited_s:.0f} s: {state}")


def parse_squeue(job_id: str, line: str, expand=None) -> JobInfo:
    """A :class:`JobInfo` from squeue's ``%T|%r|%N`` line; ``expand`` turns a node list
    (``node[01-03]``) into names (default: ``scontrol show hostnames``)."""
    state, reason, nodelist = (line.strip().split("|", 2) + ["", ""])[:3]
    nodes = ()
    if nodelist and state == "RUNNING":
        nodes = tuple((expand or _expand_hostlist)(nodelist))
    return JobInfo(job_id=job_id, state=state, reason=reason, nodes=nodes)


def _expand_hostlist(nodelist: str) -> list[str]:
    result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                            text=True, check=True, timeout=60)
    return result.stdout.split()


def job_info(job_id: str) -> JobInfo | None:
    """The job as squeue lists it now; None once it has left the queue (finished more
    than MinJobAge ago, or unknown)."""
    result = subprocess.run(["squeue", "-h", "-j", job_id, "-t", "all", "-o", "%T|%r|%N"],
                            capture_output=True, text=True, timeout=60)
    line = result.stdout.strip()
    if result.returncode != 0 or not line:
        return None  # "slurm_load_jobs error: Invalid job id specified"
    return parse_squeue(job_id, line.splitlines()[0])


class SlurmJob(_MonarchSlurmJob):
    """Monarch's ``SlurmJob`` (module docstring) with forge_ext's batch script and squeue
    reading.

    Args:
        meshes: ``{group: nodes}``.
        heartbeat: the file the controller rewrites every :func:`heartbeat_period` seconds;
            None: no watchdog (the job ends at its time limit or by ``scancel``).
        heartbeat_timeout_s: seconds without a change after which the job cancels itself.
        **kwargs: ``monarch.job.SlurmJob``'s (``python_exe``, ``monarch_port``, ``partition``
            ...).
    """

    def __init__(self, meshes: dict[str, int], *, heartbeat: str | None = None,
                 heartbeat_timeout_s: float = 60.0, **kwargs):
        super().__init__(dict(meshes), **kwargs)
        self._heartbeat = heartbeat
        self._heartbeat_timeout_s = heartbeat_timeout_s

    # ---- what Monarch reads: squeue --json, in its shape ---------------------------------
    def _get_job_info_json(self, job_id: str) -> dict | None:
        info = job_info(job_id)
        return None if info is None else info.monarch_json()

    # ---- the batch script ---------------------------------------------------------------
    def batch_script(self, num_nodes: int) -> str:
        """The ``sbatch`` script: Monarch's directives, the heartbeat watchdog and one worker
        per node (``srun``)."""
        log = os.path.join(self._log_dir, f"{self._job_name}-%j")
        directives = [f"--job-name={self._job_name}", f"--nodes={num_nodes}",
                      f"--ntasks-per-node={self._ntasks_per_node}",
                      f"--output={log}.out", f"--error={log}.err"]
        for flag, value in (("time", self._time_limit), ("gpus-per-node", self._gpus_per_node),
                            ("cpus-per-task", self._cpus_per_task), ("mem", self._mem),
                            ("partition", self._partition), ("account", self._account),
                            ("qos", self._qos)):
            if value is not None:
                directives.append(f"--{flag}={value}")
        if self._exclusive:
            directives.append("--exclusive")
        directives += [a for a in self._slurm_args if a.startswith("-")]
        lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives),
                 f"export {SERVICE_PROC_IDS_ENV}="
                 f"{shlex.quote(serialize_service_proc_ids(self._service_proc_ids))}"]
        if self._heartbeat is not None and self._heartbeat_timeout_s > 0:
            lines.append(_WATCHDOG.format(
                path=shlex.quote(self._heartbeat), timeout=int(self._heartbeat_timeout_s),
                poll=heartbeat_period(self._heartbeat_timeout_s)))
        lines.append(f"srun {self._python_exe} -c {shlex.quote(_WORKER.format(port=self._port))}")
        return "\n".join(lines) + "\n"

    def _submit_slurm_job(self, num_nodes: int, client_script: str | None = None) -> str:
        if client_script is not None:
            raise NotImplementedError("forge_ext runs the controller outside the allocation")
        self._ensure_service_proc_ids(num_nodes)
        os.makedirs(self._log_dir, exist_ok=True)
        result = subprocess.run(["sbatch", "--parsable"], input=self.batch_script(num_nodes),
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch refused the job: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]  # "<job id>[;<cluster>]"

    # ---- waiting for it -----------------------------------------------------------------
    @property
    def job_id(self) -> str | None:
        return self._slurm_job_id

    @property
    def port(self) -> int:
        return self._port

    @property
    def log_dir(self) -> str:
        return self._log_dir

    def worker_addresses(self) -> dict[str, list[str]]:
        """``{group: [tcp://<node>:<port>, ...]}`` once the job runs (empty before)."""
        nodes, out = iter(self._all_hostnames), {}
        if self._all_hostnames:
            for group, count in self._meshes.items():
                out[group] = [f"tcp://{next(nodes)}:{self._port}" for _ in range(count)]
        return out

    def log_paths(self) -> tuple[str, str]:
        """The job's stdout and stderr files."""
        base = os.path.join(self._log_dir, f"{self._job_name}-{self._slurm_job_id}")
        return f"{base}.out", f"{base}.err"

    async def wait_running(self, timeout_s: float | None) -> list[str]:
        """Wait on the event loop (cancellable) until the submitted job runs; return its
        nodes in Slurm's order. squeue is asked every 0.5 s for 10 s, then every 2 s.

        Raises:
            JobNotStarted: not RUNNING within ``timeout_s`` (None or 0: no limit), or it
                ended or left the queue first. The job is not cancelled here.
        """
        job_id = self._slurm_job_id
        began = time.monotonic()
        info = None
        while True:
            info = await asyncio.to_thread(job_info, job_id)
            waited = time.monotonic() - began
            if info is None or info.state in ENDED:
                raise JobNotStarted(job_id, info, waited, timed_out=False)
            if info.state == "RUNNING":
                expected = sum(self._meshes.values())
                if len(info.nodes) != expected:
                    raise RuntimeError(f"Slurm job {job_id} runs on {len(info.nodes)} nodes, "
                                       f"not the {expected} asked for")
                self._all_hostnames = list(info.nodes)
                return list(info.nodes)
            if timeout_s and waited >= timeout_s:
                raise JobNotStarted(job_id, info, waited, timed_out=True)
            await asyncio.sleep(0.5 if waited < 10 else 2.0)
