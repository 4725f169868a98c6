"""Weight-push benchmark: ``WeightsPublisher`` transports versus plain torchstore, side by side.

Run from the repository root::

    .venv/bin/python -m bench.push_weights                      # 60 MB, 346 MB, 1.19 GB, 2.0 GB
    .venv/bin/python -m bench.push_weights --hidden 1536        # 4.4 GB
    .venv/bin/python -m bench.push_weights --chunk-mb 32 --reps 5

For each model size, the same fp32 tensors (a Qwen3-shaped decoder: 28 layers of
q/k/v/o/q_norm/k_norm/gate/up/down/2 layernorms, vocab 32000, embeddings + final norm +
untied lm_head: 311 tensors, the count of Qwen3-0.6B) are pushed by:

- ``copy_``: ``Tensor.copy_`` of every tensor into an already-touched ("warm") buffer of
  the same bytes in this process: the memory-copy ceiling of any same-host transport (the
  ``same-host/copy_`` ratio divides by copies timed right before each same-host push, see
  :func:`measure`);
- ``per-param``: torchforge's seed, one awaited ``ts.put`` per parameter (the baseline);
- ``put_state_dict``: one ``ts.put_state_dict`` of the same tensors (the raw ceiling the
  issue compares against);
- ``same-host``: ``WeightsPublisher.publish`` with ``weights.transport=direct`` and
  ``same_host=auto`` (the default on one host): the tensors go into the publisher's reused
  shared-memory slots, torchstore gets the commit record; one publisher for all runs, as in
  a trainer (the warm-up publishes ``keep_versions + 1`` versions, so every slot is warm);
- ``direct``: the same with ``same_host=off`` (chunks over Monarch RPC, what a reader on
  another host needs);
- ``rdma``: ``direct`` with ``same_host=off`` over torchstore's RDMA branch, through Monarch's
  TCP fallback here (``forge_ext.compat.torchstore_rdma``; ibverbs on a cluster);
- ``dcp``: ``WeightsPublisher.publish`` with DCP files under ``--dcp-dir``.

Preflight check and commit record are included. Effective GB/s = model bytes / wall seconds
of the push, median over ``--reps`` runs after one warm-up run of the same method; keys and
files are deleted between runs (not timed).
Each method gets a torchstore of its own (a fresh storage volume proc), as in a trainer that
only ever pushes one way: a volume whose allocator served another method's pattern (e.g. 311
differently sized tensors, freed) slows the next method's pushes by up to 1.5x. Wall time
depends on what else runs on the machine, so the CPU seconds the push cost (this process
plus its child procs, i.e. the storage volume; from /proc) are reported too, as GB per
CPU-second: on a shared or loaded machine that column is the stable one (the load average
is printed). A second table times the read side: ``copy_`` of the tensors from one warm
buffer into another (the ceiling), ``ts.get_state_dict`` versus ``fetch_weights`` for each
transport (same host: into fresh tensors, as by default, and into a warm buffer through
``fetch_weights(allocate=...)``, as a generator that keeps its buffer), each checked for exact
equality with the pushed tensors. One torchstore storage volume in its own proc.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import torch
import torchstore as ts
from monarch.actor import this_host
from torchstore.api import DEFAULT_TORCHSTORE_NAME
from torchstore.transport.buffers import rdma_available

from forge_ext.compat import torchstore_rdma
from forge_ext.compat.torchstore_monarch import initialize_store
from forge_ext.weights import publish as weights_publish
from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.transports.direct import MAX_INFLIGHT_PUTS
from forge_ext.weights.fetch import fetch_weights

LAYERS, VOCAB, HEAD_DIM = 28, 32000, 128
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and its live children (the
    Monarch procs torchstore spawned, the storage volume among them)."""
    me = os.getpid()
    with open(f"/proc/{me}/task/{me}/children") as f:
        pids = [me, *map(int, f.read().split())]
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / CLOCK_TICKS


class Timer:
    """Wall and process-tree CPU seconds of a block."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), tree_cpu_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = tree_cpu_seconds() - self.cpu


def decoder_state_dict(hidden: int) -> dict[str, torch.Tensor]:
    """Qwen3-style HF names/shapes (heads = hidden / 64, kv heads = heads / 2, ffn = 3 x)."""
    heads = max(1, hidden // 64)
    kv_heads = max(1, heads // 2)
    inter = 3 * hidden
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    sd = {"model.embed_tokens.weight": randn(VOCAB, hidden)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = randn(heads * HEAD_DIM, hidden)
        sd[p + "self_attn.k_proj.weight"] = randn(kv_heads * HEAD_DIM, hidden)
        sd[p + "self_attn.v_proj.weight"] = randn(kv_heads * HEAD_DIM, hidden)
        sd[p + "self_attn.o_proj.weight"] = randn(hidden, heads * HEAD_DIM)
        sd[p + "self_attn.q_norm.weight"] = randn(HEAD_DIM)
        sd[p + "self_attn.k_norm.weight"] = randn(HEAD_DIM)
        sd[p + "mlp.gate_proj.weight"] = randn(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = randn(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = randn(hidden, inter)
        sd[p + "input_layernorm.weight"] = randn(hidden)
        sd[p + "post_attention_layernorm.weight"] = randn(hidden)
    sd["model.norm.weight"] = randn(hidden)
    sd["lm_head.weight"] = randn(VOCAB, hidden)
    return sd


def warm_buffer(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors shaped like ``sd`` in one buffer whose pages are already touched."""
    flat = torch.zeros(sum(t.numel() * t.element_size() for t in sd.values()), dtype=torch.uint8)
    views, offset = {}, 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        views[name] = flat[offset : offset + nbytes].view(t.dtype).view(t.shape)
        offset += nbytes
    return views


class Bench:
    def __init__(self, sd: dict[str, torch.Tensor], chunk_mb: int, dcp_dir: str) -> None:
        self.sd = sd
        self.chunk_mb = chunk_mb
        self.dcp_dir = dcp_dir
        self.run = 0
        self.store = DEFAULT_TORCHSTORE_NAME  # the store the methods use
        self.warm = warm_buffer(sd)  # copy_'s destination
        self.same_host_publisher: weights_publish.WeightsPublisher | None = None
        self.version = 0  # of same_host_publisher

    @contextlib.asynccontextmanager
    async def fresh_store(self, name: str) -> AsyncIterator[None]:
        """Run the methods against a new torchstore whose storage volume gets a proc of its
        own, stopped afterwards."""
        self.run += 1
        self.store = f"bench_{name}_{self.run}"
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            await initialize_store(store_name=self.store, mesh=procs)
            yield
        finally:
            if self.same_host_publisher is not None:
                self.same_host_publisher.close()
                self.same_host_publisher = None
            await ts.shutdown(self.store)
            await procs.stop()

    def _publisher(
        self, transport: str, prefix: str, same_host: str = "off"
    ) -> weights_publish.WeightsPublisher:
        config = WeightsConfig(
            transport=transport,
            dcp_path=os.path.join(self.dcp_dir, prefix),
            key_prefix=prefix,
            chunk_mb=self.chunk_mb,
            same_host=same_host,
        )
        return weights_publish.WeightsPublisher(config, store_name=self.store)

    # Push methods: store self.sd under `prefix`.
    async def copy(self, prefix: str) -> None:
        for name, tensor in self.sd.items():
            self.warm[name].copy_(tensor)

    async def per_param(self, prefix: str) -> None:
        for name, tensor in self.sd.items():
            await ts.put(f"{prefix}.{name}", tensor, store_name=self.store)

    async def put_state_dict(self, prefix: str) -> None:
        await ts.put_state_dict(self.sd, prefix, store_name=self.store)

    async def same_host(self, prefix: str) -> None:
        """One publisher for every run in this store (its slots persist), a new version each
        run under the first prefix; retention deletes old versions, not cleanup."""
        if self.same_host_publisher is None:
            self.same_host_publisher = self._publisher("direct", prefix, same_host="auto")
        self.version += 1
        result = await self.same_host_publisher.publish(self.sd, self.version)
        assert result.same_host

    async def direct(self, prefix: str) -> None:
        await self._publisher("direct", prefix).publish(self.sd, 0)

    async def rdma(self, prefix: str) -> None:
        torchstore_rdma.use_tcp_fallback(True)
        try:
            result = await self._publisher("direct", prefix).publish(self.sd, 0)
        finally:
            torchstore_rdma.use_tcp_fallback(None)
        assert result.rdma

    async def dcp(self, prefix: str) -> None:
        await self._publisher("dcp", prefix).publish(self.sd, 0)

    async def cleanup(self, prefix: str) -> None:
        if prefix.startswith("put_state_dict"):
            # put_state_dict keys are "<prefix>/<name>": no '.'-boundary prefix lists them.
            for name in [*self.sd, "MAPPING"]:
                await ts.delete(f"{prefix}/{name}", store_name=self.store)
        else:
            client = await ts.client(self.store)
            for key in await client.keys(prefix):
                await ts.delete(key, store_name=self.store)
        shutil.rmtree(os.path.join(self.dcp_dir, prefix), ignore_errors=True)

    async def fetch(self, method: str, prefix: str) -> Timer:
        version = self.version if method.startswith("same-host") else 0
        warm = self.fetch_buffer if method in ("copy_", "same-host warm") else None
        torchstore_rdma.use_tcp_fallback(method == "rdma" or None)
        try:
            with Timer() as timer:
                if method == "copy_":
                    for name, tensor in self.warm.items():
                        warm[name].copy_(tensor)
                    got = warm
                elif method == "get_state_dict":
                    got = await ts.get_state_dict(prefix, store_name=self.store)
                else:
                    got = await fetch_weights(
                        version, key_prefix=prefix, store_name=self.store,
                        allocate=warm and (lambda specs: warm),
                    )
        finally:
            torchstore_rdma.use_tcp_fallback(None)
        assert list(got) == list(self.sd), method
        assert all(torch.equal(got[n], t) for n, t in self.sd.items()), method
        return timer


Medians = dict[str, tuple[float, float]]  # method -> (wall seconds, CPU seconds)


def medians(timers: dict[str, list[Timer]]) -> Medians:
    return {
        m: (statistics.median(t.wall for t in ts_), statistics.median(t.cpu for t in ts_))
        for m, ts_ in timers.items()
    }


async def measure(
    methods: dict[str, Callable[[str], Awaitable[None]]], bench: Bench, reps: int
) -> tuple[Medians, Medians]:
    """Median wall and CPU seconds per method: one method at a time, each in a fresh store,
    untimed warm-up runs (one; ``same-host``: one per slot, so that every slot is warm) then
    ``reps`` timed runs. Why not interleaved: the storage volume's allocator state left by
    one method slows the next one (see the module docstring); a trainer pushing every step
    only ever sees its own pattern.

    Also returns, for ``same-host``, the median of a ``copy_`` of the same bytes timed right
    before each of its runs (``copy_`` uses no store): the ratio of the two compares pushes
    and copies made within milliseconds of each other, while this machine's copy speed drifts
    by up to 2x from one minute to the next (measured 3.6 to 7.6 GB/s)."""
    timers: dict[str, list[Timer]] = {m: [] for m in methods}
    paired: dict[str, list[Timer]] = {"same-host": []}
    slots = WeightsConfig().keep_versions + 1
    for name, push in methods.items():
        async with bench.fresh_store(name):
            for rep in range(-(slots if name == "same-host" else 1), reps):
                prefix = f"{name.replace('-', '_')}_{max(rep + 1, 0)}"
                if name in paired and rep >= 0:
                    with Timer() as timer:
                        await bench.copy(prefix)
                    paired[name].append(timer)
                with Timer() as timer:
                    await push(prefix)
                if rep >= 0:
                    timers[name].append(timer)
                if name != "same-host":  # its publisher's retention deletes old versions
                    await bench.cleanup(prefix)
    return medians(timers), medians({m: t for m, t in paired.items() if t})


async def measure_fetch(bench: Bench, reps: int) -> Medians:
    """Median seconds of the read side; each version is pushed once, read ``reps`` times
    (after one untimed read each, which touches the destination and the mappings)."""
    prefixes = {
        "copy_": "", "get_state_dict": "put_state_dict_fetch", "same-host": "same_host_fetch",
        "same-host warm": "same_host_fetch", "direct": "direct_fetch", "rdma": "rdma_fetch",
        "dcp": "dcp_fetch",
    }
    await bench.copy("")  # the copy_ source is the warm buffer
    bench.fetch_buffer = warm_buffer(bench.sd)
    async with bench.fresh_store("fetch"):
        await bench.put_state_dict(prefixes["get_state_dict"])
        await bench.same_host(prefixes["same-host"])
        await bench.direct(prefixes["direct"])
        await bench.rdma(prefixes["rdma"])
        await bench.dcp(prefixes["dcp"])
        timers: dict[str, list[Timer]] = {m: [] for m in prefixes}
        for rep in range(-1, reps):
            for method, prefix in prefixes.items():
                timer = await bench.fetch(method, prefix)
                if rep >= 0:
                    timers[method].append(timer)
        for method, prefix in prefixes.items():
            if prefix and not method.startswith("same-host"):
                await bench.cleanup(prefix)
    del bench.fetch_buffer
    return medians(timers)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def rows_for(
    nbytes: int, tensors: int, result: Medians, ratios: list[tuple[str, str]],
    copies_next_to: Medians | None = None,
) -> tuple[list[str], list[str]]:
    """A row of wall GB/s and a row of GB per CPU-second, each ending with the rate ratios
    ``a / b`` for each pair in ``ratios``; ``a / copy_`` takes ``copies_next_to[a]`` (the
    copies timed next to ``a``'s runs, see :func:`measure`) where there is one."""
    rows = []
    for index in (0, 1):  # wall, CPU
        rate = {m: nbytes / result[m][index] / 1e9 for m in result}
        paired = {m: nbytes / t[index] / 1e9 for m, t in (copies_next_to or {}).items()}
        rows.append([
            f"{nbytes / 1e6:.0f}", str(tensors), *(f"{rate[m]:.3f}" for m in result),
            *(f"{rate[a] / (paired.get(a, rate[b]) if b == 'copy_' else rate[b]):.2f}x"
              for a, b in ratios),
        ])
    return rows[0], rows[1]


PUSH_METHODS = ["copy_", "per-param", "put_state_dict", "same-host", "direct", "rdma", "dcp"]
PUSH_RATIOS = [
    ("same-host", "copy_"), ("same-host", "per-param"), ("direct", "per-param"),
    ("rdma", "per-param"), ("dcp", "per-param"),
]
FETCH_METHODS = [
    "copy_", "get_state_dict", "same-host", "same-host warm", "direct", "rdma", "dcp",
]
FETCH_RATIOS = [
    ("same-host warm", "copy_"), ("same-host", "get_state_dict"),
    ("same-host warm", "get_state_dict"), ("direct", "get_state_dict"),
]


async def measure_size(args: argparse.Namespace, hidden: int) -> dict[str, list[list[str]]]:
    """Rows of the four tables for one model size."""
    dcp_dir = args.dcp_dir or tempfile.mkdtemp(prefix="push_weights_")
    rows: dict[str, list[list[str]]] = {"push": [], "push_cpu": [], "fetch": [], "fetch_cpu": []}
    try:
        sd = decoder_state_dict(hidden)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        bench = Bench(sd, args.chunk_mb, dcp_dir)
        pushes = [
            bench.copy, bench.per_param, bench.put_state_dict, bench.same_host, bench.direct,
            bench.rdma, bench.dcp,
        ]
        methods = dict(zip(PUSH_METHODS, pushes))
        push, copies_next_to = await measure(methods, bench, args.reps)
        print(f"push  {nbytes / 1e6:.0f} MB: " + ", ".join(
            f"{m} {w:.2f} s ({c:.2f} CPU-s)" for m, (w, c) in push.items()), flush=True)
        wall, cpu = rows_for(nbytes, len(sd), push, PUSH_RATIOS, copies_next_to)
        rows["push"].append(wall)
        rows["push_cpu"].append(cpu)
        if not args.no_fetch:
            fetch = await measure_fetch(bench, args.reps)
            print(f"fetch {nbytes / 1e6:.0f} MB: " + ", ".join(
                f"{m} {w:.2f} s ({c:.2f} CPU-s)" for m, (w, c) in fetch.items()), flush=True)
            wall, cpu = rows_for(nbytes, len(sd), fetch, FETCH_RATIOS)
            rows["fetch"].append(wall)
            rows["fetch_cpu"].append(cpu)
    finally:
        if not args.dcp_dir:
            shutil.rmtree(dcp_dir, ignore_errors=True)
    return rows


def main(args: argparse.Namespace) -> None:
    if args.rows_to is not None:  # a child run: one size, rows to a file
        (hidden,) = args.hidden
        with open(args.rows_to, "w") as f:
            json.dump(asyncio.run(measure_size(args, hidden)), f)
        return
    print(
        f"torchstore transport: {'RDMA' if rdma_available() else 'Monarch RPC'}; "
        f"direct chunk_mb={args.chunk_mb}, {MAX_INFLIGHT_PUTS} puts in flight; "
        f"{args.reps} reps (median); {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; each model size in a process of its own",
        flush=True,
    )
    # Why a process per size: the controller's heap after a larger or smaller model makes
    # every method slower (measured up to 2x at 1.2 GB after the 60 and 346 MB runs).
    tables: dict[str, list[list[str]]] = {"push": [], "push_cpu": [], "fetch": [], "fetch_cpu": []}
    for hidden in args.hidden:
        with tempfile.NamedTemporaryFile(suffix=".json") as rows_file:
            command = [
                sys.executable, "-m", "bench.push_weights", "--hidden", str(hidden),
                "--reps", str(args.reps), "--chunk-mb", str(args.chunk_mb),
                "--rows-to", rows_file.name,
                *(["--dcp-dir", args.dcp_dir] if args.dcp_dir else []),
                *(["--no-fetch"] if args.no_fetch else []),
            ]
            subprocess.run(command, check=True)
            for name, rows in json.load(rows_file).items():
                tables[name] += rows
    push_header = ["MB", "tensors", *PUSH_METHODS, *(f"{a}/{b}" for a, b in PUSH_RATIOS)]
    fetch_header = ["MB", "tensors", *FETCH_METHODS, *(f"{a}/{b}" for a, b in FETCH_RATIOS)]
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    print("\nPush, effective GB/s (model bytes / wall seconds):")
    print(table(push_header, tables["push"]))
    print("\nPush, GB per CPU-second (this process + storage volume):")
    print(table(push_header, tables["push_cpu"]))
    if tables["fetch"]:
        print("\nFetch to the controller, effective GB/s:")
        print(table(fetch_header, tables["fetch"]))
        print("\nFetch, GB per CPU-second:")
        print(table(fetch_header, tables["fetch_cpu"]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=[128, 384, 768, 1024],
        help="decoder hidden sizes, one model each (fp32: 128: 60 MB, 384: 346 MB, 768: 1.19 GB, "
        "1024: 2.0 GB, 1536: 4.4 GB)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-mb", type=int, default=WeightsConfig().chunk_mb)
    parser.add_argument("--dcp-dir", default=None, help="default: a temporary folder")
    parser.add_argument("--no-fetch", action="store_true", help="skip the read-side table")
    parser.add_argument("--rows-to", default=None, help=argparse.SUPPRESS)  # child runs
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
