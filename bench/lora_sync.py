"""LoRA weight sync benchmark: a LoRA policy version (the adapter alone) versus a full-weights
version, push plus generator update, side by side in one run (issue 25).

Run from the repository root::

    .venv/bin/python -m bench.lora_sync                    # Qwen3-0.6B shape, rank 16, 3 versions
    .venv/bin/python -m bench.lora_sync --layers 8         # a shallower model (less memory)
    .venv/bin/python -m bench.lora_sync --rank 64 --targets q_proj v_proj

The model is Qwen3-0.6B's shape (the ``config.json`` of ``Qwen/Qwen3-0.6B``: 28 layers,
hidden 1024, 16/8 heads of 128, intermediate 3072, vocab 151936, tied embeddings; 596 M
parameters) with random fp32 weights, written as an HF checkpoint that one vLLM engine (tp=1,
``enable_lora``, ``max_lora_rank`` = ``--rank``) starts from. Per version, each way, timed:

- ``push``: ``WeightsPublisher.publish`` with ``weights.transport: direct`` and the default
  ``same_host: auto`` (trainer and generator on this host: a reused shared-memory slot plus
  the commit record in torchstore), of the full HF state dict (``full``), or of the adapter's
  PEFT tensors with its ``adapter_config`` as the version's metadata (``lora``), as
  ``RLTrainer.push_weights`` does without and with ``trainer.lora``;
- ``update``: what ``Generator.update_weights`` does then (``open_weights`` +
  :func:`forge_ext.rollout.generator.load_version`): ``full``: vLLM's in-place
  ``reload_weights`` in its worker from the slot; ``lora``: the PEFT folder written into
  ``/dev/shm``, ``add_lora`` under a new id, the previous adapter removed.

Bytes are what the publisher wrote per version (``PublishResult.bytes_written``). Median of
``--versions`` versions after ``keep_versions + 1`` warm-up versions each way (every slot
warm). The trainer's own conversion to HF names (``to_hf``) is not timed (a view per tensor).
Needs about 11 GB of memory at the full shape (state dict, 2 slots, vLLM's copy, its KV cache).
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
from forge_ext.engine import lora
from forge_ext.engine.schema import HF_TARGETS, check_targets

# config.json of Qwen/Qwen3-0.6B (max_position_embeddings lowered: vLLM sizes buffers by it).
QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=512,
    tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000,
)


def write_checkpoint(directory: str, fields: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random Qwen3 saved with ``save_pretrained``; returns its state dict (the model's own
    tensors: no second copy)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**fields, eos_token_id=0))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(directory)
    state_dict = {k: v.detach() for k, v in model.state_dict().items()}
    if fields["tie_word_embeddings"]:
        state_dict.pop("lm_head.weight")
    return state_dict


def make_adapter(state_dict, rank: int, targets, seed: int) -> dict[str, torch.Tensor]:
    """Random PEFT-named ``lora_A [r, in]`` / ``lora_B [out, r]`` for ``targets``."""
    g = torch.Generator().manual_seed(seed)
    adapter = {}
    for name, weight in state_dict.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
            adapter[lora.peft_key(module, "A")] = torch.randn(rank, weight.shape[1], generator=g) * 0.01
            adapter[lora.peft_key(module, "B")] = torch.randn(weight.shape[0], rank, generator=g) * 0.01
    return adapter


async def run(args) -> list[str]:
    import torchstore as ts

    from forge_ext.rollout.generator import load_version
    from forge_ext.compat.torchstore_monarch import initialize_store
    from forge_ext.rollout.engines.base import SamplingConfig
    from forge_ext.rollout.engines.vllm import VLLMEngine
    from forge_ext.weights.fetch import open_weights
    from forge_ext.weights.config import WeightsConfig
    from forge_ext.weights.publish import WeightsPublisher

    fields = {**QWEN3_0_6B, "num_hidden_layers": args.layers}
    targets = check_targets(args.targets, field="--targets")
    await initialize_store()
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        state_dict = write_checkpoint(root, fields)
        print(f"checkpoint written in {time.perf_counter() - start:.0f} s", flush=True)
        start = time.perf_counter()
        engine = VLLMEngine(
            root, sampling=SamplingConfig(), stop_token_ids=fields["vocab_size"] - 1,
            engine_args={"max_model_len": 64, "enable_lora": True, "max_lora_rank": args.rank},
        )
        config = lora.peft_adapter_config(args.rank, 2.0 * args.rank, targets)
        keep = 1
        publishers = {
            way: WeightsPublisher(WeightsConfig(keep_versions=keep, key_prefix=f"bench_{way}"))
            for way in ("full", "lora")
        }
        times = {(way, phase): [] for way in publishers for phase in ("push", "update")}
        nbytes = {}
        try:
            await engine.start()
            print(f"vLLM started in {time.perf_counter() - start:.0f} s", flush=True)
            for version in range(1, keep + 2 + args.versions):
                for way, publisher in publishers.items():
                    if way == "full":
                        for tensor in state_dict.values():  # a new version (not timed)
                            tensor.add_(1e-4)
                        tensors, metadata = state_dict, None
                    else:
                        tensors = make_adapter(state_dict, args.rank, targets, seed=version)
                        metadata = {"adapter_config": config}
                    start = time.perf_counter()
                    result = await publisher.publish(tensors, version, metadata=metadata)
                    pushed = time.perf_counter()
                    async with open_weights(version, key_prefix=f"bench_{way}",
                                            allocate=engine.allocate) as weights:
                        await load_version(engine, weights, version)
                    done = time.perf_counter()
                    assert result.same_host
                    nbytes[way] = result.bytes_written
                    if version > keep + 1:
                        times[way, "push"].append(pushed - start)
                        times[way, "update"].append(done - pushed)
        finally:
            for publisher in publishers.values():
                publisher.close()
            await engine.close()
            await ts.shutdown()
    median = {key: statistics.median(values) for key, values in times.items()}
    rows = [
        "| version | bytes | push s | update s | push + update s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for way in ("full", "lora"):
        total = median[way, "push"] + median[way, "update"]
        label = "full weights" if way == "full" else f"LoRA r={args.rank} ({len(targets)} kinds)"
        rows.append(f"| {label} | {nbytes[way] / 1e6:,.1f} MB | {median[way, 'push']:.3f} | "
                    f"{median[way, 'update']:.3f} | {total:.3f} |")
    full = median["full", "push"] + median["full", "update"]
    lora_total = median["lora", "push"] + median["lora", "update"]
    rows.append(f"| full / LoRA | {nbytes['full'] / nbytes['lora']:.1f}x | "
                f"{median['full', 'push'] / median['lora', 'push']:.1f}x | "
                f"{median['full', 'update'] / median['lora', 'update']:.1f}x | "
                f"{full / lora_total:.1f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="*", default=list(HF_TARGETS))
    parser.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    parser.add_argument("--versions", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores; Qwen3-0.6B shape "
          f"with {args.layers} layers, LoRA r={args.rank} on {args.targets}", flush=True)
    print("\n".join(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
