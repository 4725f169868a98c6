"""LoRA RL, weights and generators (issue 25): a trainer with ``trainer.lora`` publishes each
policy version as its adapter alone (PEFT names and ``adapter_config``), and the vLLM
generator (tp=1 and tp=2, each version a new LoRA request) and the transformers generator
(the adapter merged into a kept copy of the base weights) sample with it: the on-policy
importance ratio ``pi_trainer / pi_generator`` of every sampled token is 1 within 1e-4 at
each of 3 versions, while each version moves the trainer's log-probs of the previous
version's samples by more than 1e-2 (a generator that kept serving the previous version
would fail).

One LoRA trainer and the three generators, spawned at once, serve every test here (two vLLM
engines start in ~1-2 min on 2 cores).
"""

import asyncio
import math
import os

import pytest
import pytest_asyncio
import torch
import torchstore as ts
from conftest import random_state_dict, spawn_all, trainer_logprobs

from forge_ext import lora
from forge_ext.actors import spawn_trainer
from forge_ext.actors.generator import GeneratorConfig, alive_processes, spawn_generator
from forge_ext.compat.torchstore_monarch import initialize_store
from forge_ext.generation import SamplingConfig
from forge_ext.weights.fetch import fetch_metadata, fetch_weights

module_loop = pytest.mark.asyncio(loop_scope="module")

# head_dim 32: a size vLLM's CPU attention takes; tied embeddings, as Qwen3-0.6B.
ARCH = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    tie_word_embeddings=True,
)
RANK = 4
PROMPTS = [[1, 5, 14, 6, 15], [1, 7, 8], [3, 9, 9, 200, 17, 4, 1]]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}
KEY_PREFIX = "lora_rl"
GENERATORS = {"vllm_tp1": ("vllm", 1), "vllm_tp2": ("vllm", 2), "hf": ("hf", 1)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**ARCH, eos_token_id=2)).eval()
    model.load_state_dict(random_state_dict(model.state_dict(), seed=1, std=0.3))
    path = tmp_path_factory.mktemp("lora_rl") / "ckpt"
    model.save_pretrained(path)
    return str(path)


def generator_config(checkpoint, backend, tp):
    vllm = {}
    if backend == "vllm":  # what the GRPO app derives from trainer.lora (tests/test_configs.py)
        vllm = {"tensor_parallel_size": tp, "max_model_len": 128, "enable_lora": True,
                "max_lora_rank": 8}
    return GeneratorConfig(hf_path=checkpoint, backend=backend,
                           sampling=SamplingConfig(**SAMPLING), vllm=vllm)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def actors(checkpoint):
    await initialize_store()
    trainer, *generators = await spawn_all(
        spawn_trainer(
            {
                "model": {"name": "qwen3", "flavor": "hf", "hf_path": checkpoint},
                "training": {"local_batch_size": 4, "seq_len": 64},
                "optimizer": {"lr": 3e-2},
                "lora": {"rank": RANK},  # all seven linear kinds, alpha 2 * rank
            },
            weights={"transport": "direct", "key_prefix": KEY_PREFIX},
        ),
        *(
            spawn_generator(generator_config(checkpoint, backend, tp), stop_token_ids=[2],
                            pad_token_id=0, key_prefix=KEY_PREFIX, name=f"generator_{name}")
            for name, (backend, tp) in GENERATORS.items()
        ),
    )
    yield {"trainer": trainer, "generators": dict(zip(GENERATORS, generators))}
    await asyncio.gather(*(g.stop() for g in generators if g not in _stopped))
    await trainer.stop()
    await ts.shutdown()


_stopped = []
_versions = iter(range(1, 1000))
_seeds = iter(range(0, 10**6, 2))


@pytest.fixture(scope="module")
def trainer(actors):
    return actors["trainer"]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(GENERATORS))
async def generator(request, actors):
    """One generator; stopped once its tests are done (vLLM's processes and its LoRA folders
    must go with it)."""
    handle = actors["generators"][request.param]
    yield handle
    _stopped.append(handle)
    await handle.stop()
    assert not alive_processes(handle.pids), "vLLM processes outlived Generator.stop()"
    assert not _lora_roots(handle), "the generator's LoRA folder outlived Generator.stop()"


def _lora_roots(generator) -> list[str]:
    """The vLLM sampler's adapter folders in /dev/shm (``forge_ext-lora-<its pid>-...``)."""
    return [os.path.join("/dev/shm", f) for f in os.listdir("/dev/shm")
            if f.startswith(f"forge_ext-lora-{generator.owner_pid}-")]


async def train_a_little(trainer, seed: int) -> None:
    """Two optimizer steps on random sequences: the adapters (B starts at zero) move."""
    for s in (seed, seed + 1):
        batch = torch.randint(0, ARCH["vocab_size"], (4, 16),
                              generator=torch.Generator().manual_seed(s))
        await trainer.train_step([{"input_ids": batch}], [{"labels": torch.roll(batch, -1, 1)}])


@module_loop
async def test_on_policy_ratio_is_one_at_every_lora_version(generator, trainer):
    previous = None
    for _ in range(3):
        await train_a_little(trainer, seed=next(_seeds))
        version = next(_versions)
        await trainer.push_weights(version)
        await generator.update_weights(version)
        sampled = await generator.generate(PROMPTS, n=4, seed=version)
        assert {c.policy_version for c in sampled} == {version}
        reference = await trainer_logprobs(trainer, sampled)
        log_ratio = max((lp - torch.tensor(c.logprobs)).abs().max().item()
                        for c, (lp, _) in zip(sampled, reference))
        assert math.expm1(log_ratio) <= 1e-4, (
            f"version {version}: importance ratio off 1 by {math.expm1(log_ratio):.2e}")
        if previous is not None:  # the new version must matter, or this test could not fail
            again = await trainer_logprobs(trainer, previous)
            moved = max((lp - torch.tensor(c.logprobs)).abs().max().item()
                        for c, (lp, _) in zip(previous, again))
            assert moved > 1e-2, f"version {version} barely changed the policy ({moved:.1e})"
        previous = sampled
        if generator.config.backend == "vllm":  # the previous adapter's folder is gone
            (root,) = _lora_roots(generator)
            (folder,) = os.listdir(root)
            assert folder.startswith(f"policy-v{version}-id")


@module_loop
@pytest.mark.parametrize("generator", ["hf"], indirect=True)
async def test_a_lora_version_publishes_the_adapter_bytes_alone(generator, trainer):
    """The version holds A [r, in] and B [out, r] of every adapted layer under PEFT's names
    and nothing else; ``bytes`` is their size; the adapter_config travels with it."""
    version = next(_versions)
    pushed = await trainer.push_weights(version)
    tensors = await fetch_weights(version, key_prefix=KEY_PREFIX)
    base = await trainer.get_hf_state_dict()
    want = {}
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in lora.HF_TARGETS:
            want[lora.peft_key(module, "A")] = (RANK, weight.shape[1])
            want[lora.peft_key(module, "B")] = (weight.shape[0], RANK)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert pushed["bytes"] == adapter_bytes
    assert adapter_bytes * 10 < sum(t.numel() * t.element_size() for t in base.values())
    config = (await fetch_metadata(version, key_prefix=KEY_PREFIX))["adapter_config"]
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, 2.0 * RANK, "LORA")
    assert sorted(config["target_modules"]) == sorted(lora.HF_TARGETS)
