"""Both generators sample from the distribution they are asked for, and from nothing a library
or the checkpoint fills in: draws of the first response token match the model's own softmax
(at the requested temperature) and, under ``top_p < 1``, a nucleus computed here from that
softmax, by a chi-square bound.

The model: a tiny Qwen3 with 1024 token ids whose logits after ``PROMPT`` spread over
hundreds of tokens (an LM head of std 1/8 over a unit-RMS hidden state: logits of std ~1).
Its ``generation_config.json`` asks for every sampling option a checkpoint can carry (top-k
20, top-p, min-p, typical-p, penalties, no-repeat n-grams, suppressed and banned tokens);
``PROMPT`` holds 32 of the ids, so repetition rules would show in the first token too. The
fault this guards: transformers reads ``top_k=None`` as unset and fills in its own default,
50 (issue 26): 50 distinct tokens where the softmax gives hundreds, while the recorded
log-probs still read as the full softmax's.

The transformers cases take ~4 s each; the vLLM cases share one engine (~30-70 s to start).
"""

import json
import math
import os

import pytest
import pytest_asyncio
import torch

from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.rollout.engines.hf import HFSampler
from forge_ext.engine.hf_checkpoint import hf_config_dict, init_hf_checkpoint, save_hf_checkpoint

# head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (not 8 or 16).
VOCAB = 1024
ARCH = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
    tie_word_embeddings=False, eos_token_id=0, pad_token_id=0,
)
PROMPT = list(range(3, VOCAB, 32))  # 32 distinct ids spread over the vocabulary
DRAWS = 4096
# Everything a generation_config.json can say about sampling; none of it may reach a draw.
CHECKPOINT_SAMPLING_DEFAULTS = {
    "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.8, "min_p": 0.05,
    "typical_p": 0.9, "epsilon_cutoff": 3e-4, "eta_cutoff": 3e-4, "repetition_penalty": 1.3,
    "presence_penalty": 1.5, "frequency_penalty": 1.5, "no_repeat_ngram_size": 1,
    "suppress_tokens": [PROMPT[1], PROMPT[2]], "begin_suppress_tokens": [PROMPT[3]],
    "bad_words_ids": [[PROMPT[4]]],
}
# (temperature, top_p): top_p "nucleus" is chosen from the softmax (see nucleus_top_p).
CASES = [(1.0, 1.0), (1.0, "nucleus"), (0.7, 1.0)]
CASE_IDS = ["softmax", "nucleus", "temperature"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("flat")
    init = init_hf_checkpoint(root / "init", "qwen3", ARCH, seed=0)
    from safetensors.torch import load_file

    weights = load_file(str(init / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    weights["lm_head.weight"] = torch.randn(VOCAB, ARCH["hidden_size"], generator=g) / 8
    path = save_hf_checkpoint(root / "ckpt", weights, hf_config_dict("qwen3", ARCH))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 0, "pad_token_id": 0, **CHECKPOINT_SAMPLING_DEFAULTS})
    )
    return str(path)


@pytest.fixture(scope="module")
def logits(checkpoint):
    """The model's own ``[VOCAB]`` float64 logits of the first response token after PROMPT
    (a plain forward of a freshly loaded model, no generate())."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1].double()


def nucleus_top_p(probs: torch.Tensor, near: float = 0.7) -> float:
    """A ``top_p`` near ``near`` whose nucleus is unambiguous: halfway between the masses of
    the top m-1 and top m tokens, for the m (mass 0.6-0.8) whose probability is furthest
    above the next token's, so no float rounding in either backend changes the kept set."""
    p = probs.sort(descending=True).values
    mass = p.cumsum(0)
    candidates = [m for m in range(1, len(p)) if 0.6 <= mass[m].item() <= 0.8]
    m = max(candidates, key=lambda m: (p[m] / p[m + 1]).item())
    assert abs(mass[m].item() - near) < 0.2
    return ((mass[m - 1] + mass[m]) / 2).item()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` restricted to the fewest most-likely tokens whose mass reaches ``top_p``
    (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"), renormalised."""
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]  # mass of the tokens ranked above each
    kept = torch.zeros_like(probs)
    kept[order[before < top_p]] = probs[order[before < top_p]]
    return kept / kept.sum()


def target_distribution(logits, temperature, top_p):
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p == "nucleus":
        top_p = nucleus_top_p(probs)
    return probs if top_p == 1.0 else nucleus(probs, top_p), top_p


def chi_square_bound(df: int, z: float = 6.0) -> float:
    """The chi-square quantile ``z`` standard deviations up (Wilson-Hilferty 1931): a false
    alarm rate of ~1e-9 for a correct sampler."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_draws_follow(draws: list[int], probs: torch.Tensor) -> None:
    """Chi-square test of ``draws`` (token ids) against ``probs [VOCAB]``: no draw outside
    its support, and tokens pooled (least likely first) into bins of >= 5 expected draws."""
    counts = torch.bincount(torch.tensor(draws), minlength=len(probs)).double()
    support = probs > 0
    distinct = int((counts > 0).sum())
    assert counts[~support].sum() == 0, (
        f"{int(counts[~support].sum())} draws outside the distribution's support "
        f"({int(support.sum())} tokens); {distinct} distinct tokens drawn"
    )
    expected = probs * len(draws)
    bins_observed, bins_expected, o, e = [], [], 0.0, 0.0
    for token in expected.argsort().tolist():
        if not support[token]:
            continue
        o, e = o + counts[token].item(), e + expected[token].item()
        if e >= 5:
            bins_observed.append(o), bins_expected.append(e)
            o, e = 0.0, 0.0
    if e:  # a remainder under 5 joins the last bin
        bins_observed[-1] += o
        bins_expected[-1] += e
    observed, expect = torch.tensor(bins_observed), torch.tensor(bins_expected)
    statistic = ((observed - expect) ** 2 / expect).sum().item()
    bound = chi_square_bound(len(observed) - 1)
    assert statistic < bound, (
        f"draws do not follow the softmax: chi-square {statistic:.0f} over {len(observed) - 1} "
        f"degrees of freedom (bound {bound:.0f}); {distinct} distinct tokens drawn where "
        f"{int(support.sum())} are possible"
    )


def first_tokens(completions) -> list[int]:
    assert len(completions) == DRAWS and all(len(c.response_ids) == 1 for c in completions)
    return [c.response_ids[0] for c in completions]


def assert_logprobs_are_the_softmax(completions, logits):
    """The recorded log-probs are those of the raw logits, whatever was sampled with."""
    recorded = torch.tensor([c.logprobs[0] for c in completions], dtype=torch.float64)
    policy = torch.log_softmax(logits, -1)[torch.tensor(first_tokens(completions))]
    assert (recorded - policy).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def hf_sampler(checkpoint):
    return HFSampler(checkpoint, stop_token_ids=0, pad_token_id=0)


@pytest.mark.parametrize(("temperature", "top_p"), CASES, ids=CASE_IDS)
def test_transformers_draws_follow_the_requested_distribution(
    hf_sampler, logits, temperature, top_p
):
    probs, top_p = target_distribution(logits, temperature, top_p)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=1)
    completions = hf_sampler.generate([PROMPT], n=DRAWS, sampling=sampling, seed=0)
    assert_draws_follow(first_tokens(completions), probs)
    assert_logprobs_are_the_softmax(completions, logits)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_engine(checkpoint):
    pytest.importorskip("vllm")
    from forge_ext.rollout.engines.vllm import VLLMEngine

    environ = dict(os.environ)
    engine = VLLMEngine(checkpoint, sampling=SamplingConfig(), stop_token_ids=0,
                        engine_args={"max_model_len": 64})
    os.environ.clear()  # its defaults (the tp=1 thread binding) must not reach later engines
    os.environ.update(environ)
    try:
        await engine.start()
        yield engine
    finally:
        await engine.close()


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("temperature", "top_p"), CASES, ids=CASE_IDS)
async def test_vllm_draws_follow_the_requested_distribution(vllm_engine, logits, temperature,
                                                            top_p):
    probs, top_p = target_distribution(logits, temperature, top_p)
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=1)
    completions = await vllm_engine.sample(PROMPT, n=DRAWS, sampling=sampling, seed=0)
    assert_draws_follow(first_tokens(completions), probs)
    assert_logprobs_are_the_softmax(completions, logits)


def test_transformers_separate_prompts_in_one_seeded_call_are_independent_draws(
    hf_sampler, logits
):
    """``DRAWS`` copies of ``PROMPT``, one sample each, in one call with one seed (a step
    holding one row twice): the first tokens still follow the softmax."""
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=1)
    completions = hf_sampler.generate([PROMPT] * DRAWS, n=1, sampling=sampling, seed=0)
    assert_draws_follow(first_tokens(completions), torch.softmax(logits, -1))


@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_separate_requests_of_one_prompt_in_one_seeded_call_are_independent_draws(
    vllm_engine, logits
):
    """``DRAWS`` requests of ``PROMPT``, one sample each, seeded from one seed (how a
    multi-turn group's turns reach the engine, and a step holding one row twice): the first
    tokens still follow the softmax. The fault (issue 32): vLLM seeds each request's
    generator with its seed, and every request had the call's seed, so every copy drew the
    same token, and a group of episodes was one episode copied; every advantage 0."""
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=1)
    completions = await vllm_engine.generate([PROMPT] * DRAWS, n=1, sampling=sampling, seed=0)
    assert_draws_follow(first_tokens(completions), torch.softmax(logits, -1))


@pytest.mark.asyncio(loop_scope="module")
async def test_vllm_on_cpu_serves_requests_over_its_batched_token_budget_exactly(vllm_engine):
    """``DRAWS`` seeded requests of 32 tokens (131,072 tokens) at once: 32 times the engine's
    4,096 batched tokens per step. On CPU, vLLM 0.32's chunked prefill crashed such a step
    (``RuntimeError: CPU Generator does not use offset``, issue 32); with it off a prompt
    waits for the next step instead of being split, so each request draws what it draws
    alone with its seed."""
    from forge_ext.rollout.engines.base import request_seeds

    config = vllm_engine.engine.vllm_config.scheduler_config
    assert DRAWS * len(PROMPT) > 8 * config.max_num_batched_tokens
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=3)
    prompts = [PROMPT[k:] + PROMPT[:k] for k in range(32)] * (DRAWS // 32)  # 32 distinct
    together = await vllm_engine.generate(prompts, n=1, sampling=sampling, seed=5)
    seeds = request_seeds(5, len(prompts))
    for i in (0, 1, 777, DRAWS - 1):
        (alone,) = await vllm_engine.sample(prompts[i], n=1, sampling=sampling, seed=seeds[i])
        assert alone.response_ids == together[i].response_ids
        assert alone.logprobs == pytest.approx(together[i].logprobs, abs=1e-5)
