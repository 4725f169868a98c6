"""LoRA RL, weights and generators (issue 25): a trainer with ``trainer.lora`` publishes each
policy version as its adapter alone (PEFT names and ``adapter_config``), and the transformers
generator serves it merged into a kept copy of the base weights: the on-policy importance
ratio is 1 within 1e-4 at each of 3 versions. The vLLM generator's LoRA versions (tp=1 and
tp=2, a new LoRA request each) are tested in tests/test_vllm.py on that module's engines
(started with LoRA on), with the same check (``conftest.assert_on_policy_across_lora_versions``);
the settings vLLM cannot serve are refused in tests/test_configs.py. What the vLLM sampler asks
of its engine per version (a new LoRA id each, the old one removed after) is checked here
without starting vLLM.
"""

import asyncio
import os

import pytest
import pytest_asyncio
import torch
import torchstore as ts
from conftest import (
    LORA_RANK,
    assert_on_policy_across_lora_versions,
    lora_trainer_config,
    random_state_dict,
    spawn_all,
)
from test_vllm import ARCH, PROMPTS  # tests/test_vllm.py's model (head_dim 32, tied) and prompts

from forge_ext.engine import lora
from forge_ext.engine.schema import HF_TARGETS
from forge_ext.actors import spawn_trainer
from forge_ext.rollout.config import GeneratorConfig
from forge_ext.rollout.generator import spawn_generator
from forge_ext.compat.torchstore_monarch import initialize_store
from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.rollout.engines.vllm import VLLMEngine
from forge_ext.weights.fetch import fetch_metadata, fetch_weights

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY_PREFIX = "lora_rl"
_versions = iter(range(1, 1000))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**ARCH, eos_token_id=2)).eval()
    model.load_state_dict(random_state_dict(model.state_dict(), seed=1, std=0.3))
    path = tmp_path_factory.mktemp("lora_rl") / "ckpt"
    model.save_pretrained(path)
    return str(path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def actors(checkpoint):
    await initialize_store()
    trainer, generator = await spawn_all(
        spawn_trainer(lora_trainer_config(checkpoint),
                      weights={"transport": "direct", "key_prefix": KEY_PREFIX}),
        spawn_generator(
            GeneratorConfig(hf_path=checkpoint, backend="hf", sampling=SamplingConfig(
                temperature=1.0, top_p=1.0, max_new_tokens=8)),
            stop_token_ids=[2], pad_token_id=0, key_prefix=KEY_PREFIX,
        ),
    )
    yield trainer, generator
    await asyncio.gather(trainer.stop(), generator.stop())
    await ts.shutdown()


async def test_on_policy_ratio_is_one_at_every_lora_version_with_transformers(actors):
    trainer, generator = actors
    await assert_on_policy_across_lora_versions(generator, trainer, PROMPTS, _versions)


async def test_a_lora_version_publishes_the_adapter_bytes_alone(actors):
    """The version holds A [r, in] and B [out, r] of every adapted layer under PEFT's names
    and nothing else; ``bytes`` is their size; the adapter_config travels with it."""
    trainer, _ = actors
    version = next(_versions)
    pushed = await trainer.push_weights(version)
    tensors = await fetch_weights(version, key_prefix=KEY_PREFIX)
    base = await trainer.get_hf_state_dict()
    want = {}
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in HF_TARGETS:
            want[lora.peft_key(module, "A")] = (LORA_RANK, weight.shape[1])
            want[lora.peft_key(module, "B")] = (weight.shape[0], LORA_RANK)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert pushed["bytes"] == adapter_bytes
    assert adapter_bytes * 10 < sum(t.numel() * t.element_size() for t in base.values())
    config = (await fetch_metadata(version, key_prefix=KEY_PREFIX))["adapter_config"]
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (
        LORA_RANK, 2.0 * LORA_RANK, "LORA")
    assert sorted(config["target_modules"]) == sorted(HF_TARGETS)


@pytest.mark.parametrize(
    ("max_lora_rank", "message"),
    [(None, r"policy_version=7 is a LoRA adapter \(r=16\), but this vLLM generator was started "
            r"without LoRA: set generator.vllm.enable_lora=true"),
     (8, r"policy_version=7 is a LoRA adapter of r=16 > generator.vllm.max_lora_rank=8")],
)
def test_a_lora_version_vllm_cannot_serve_names_the_field(max_lora_rank, message):
    """Checked before the engine is touched (the engine is never reached here: the sampler
    is built without one), so the served version stays."""
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.max_lora_rank = max_lora_rank
    with pytest.raises(ValueError, match=message):
        asyncio.run(engine.load_adapter({}, {"r": 16, "lora_alpha": 32}, 7))


def test_each_lora_load_is_a_new_vllm_request_id_and_the_old_one_goes_after_it(tmp_path):
    """vLLM caches adapters by id (``LRUCacheWorkerLoRAManager.add_adapter`` loads only an
    unknown id), so every adapter the sampler adds comes under an id never used before, a
    version loaded again included; the one served before is removed only after the new one
    was added, and its folder deleted. The engine here records what the sampler asks of it
    (vLLM is not started: the ids and the order of calls are what is under test; serving a
    version is tested in tests/test_vllm.py)."""
    import itertools

    from safetensors.torch import load_file

    class Engine:  # the AsyncLLM calls load_adapter makes
        def __init__(self):
            self.calls = []

        async def add_lora(self, request):
            self.calls.append(("add", request.lora_int_id, request.lora_name))

        async def remove_lora(self, lora_id):
            self.calls.append(("remove", lora_id))

        async def reset_prefix_cache(self):
            pass

        async def update_weight_version(self, version):
            self.calls.append(("version", version))

    # What VLLMEngine.__init__ sets up for LoRA, around a recording engine.
    sampler = VLLMEngine.__new__(VLLMEngine)
    sampler.engine = Engine()
    sampler.max_lora_rank, sampler.lora_request = LORA_RANK, None
    sampler._lora_ids, sampler.lora_root = itertools.count(1), str(tmp_path)
    module = "model.layers.0.self_attn.q_proj"
    config = {"r": LORA_RANK, "lora_alpha": 2 * LORA_RANK, "target_modules": ["q_proj"],
              "peft_type": "LORA"}
    served = []
    for version in (1, 2, 2, 3):  # version 2 loaded twice (e.g. pushed again after a resume)
        tensors = {lora.peft_key(module, "A"): torch.full((LORA_RANK, 64), float(version)),
                   lora.peft_key(module, "B"): torch.zeros(64, LORA_RANK)}
        loaded = asyncio.run(sampler.load_adapter(tensors, config, version))
        request = sampler.lora_request
        used = [r.lora_int_id for r in served]
        assert request.lora_int_id not in used, (version, request.lora_int_id, used)
        assert (loaded["lora_int_id"], loaded["folder"]) == (request.lora_int_id,
                                                             request.lora_path)
        assert request.lora_name == f"policy-v{version}"
        written = load_file(os.path.join(request.lora_path, "adapter_model.safetensors"))
        assert all(torch.equal(written[k], t) for k, t in tensors.items()), version
        served.append(request)
    ids = [r.lora_int_id for r in served]
    assert sampler.engine.calls == [
        ("add", ids[0], "policy-v1"), ("version", "1"),
        ("add", ids[1], "policy-v2"), ("remove", ids[0]), ("version", "2"),
        ("add", ids[2], "policy-v2"), ("remove", ids[1]), ("version", "2"),
        ("add", ids[3], "policy-v3"), ("remove", ids[2]), ("version", "3"),
    ]
    assert os.listdir(tmp_path) == [os.path.basename(served[-1].lora_path)]
