"""Which TCP sockets a run's processes listen on (tests of what a run exposes)."""

from __future__ import annotations

import ipaddress

import psutil


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    except OSError:
        return {}
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def run_processes(root: int, slurm_job: str | None = None) -> list[int]:
    """``root`` and its descendants, plus (``slurm_job``) every process of that Slurm job on
    this machine (those whose environment holds ``SLURM_JOB_ID=<job>``) and theirs."""
    pids = set()
    roots = [root]
    if slurm_job is not None:
        roots += [p.pid for p in psutil.process_iter()
                  if _environ(p.pid).get("SLURM_JOB_ID") == str(slurm_job)]
    for pid in roots:
        try:
            process = psutil.Process(pid)
            pids |= {pid, *(c.pid for c in process.children(recursive=True))}
        except psutil.Error:
            pass
    return sorted(pids)


def listening_sockets(pids) -> list[dict]:
    """The TCP sockets in LISTEN state of ``pids``: ``{pid, name, ip, port, node}``, ``node``
    the Slurm node a process runs on (``SLURMD_NODENAME``; None outside a job)."""
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            connections = process.net_connections(kind="inet")
            name = process.name()
        except psutil.Error:
            continue
        for c in connections:
            if c.status == psutil.CONN_LISTEN:
                found.append({"pid": pid, "name": name, "ip": c.laddr.ip, "port": c.laddr.port,
                              "node": _environ(pid).get("SLURMD_NODENAME")})
    return found


def is_wildcard(ip: str) -> bool:
    """0.0.0.0 or :: (every interface)."""
    return ipaddress.ip_address(ip.split("%")[0]).is_unspecified


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if getattr(address, "ipv4_mapped", None):
        address = address.ipv4_mapped
    return address.is_loopback
