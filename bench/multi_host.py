"""Multi-host benchmark: the trainer on 1 versus 2 (simulated) hosts, same total procs, as ratios.

Run from the repository root (the worker processes import this module)::

    .venv/bin/python -m bench.multi_host                     # qwen3 debugmodel, 2 procs
    .venv/bin/python -m bench.multi_host --flavor small --reps 5

Two trainers of the same model, DP=2 by FSDP (each rank holds half of every parameter), both
placed through :mod:`forge_ext.runtime.placement` with the ``processes`` launcher (each host a
Monarch worker process, ``ProcessJob``), alive side by side:

- ``1 host x 2 procs``: both ranks on one host;
- ``2 hosts x 1 proc``: one rank per host.

Each has a reader (a proc on a host of its own, as a generator would be). Per round, in
alternating order (AB, BA, ...): ``--steps`` ``RLTrainer.train_step`` calls timed in the
controller (the batch travels with the call, as in the GRPO app), then one ``push_weights``
(``weights.transport: direct``, ``same_host: off``: the cross-host path) and the reader's
``fetch_weights`` of that version, timed separately. Reported: medians over rounds, the
median of the per-round ratios ``2 hosts / 1 host`` and their range.

What crossing hosts costs here: on one machine both layouts talk over the same loopback
network (gloo's TCP between ranks, Monarch's sockets between procs and torchstore's volume),
so the ratios measure what the multi-host placement itself adds (worker processes, a 2-D
proc mesh, rank layout) and should be ~1.0; on a real cluster the difference is the network
(gloo/NCCL between nodes, torchstore's RPC or RDMA to the controller's host). Every proc runs
one torch thread (``--threads``).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # ``python bench/multi_host.py``: make ``bench`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import forge_ext  # noqa: F401, E402  (must precede any torchtitan import: CPU device fix)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from monarch.actor import Actor, endpoint  # noqa: E402

from bench.common import make_batch  # noqa: E402

LAYOUTS = {"1 host x 2 procs": (1, 2), "2 hosts x 1 proc": (2, 1)}


class Reader(Actor):
    """A reader of published weights on a host of its own (as the generator is)."""

    @endpoint
    async def fetch(self, version: int, key_prefix: str) -> tuple[int, float]:
        from forge_ext.weights.fetch import fetch_weights

        start = time.perf_counter()
        weights = await fetch_weights(version, key_prefix=key_prefix)
        seconds = time.perf_counter() - start
        return sum(t.numel() * t.element_size() for t in weights.values()), seconds


def trainer_config(flavor: str, batch: int, seq: int) -> dict:
    return {
        "model": {"name": "qwen3", "flavor": flavor},
        "training": {"local_batch_size": batch // 2, "seq_len": seq, "steps": 1000},
        "parallelism": {"data_parallel_shard_degree": 2},
        "optimizer": {"lr": 1e-4},
        "seed": 0,
    }


async def build(name: str, layout: tuple[int, int], args):
    from forge_ext.actors import spawn_trainer
    from forge_ext.runtime.hosts import HostsConfig, RoleHosts
    from forge_ext.runtime.placement import Placement

    hosts, per_host = layout
    placement = Placement(
        HostsConfig(launcher="processes",
                    trainer=RoleHosts(hosts=hosts, procs_per_host=per_host)),
        {"trainer": hosts * per_host, "generator": 1},
    )
    await placement.start()
    env = {"OMP_NUM_THREADS": str(args.threads)}
    key_prefix = "bench_" + name.replace(" ", "_")
    trainer = await spawn_trainer(
        trainer_config(args.flavor, args.batch, args.seq),
        weights={"transport": "direct", "same_host": "off", "key_prefix": key_prefix},
        spawn_procs=functools.partial(placement.spawn_procs, "trainer", env),
    )
    reader = placement.spawn_procs("generator", env).spawn("reader", Reader)
    return {"placement": placement, "trainer": trainer, "reader": reader,
            "key_prefix": key_prefix}


async def stop(setup) -> None:
    """Stop the trainer's procs, then kill the job (workers and the reader's proc)."""
    try:
        await setup["trainer"].stop()
    finally:
        setup["placement"].stop()


async def measure(setup, batch, steps: int, version: int) -> dict[str, float]:
    trainer = setup["trainer"]
    inputs = [{"input_ids": t} for t in batch["input_ids"].chunk(2)]
    targets = [{"labels": t} for t in batch["labels"].chunk(2)]
    train = []
    for _ in range(steps):
        start = time.perf_counter()
        await trainer.train_step(inputs, targets)
        train.append(time.perf_counter() - start)
    start = time.perf_counter()
    await trainer.push_weights(version)
    push = time.perf_counter() - start
    start = time.perf_counter()
    nbytes, _ = await setup["reader"].fetch.call_one(version, setup["key_prefix"])
    fetch = time.perf_counter() - start
    return {"train_step": statistics.median(train), "push": push, "fetch": fetch,
            "push+fetch": push + fetch, "bytes": nbytes}


async def run(args) -> None:
    import torchstore as ts

    from forge_ext.compat.torchstore_monarch import initialize_store

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    start = time.perf_counter()
    await initialize_store()
    setups = {}
    try:
        for name, layout in LAYOUTS.items():
            setups[name] = await build(name, layout, args)
        batch = make_batch(args.batch, args.seq, 512 if args.flavor == "small" else 2048,
                           seed=0)
        names = list(LAYOUTS)
        for name in names:  # warm-up: first steps allocate the optimizer state
            await measure(setups[name], batch, 1, version=1)
        rounds: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for r in range(args.reps):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                rounds[name].append(await measure(setups[name], batch, args.steps, 2 + r))
        report(args, rounds, time.perf_counter() - start)
    finally:
        for setup in setups.values():
            await stop(setup)
        await ts.shutdown()


def report(args, rounds, seconds: float) -> None:
    from tabulate import tabulate

    one, two = list(LAYOUTS)
    mb = rounds[one][0]["bytes"] / 1e6
    rows = []
    for key in ("train_step", "push", "fetch", "push+fetch"):
        a = statistics.median(x[key] for x in rounds[one])
        b = statistics.median(x[key] for x in rounds[two])
        ratios = [y[key] / x[key] for x, y in zip(rounds[one], rounds[two])]
        rows.append([key, f"{a:.3f}", f"{b:.3f}", f"{statistics.median(ratios):.3f}",
                     f"{min(ratios):.2f}-{max(ratios):.2f}"])
    print(f"\n## qwen3 {args.flavor} ({mb:.0f} MB of weights), DP=2 FSDP, "
          f"{args.batch} x {args.seq} tokens per step; {args.reps} rounds x {args.steps} "
          f"train steps; load average {os.getloadavg()[0]:.1f}; {seconds:.0f} s")
    print(tabulate(rows, headers=["seconds (median)", one, two, "2 hosts / 1 host",
                                  "per-round range"], disable_numparse=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="train steps per round")
    parser.add_argument("--reps", type=int, default=4, help="rounds (layouts alternate)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    # Run the importable module, not ``__main__``: Monarch pickles Reader by reference.
    from bench import multi_host

    multi_host.main()
