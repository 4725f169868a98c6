"""Delta weight sync benchmark (issue 48): ``weights.delta`` beside full versions, in one run.

Run from the repository root::

    .venv/bin/python -m bench.delta_sync                 # Qwen3-0.6B shape, 20 steps
    .venv/bin/python -m bench.delta_sync --layers 4 --steps 5   # a quick look

A Qwen3-0.6B-shaped decoder (``transformers``' ``Qwen3ForCausalLM`` from its config, random
weights: hidden 1024, 28 layers, 16/8 heads of 128, MLP 3072, vocab 151936, tied embeddings,
596M parameters) trains in fp32 with ``torch.optim.Adam`` at ``--lr`` (1e-6) on random
tokens. After each real optimizer step the bf16 weights are published twice, interleaved:

- **full**: ``weights.transport: direct``, ``same_host: off`` (chunks over Monarch RPC), as a
  trainer publishes every version today; the reader fetches it into the tensors it keeps
  (``fetch_weights(allocate=...)``, no allocation);
- **delta**: the same with ``weights.delta: true`` (anchor at step 0, then deltas on the
  version the reader holds); the reader applies it onto its own tensors in place
  (``fetch_weights(holding=...)``), checksums checked.

The reader is an actor on its own proc; after each step it compares its two copies bit for
bit (exactness is part of the run: any difference fails it). Printed per step: bytes sent,
changed fraction, push seconds (``publish``), fetch + apply seconds (the reader's
``fetch_weights``), and the delta/full ratios; the summary gives medians over the delta steps.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
import torchstore as ts
from monarch.actor import Actor, endpoint, this_host

from forge_ext.compat.torchstore_monarch import initialize_store
from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.fetch import fetch_weights
from forge_ext.weights.publish import WeightsPublisher


class Reader(Actor):
    """A generator-side process that keeps one copy of the weights per way of syncing."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, torch.Tensor]] = {}
        self.holding: dict[str, int | None] = {}

    @endpoint
    async def update(self, prefix: str, version: int) -> float:
        """Fetch ``version`` into this way's tensors; returns the seconds it took."""
        start = time.perf_counter()
        held = self.held.get(prefix)
        if held is None:
            self.held[prefix] = await fetch_weights(version, key_prefix=prefix)
        else:
            await fetch_weights(version, key_prefix=prefix, allocate=lambda specs: held,
                                holding=self.holding[prefix])
        self.holding[prefix] = version
        return time.perf_counter() - start

    @endpoint
    async def same(self, a: str, b: str) -> list[str]:
        """Names whose tensors differ in any bit between the two ways."""
        return [name for name, t in self.held[a].items()
                if not torch.equal(t.view(torch.uint8), self.held[b][name].view(torch.uint8))]


def qwen3_like(layers: int) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = qwen3_like(args.layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    await initialize_store()
    procs = this_host().spawn_procs(per_host={"procs": 1})
    reader = procs.spawn("delta_reader", Reader)
    common = dict(same_host="off", dtype="bfloat16", chunk_mb=args.chunk_mb, keep_versions=2)
    ways = {
        "full": WeightsPublisher(WeightsConfig(key_prefix="bench_full", **common)),
        "delta": WeightsPublisher(WeightsConfig(
            key_prefix="bench_delta", delta=True, delta_anchor_every=args.steps + 1, **common)),
    }
    print(f"Qwen3-shaped, {args.layers} layers, {n_params / 1e6:.0f}M parameters, bf16 "
          f"published ({2 * n_params / 1e9:.2f} GB), Adam lr {args.lr:g}, {args.steps} steps; "
          f"torch threads {args.threads}")
    print(f"{'step':>4} {'way':>5} {'sent MB':>9} {'changed':>8} {'push s':>7} {'fetch s':>8}")
    rows = []
    holding = None
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps + 1):
        if step:
            ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        state_dict = {name: p.detach() for name, p in model.state_dict().items()}
        row = {"step": step}
        for way, publisher in ways.items():
            start = time.perf_counter()
            result = await publisher.publish(
                state_dict, step, reader_base=holding if way == "delta" else None)
            push = time.perf_counter() - start
            fetch = await reader.update.call_one(publisher.config.key_prefix, step)
            stats = result.delta
            changed = 1.0 if stats is None else stats.changed / stats.elements
            row[way] = (result.bytes_written, changed, push, fetch)
            print(f"{step:>4} {way:>5} {result.bytes_written / 2**20:>9.1f} {changed:>8.2%} "
                  f"{push:>7.2f} {fetch:>8.2f}")
        holding = step
        differ = await reader.same.call_one("bench_full", "bench_delta")
        if differ:
            raise SystemExit(f"step {step}: the delta reader's weights differ in {differ[:5]}")
        rows.append(row)
    deltas = rows[1:]
    ratio_bytes = statistics.median(r["delta"][0] / r["full"][0] for r in deltas)
    speedup = statistics.median(
        (r["full"][2] + r["full"][3]) / (r["delta"][2] + r["delta"][3]) for r in deltas)
    changed = statistics.median(r["delta"][1] for r in deltas)
    print(f"\nover {len(deltas)} delta versions (medians): changed {changed:.2%} of elements, "
          f"bytes {ratio_bytes:.2%} of a full version, push + fetch/apply {speedup:.1f}x faster "
          "than full; every version bitwise equal to the full one")
    for publisher in ways.values():
        publisher.close()
    await procs.stop()
    await ts.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--chunk-mb", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
