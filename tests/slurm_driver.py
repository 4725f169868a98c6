"""Controllers for the tests of ``hosts.launcher: slurm`` (tests/test_slurm.py), run as
programs of their own: each is a fresh Monarch client (whose transport the launcher sets),
and the tests send them signals or ``kill -9`` as a user would.

``python tests/slurm_driver.py placement OUT.json HOSTS_JSON OUTPUT_DIR``
    Start the placement of ``HOSTS_JSON`` (a ``hosts:`` section; one proc per role per host),
    spawn a probe on every role's procs and write to ``OUT.json`` where each proc runs, the
    workers' addresses, the seconds from submission to the first answer and the sockets the
    run's processes listen on; then stop.

``python tests/slurm_driver.py cancel OUT.json HOSTS_JSON OUTPUT_DIR``
    Start the placement of ``HOSTS_JSON`` (a job that waits), cancel that start once the job
    is submitted, and write to ``OUT.json`` the job's id and how the start ended; nothing
    stops the placement after (the promise under test is :meth:`Placement.start`'s own).
    Then print ``cancelled`` and wait for a line on stdin before exiting, so that the job's
    state is read while this process lives.

``python tests/slurm_driver.py grpo OUT.json --config PATH [key=value ...]``
    ``python -m apps.grpo.main`` (the same exit codes and messages), with a probe that
    writes the same record for the GRPO app's roles once its second step's rollouts are
    built (after a weight sync: every listener of the run is open).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import forge_ext  # noqa: E402,F401
from monarch.actor import Actor, endpoint  # noqa: E402

from listening import listening_sockets, run_processes  # noqa: E402


class Probe(Actor):
    """Where a proc runs (shipped by value: this file is ``__main__``)."""

    @endpoint
    async def where(self) -> dict:
        env = os.environ
        return {"pid": os.getpid(), "parent": os.getppid(), "exe": sys.executable,
                "hostname": socket.gethostname(), "node": env.get("SLURMD_NODENAME"),
                "job": env.get("SLURM_JOB_ID"),
                **{k: env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}}


async def probe(procs_by_role: dict) -> dict:
    roles = {}
    for role, meshes in procs_by_role.items():
        roles[role] = []
        for procs in meshes:
            roles[role] += list((await procs.spawn("probe", Probe).where.call()).values())
    return roles


def record(path: str, placement, roles: dict, **extra) -> None:
    job = placement.job
    job_id = getattr(job, "job_id", None)
    pids = run_processes(os.getpid(), slurm_job=job_id)
    Path(path).write_text(json.dumps({
        "launcher": placement.launcher, "job_id": job_id, "roles": roles,
        "workers": placement.worker_addresses,
        "port": getattr(job, "port", None), "log_dir": getattr(job, "log_dir", None),
        "listening": listening_sockets(pids), **extra}, indent=1))


async def placement_main(out: str, hosts_json: str, output_dir: str) -> None:
    from forge_ext.config import from_mapping
    from forge_ext.runtime.hosts import HostsConfig
    from forge_ext.runtime.placement import Placement

    hosts = from_mapping(HostsConfig, json.loads(hosts_json), "hosts")
    roles = [r for r in ("trainer", "reference", "generator")
             if r in json.loads(hosts_json) or r == "trainer"]
    placement = Placement(hosts, {r: hosts.role(r).hosts for r in roles}, output_dir=output_dir)
    began = time.perf_counter()
    try:
        await placement.start()
        started = time.perf_counter()
        procs = {r: [placement.spawn_procs(r)] for r in roles}
        where = await probe(procs)
        first_call = time.perf_counter()
        exposed = await placement.exposed_ports(procs)
        print(exposed, flush=True)  # what the app writes at its start
        record(out, placement, where, start_s=started - began, first_call_s=first_call - began,
               exposed=exposed)
    finally:
        placement.stop()


async def cancel_main(out: str, hosts_json: str, output_dir: str) -> None:
    from forge_ext.config import from_mapping
    from forge_ext.runtime.hosts import HostsConfig
    from forge_ext.runtime.placement import Placement

    hosts = from_mapping(HostsConfig, json.loads(hosts_json), "hosts")
    roles = [r for r in ("trainer", "reference", "generator")
             if r in json.loads(hosts_json) or r == "trainer"]
    placement = Placement(hosts, {r: hosts.role(r).hosts for r in roles}, output_dir=output_dir)
    start = asyncio.create_task(placement.start())
    deadline = time.monotonic() + 60
    while getattr(placement.job, "job_id", None) is None:  # not submitted yet
        if start.done() or time.monotonic() > deadline:
            raise RuntimeError(f"no job submitted: {start}")
        await asyncio.sleep(0.1)
    job_id = placement.job.job_id
    await asyncio.sleep(1)  # the start is in its wait for the job (squeue)
    start.cancel()
    try:
        await start
        outcome = "returned"
    except asyncio.CancelledError:
        outcome = "CancelledError"
    Path(out).write_text(json.dumps({"job_id": job_id, "outcome": outcome,
                                     "job_left": placement.job is not None}))
    print("cancelled", flush=True)
    await asyncio.to_thread(sys.stdin.readline)


def grpo_main(out: str, argv: list[str]) -> None:
    import apps.grpo.main as app_module

    class ProbedApp(app_module.RLApp):
        async def build_rollouts(self, step):
            rollouts = await super().build_rollouts(step)
            if step == 1:
                where = await probe({
                    "trainer": [self.trainer.procs],
                    "reference": [self.reference.trainer.procs],
                    "generator": [h.procs for h in self.generator.handles]})
                record(out, self.placement, where)
            return rollouts

    # main() builds the app it names: this one, with the probe.
    app_module.RLApp = ProbedApp
    try:
        app_module.main(argv)
    finally:
        app_module.shutdown_monarch()


if __name__ == "__main__":
    mode, out, *args = sys.argv[1:]
    if mode == "placement":
        asyncio.run(placement_main(out, *args))
    elif mode == "cancel":
        asyncio.run(cancel_main(out, *args))
    else:
        grpo_main(out, args)
