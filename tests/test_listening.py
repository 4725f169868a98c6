"""What a run listens on, and where the controller listens for its workers, without a
cluster (the real ones: tests/test_slurm.py):

- ``hosts.transport``: its values and errors, and the controller's host name resolving only
  to loopback is one error naming the field and the fix, before anything is submitted.
"""

import asyncio

import pytest

from forge_ext.placement import HostsConfig, Placement, PlacementError, SlurmHosts


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
    import forge_ext.placement as placement_module

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
