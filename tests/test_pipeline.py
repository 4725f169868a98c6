"""Pipeline parallelism through RLTrainer on real Monarch procs (gloo): PP=2 and PP=2 x DP=2
give the same loss, gradients and weights as PP=1 from the same weights and batch, with
gradient accumulation over microbatches of unequal valid-token counts."""

import asyncio
import copy
import json

import pytest
import pytest_asyncio
import torch
from conftest import make_lm_batch, random_state_dict, spawn_all

import torchstore as ts

from forge_ext.actors import spawn_trainer
from forge_ext.compat.torchstore_monarch import initialize_store
from forge_ext.engine import engine_config_from_mapping
from forge_ext.weights.fetch import fetch_weights

pytestmark = pytest.mark.asyncio(loop_scope="module")

BATCH = 8
BASE = {
    "model": {"name": "qwen3", "flavor": "tiny"},
    "training": {"local_batch_size": BATCH, "gradient_accumulation_steps": 2, "seq_len": 64,
                 "max_norm": 1.0e6},
    "optimizer": {"lr": 1e-2, "eps": 1e-3},  # large eps: first Adam step ~ linear in grad
}
PREFIX = [0, 25, 3, 30, 10, 0, 31, 16]
# Under DP=2 rank 0 gets rows 0-3 with 4+3+2+1 = 10 valid tokens and rank 1 rows 4-7 with
# 31+30+29+30 = 120: a rank-local normalisation is far off the global one.
DP_PREFIX = [27, 28, 29, 30, 0, 1, 2, 1]


def config(pp=1, dp=1, schedule="1F1B", **extra):
    c = copy.deepcopy(BASE)
    c["training"]["local_batch_size"] = BATCH // dp
    c["parallelism"] = {
        "pipeline_parallel_degree": pp, "data_parallel_replicate_degree": dp,
        "pipeline_parallel_microbatch_size": 1, "pipeline_parallel_schedule": schedule,
    }
    c.update(extra)
    return c


def split(batch, dp):
    return ([{"input_ids": t} for t in batch["input_ids"].chunk(dp)],
            [{"labels": t} for t in batch["labels"].chunk(dp)])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def meshes(tmp_path_factory):
    ckpt = {"checkpoint": {"enable": True, "folder": "ckpt"},
            "dump_folder": str(tmp_path_factory.mktemp("pp"))}
    weights = {"transport": "dcp", "dcp_path": str(tmp_path_factory.mktemp("pp_dcp")),
               "key_prefix": "pp2"}
    handles = dict(zip(["pp1", "pp2", "pp2dp2"], await spawn_all(
        spawn_trainer(config()),
        spawn_trainer(config(pp=2, **ckpt), weights=weights),
        spawn_trainer(config(pp=2, dp=2, schedule="Interleaved1F1B")),
    )))
    weights = random_state_dict(await handles["pp1"].get_hf_state_dict(), seed=3)
    for h in handles.values():
        await h.load_hf_state_dict(weights)
    yield handles
    await asyncio.gather(*(h.stop() for h in handles.values()))


async def one_step(handle, batch, dp):
    fb = await handle.forward_backward(*split(batch, dp))
    grads = await handle.get_gradients()
    await handle.optim_step()
    return fb, grads, await handle.get_hf_state_dict()


@pytest.mark.parametrize("name, dp", [("pp2", 1), ("pp2dp2", 2)])
async def test_pipeline_equals_no_pipeline(meshes, name, dp):
    batch = make_lm_batch(BATCH, 32, 256, seed=11, ignore_prefix=DP_PREFIX)
    ref = meshes["pp1"]
    weights = await ref.get_hf_state_dict()
    await meshes[name].load_hf_state_dict(weights)
    fb_ref, g_ref, w_ref = await one_step(ref, batch, 1)
    fb, g, w = await one_step(meshes[name], batch, dp)
    assert fb["loss"] == pytest.approx(fb_ref["loss"], rel=1e-5)
    assert fb["num_tokens"] == fb_ref["num_tokens"]
    assert set(g) == set(g_ref)
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-5, atol=1e-6, msg=k)
    for k in w_ref:
        torch.testing.assert_close(w[k], w_ref[k], rtol=1e-5, atol=1e-6, msg=k)
    await meshes[name].load_hf_state_dict(weights)
    await ref.load_hf_state_dict(weights)


async def test_loss_metrics_under_pipeline_are_the_full_batch_token_means():
    # A fresh PP trainer: its first forward-backward step runs the schedule's shape
    # inference, which calls the loss on placeholder activations; that call must not count.
    from forge_ext.rl.losses.grpo import grpo_metrics, token_logprobs

    loss = {"name": "grpo", "kl_coef": 0.1}
    trainer = await spawn_trainer(config(pp=2), loss=loss)
    try:
        batch = make_lm_batch(BATCH, 32, 256, seed=13, ignore_prefix=PREFIX)
        inputs, targets = split(batch, 1)
        logits = await trainer.forward(inputs)
        g = torch.Generator().manual_seed(13)
        logprobs = token_logprobs(logits, batch["labels"])
        extra = {
            "generator_logprobs": logprobs + 0.3 * torch.randn(logprobs.shape, generator=g),
            "ref_logprobs": logprobs + 0.2 * torch.randn(logprobs.shape, generator=g),
            "advantages": torch.randn(BATCH, generator=g),
        }
        targets[0].update(extra)
        fb = await trainer.forward_backward(inputs, targets)
        expected = grpo_metrics(logits, {**batch, **extra}, kl_coef=0.1)
        assert fb["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        for name in ("kl", "ratio_mean", "clip_fraction"):
            assert fb[f"loss/{name}"] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
        # A train step's forward gives its label log-probs (the train-inference mismatch's
        # source) from the last stage, before the update, at the batch's length.
        step = await trainer.train_step(inputs, targets, return_metrics=True,
                                        return_logprobs=True)
        torch.testing.assert_close(step["logprobs"],
                                   label_logprobs_reference(logits, batch["labels"]),
                                   rtol=1e-5, atol=1e-5)
    finally:
        await trainer.stop()


def label_logprobs_reference(logits, labels):
    """``log_softmax(logits)[label]`` per position, 0 where the label is ignored: written
    here with plain torch, not with the code under test."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    gathered = logprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels == -100, 0.0, gathered).float()


async def test_eval_and_forward_under_pipeline_equal_no_pipeline(meshes):
    batch = make_lm_batch(BATCH, 32, 256, seed=12, ignore_prefix=PREFIX)
    ref_logits = await meshes["pp1"].forward(*split(batch, 1))
    # The reference model's KL input: label log-probs, against an independent gather.
    expected_lp = label_logprobs_reference(ref_logits, batch["labels"])
    ref_loss = await meshes["pp1"].eval_step(*split(batch, 1))
    valid = batch["labels"] != -100
    assert ref_loss == pytest.approx(float(-expected_lp[valid].mean()), rel=1e-5)
    lp = await meshes["pp1"].forward(*split(batch, 1), output="logprobs")
    torch.testing.assert_close(lp, expected_lp, rtol=1e-5, atol=1e-5)
    for name, dp in (("pp2", 1), ("pp2dp2", 2)):
        loss = await meshes[name].eval_step(*split(batch, dp))
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        logits = await meshes[name].forward(*split(batch, dp))
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        lp = await meshes[name].forward(*split(batch, dp), output="logprobs")
        torch.testing.assert_close(lp, expected_lp, rtol=1e-5, atol=1e-5, msg=name)
    # Stages other than the last return nothing, not zeros.
    values = list((await meshes["pp2"].actor.forward.call(*split(batch, 1))).values())
    assert values[0] is None and values[1] is not None
    losses = list((await meshes["pp2"].actor.eval_step.call(*split(batch, 1))).values())
    assert losses[0] is None and losses[1] == pytest.approx(ref_loss, rel=1e-5)


async def test_pipeline_accepts_batches_of_different_lengths(meshes):
    """Schedules fix shapes at their first step; the engine pads to training.seq_len, so a
    shorter batch later gives the same loss as without PP."""
    for seq in (32, 20):
        batch = make_lm_batch(BATCH, seq, 256, seed=seq, ignore_prefix=[p % seq for p in PREFIX])
        ref = await meshes["pp1"].eval_step(*split(batch, 1))
        assert await meshes["pp2"].eval_step(*split(batch, 1)) == pytest.approx(ref, rel=1e-5)
        logits = await meshes["pp2"].forward(*split(batch, 1))
        assert logits.shape == (BATCH, seq, 256)


async def test_pipeline_checkpoint_restores_exactly(meshes):
    pp2 = meshes["pp2"]
    batches = [make_lm_batch(BATCH, 32, 256, seed=s, ignore_prefix=PREFIX) for s in (13, 14)]
    await pp2.train_step(*split(batches[0], 1))
    step = await pp2.save_checkpoint()
    first = await pp2.train_step(*split(batches[1], 1), return_metrics=True)
    w_first = await pp2.get_hf_state_dict()
    assert await pp2.load_checkpoint(step) == step
    again = await pp2.train_step(*split(batches[1], 1), return_metrics=True)
    for key in ("loss", "grad_norm", "lr"):
        assert again[key] == first[key], key
    w_again = await pp2.get_hf_state_dict()
    assert all(torch.equal(w_first[k], w_again[k]) for k in w_first)


async def test_pipeline_trainer_pushes_complete_weights_with_dcp(meshes):
    """Each PP stage publishes its own tensors; the DCP version holds all of them."""
    await initialize_store()
    try:
        pp2 = meshes["pp2"]
        await pp2.push_weights(100)
        fetched = await fetch_weights(100, key_prefix="pp2")
        expected = await pp2.get_hf_state_dict()
        assert set(fetched) == set(expected)
        for k in expected:
            assert torch.equal(fetched[k], expected[k]), k
    finally:
        await ts.shutdown()
    with pytest.raises(ValueError, match="use weights.transport=dcp"):
        await spawn_trainer(config(pp=2), weights={"transport": "direct"})


@pytest.mark.parametrize("name, dp", [("pp2", 1), ("pp2dp2", 2)])
async def test_pipeline_export_gives_transformers_the_trainers_logits(meshes, name, dp,
                                                                      tmp_path):
    """Each stage's first rank writes its own layers' shards into one HF folder: transformers
    loads it with the pipeline trainer's logits (fp32)."""
    from transformers import AutoModelForCausalLM

    handle = meshes[name]
    info = await handle.export_hf(tmp_path / "hf", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert info["files"] == len(set(index["weight_map"].values())) > 2
    batch = make_lm_batch(BATCH, 32, 256, seed=21)
    model, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                          output_loading_info=True)
    assert not any(loading.values()), loading  # every weight, each from the folder
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    assert logits.abs().max() > 1.0  # random weights (the fixture's): not vacuous
    torch.testing.assert_close(logits, await handle.forward(*split(batch, dp)),
                               rtol=1e-5, atol=1e-5)


async def test_every_grpo_variant_under_pipeline_equals_no_pipeline(meshes):
    """Each aggregation and GSPO under PP=2 x DP=2 (Interleaved1F1B, GA=2, one row per PP
    microbatch: the loss weights are per-row sequence counts, 0 for an empty row) gives the
    PP=1 loss and gradients, and the float64 reference's loss (tests/grpo_reference.py)."""
    from grpo_reference import ENGINE_VARIANTS, grpo_targets, reference_kwargs, reference_loss

    ref, pp = meshes["pp1"], meshes["pp2dp2"]
    prefix = [27, 31, 29, 30, 0, 1, 2, 1]  # row 1: no valid token
    batch = make_lm_batch(BATCH, 32, 256, seed=14, ignore_prefix=prefix)
    weights = await ref.get_hf_state_dict()
    await pp.load_hf_state_dict(weights)
    logits = await ref.forward(*split(batch, 1))
    batch.update(grpo_targets(logits, batch["labels"], seed=14))
    try:
        for variant in ENGINE_VARIANTS:
            loss = {"name": "grpo", "kl_coef": 0.1, **variant}
            await asyncio.gather(ref.set_loss(loss), pp.set_loss(loss))
            results = []
            for handle, dp in ((ref, 1), (pp, 2)):
                inputs, targets = split(batch, dp)
                for target, part in zip(targets, range(dp)):
                    rows = slice(part * BATCH // dp, (part + 1) * BATCH // dp)
                    for key in ("generator_logprobs", "ref_logprobs", "advantages"):
                        target[key] = batch[key][rows]
                fb = await handle.forward_backward(inputs, targets)
                results.append((fb, await handle.get_gradients()))
                await handle.optim_step()  # consumes (zeroes) the gradients
                await handle.load_hf_state_dict(weights)
            expected = float(reference_loss(logits, batch, **reference_kwargs(variant, 0.1)))
            (fb_ref, g_ref), (fb, g) = results
            assert fb_ref["loss"] == pytest.approx(expected, rel=1e-5), variant
            assert fb["loss"] == pytest.approx(expected, rel=1e-5), variant
            assert fb["num_tokens"] == fb_ref["num_tokens"], variant
            assert set(g) == set(g_ref)
            for k in g_ref:
                atol = 1e-5 * float(g_ref[k].abs().max())
                torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=atol,
                                           msg=f"{variant} {k}")
    finally:
        await asyncio.gather(ref.set_loss({"name": "cross_entropy"}),
                             pp.set_loss({"name": "cross_entropy"}))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": {"name": "qwen3", "flavor": "debugmodel"}}, "ties its embedding"),
        ({"parallelism": {"pipeline_parallel_microbatch_size": 4}},
         "fewer than parallelism.pipeline_parallel_degree=2"),
        ({"parallelism": {"pipeline_parallel_schedule": "2F2B"}},
         "pipeline_parallel_schedule='2F2B'"),
        ({"parallelism": {"pipeline_parallel_microbatch_size": 3}},
         "not divisible by parallelism.pipeline_parallel_microbatch_size=3"),
    ],
)
async def test_bad_pipeline_config_fails_before_spawn(change, message):
    c = config(pp=2)
    for section, values in change.items():
        c[section] = {**c.get(section, {}), **values}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine_config_from_mapping(c)
