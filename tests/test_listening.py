"""What a run listens on, and where the controller listens for its workers, without a
cluster (the real ones: tests/test_slurm.py):

- a torch.distributed world rendezvousing on 127.0.0.1 (every rank on this machine: the
  ``local`` and ``processes`` launchers) listens on loopback only, its store and gloo alike
  (torch's own store binds every interface);
- ``hosts.transport``: its values and errors, and the controller's host name resolving only
  to loopback is one error naming the field and the fix, before anything is submitted.
"""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from forge_ext.runtime.hosts import HostsConfig, SlurmHosts
from forge_ext.runtime.placement import Placement, PlacementError

ROOT = Path(__file__).resolve().parent.parent

WORLD = """
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from forge_ext.engine.distributed import free_port, rendezvous_on_master_addr
from listening import listening_sockets
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port()))
with rendezvous_on_master_addr():
    dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
print(json.dumps(listening_sockets([os.getpid()])))
"""


def test_a_world_on_this_machine_listens_on_loopback_only():
    out = subprocess.run([sys.executable, "-c", WORLD.format(tests=str(ROOT / "tests"))],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    sockets = json.loads(out.stdout.splitlines()[-1])
    assert len(sockets) >= 2  # the store and gloo's pair
    assert {s["ip"] for s in sockets} == {"127.0.0.1"}, sockets


@pytest.mark.parametrize("hosts, message", [
    (dict(launcher="processes", transport="localhost"),
     "hosts.transport='localhost' is for the slurm and attach launchers"),
    (dict(launcher="slurm", slurm=SlurmHosts(partition="p"), transport="tcp://0.0.0.0"),
     "hosts.transport='tcp://0.0.0.0' must be 'hostname', 'localhost' or tcp://<address>"),
    (dict(launcher="slurm", slurm=SlurmHosts(partition="p", heartbeat_timeout_s=2)),
     "hosts.slurm.heartbeat_timeout_s=2 is shorter than a few heartbeats"),
    (dict(launcher="slurm", slurm=SlurmHosts(partition="p", start_timeout_s=-1)),
     "hosts.slurm.start_timeout_s=-1 must be >= 0"),
    (dict(launcher="slurm", slurm=SlurmHosts(partition="p", port=70000)),
     "hosts.slurm.port=70000 must be a TCP port"),
])
def test_hosts_transport_and_slurm_errors_name_the_field(hosts, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HostsConfig(**hosts)


@pytest.mark.parametrize("transport", ["hostname", "localhost", "tcp://10.1.2.3:0",
                                       "tcp://[fd00::1]:26600"])
def test_hosts_transport_values(transport):
    assert HostsConfig(launcher="attach", transport=transport).transport == transport


def test_a_host_name_on_loopback_only_is_one_error_before_anything_is_submitted(monkeypatch):
    """Monarch's TcpWithHostname panics on it ("hostname resolved to no non-loopback,
    non-link-local address"); here the run stops first, naming hosts.transport and an
    address of this machine to set it to."""
    import forge_ext.runtime.placement as placement_module

    monkeypatch.setattr(placement_module, "_host_name_addresses", lambda: ["127.0.0.1"])
    monkeypatch.setattr(placement_module, "_interface_addresses",
                        lambda: ["127.0.0.1", "::1", "192.0.2.7"])
    monkeypatch.setattr(placement_module.socket, "gethostname", lambda: "vm")
    submitted = []
    monkeypatch.setattr(placement_module.subprocess, "run",
                        lambda *a, **k: submitted.append(a))
    placement = Placement(HostsConfig(launcher="slurm", slurm=SlurmHosts(partition="p")),
                          {"trainer": 1})
    with pytest.raises(PlacementError) as error:
        asyncio.run(placement.start())
    assert str(error.value) == (
        "this machine's host name 'vm' resolves only to 127.0.0.1, which workers on other "
        "nodes cannot dial: set hosts.transport=tcp://192.0.2.7:0 (this machine's address on "
        "the cluster network), or hosts.transport=localhost when every worker is on this "
        "machine")
    assert submitted == [] and placement.job is None
