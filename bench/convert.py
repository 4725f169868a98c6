"""Throughput and peak memory of HF -> vLLM weight conversion for a Qwen3-0.6B-sized model.

Compares, side by side, on random weights shaped like Qwen/Qwen3-0.6B (tied embeddings):

- ``copy``: ``torch.cat([t])`` of every tensor, i.e. every byte of the model copied once into
  fresh tensors with no layout logic: the plain copy bandwidth;
- ``seed``: torchforge's ``_qwen3_hf_to_vllm`` approach (re-implemented below);
- ``hf_to_vllm`` (a dict) and ``iter_hf_to_vllm`` (streamed: each tensor dropped once made),
  whole (``tp_rank=None``) and per TP rank.

Peak memory: each method runs once in a fresh process, which reports its peak resident memory
above the input (``ru_maxrss``). Time: one process runs the methods in turn, ``--repeats``
rounds, and keeps each method's best. GB/s is the bytes of the converted output over that
time; "copied" is how much of it was freshly written (unchanged tensors are passed through
without a copy), "x copy" the ratio to the plain copy's GB/s.

Usage: ``python bench/convert.py [--dtype bfloat16] [--repeats 5] [--tp 2]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

QWEN3_0_6B = dict(  # Qwen/Qwen3-0.6B config.json
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)


def hf_state_dict(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors with the keys and shapes of transformers' Qwen3-0.6B (checkpoint layout:
    no ``lm_head.weight``, as the embeddings are tied)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        shapes = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B)).state_dict()
    torch.manual_seed(0)
    return {
        k: torch.randn(v.shape, dtype=dtype) for k, v in shapes.items() if k != "lm_head.weight"
    }


def seed_hf_to_vllm(sd: dict[str, torch.Tensor], num_layers: int, vllm_tp: int) -> dict:
    """torchforge's ``_qwen3_hf_to_vllm`` approach, for comparison: move every tensor to CPU in
    the caller's dict, pass through keys matched by substring, and for q/k/v and gate/up chunk
    each source into ``vllm_tp`` pieces, concatenate per rank, then concatenate the ranks
    (two copies; K/V chunked by ``vllm_tp`` even when there are fewer KV heads)."""
    for key in sd:
        sd[key] = sd[key].cpu()
    passed = (
        "down_proj",
        "input_layernorm",
        "post_attention_layernorm",
        "o_proj",
        "norm.weight",
        "embed_tokens.weight",
        "lm_head.weight",
    )
    out = {k: v for k, v in sd.items() if any(p in k for p in passed)}

    def interleave(sources):
        chunks = [s.chunk(vllm_tp, dim=0) for s in sources]
        return torch.cat([torch.cat([c[r] for c in chunks], dim=0) for r in range(vllm_tp)], dim=0)

    for i in range(num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = interleave(
            [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        )
        out[p + "mlp.gate_up_proj.weight"] = interleave(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
        )
    return out


def _methods(tp: int):
    """name -> (description, fn(sd, config) -> iterable of output tensors)."""
    from forge_ext.weights.convert import hf_to_vllm, iter_hf_to_vllm

    def streamed(sd, config, tp_size, ranks):
        for rank in ranks:
            for _, tensor in iter_hf_to_vllm(sd, config, tp_size, rank):
                yield tensor  # the caller drops it, as a sender to torchstore would

    layers = QWEN3_0_6B["num_hidden_layers"]
    return {
        "copy": (
            "torch.cat of the same bytes",
            lambda sd, c: [torch.cat([t]) for t in sd.values()],
        ),
        "seed": (
            "seed approach, tp=1",
            lambda sd, c: seed_hf_to_vllm(dict(sd), layers, 1).values(),
        ),
        "dict": ("hf_to_vllm, full", lambda sd, c: hf_to_vllm(sd, c).values()),
        "iter": ("iter_hf_to_vllm, full, streamed", lambda sd, c: streamed(sd, c, 1, [None])),
        "seed_tp": (
            f"seed approach, tp={tp} (all ranks in one tensor)",
            lambda sd, c: seed_hf_to_vllm(dict(sd), layers, tp).values(),
        ),
        "dict_rank": (
            f"hf_to_vllm, tp={tp} rank 0",
            lambda sd, c: hf_to_vllm(sd, c, tp, 0).values(),
        ),
        "iter_ranks": (
            f"iter_hf_to_vllm, tp={tp}, every rank, streamed",
            lambda sd, c: streamed(sd, c, tp, range(tp)),
        ),
    }


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _config():
    from transformers import Qwen3Config

    from forge_ext.weights.model_config import ModelConfig

    return ModelConfig.from_hf(Qwen3Config(**QWEN3_0_6B))


def memory_worker(method: str, dtype: torch.dtype, tp: int) -> dict:
    """Run ``method`` once in this fresh process: peak resident memory above the input, and
    the bytes it produced / freshly wrote."""
    config, sd = _config(), hf_state_dict(dtype)
    input_ids = {id(t) for t in sd.values()}
    _, fn = _methods(tp)[method]
    base = _maxrss_bytes()
    out_bytes = copied = 0
    for t in fn(sd, config):
        out_bytes += t.numel() * t.element_size()
        copied += 0 if id(t) in input_ids else t.numel() * t.element_size()
        del t
    return dict(peak_extra=_maxrss_bytes() - base, out_bytes=out_bytes, copied=copied)


def best_seconds(dtype: torch.dtype, tp: int, repeats: int) -> dict[str, float]:
    """Best time of each method over ``repeats`` rounds; the methods take turns within a round
    so that a change in machine load touches them all alike."""
    config, sd = _config(), hf_state_dict(dtype)
    methods = _methods(tp)
    best = dict.fromkeys(methods, float("inf"))
    for _ in range(repeats):
        for method, (_, fn) in methods.items():
            start = time.perf_counter()
            for t in fn(sd, config):
                del t
            best[method] = min(best[method], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.memory_worker:
        print(json.dumps(memory_worker(args.memory_worker, dtype, args.tp)))
        return

    methods = _methods(args.tp)
    memory = {}
    for method in methods:
        cmd = [sys.executable, __file__, "--memory-worker", method]
        cmd += ["--dtype", args.dtype, "--tp", str(args.tp)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        memory[method] = json.loads(out)
    seconds = best_seconds(dtype, args.tp, args.repeats)

    gb = 1e9
    copy_bw = memory["copy"]["out_bytes"] / seconds["copy"]
    print(
        f"Qwen3-0.6B-sized state dict, {args.dtype}, {memory['copy']['out_bytes'] / gb:.2f} GB, "
        f"{torch.get_num_threads()} threads, best of {args.repeats} interleaved rounds"
    )
    print(
        f"| {'method':<48} | {'output GB':>9} | {'copied GB':>9} | {'seconds':>7} | {'GB/s':>6} "
        f"| {'x copy':>6} | {'peak extra GB':>13} |"
    )
    print(f"|{'-' * 50}|{'-' * 11}|{'-' * 11}|{'-' * 9}|{'-' * 8}|{'-' * 8}|{'-' * 15}|")
    for method, (description, _) in methods.items():
        m, t = memory[method], seconds[method]
        bw = m["out_bytes"] / t
        print(
            f"| {description:<48} | {m['out_bytes'] / gb:>9.3f} | {m['copied'] / gb:>9.3f} "
            f"| {t:>7.3f} | {bw / gb:>6.2f} | {bw / copy_bw:>6.2f} "
            f"| {m['peak_extra'] / gb:>13.3f} |"
        )


if __name__ == "__main__":
    main()
