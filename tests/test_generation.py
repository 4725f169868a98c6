"""The generator's transformers backend (forge_ext.rollout.engines): the log-probs it records are
the policy's (a full forward of the unpadded sequence gives the same), responses stop at the
first of the checkpoint's stop ids, seeds reproduce samples, loaded weights are the weights
it samples with. (The vLLM backend: tests/test_vllm.py.)"""

import json
import os

import pytest
import torch
from conftest import random_state_dict
from safetensors.torch import load_file

from forge_ext.tasks.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer, stop_token_ids
from forge_ext.tasks.tokenizer import CheckpointTokenizer
from forge_ext.rollout.engines.base import SamplingConfig, make_completion
from forge_ext.rollout.engines.hf import HFSampler
from forge_ext.engine.hf_checkpoint import hf_config_dict, init_hf_checkpoint, save_hf_checkpoint

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
    sampler = HFSampler(str(init), stop_token_ids=EOS_ID, pad_token_id=PAD_ID)
    weights = random_state_dict(sampler.model.state_dict(), seed=3, std=0.3)
    path = save_hf_checkpoint(root / "ckpt", weights, hf_config_dict("qwen3", ARCH), tokenizer_from=init)
    return str(path)


def test_a_saved_checkpoint_keeps_the_end_ids_of_the_one_it_started_from(checkpoint, tmp_path):
    """generation_config.json declares the end ids (two for Qwen3, one in config.json): an
    SFT export that dropped it made GRPO stop at one of them only."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    saved = save_hf_checkpoint(
        tmp_path / "saved", weights, hf_config_dict("qwen3", ARCH), tokenizer_from=source
    )
    assert stop_token_ids(saved, tokenizer_eos_id=None) == (7, 9)


@pytest.fixture(scope="module")
def sampler(checkpoint):
    return HFSampler(checkpoint, stop_token_ids=EOS_ID, pad_token_id=PAD_ID)


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


def test_a_seeded_prompt_draws_the_same_tokens_in_any_batch(sampler):
    """Each sample draws from its own generator: a prompt's samples do not depend on which
    prompts share its batch, or on their order (the transformers engine batches whatever
    requests arrive together; a resumed step must draw again what it drew before). The fault:
    one generator for the batch, whose draws shift with its composition."""
    seeds = [11, 12, 13]
    together = sampler.generate(PROMPTS, 4, SAMPLING, seed=seeds)
    for i in range(3):
        alone = sampler.generate([PROMPTS[i]], 4, SAMPLING, seed=[seeds[i]])
        assert [c.response_ids for c in alone] == [c.response_ids for c in together[4 * i:4 * i + 4]]
    reversed_ = sampler.generate(PROMPTS[::-1], 4, SAMPLING, seed=seeds[::-1])
    assert [c.response_ids for c in reversed_[8:]] == [c.response_ids for c in together[:4]]


def test_greedy_decoding_takes_the_argmax_at_every_step(sampler):
    (c,) = sampler.generate(PROMPTS[:1], 1, SAMPLING, greedy=True)
    ids = list(PROMPTS[0])
    for token in c.response_ids:
        with torch.no_grad():
            assert sampler.model(torch.tensor([ids])).logits[0, -1].argmax().item() == token
        ids.append(token)


def test_loaded_weights_are_the_weights_it_samples_with(sampler, checkpoint):
    from transformers import AutoModelForCausalLM

    original = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    new = random_state_dict(original, seed=9, std=0.3)
    # An independent model holding the same weights: its logits are the reference.
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    reference.load_state_dict(new)
    try:
        sampler.load_hf_state_dict(new)
        for name, value in sampler.model.state_dict().items():
            assert torch.equal(value, new[name]), name
        completions = sampler.generate(PROMPTS, 2, SAMPLING, seed=0)
        for c in completions:
            ids = torch.tensor([c.prompt_ids + c.response_ids])
            with torch.no_grad():
                logits = reference(ids).logits[0]
            start = len(c.prompt_ids) - 1
            expected = torch.log_softmax(logits[start : start + len(c.response_ids)], -1)
            expected = expected.gather(-1, torch.tensor(c.response_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0, atol=1e-5)
        with pytest.raises(KeyError, match="missing"):
            sampler.load_hf_state_dict({"model.norm.weight": original["model.norm.weight"]})
    finally:
        sampler.load_hf_state_dict(original)


END_ID = 229  # a second end id, as Qwen3's generation_config.json declares two


@pytest.fixture(scope="module")
def two_end_ids_checkpoint(tmp_path_factory):
    """A checkpoint whose generation_config.json lists ``[2, 229]`` as ``eos_token_id`` and
    whose greedy first token after ``PROMPTS[0]`` is 229 (its ``lm_head`` row is set to the
    last hidden state, scaled)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    arch = {**ARCH, "vocab_size": 256, "eos_token_id": 2}
    root = tmp_path_factory.mktemp("two_ends")
    init = init_hf_checkpoint(root / "init", "qwen3", arch, seed=0)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32).eval()
    model.load_state_dict(random_state_dict(model.state_dict(), seed=4, std=0.3))
    with torch.no_grad():
        hidden = model.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
        model.lm_head.weight[END_ID] = 100 * hidden / hidden.norm()
    model.save_pretrained(root / "ckpt")
    GenerationConfig(eos_token_id=[2, END_ID]).save_pretrained(root / "ckpt")
    return root / "ckpt"


def test_every_end_id_the_checkpoint_declares_ends_a_response(two_end_ids_checkpoint):
    stops = stop_token_ids(two_end_ids_checkpoint, tokenizer_eos_id=None)
    assert stops == (2, END_ID)
    sampler = HFSampler(str(two_end_ids_checkpoint), stop_token_ids=stops, pad_token_id=0)
    (c,) = sampler.generate(PROMPTS[:1], 1, SAMPLING, greedy=True)
    assert (c.response_ids, c.finished) == ([END_ID], True)
    # The stop id list also comes from config.json alone, plus the tokenizer's eos.
    assert stop_token_ids(two_end_ids_checkpoint.parent / "init", tokenizer_eos_id=7) == (2, 7)


def test_a_completion_ends_at_the_first_stop_id_of_any_kind():
    c = make_completion([1], [5, 229, 2, 0], [-1.0, -2.0, -3.0, -4.0], (2, 229), 3)
    assert (c.response_ids, c.logprobs, c.finished) == ([5, 229], [-1.0, -2.0], True)
    c = make_completion([1], [5, 6], [-1.0, -2.0], (2, 229), 3)
    assert (c.response_ids, c.finished) == ([5, 6], False)


def test_the_apps_tokenizer_reads_every_end_id_and_cuts_answers_at_any(tmp_path):
    import json

    save_tokenizer(tmp_path)
    tok = CheckpointTokenizer(tmp_path)
    assert tok.stop_ids == (EOS_ID,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, 13]}))
    tok = CheckpointTokenizer(tmp_path)
    assert tok.stop_ids == (EOS_ID, 13)
    digits = tok.tokenizer("42", add_special_tokens=False)["input_ids"]
    assert tok.answer_text(digits + [13]) == "42"
    assert tok.answer_text(digits + [EOS_ID, 13]) == "42"
    assert tok.answer_text(digits) is None


def test_a_checkpoint_without_a_tokenizer_is_a_clear_error(tmp_path):
    """``save_pretrained`` of a model writes no tokenizer; the apps read theirs from
    ``model.hf_path``: the error names the field and how to add one."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"model.hf_path=.* has no tokenizer .*"
                                                r"save_tokenizer\("):
        CheckpointTokenizer(tmp_path)


def test_sampling_config_rejects_bad_values():
    with pytest.raises(ValueError, match="temperature=0"):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingConfig(top_p=1.5)


def test_vllms_chat_template_warmup_notice_is_dropped_and_nothing_else(caplog):
    """vLLM's LLM() warms up chat templates, which fail without the tokenizer the vLLM
    backend skips (a warning with a traceback at every engine start)."""
    import logging

    from forge_ext.rollout.engines.vllm import (
        CHAT_TEMPLATE_WARMUP_NOTICE,
        drop_chat_template_warmup_notice,
    )

    drop_chat_template_warmup_notice()
    drop_chat_template_warmup_notice()  # idempotent
    renderer_log = logging.getLogger("vllm.renderers.base")
    with caplog.at_level(logging.WARNING, logger="vllm.renderers.base"):
        renderer_log.warning(CHAT_TEMPLATE_WARMUP_NOTICE)
        renderer_log.warning("another renderer warning")
    assert [r.getMessage() for r in caplog.records] == ["another renderer warning"]
    assert len(renderer_log.filters) == 1
