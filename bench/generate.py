"""Generation benchmark: the transformers sampler vs vLLM, and vLLM weight updates vs vLLM's
bare in-place reload, side by side in one run.

Run from the repository root::

    .venv/bin/python -m bench.generate                     # both tables
    .venv/bin/python -m bench.generate --skip-update       # throughput only
    .venv/bin/python -m bench.generate --update-hidden 256 512 768

Table 1, throughput (tokens/s of sampled response tokens, same model, prompts and sampling,
``temperature 1``, fp32): ``HFSampler`` (one batch) vs ``VLLMEngine`` (vLLM's async engine,
one request per prompt, all sent at once) at the CPU demo's shape (2 layers, hidden 128,
head_dim 32, vocab 16; 64 prompts x 8 samples x 16 tokens) and at Qwen3-0.6B's shape
(28 layers, hidden 1024, 16/8 heads, head_dim 128, vocab 151936; ``--big-prompts`` prompts
x 8 samples x 16 tokens). A response ends at the last vocabulary id or at ``max_new_tokens`` (vLLM
refuses stop ids outside the vocabulary): tokens/s counts the tokens each backend generated,
and both sample the same distribution (mean response lengths shown).

Table 2, weight update into vLLM (tp=1), for Qwen3-shaped fp32 decoders (28 layers, vocab 32000,
``--update-hidden`` sizes: ~150 MB, ~480 MB, ~1 GB), median of ``--reps`` after a warm-up of
``keep_versions + 1`` versions (every shared-memory slot warm):

- ``push``: ``WeightsPublisher.publish`` with ``weights.transport: direct`` and the default
  ``same_host: auto`` (trainer and generator on this host): into a reused shared-memory slot;
- ``update``: what ``Generator.update_weights`` does then: ``open_weights`` of the version
  (its slot, leased) and ``VLLMEngine.load_hf_state_dict``: ``forge_load_weights`` on the
  worker with the slot's handle (map + ``reload_weights``), a prefix-cache reset and the new
  weight-version label (no request is in flight, so no pause: ``bench.rollout`` times
  updates under load); ``push + update`` is the end-to-end figure;
- ``update, same_host off``: the same for a version published with ``same_host: off`` (what a
  trainer on another host sends): ``fetch_weights`` over torchstore's Monarch RPC into the
  generator's own shared buffer, then the same load;
- ``bare reload``: vLLM's ``reload_weights`` timed inside the worker from tensors already in
  the worker's own memory (the floor for any transport).

A model vLLM does not know here (head_dim 16) would fail; the shapes above are all supported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import torch

import forge_ext  # noqa: F401  (CPU device for torchtitan, before anything imports it)
from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.rollout.engines.hf import HFSampler
from forge_ext.rollout.engines.vllm import VLLMEngine
from forge_ext.rollout.engines.vllm_worker import WeightSyncExtension
from forge_ext.weights.shared_buffer import open_shared_tensors

DEMO = dict(
    vocab_size=16, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    tie_word_embeddings=False,
)
QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=512,
    tie_word_embeddings=True,
)


def stop_id(fields: dict) -> int:
    """The stop id of the benchmark models: their last vocabulary id."""
    return fields["vocab_size"] - 1


class BenchExtension(WeightSyncExtension):
    """``WeightSyncExtension`` plus a timed bare reload, for this benchmark only."""

    def forge_bench_bare_reload(self, handle) -> float:
        """Copy the buffer's tensors into this worker's own memory (not timed), then time
        ``reload_weights`` from them. Returns seconds."""
        tensors = {k: v.clone() for k, v in open_shared_tensors(handle).items()}
        start = time.perf_counter()
        with torch.no_grad():
            self.model_runner.reload_weights(
                weights_iterator=iter(tensors.items()), is_checkpoint_format=True
            )
        return time.perf_counter() - start


def write_checkpoint(directory: str, fields: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random Qwen3 saved with ``save_pretrained``; returns its state dict."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**fields, eos_token_id=0))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(directory)
    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if fields["tie_word_embeddings"]:
        state_dict.pop("lm_head.weight")
    return state_dict


def prompts_for(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(4, 9, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(count)]


def throughput(name: str, fields: dict, prompts: int, samples: int, tokens: int) -> list[str]:
    sampling = SamplingConfig(max_new_tokens=tokens)
    with tempfile.TemporaryDirectory() as root:
        write_checkpoint(root, fields)
        batch = prompts_for(prompts, fields["vocab_size"])
        results = {}
        hf = HFSampler(root, stop_token_ids=stop_id(fields), pad_token_id=0)
        hf.generate(batch[:2], 2, sampling, seed=0)  # warm-up
        start = time.perf_counter()
        out = hf.generate(batch, samples, sampling, seed=1)
        seconds = time.perf_counter() - start
        results["hf"] = sum(len(c.response_ids) for c in out) / seconds
        lengths = {"hf": sum(len(c.response_ids) for c in out) / len(out)}
        del hf
        results["vllm"], lengths["vllm"] = asyncio.run(
            vllm_throughput(root, fields, batch, samples, sampling))
    return [
        f"| {name} | {prompts} x {samples} x {tokens} | {results['hf']:,.0f} | "
        f"{results['vllm']:,.0f} | {results['vllm'] / results['hf']:.2f}x | "
        f"{lengths['hf']:.1f} / {lengths['vllm']:.1f} |"
    ]


async def vllm_throughput(root: str, fields: dict, batch: list[list[int]], samples: int,
                          sampling: SamplingConfig) -> tuple[float, float]:
    """Tokens/s and mean response length of ``VLLMEngine.generate`` on ``batch``."""
    engine = VLLMEngine(root, sampling=sampling, stop_token_ids=stop_id(fields),
                        engine_args={"max_model_len": 64})
    try:
        await engine.start()
        await engine.generate(batch[:2], 2, seed=0)  # warm-up
        start = time.perf_counter()
        out = await engine.generate(batch, samples, seed=1)
        seconds = time.perf_counter() - start
    finally:
        await engine.close()
    tokens = sum(len(c.response_ids) for c in out)
    return tokens / seconds, tokens / len(out)


def decoder_fields(hidden: int) -> dict:
    return dict(
        vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=28,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=256, tie_word_embeddings=False,
    )


async def update_latencies(hiddens: list[int], reps: int) -> list[str]:
    """One row per size (see the module docstring); one torchstore for all of them."""
    import torchstore as ts

    from forge_ext.compat.torchstore_monarch import initialize_store

    await initialize_store()
    try:
        return [await update_latency(hidden, reps) for hidden in hiddens]
    finally:
        await ts.shutdown()


async def update_latency(hidden: int, reps: int) -> str:
    from forge_ext.weights.fetch import open_weights
    from forge_ext.weights.config import WeightsConfig
    from forge_ext.weights.publish import WeightsPublisher

    prefix = f"bench_h{hidden}"
    with tempfile.TemporaryDirectory() as root:
        state_dict = write_checkpoint(root, decoder_fields(hidden))
        nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        engine = VLLMEngine(
            root, sampling=SamplingConfig(), stop_token_ids=stop_id(decoder_fields(hidden)),
            engine_args={"max_model_len": 64}, worker_extension=f"{__name__}.BenchExtension",
        )
        keep_versions = 2
        publishers = {
            mode: WeightsPublisher(WeightsConfig(
                transport="direct", keep_versions=keep_versions, key_prefix=f"{prefix}_{mode}",
                same_host=mode,
            ))
            for mode in ("auto", "off")
        }
        times: dict[str, list[float]] = {"push": [], "update": [], "off": [], "bare": []}

        async def update(mode: str, version: int) -> float:
            """Generator.update_weights' steps; seconds."""
            start = time.perf_counter()
            async with open_weights(
                version, key_prefix=f"{prefix}_{mode}", allocate=engine.allocate
            ) as weights:
                await engine.load_hf_state_dict(weights.tensors, version,
                                                 shared_handle=weights.shared_handle)
            return time.perf_counter() - start

        try:
            await engine.start()
            warmup = keep_versions + 1
            for version in range(1, warmup + reps + 1):
                new = {k: v + 0.01 * version for k, v in state_dict.items()}
                start = time.perf_counter()
                result = await publishers["auto"].publish(new, version)
                push = time.perf_counter() - start
                assert result.same_host
                same = await update("auto", version)
                await publishers["off"].publish(new, version)
                del new
                off = await update("off", version)
                (bare,) = await engine.engine.collective_rpc(
                    "forge_bench_bare_reload", args=(engine.buffer.handle(),)
                )
                if version > warmup:
                    for key, value in zip(times, (push, same, off, bare)):
                        times[key].append(value)
        finally:
            for publisher in publishers.values():
                publisher.close()
            await engine.close()
    p, u, o, b = (statistics.median(times[k]) for k in times)
    return (
        f"| {nbytes / 1e6:,.0f} | {p:.3f} | {u:.3f} | {p + u:.3f} | {b:.3f} | {u / b:.2f}x | "
        f"{(p + u) / b:.2f}x | {o:.3f} | {o / b:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-prompts", type=int, default=8)
    parser.add_argument("--update-hidden", type=int, nargs="*", default=[256, 512, 768])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-update", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores", flush=True)
    if not args.skip_throughput:
        rows = [
            "| model | prompts x samples x max tokens | HF tok/s | vLLM tok/s | vLLM / HF | "
            "mean tokens HF / vLLM |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        rows += throughput("demo (2 layers, hidden 128)", DEMO, 64, 8, 16)
        print("\n".join(rows), flush=True)
        rows = throughput("Qwen3-0.6B shape", QWEN3_0_6B, args.big_prompts, 8, 16)
        print("\n".join(rows), flush=True)
    if not args.skip_update:
        print("\n| MB (fp32) | push s | update s | push + update s | bare reload s | "
              "update / bare | (push + update) / bare | update, same_host off s | "
              "off / bare |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
        rows = asyncio.run(update_latencies(args.update_hidden, args.reps))
        print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
