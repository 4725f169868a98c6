"""Correctness faults reported by RL trainers in the field (issue 11, items 4-6), each checked
against an independent reference: equal rewards give zero advantages, a weight push that fails
inside ``dcp.save`` is cleaned up like any other failure, and a step that applied gradients
leaves none for the next accumulation."""

from __future__ import annotations

import os

import pytest
import pytest_asyncio
import torch
import torch.nn.functional as F
import torchstore as ts
from conftest import make_lm_batch, random_state_dict

from forge_ext.actors import spawn_trainer
from forge_ext.engine.models import SMALL_FLAVORS, build_model_spec
from forge_ext.rl.advantages import compute_group_advantages
from forge_ext.weights import fetch as weights_fetch
from forge_ext.weights import publish as weights_publish
from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.errors import WeightsPublishError
from forge_ext.weights.store import committed_versions


# ---- 4. group advantages ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("reward", [0.35, 12.3, 1000.1, -7.77, 0.0, 1e6 + 0.3])
@pytest.mark.parametrize("group_size", [7, 8])
def test_equal_rewards_give_exactly_zero_advantages(reward, dtype, group_size):
    # Eight fp32 copies of 0.35 gave +0.0289 each: the mean's rounding residue over eps.
    # Seven float64 copies of 1e6 + 0.3 leave a residue even in float64 (-1.2e-4).
    if abs(reward) > torch.finfo(dtype).max:
        pytest.skip(f"{reward} does not fit in {dtype}")
    rewards = torch.full((2 * group_size,), reward, dtype=dtype)
    advantages = compute_group_advantages(rewards, group_size=group_size)
    assert advantages.dtype == dtype
    assert torch.equal(advantages, torch.zeros_like(rewards)), advantages


def test_a_constant_group_next_to_a_varied_one_is_zero_and_the_other_is_not_disturbed():
    rewards = torch.tensor([1000.1] * 4 + [1000.1, 1000.1, 1001.1, 1001.1], dtype=torch.float32)
    advantages = compute_group_advantages(rewards, group_size=4)
    assert torch.equal(advantages[:4], torch.zeros(4))
    # The varied group's rewards as fp32 stores them, normalised in float64 by hand.
    r = rewards[4:].double()
    expected = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(advantages[4:], expected.float(), rtol=1e-6, atol=1e-6)


# ---- 5. a failure inside the transport ----------------------------------------------------
class FailsToSerialise(torch.Tensor):
    """A tensor whose bytes cannot be produced: pickling it (``torch.save`` inside DCP's file
    writer, i.e. inside ``dcp.save``) or reading it as numpy (the direct transport's chunk
    packing) raises."""

    def __reduce_ex__(self, protocol):
        raise RuntimeError("injected: this tensor cannot be serialised")

    def numpy(self, *args, **kwargs):
        raise RuntimeError("injected: this tensor cannot be serialised")


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
        "model.norm.weight": torch.randn(64, generator=g),
    }


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("transport", ["dcp", "direct"])
async def test_a_failure_inside_the_transport_is_a_publish_error_and_leaves_nothing(
    store, tmp_path, transport
):
    prefix = f"faults_{transport}"
    dcp_path = tmp_path / "weights"
    # same_host=off: the chunk packing of direct over torchstore (the same-host transport's
    # own failures: tests/test_weights_publish.py, test_push_failing_half_way...).
    publisher = weights_publish.WeightsPublisher(
        WeightsConfig(
            transport=transport, dcp_path=str(dcp_path), key_prefix=prefix, chunk_mb=1,
            same_host="off",
        )
    )
    await publisher.publish(state_dict(seed=1), 1)

    bad = state_dict(seed=2)
    name = "model.layers.0.self_attn.q_proj.weight"
    bad[name] = bad[name].as_subclass(FailsToSerialise)
    with pytest.raises(WeightsPublishError, match="policy_version=2") as info:
        await publisher.publish(bad, 2)
    causes = []
    cause = info.value.__cause__
    while cause is not None:
        causes.append(repr(cause))
        cause = cause.__cause__ or cause.__context__
    assert "injected" in str(info.value) + " ".join(causes)

    assert not (dcp_path / "2").exists()  # what was written is removed
    client = await ts.client()
    assert await client.keys(f"{prefix}.v2") == []
    assert await committed_versions(key_prefix=prefix) == [1]
    got = await weights_fetch.fetch_weights(1, key_prefix=prefix)  # earlier version intact
    for key, value in state_dict(seed=1).items():
        assert torch.equal(got[key], value), key

    # The same version can be published again once the fault is gone.
    await publisher.publish(state_dict(seed=2), 2)
    got = await weights_fetch.fetch_weights(2, key_prefix=prefix)
    for key, value in state_dict(seed=2).items():
        assert torch.equal(got[key], value), key
    if transport == "dcp":
        assert sorted(os.listdir(dcp_path)) == ["1", "2"]


# ---- 6. gradients after a step --------------------------------------------------------------
TRAINER = {
    "model": {"name": "qwen3", "flavor": "tiny"},
    "training": {"local_batch_size": 4, "seq_len": 32},  # default max_norm: clipping is on
    "optimizer": {"lr": 1e-3},
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainer():
    handle = await spawn_trainer(TRAINER)
    weights = random_state_dict(await handle.get_hf_state_dict(), seed=3, std=0.1)
    await handle.load_hf_state_dict(weights)
    yield handle
    await handle.stop()


def split(batch):
    return [{"input_ids": batch["input_ids"]}], [{"labels": batch["labels"]}]


def transformers_gradients(weights, batch) -> dict[str, torch.Tensor]:
    """The reference: the token-mean cross-entropy gradient of ``batch`` at ``weights``
    (HF names), computed from zero by transformers' Qwen3 in this process."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SMALL_FLAVORS["qwen3"]["tiny"], attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config).float()
    model.load_state_dict(weights, strict=True)
    logits = model(batch["input_ids"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(0, 1), ignore_index=-100)
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def hf_named(gradients: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's gradients (by torchtitan parameter name, fused ``wqkv``) under HF names:
    put into a torchtitan model's parameters, read back through its ``state_dict`` (which
    splits ``wqkv``) and the engine's state-dict adapter."""
    spec = build_model_spec("qwen3", "tiny")
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(gradients[name])
    return spec.state_dict_adapter(spec.model, "").to_hf(model.state_dict())


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("first", ["train_step", "forward_backward+optim_step"])
async def test_after_a_step_the_next_accumulation_starts_from_zero(trainer, first):
    batch = make_lm_batch(4, 16, 256, seed=5)
    if first == "train_step":
        metrics = await trainer.train_step(*split(batch), return_metrics=True)
        assert metrics["grad_norm"] > 1.0  # so the clip factor applies to what is left
    else:
        await trainer.forward_backward(*split(batch))
        await trainer.optim_step()
    weights = await trainer.get_hf_state_dict()
    await trainer.forward_backward(*split(batch))
    mixed = await trainer.get_gradients()

    expected = transformers_gradients(weights, batch)
    mixed = hf_named(mixed)
    assert set(mixed) == set(expected)
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-2  # not vacuous
    for name, grad in expected.items():
        torch.testing.assert_close(mixed[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
