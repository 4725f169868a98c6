"""``hosts.launcher: slurm`` on a real Slurm cluster: Debian's Slurm 22.05 with 3 simulated
nodes on this machine (the session's ``slurm_cluster``, tests/slurm_cluster.py; partition
``all`` of 3 nodes, ``one`` of 1). Controllers run as programs of their own
(tests/slurm_driver.py, ``python -m apps.grpo.main``), as a user runs them:

- squeue 22.05's output is read as Monarch's SlurmJob needs it (forge_ext.compat.monarch_slurm);
- each role (group) gets a host mesh on nodes of its own, its procs under that node's worker;
  the workers run the controller's interpreter, the job's logs go to <output_dir>/slurm, each
  worker listens on its node's address only, on a port drawn for each run, and the run prints
  what it exposes once, "unauthenticated";
- the 2-step GRPO demo on 3 nodes (the trainer's torch.distributed world across 2 of them,
  reference and generator on the third: weights cross nodes) gives the held-out accuracy and
  losses of the same run on the ``processes`` launcher; neither run listens on every
  interface, the ``processes`` one only on loopback;
- a job that cannot start is cancelled after hosts.slurm.start_timeout_s (timed: a few
  seconds past it), with one line naming it, its state and Slurm's reason; SIGTERM and
  Ctrl-C during the wait cancel it, and so does a cancelled ``Placement.start`` by itself;
- a controller killed with SIGKILL leaves no job, worker or proc running beyond
  hosts.slurm.heartbeat_timeout_s (plus a poll and Slurm's kill).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import task_checkpoint
from listening import is_loopback, is_wildcard
from test_grpo_app import overrides

ROOT = Path(__file__).resolve().parent.parent
DRIVER = str(ROOT / "tests" / "slurm_driver.py")
DEMO = str(ROOT / "configs" / "grpo_cpu_demo.yaml")
# Every node here is this machine, whose host name resolves only to loopback: the controller
# listens on 127.0.0.1 (hosts.transport). A short heartbeat keeps the kill test short.
SLURM = ["hosts.launcher=slurm", "hosts.transport=localhost", "hosts.slurm.partition=all",
         "hosts.slurm.heartbeat_timeout_s=10"]
HOSTS = {"launcher": "slurm", "transport": "localhost",
         "slurm": {"partition": "all", "heartbeat_timeout_s": 10}}
# Seconds a run may take beyond hosts.slurm.start_timeout_s to give up on a job that cannot
# start: squeue's poll, scancel and the app's exit.
START_TIMEOUT_SLACK_S = 15
# Slurm's own processes in a job: srun listens on every interface for its step's I/O
# (Slurm's SrunPortRange, authenticated by munge), not a port of the run.
SLURM_OWN = ("srun", "slurmstepd")


@pytest.fixture
def slurm(slurm_cluster):
    """The session's cluster; no job of a test outlives it."""
    yield slurm_cluster
    left = slurm_cluster.active_jobs()
    slurm_cluster.cancel_all()
    assert not left, f"jobs still active after the test: {left}"


def run(cluster, argv, timeout, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=cluster.env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def wait_for(predicate, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"not within {timeout} s: {what}")


# ---- squeue of Slurm 22.05 ------------------------------------------------------------------
def test_squeue_of_this_slurm_is_read_as_monarch_reads_it(slurm):
    """A pending and a running job as squeue 22.05 lists them: state, reason, nodes; Monarch's
    own wait for a job's nodes reads them through the compat layer."""
    from forge_ext.compat import monarch_slurm

    def sbatch(*args):
        return slurm.run("sbatch", "--parsable", "--wrap", "sleep 300", *args).stdout.strip()

    running, pending = sbatch("-N", "2", "-p", "all"), sbatch("-N", "3", "-p", "one")
    os.environ["SLURM_CONF"] = slurm.env["SLURM_CONF"]  # what the compat layer's squeue reads
    try:
        info = wait_for(lambda: (i := monarch_slurm.job_info(running)) and
                        i.state == "RUNNING" and i, 30, "the 2-node job runs")
        assert info.nodes == ("127.0.1.1", "127.0.1.2")
        waiting = monarch_slurm.job_info(pending)
        assert (waiting.state, waiting.reason, waiting.nodes) == ("PENDING", "PartitionConfig", ())
        # Monarch's SlurmJob._wait_for_job_start, on what the compat layer hands it.
        job = object.__new__(monarch_slurm.SlurmJob)  # no __init__: it configures Monarch
        job._slurm_job_id, job._all_hostnames = None, []
        assert job._wait_for_job_start(running, 2, timeout=10) == ["127.0.1.1", "127.0.1.2"]
        assert monarch_slurm.job_info("999999") is None
    finally:
        del os.environ["SLURM_CONF"]
        slurm.cancel_all()


def test_squeue_lines_of_any_version_read_the_same():
    """squeue's plain ``%T|%r|%N`` (the same from Slurm 2.x to 25.x), without a cluster."""
    from forge_ext.compat.monarch_slurm import parse_squeue

    expand = {"gpu[01-02]": ["gpu01", "gpu02"]}.__getitem__
    running = parse_squeue("7", "RUNNING|None|gpu[01-02]\n", expand)
    assert (running.state, running.reason, running.nodes) == ("RUNNING", "None",
                                                              ("gpu01", "gpu02"))
    assert running.monarch_json() == {
        "job_id": "7", "job_state": ["RUNNING"], "state_reason": "None",
        "job_resources": {"nodes": {"allocation": [{"name": "gpu01"}, {"name": "gpu02"}]}}}
    pending = parse_squeue("8", "PENDING|Resources|", expand)
    assert pending.nodes == () and pending.why() == (
        "PENDING (Reason=Resources: the nodes it needs are busy with other jobs)")
    assert parse_squeue("9", "CANCELLED|None|gpu[01-02]", expand).nodes == ()


# ---- host meshes, defaults, where workers listen -------------------------------------------
def global_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (None if it has none)."""
    import ipaddress
    import socket

    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


@pytest.fixture(scope="module")
def placement(slurm_cluster, tmp_path_factory):
    """A placement of trainer, reference and generator (a node each) by
    tests/slurm_driver.py: its record."""
    output_dir = tmp_path_factory.mktemp("slurm_placement")
    out = output_dir / "record.json"
    hosts = {**HOSTS, "reference": {"hosts": 1}, "generator": {"hosts": 1}}
    result = run(slurm_cluster, [sys.executable, DRIVER, "placement", str(out),
                                 json.dumps(hosts), str(output_dir)], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not slurm_cluster.active_jobs() and not slurm_cluster.job_processes()
    return {**json.loads(out.read_text()), "output_dir": str(output_dir),
            "stdout": result.stdout}


def test_each_role_gets_a_host_mesh_on_a_node_of_its_own(placement):
    record = placement
    nodes = {role: [p["node"] for p in procs] for role, procs in record["roles"].items()}
    assert nodes == {"trainer": ["127.0.1.1"], "reference": ["127.0.1.2"],
                     "generator": ["127.0.1.3"]}
    assert {p["job"] for procs in record["roles"].values() for p in procs} == {record["job_id"]}
    workers = {r: [f"tcp://{n}:{record['port']}" for n in ns] for r, ns in nodes.items()}
    assert record["workers"] == workers
    # Each proc is a child of the worker listening on its node's address.
    worker_pid = {s["node"]: s["pid"] for s in record["listening"] if s["port"] == record["port"]}
    assert all(p["parent"] == worker_pid[p["node"]]
               for procs in record["roles"].values() for p in procs)
    print(f"sbatch -> first actor call: {record['first_call_s']:.1f} s "
          f"(job running, meshes attached: {record['start_s']:.1f} s)")


def test_workers_run_the_controllers_python_and_log_under_output_dir(placement):
    record = placement
    assert {p["exe"] for procs in record["roles"].values() for p in procs} == {sys.executable}
    log_dir = Path(record["output_dir"]) / "slurm"
    assert record["log_dir"] == str(log_dir)
    assert sorted(f.name for f in log_dir.iterdir()) == [
        f"forge_ext-{record['job_id']}.err", f"forge_ext-{record['job_id']}.out"]


def exposed_line(stdout: str) -> str:
    """The one line a run prints about its ports beyond loopback."""
    lines = [line for line in stdout.splitlines() if line.startswith("listening beyond")]
    assert len(lines) == 1, stdout
    return lines[0]


def test_workers_listen_on_their_node_address_on_a_port_drawn_per_run(placement, demo_runs):
    """Each worker listens on its node's address alone; nothing of the run listens on every
    interface; the port differs between two runs (this one and the demo's); the workers'
    addresses are printed, unauthenticated, and nothing else (the controller on loopback)."""
    sockets = [s for s in placement["listening"] if s["name"] not in SLURM_OWN]
    port = placement["port"]
    workers = sorted((s["node"], s["ip"]) for s in sockets if s["port"] == port)
    assert workers == [(n, n) for n in ("127.0.1.1", "127.0.1.2", "127.0.1.3")]
    assert not [s for s in sockets if is_wildcard(s["ip"])], sockets
    assert port != demo_runs["slurm"][0]["port"]
    assert exposed_line(placement["stdout"]) == (
        "listening beyond loopback, unauthenticated (whoever reaches these ports can run code "
        'as this user: see docs/hosts.md, "Security"): ' + "; ".join(
            f"{role} workers tcp://{node}:{port}" for role, node in (
                ("trainer", "127.0.1.1"), ("reference", "127.0.1.2"),
                ("generator", "127.0.1.3"))))


# ---- the GRPO demo on 3 nodes ---------------------------------------------------------------
# The held-out evaluation samples (eval.greedy=false, seeded by the step): the tiny random
# model answers no held-out prompt right greedily, and its partial-credit reward is then 0
# too, which two launchers would agree on whatever they did.
DEMO_RUN = ["loop.steps=2", "loop.save_every=0", "trainer.checkpoint.enable=false",
            "eval.greedy=false",
            "hosts.trainer.hosts=2", "trainer.parallelism.data_parallel_shard_degree=2",
            "trainer.training.local_batch_size=4",
            "hosts.reference.group=rollout", "hosts.generator.group=rollout"]


@pytest.fixture(scope="module")
def demo_runs(slurm_cluster, tmp_path_factory):
    """The 2-step demo (trainer over 2 hosts, reference and generator on a third) on the
    ``processes`` launcher and on Slurm, the same seed: ``{launcher: (record, metrics rows,
    seconds)}``."""
    checkpoint = task_checkpoint(tmp_path_factory.mktemp("slurm_demo_ckpt"))
    runs = {}
    address = global_address()  # the controller listens there: it must say so
    slurm = [*SLURM, f"hosts.transport=tcp://{address}:0"] if address else SLURM
    for launcher, extra in (("processes", ["hosts.launcher=processes"]), ("slurm", slurm)):
        output_dir = tmp_path_factory.mktemp(f"slurm_demo_{launcher}")
        out = output_dir / "record.json"
        began = time.perf_counter()
        result = run(slurm_cluster, [sys.executable, DRIVER, "grpo", str(out), "--config", DEMO,
                                     *overrides(checkpoint, output_dir, *DEMO_RUN, *extra)],
                     timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        rows = [json.loads(line) for line in open(output_dir / "metrics.jsonl")]
        record = {**json.loads(out.read_text()), "stdout": result.stdout, "address": address}
        runs[launcher] = (record, rows, time.perf_counter() - began)
    assert not slurm_cluster.active_jobs() and not slurm_cluster.job_processes()
    return runs


def test_the_trainers_world_spans_two_nodes(demo_runs):
    record = demo_runs["slurm"][0]
    trainer = record["roles"]["trainer"]
    assert [(p["RANK"], p["node"]) for p in trainer] == [("0", "127.0.1.1"), ("1", "127.0.1.2")]
    assert {p["WORLD_SIZE"] for p in trainer} == {"2"}
    assert {p["MASTER_ADDR"] for p in trainer} == {trainer[0]["hostname"]}
    assert [p["node"] for p in record["roles"]["reference"] + record["roles"]["generator"]] \
        == ["127.0.1.3", "127.0.1.3"]


def test_the_demo_on_three_nodes_equals_the_processes_launchers(demo_runs):
    """Same seed, same layout: the same losses, rewards and held-out accuracy; each step
    trained on samples of the version pushed from the trainer's nodes to the generator's."""
    (_, processes, p_s), (_, slurm, s_s) = demo_runs["processes"], demo_runs["slurm"]
    print(f"2-step demo: processes {p_s:.0f} s, slurm {s_s:.0f} s")
    keys = ("loss", "reward/mean", "eval/accuracy", "eval/reward", "policy_version",
            "generator_version")
    for a, b in zip(processes, slurm, strict=True):
        assert a["step"] == b["step"]
        for key in keys:
            assert (key in a) == (key in b), key
            if key in a:  # the same but for float rounding (procs' thread counts may differ)
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    evals = [r["eval/reward"] for r in slurm if "eval/reward" in r]
    assert len(evals) == 2 and max(evals) > 0  # the baseline and step 2, not all wrong
    assert [r["generator_version"] for r in slurm if "loss" in r] == [0, 1]


def test_no_process_of_either_run_listens_on_every_interface(demo_runs):
    """``processes``: loopback only, and nothing printed. Slurm: each process on loopback or
    its node's address (the simulated nodes' addresses are loopback addresses too; the
    controller's, this machine's global address), never 0.0.0.0 or ::; what is beyond
    loopback is printed once: the workers, the controller's (and its local procs') ports."""
    processes = demo_runs["processes"][0]
    assert processes["listening"] and [
        s for s in processes["listening"] if not is_loopback(s["ip"])] == []
    assert "listening beyond" not in processes["stdout"]
    record = demo_runs["slurm"][0]
    slurm = [s for s in record["listening"] if s["name"] not in SLURM_OWN]
    assert slurm and [s for s in slurm if is_wildcard(s["ip"])] == []
    controller = [s for s in slurm if s["node"] is None]
    assert all(is_loopback(s["ip"]) or s["ip"] in (s["node"], record["address"])
               for s in slurm), slurm
    line = exposed_line(record["stdout"])
    assert "unauthenticated" in line and 'docs/hosts.md, "Security"' in line
    for group, workers in record["workers"].items():
        assert f"{group} workers {', '.join(workers)}" in line
    beyond = sorted((s["ip"], s["port"]) for s in controller if not is_loopback(s["ip"]))
    if record["address"]:
        assert beyond and line.endswith(
            "; controller " + ", ".join(f"{ip}:{port}" for ip, port in beyond))


# ---- faults ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_checkpoint_small(tmp_path_factory):
    return task_checkpoint(tmp_path_factory.mktemp("slurm_fault_ckpt"))


def start_app(cluster, checkpoint, output_dir, *extra) -> subprocess.Popen:
    """``python -m apps.grpo.main`` of the demo on the cluster, in the background; its
    ``known_jobs`` are the jobs Slurm listed before (ended ones stay listed a minute)."""
    argv = [sys.executable, "-m", "apps.grpo.main", "--config", DEMO,
            *overrides(checkpoint, output_dir, *SLURM, *extra)]
    app = subprocess.Popen(argv, env=cluster.env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    app.known_jobs = set(cluster.jobs())
    return app


def its_job(cluster, app, timeout: float = 120) -> str:
    """The one job ``app`` submitted."""
    jobs = wait_for(lambda: set(cluster.jobs()) - app.known_jobs, timeout,
                    "the run submits its job")
    assert len(jobs) == 1, jobs
    return jobs.pop()


def test_a_job_that_cannot_start_is_cancelled_naming_its_state_and_reason(
        slurm, demo_checkpoint_small, tmp_path):
    """Three nodes asked of the one-node partition: PENDING (PartitionConfig) for ever. The
    run stops after hosts.slurm.start_timeout_s with one line, the job cancelled."""
    app = start_app(slurm, demo_checkpoint_small, tmp_path, "hosts.slurm.partition=one",
                    "hosts.slurm.start_timeout_s=3")
    try:
        job = its_job(slurm, app)
        submitted = time.monotonic()
        try:
            out, err = app.communicate(timeout=3 + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run still waits for job {job} {time.monotonic() - submitted:.0f} "
                        "s after submitting it, with hosts.slurm.start_timeout_s=3")
        seconds = time.monotonic() - submitted
    finally:
        app.kill()
    print(f"submitted -> exit: {seconds:.1f} s")
    assert app.returncode == 1, err
    # The wait, squeue's poll (0.5 s), scancel and the app's exit; not the test's own limit.
    assert 3 - 1 < seconds < 3 + START_TIMEOUT_SLACK_S, (
        f"the run stopped {seconds:.1f} s after submitting job {job}, with "
        "hosts.slurm.start_timeout_s=3")
    assert err.strip().splitlines()[-1] == (
        f"error: Slurm job {job} did not start within hosts.slurm.start_timeout_s=3: PENDING "
        "(Reason=PartitionConfig: the job asks for more than its partition has (nodes, GPUs, "
        "time)); it was cancelled. Raise hosts.slurm.start_timeout_s to wait longer, or ask "
        "for fewer nodes or another partition (`sinfo`, `scontrol show partition`)")
    assert slurm.jobs()[job] == "CANCELLED"


def test_a_cancelled_start_cancels_the_job_it_waits_for(slurm, tmp_path):
    """Placement.start's own promise (the apps also stop their placement in a ``finally``,
    which hid its loss): a start cancelled while it waits for a job that cannot start
    (three nodes of the one-node partition, no start timeout) ends with CancelledError and
    leaves no job: the job is CANCELLED while the process that submitted it still lives."""
    out = tmp_path / "record.json"
    hosts = {**HOSTS, "slurm": {**HOSTS["slurm"], "partition": "one", "start_timeout_s": 0},
             "reference": {"hosts": 1}, "generator": {"hosts": 1}}
    driver = subprocess.Popen([sys.executable, DRIVER, "cancel", str(out), json.dumps(hosts),
                               str(tmp_path)], env=slurm.env, cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Once the cancelled start has returned (imports, sbatch and the wait: seconds).
        assert select.select([driver.stdout], [], [], 120)[0], "no word from the driver in 120 s"
        line = driver.stdout.readline()
        assert line == "cancelled\n", driver.communicate(timeout=30)[1][-3000:]
        record = json.loads(out.read_text())
        assert record["outcome"] == "CancelledError"
        job = record["job_id"]
        wait_for(lambda: slurm.jobs().get(job) == "CANCELLED", 10,
                 f"job {job} cancelled by its cancelled start")
        assert not record["job_left"]  # the placement let go of it
        driver.stdin.close()
        assert driver.wait(timeout=60) == 0, driver.stderr.read()[-3000:]
    finally:
        driver.kill()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_while_the_job_waits_cancels_it(slurm, demo_checkpoint_small,
                                                          tmp_path, signum):
    app = start_app(slurm, demo_checkpoint_small, tmp_path, "hosts.slurm.partition=one",
                    "hosts.slurm.start_timeout_s=0")
    try:
        job = its_job(slurm, app)
        sent = time.monotonic()
        app.send_signal(signum)
        out, err = app.communicate(timeout=60)
        seconds = time.monotonic() - sent
    finally:
        app.kill()
    print(f"{signal.Signals(signum).name} -> exit: {seconds:.1f} s")
    assert app.returncode == 128 + signum, err  # 143 for SIGTERM, 130 for Ctrl-C
    assert "stopping now (the run was still starting)" in out
    assert slurm.jobs()[job] == "CANCELLED"
    assert seconds < 20, f"the run exited {seconds:.1f} s after {signal.Signals(signum).name}"


def test_a_controller_killed_with_sigkill_leaves_no_job_running(slurm, demo_checkpoint_small,
                                                                 tmp_path):
    """kill -9 of the controller once the roles' procs run on the nodes: the job cancels
    itself once the heartbeat stops (hosts.slurm.heartbeat_timeout_s=10), workers and procs
    with it."""
    app = start_app(slurm, demo_checkpoint_small, tmp_path, "loop.steps=1000")
    try:
        job = its_job(slurm, app)

        def procs_running():  # a proc Monarch spawned on every node (trainer, reference, ...)
            import psutil

            cmdlines = []
            for pid in slurm.job_processes():
                try:
                    cmdlines.append(" ".join(psutil.Process(pid).cmdline()))
                except psutil.Error:  # ended (or a zombie) since it was listed
                    pass
            return sum("bootstrap_main" in c for c in cmdlines) >= 3

        wait_for(procs_running, 180, "the roles' procs run on the nodes", step=1)
        app.kill()
        killed = time.monotonic()
        app.wait()
        wait_for(lambda: not slurm.active_jobs() and not slurm.job_processes(), 60,
                 "the job and its processes end", step=0.5)
        seconds = time.monotonic() - killed
    finally:
        app.kill()
    print(f"controller SIGKILL -> job {job} and its processes gone: {seconds:.1f} s")
    assert slurm.jobs()[job] == "CANCELLED"
    # The heartbeat timeout, a poll, Slurm's SIGTERM -> SIGKILL (KillWait 5).
    assert seconds < 10 + 5 + 15, (
        f"job {job} and its processes outlived the controller by {seconds:.1f} s, with "
        "hosts.slurm.heartbeat_timeout_s=10")
