"""RLTrainer.push_weights end to end: a trainer pushes versioned weights (DP=1 through
torchstore over Monarch RPC, ``weights.same_host: off``; DP=2 with sharded parameters into
same-host shared memory, the default on one host); a reader on another proc fetches them,
loads them into transformers' Qwen3ForCausalLM (strict) and reproduces the trainer's logits.
Stopping the trainer unlinks its shared memory."""

import copy
import os
import re
import sys

import cloudpickle
import pytest
import pytest_asyncio
import torch
import torchstore as ts
from torchstore.api import DEFAULT_TORCHSTORE_NAME
from conftest import make_lm_batch, random_state_dict, spawn_all
from monarch.actor import Actor, endpoint, this_host

from forge_ext.actors import spawn_trainer
from forge_ext.compat.torchstore_monarch import initialize_store
from forge_ext.engine.models import SMALL_FLAVORS
from forge_ext.weights.fetch import fetch_commit_record

pytestmark = pytest.mark.asyncio(loop_scope="module")
# Spawned procs cannot import test modules: ship the reader actor by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRAINER = {
    "model": {"name": "qwen3", "flavor": "tiny"},
    "training": {"local_batch_size": 4, "seq_len": 64},
    "optimizer": {"lr": 1e-2},
}


class HFReader(Actor):
    """A generator-side actor: fetches a version and runs transformers' Qwen3 on it."""

    @endpoint
    async def logits(self, version: int, key_prefix: str, input_ids: torch.Tensor):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from forge_ext.weights.fetch import fetch_weights

        state_dict = await fetch_weights(version, key_prefix=key_prefix)
        config = Qwen3Config(**SMALL_FLAVORS["qwen3"]["tiny"], attn_implementation="sdpa")
        model = Qwen3ForCausalLM(config).float().eval()
        model.load_state_dict(state_dict, strict=True)
        with torch.no_grad():
            return model(input_ids).logits, {k: v.clone() for k, v in state_dict.items()}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup():
    await initialize_store()
    dp2_cfg = copy.deepcopy(TRAINER)
    dp2_cfg["training"]["local_batch_size"] = 2
    dp1, dp2 = await spawn_all(
        spawn_trainer(
            TRAINER, weights={"transport": "direct", "same_host": "off", "key_prefix": "dp1"}
        ),
        spawn_trainer(dp2_cfg, num_procs=2, weights={"key_prefix": "dp2"}),
    )
    weights = random_state_dict(await dp1.get_hf_state_dict(), seed=5, std=0.1)
    await dp1.load_hf_state_dict(weights)
    await dp2.load_hf_state_dict(weights)
    procs = this_host().spawn_procs(per_host={"procs": 1})
    reader = procs.spawn("hf_reader", HFReader)
    stopped = []
    yield {"dp1": (dp1, "dp1", 1), "dp2": (dp2, "dp2", 2), "reader": reader, "stopped": stopped}
    for trainer in (dp1, dp2):
        if trainer not in stopped:
            await trainer.stop()
    await procs.stop()
    await ts.shutdown()


@pytest.mark.parametrize("name", ["dp1", "dp2"])
async def test_generator_reproduces_trainer_logits_and_follows_new_versions(setup, name):
    trainer, prefix, dp = setup[name]
    reader = setup["reader"]
    batch = make_lm_batch(4, 16, 256, seed=0)
    inputs = [{"input_ids": t} for t in batch["input_ids"].chunk(dp)]
    targets = [{"labels": t} for t in batch["labels"].chunk(dp)]

    pushed = await trainer.push_weights(1)
    assert pushed["policy_version"] == 1
    assert pushed["same_host"] == (name == "dp2")
    trainer_logits = await trainer.forward(inputs)
    assert trainer_logits.abs().max() > 1.0  # random weights: parity is not vacuous
    hf_logits, v1 = await reader.logits.call_one(1, prefix, batch["input_ids"])
    torch.testing.assert_close(hf_logits, trainer_logits, rtol=1e-4, atol=1e-4)

    await trainer.train_step(inputs, targets)
    await trainer.push_weights(2)
    hf_logits2, v2 = await reader.logits.call_one(2, prefix, batch["input_ids"])
    trainer_weights = await trainer.get_hf_state_dict()
    assert set(v2) == set(trainer_weights)
    assert any(not torch.equal(v1[k], v2[k]) for k in v1)
    for k in trainer_weights:
        assert torch.equal(v2[k], trainer_weights[k]), k
    torch.testing.assert_close(hf_logits2, await trainer.forward(inputs), rtol=1e-4, atol=1e-4)


async def test_stopping_the_trainer_unlinks_its_shared_memory(setup):
    trainer, prefix, _ = setup["dp2"]
    await trainer.push_weights(10)
    record = await fetch_commit_record(10, key_prefix=prefix, store_name=DEFAULT_TORCHSTORE_NAME)
    # forge_ext-weights.dp2-<pid of rank 0>-<n>-p<pid namespace>: this trainer's slots only
    (owner,) = re.findall(rf"-weights\.{prefix}-(\d+)-", record["segment"]["path"])

    def slots() -> list[str]:
        return [f for f in os.listdir("/dev/shm")
                if f.startswith(f"forge_ext-weights.{prefix}-{owner}-")]

    assert os.path.basename(record["segment"]["path"]) in slots()
    await trainer.actor.cleanup.call()  # what TrainerHandle.stop runs before stopping the procs
    assert slots() == []
    await trainer.stop()
    setup["stopped"].append(trainer)
    assert slots() == []
