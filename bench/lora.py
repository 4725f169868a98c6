"""LoRA versus full fine-tuning, side by side, as ratios; and what the KL reference of a LoRA
policy costs each way.

Run from the repository root::

    .venv/bin/python -m bench.lora                      # qwen3 small, 8 x 128 tokens, rank 8
    .venv/bin/python -m bench.lora --flavor tiny --steps 10 --rank 4

Two tables:

1. **Train step and memory.** Two :class:`TitanEngine` s on the same base weights, one full
   fine-tuning, one with ``lora: {rank}`` on all seven projections; ``train_batch`` steps
   alternate between them (AB, BA, ...) after a warmup. Step time: median seconds per step
   and the median of per-round ratios (LoRA / full). Trainable parameters, gradient bytes
   and optimizer-state bytes (every tensor in ``optimizer.state``: AdamW's two moments and
   step) after the first step: exact counts, not allocator figures.
2. **KL reference.** (a) the trainer's own base, adapters disabled
   (``TitanEngine.disable_adapter``, the GRPO app's choice with ``reference: null``): a
   forward of the LoRA engine, no extra weights; (b) a reference role: a second engine (its
   own process in the app) holding a full copy of the weights. Forward seconds per batch
   (median, alternating), the extra weight bytes, and with ``--rss`` the resident memory of a
   fresh process that builds a reference engine (what a reference role's process holds:
   Python, torch and torchtitan as well as the weights).

Absolute timings on a shared 2-core machine are noisy; ratios measured side by side less so.
One torch thread by default (``--threads``).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # ``python bench/lora.py``: make ``bench`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import forge_ext  # noqa: F401, E402  (must precede any torchtitan import: CPU device fix)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from bench.common import make_batch  # noqa: E402
from forge_ext.engine import TitanEngine, cross_entropy_loss, valid_tokens  # noqa: E402
from forge_ext.engine.distributed import init_single_process_env  # noqa: E402


def engine_config(args, lora: bool) -> dict:
    c = {
        "model": {"name": "qwen3", "flavor": args.flavor},
        "training": {"local_batch_size": args.batch, "seq_len": args.seq,
                     "steps": 10 * (args.steps + args.warmup) + 10},
        "optimizer": {"lr": 1e-4},
    }
    if lora:
        c["lora"] = {"rank": args.rank}
    return c


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_state_bytes(engine: TitanEngine) -> int:
    return sum(tensor_bytes(local(v) for v in state.values())
               for opt in engine.optimizers.optimizers for state in opt.state.values())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(a, b, rounds: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds of ``a()`` and ``b()`` over ``rounds`` pairs, order alternating per pair."""
    for _ in range(warmup):
        a(), b()
    ta, tb = [], []
    for i in range(rounds):
        if i % 2:
            tb.append(timed(b)), ta.append(timed(a))
        else:
            ta.append(timed(a)), tb.append(timed(b))
    return ta, tb


def reference_process_rss(args) -> dict[str, int]:
    """VmRSS (bytes) of a fresh process after its imports and after building a reference
    engine (no LoRA, forward only)."""
    code = f"""
import forge_ext, json, torch
torch.set_num_threads(1)
from forge_ext.engine import TitanEngine
from forge_ext.engine.distributed import init_single_process_env
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
init_single_process_env()
before = rss()
engine = TitanEngine({engine_config(args, lora=False)!r})
print(json.dumps({{"imports": before, "engine": rss()}}))
"""
    # Its own torch.distributed world of one, not this process's.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**env, "PYTHONPATH": os.getcwd()})
    return json.loads(out.stdout.strip().splitlines()[-1])


def mb(n: float) -> str:
    return f"{n / 2**20:.2f} MB"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="small")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rss", action="store_true", help="measure a reference process")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    init_single_process_env()

    full = TitanEngine(engine_config(args, lora=False))
    lora = TitanEngine(engine_config(args, lora=True))
    lora.load_model_state_dict(  # the same base weights (the adapters keep their init)
        {k: v.full_tensor() for k, v in full.model_state_dict().items()})
    batch = make_batch(args.batch, args.seq, 256 if args.flavor == "tiny" else 512, seed=0)

    def step(engine):
        return lambda: engine.train_batch(batch, cross_entropy_loss, valid_tokens)

    t_full, t_lora = alternate(step(full), step(lora), args.steps, args.warmup)
    ratios = [b / a for a, b in zip(t_full, t_lora)]
    rows = []
    for name, engine, times in (("full", full, t_full), ("lora", lora, t_lora)):
        trainable = engine.trainable_parameters()
        rows.append([
            name, f"{statistics.median(times):.4f}",
            f"{sum(p.numel() for p in trainable):,}",
            mb(tensor_bytes(local(p.grad) for p in trainable if p.grad is not None)
               or tensor_bytes(local(p) for p in trainable)),
            mb(optimizer_state_bytes(engine)),
        ])
    opt_ratio = optimizer_state_bytes(lora) / optimizer_state_bytes(full)
    rows.append(["lora / full", f"{statistics.median(ratios):.3f}",
                 f"{sum(p.numel() for p in lora.trainable_parameters()) / sum(p.numel() for p in full.trainable_parameters()):.4f}",
                 "", f"{opt_ratio:.4f}"])
    print(f"qwen3 {args.flavor}, {args.batch} x {args.seq} tokens, LoRA rank {args.rank} on "
          f"q,k,v,o,gate,up,down, {args.steps} alternating steps, {args.threads} thread(s)")
    print(tabulate(rows, headers=["", "step s (median)", "trainable params",
                                  "gradient bytes", "optimizer state"]))

    ids = {"input_ids": batch["input_ids"]}

    def base_forward():
        with lora.disable_adapter():
            lora.forward_batch(ids)

    t_base, t_ref = alternate(base_forward, lambda: full.forward_batch(ids), args.steps,
                              args.warmup)
    weights = tensor_bytes(local(v) for v in full.model_state_dict().values())
    rows = [
        ["trainer base (adapters disabled)", f"{statistics.median(t_base):.4f}", mb(0), ""],
        ["reference role (second engine)", f"{statistics.median(t_ref):.4f}", mb(weights), ""],
    ]
    if args.rss:
        rss = reference_process_rss(args)
        rows[1][3] = f"{mb(rss['engine'])} (imports alone {mb(rss['imports'])})"
    print()
    print("KL reference of the LoRA policy: forward of one batch")
    print(tabulate(rows, headers=["", "forward s (median)", "extra weights",
                                  "reference process RSS"]))
    print(f"base / reference role forward time: "
          f"{statistics.median([a / b for a, b in zip(t_base, t_ref)]):.3f}")


if __name__ == "__main__":
    main()
