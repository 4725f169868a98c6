"""The generator's sampling backend (forge_ext.generation): the log-probs it records are the
policy's (a full forward of the unpadded sequence gives the same), responses stop at the
first <eos>, seeds reproduce samples, and the vLLM weight loader fills vLLM-named params."""

import pytest
import torch
from conftest import random_state_dict

from apps.grpo.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer
from forge_ext.generation import HFSampler, SamplingConfig, copy_vllm_weights
from forge_ext.hf_checkpoint import hf_config_dict, init_hf_checkpoint, save_hf_checkpoint
from forge_ext.weights.convert import hf_to_vllm

ARCH = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    tie_word_embeddings=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)
PROMPTS = [[1, 5, 14, 6, 15], [1, 5, 6, 7, 14, 8, 15], [1, 13, 14, 13, 13, 15]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small Qwen3 with random weights large enough that every token is plausible."""
    root = tmp_path_factory.mktemp("gen")
    save_tokenizer(root / "tok")
    init = init_hf_checkpoint(root / "init", "qwen3", ARCH, seed=0, tokenizer_from=root / "tok")
    sampler = HFSampler(str(init), eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    weights = random_state_dict(sampler.model.state_dict(), seed=3, std=0.3)
    path = save_hf_checkpoint(root / "ckpt", weights, hf_config_dict("qwen3", ARCH), tokenizer_from=init)
    return str(path)


@pytest.fixture(scope="module")
def sampler(checkpoint):
    return HFSampler(checkpoint, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


SAMPLING = SamplingConfig(max_new_tokens=8)


def test_logprobs_equal_a_full_forward_of_each_unpadded_sequence(sampler):
    completions = sampler.generate(PROMPTS, 4, SAMPLING, seed=0)
    assert len(completions) == 12
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.response_ids])
        with torch.no_grad():
            logits = sampler.model(ids).logits[0].float()
        start = len(c.prompt_ids) - 1
        expected = torch.log_softmax(logits[start : start + len(c.response_ids)], -1)
        expected = expected.gather(-1, torch.tensor(c.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0, atol=1e-5)


def test_completions_are_prompt_major_and_stop_at_the_first_eos(sampler):
    completions = sampler.generate(PROMPTS, 4, SAMPLING, seed=1, policy_version=7)
    for i, c in enumerate(completions):
        assert c.prompt_ids == PROMPTS[i // 4]
        assert c.policy_version == 7
        assert len(c.logprobs) == len(c.response_ids) >= 1
        assert EOS_ID not in c.response_ids[:-1]
        assert c.finished == (c.response_ids[-1] == EOS_ID)
        if not c.finished:
            assert len(c.response_ids) == SAMPLING.max_new_tokens
    assert any(c.finished for c in completions) and any(len(c.response_ids) > 1 for c in completions)


def test_a_seed_reproduces_samples_and_leaves_the_process_rng_alone(sampler):
    state = torch.random.get_rng_state()
    a = sampler.generate(PROMPTS, 4, SAMPLING, seed=5)
    b = sampler.generate(PROMPTS, 4, SAMPLING, seed=5)
    c = sampler.generate(PROMPTS, 4, SAMPLING, seed=6)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert [x.response_ids for x in a] == [x.response_ids for x in b]
    assert [x.response_ids for x in a] != [x.response_ids for x in c]


def test_greedy_decoding_takes_the_argmax_at_every_step(sampler):
    (c,) = sampler.generate(PROMPTS[:1], 1, SAMPLING, greedy=True)
    ids = list(PROMPTS[0])
    for token in c.response_ids:
        with torch.no_grad():
            assert sampler.model(torch.tensor([ids])).logits[0, -1].argmax().item() == token
        ids.append(token)


def test_loading_weights_changes_the_samples_and_rejects_wrong_names(sampler, checkpoint):
    original = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    try:
        sampler.load_hf_state_dict(random_state_dict(original, seed=9, std=0.3))
        assert not torch.equal(sampler.model.state_dict()["lm_head.weight"], original["lm_head.weight"])
        with pytest.raises(KeyError, match="missing"):
            sampler.load_hf_state_dict({"model.norm.weight": original["model.norm.weight"]})
    finally:
        sampler.load_hf_state_dict(original)


@pytest.mark.parametrize("tp_size,tp_rank", [(1, 0), (2, 0)])
def test_vllm_loader_copies_converted_shards_into_vllm_named_parameters(sampler, tp_size, tp_rank):
    hf = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    config = hf_config_dict("qwen3", ARCH)
    expected = hf_to_vllm(hf, config, tp_size=tp_size, tp_rank=tp_rank)
    # A stand-in for a vLLM model: parameters with vLLM's names and per-rank shapes.
    model = torch.nn.Module()
    for i, (name, tensor) in enumerate(expected.items()):
        param = torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False)
        model.register_parameter(f"p{i}", param)
    named = {name: getattr(model, f"p{i}") for i, name in enumerate(expected)}
    model.named_parameters = lambda: iter(named.items())
    copy_vllm_weights(model, hf, config, tp_size=tp_size, tp_rank=tp_rank)
    for name, tensor in expected.items():
        assert torch.equal(named[name], tensor), name


def test_sampling_config_rejects_bad_values():
    with pytest.raises(ValueError, match="temperature=0"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingConfig(top_p=1.5)
