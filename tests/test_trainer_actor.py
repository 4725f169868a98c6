"""RLTrainer on real Monarch proc meshes with real torch.distributed (gloo): training lowers
the loss, DP=2 equals DP=1, checkpoints round-trip, bad requests are rejected cleanly; the
critic's gradients, checkpoints, and the targets a PPO step hands to its update."""

import asyncio
import copy

import pytest
import pytest_asyncio
import torch
from conftest import assert_grad_close, full, make_lm_batch, random_state_dict, spawn_all

from forge_ext.actors import spawn_trainer
from forge_ext.actors.critic import Critic

pytestmark = pytest.mark.asyncio(loop_scope="module")

GLOBAL_BATCH = 8
TRAINER = {
    "model": {"name": "qwen3", "flavor": "tiny"},
    # steps: the linear LR decay moves the LR by 1% per step, so a lost scheduler state shows.
    "training": {"local_batch_size": GLOBAL_BATCH, "microbatch_size": 2, "seq_len": 64,
                 "steps": 100},
    "optimizer": {"lr": 3e-3},
    "seed": 7,
}
GRPO_LOSS = {"name": "grpo", "kl_coef": 0.1, "clip_eps_high": 0.28}
PREFIX = [0, 25, 3, 30, 10, 0, 31, 16]
# Under DP=2, rank 0 gets rows 0-3 with 4+3+2+1 = 10 valid tokens (of 31 per row) and rank 1
# rows 4-7 with 31+30+29+30 = 120: a rank-local normalisation is far off the global one.
DP_PREFIX = [27, 28, 29, 30, 0, 1, 2, 1]
BUDGET = 96  # training.max_tokens_per_microbatch of the token-budget trainer
CRITIC_LOSS = {"name": "value", "clip_value": 0.2}


def trainer_config(dp: int, fsdp: bool = False, **extra):
    c = copy.deepcopy(TRAINER)
    c["training"]["local_batch_size"] = GLOBAL_BATCH // dp
    key = "data_parallel_shard_degree" if fsdp else "data_parallel_replicate_degree"
    c["parallelism"] = {key: dp}
    c.update(extra)
    return c


def split(batch, dp):
    inputs = [{"input_ids": t} for t in batch["input_ids"].chunk(dp)]
    targets = [{"labels": t} for t in batch["labels"].chunk(dp)]
    return inputs, targets


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainers(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    ckpt = {"checkpoint": {"enable": True, "folder": "ckpt"}, "dump_folder": ckpt_dir}
    budget = trainer_config(2, fsdp=True)
    budget["training"].pop("microbatch_size")
    budget["training"]["max_tokens_per_microbatch"] = BUDGET
    critic = trainer_config(2, fsdp=True, checkpoint={"enable": True, "folder": "critic"},
                            dump_folder=str(tmp_path_factory.mktemp("ckpt_critic")))
    critic["model"]["value_head"] = True
    dp1, dp2, fsdp2, grpo, budget2, critic2 = await spawn_all(
        spawn_trainer(trainer_config(1, **ckpt)),
        spawn_trainer(trainer_config(
            2, checkpoint={"enable": True, "folder": "ckpt"},
            dump_folder=str(tmp_path_factory.mktemp("ckpt_dp2")),
        )),
        spawn_trainer(trainer_config(2, fsdp=True)),
        spawn_trainer(trainer_config(2), loss=GRPO_LOSS),
        spawn_trainer(budget),
        spawn_trainer(critic, loss=CRITIC_LOSS),
    )
    handles = {"dp1": dp1, "dp2": dp2, "fsdp2": fsdp2, "grpo": grpo, "budget2": budget2,
               "critic2": critic2}
    yield {**handles, "ckpt": ckpt}
    await asyncio.gather(*(handle.stop() for handle in handles.values()))


async def test_dp2_replicate_and_fsdp_equal_dp1_and_loss_falls(trainers):
    """Same global batch: DP=1, DP=2 by replication and DP=2 by FSDP (sharded parameters)
    give the same losses and weights step after step."""
    dp1 = trainers["dp1"]
    others = {"replicate": trainers["dp2"], "fsdp": trainers["fsdp2"]}
    weights = random_state_dict(await dp1.get_hf_state_dict(), seed=4, std=0.05)
    for handle in (dp1, *others.values()):
        await handle.load_hf_state_dict(weights)
    batch = make_lm_batch(GLOBAL_BATCH, 32, 256, seed=0, ignore_prefix=DP_PREFIX)
    rank_tokens = [int((t != -100).sum()) for t in batch["labels"].chunk(2)]
    assert rank_tokens == [10, 120]
    losses = {"dp1": [], "replicate": [], "fsdp": []}
    for _ in range(10):
        losses["dp1"].append(await dp1.train_step(*split(batch, 1)))
        for name, handle in others.items():
            losses[name].append(await handle.train_step(*split(batch, 2)))
    assert losses["dp1"][-1] < 0.8 * losses["dp1"][0], losses["dp1"]
    w1 = await dp1.get_hf_state_dict()
    for name, handle in others.items():
        for a, b in zip(losses["dp1"], losses[name]):
            assert b == pytest.approx(a, rel=1e-4), name
        w = await handle.get_hf_state_dict()
        for k in w1:
            torch.testing.assert_close(w[k], w1[k], rtol=1e-4, atol=1e-5, msg=f"{name} {k}")
    # Every DP rank reports the same reduced loss (a mean, not a per-rank SUM).
    dp2 = others["replicate"]
    values = await dp2.actor.train_step.call(*split(batch, 2))
    assert len(set(values.values())) == 1
    assert await dp2.get_policy_version() == 11
    # The engine's mode contexts switch the model on every rank, and the verbs leave it
    # in training mode.
    for handle in others.values():
        for mode, training in (("eval", False), ("train", True), (None, True)):
            modes = await handle.actor.get_model_training.call(mode)
            assert list(modes.values()) == [[training]] * 2, (mode, modes)


async def test_forward_backward_then_optim_step_equals_train_step(trainers):
    """Two tinker-style steps (forward_backward + optim_step) and two fused train_steps from
    the same saved state (weights, Adam moments, LR) give the same losses, grad norms, LRs
    and weights: optim_step must leave no gradient behind for the next forward_backward."""
    dp2 = trainers["dp2"]
    batches = [make_lm_batch(GLOBAL_BATCH, 32, 256, seed=s, ignore_prefix=DP_PREFIX)
               for s in (1, 2)]
    await dp2.train_step(*split(batches[1], 2))  # Adam moments exist before the save
    start = await dp2.save_checkpoint()
    tinker = []
    for batch in batches:
        fb = await dp2.forward_backward(*split(batch, 2))
        tinker.append({**fb, **await dp2.optim_step()})
    w_tinker = await dp2.get_hf_state_dict()
    assert await dp2.load_checkpoint(start) == start
    fused = [await dp2.train_step(*split(b, 2), return_metrics=True) for b in batches]
    w_fused = await dp2.get_hf_state_dict()

    for i, (t, f) in enumerate(zip(tinker, fused)):
        assert t["policy_version"] == f["policy_version"] == start + i + 1
        assert t["num_tokens"] == f["num_tokens"] == float((batches[i]["labels"] != -100).sum())
        for key in ("loss", "grad_norm", "lr"):
            assert t[key] == pytest.approx(f[key], rel=1e-6), (i, key)
    for k in w_fused:
        torch.testing.assert_close(w_tinker[k], w_fused[k], rtol=1e-6, atol=1e-7, msg=k)
    eval_loss = await dp2.eval_step(*split(batches[1], 2))
    assert eval_loss < fused[1]["loss"]


async def test_checkpoint_round_trip_into_fresh_trainer(trainers):
    """A fresh trainer loaded from a checkpoint takes the next step exactly as the trainer
    that saved it: loss and grad norm (weights), LR (scheduler state) and the updated
    weights (Adam's moments show only in the update)."""
    dp1 = trainers["dp1"]
    batch = make_lm_batch(GLOBAL_BATCH, 32, 256, seed=2, ignore_prefix=PREFIX)
    await dp1.train_step(*split(batch, 1))  # Adam moments and a moved LR before the save
    saved = await dp1.save_checkpoint()
    expected = await dp1.train_step(*split(batch, 1), return_metrics=True)
    expected_weights = await dp1.get_hf_state_dict()
    fresh = await spawn_trainer(trainer_config(1, **trainers["ckpt"]))
    try:
        assert await fresh.load_checkpoint() == saved
        assert await fresh.get_policy_version() == saved
        got = await fresh.train_step(*split(batch, 1), return_metrics=True)
        got_weights = await fresh.get_hf_state_dict()
    finally:
        await fresh.stop()
    assert expected["lr"] < TRAINER["optimizer"]["lr"]  # the scheduler has moved
    for key in ("loss", "grad_norm", "lr"):
        assert got[key] == expected[key], key
    for k in expected_weights:
        assert torch.equal(got_weights[k], expected_weights[k]), k


async def test_bad_requests_are_rejected_and_trainer_stays_usable(trainers):
    dp2 = trainers["dp2"]
    batch = make_lm_batch(GLOBAL_BATCH, 32, 256, seed=3)
    inputs, targets = split(batch, 2)
    version = await dp2.get_policy_version()
    bad = [
        ((inputs[:1], targets), "len\\(inputs\\)=1 != len\\(targets\\)=2"),
        ((inputs[:1], targets[:1]), "2 data-parallel ranks"),
        (([{"input_ids": inputs[0]["input_ids"][:, :8]}, inputs[1]], targets),
         "dim 1 must equal the sequence length"),
        (([{"input_ids": inputs[0]["input_ids"][:3]}, inputs[1]], targets),
         "training.local_batch_size=4"),
    ]
    for args, message in bad:
        with pytest.raises(Exception, match=message):
            await dp2.train_step(*args)
    assert await dp2.get_policy_version() == version
    loss = await dp2.train_step(inputs, targets)
    assert loss == loss and await dp2.get_policy_version() == version + 1


async def test_bad_config_fails_before_spawn():
    with pytest.raises(ValueError, match="training.local_batch_size=6 is not a multiple"):
        await spawn_trainer(
            {"training": {"local_batch_size": 6, "microbatch_size": 4}}
        )
    with pytest.raises(ValueError, match="model.flavor='nope'"):
        await spawn_trainer({"model": {"flavor": "nope"}})
    with pytest.raises(ValueError, match="loss.name='mse'"):
        await spawn_trainer(TRAINER, loss={"name": "mse"})


async def test_grpo_trainer_returns_the_loss_metrics_token_weighted_over_dp_ranks(trainers):
    from forge_ext.rl.losses.grpo import grpo_metrics, token_logprobs

    trainer = trainers["grpo"]  # GRPO_LOSS, DP=2
    # Rank 0's rows carry far fewer valid tokens than rank 1's: a mean of the two ranks'
    # means would differ from the token mean over the whole batch.
    prefix = [60, 58, 61, 59, 0, 3, 1, 2]
    batch = make_lm_batch(GLOBAL_BATCH, 64, 256, seed=5, ignore_prefix=prefix)
    g = torch.Generator().manual_seed(6)
    inputs, targets = split(batch, 2)
    logits = await trainer.forward(inputs)  # before the step: what the loss sees
    logprobs = token_logprobs(logits, batch["labels"])
    batch["generator_logprobs"] = logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)
    batch["ref_logprobs"] = logprobs + 0.2 * torch.randn(logprobs.shape, generator=g)
    batch["advantages"] = torch.randn(GLOBAL_BATCH, generator=g)
    for key in ("generator_logprobs", "ref_logprobs", "advantages"):
        for target, part in zip(targets, batch[key].chunk(2)):
            target[key] = part

    result = await trainer.train_step(inputs, targets, return_metrics=True,
                                      return_logprobs=True)
    # The step forward's log-probs of the labels, under the weights before the update (what
    # the train-inference mismatch is measured from), both ranks' rows in order.
    valid = batch["labels"] != -100
    torch.testing.assert_close(result["logprobs"], torch.where(valid, logprobs, 0.0),
                               rtol=1e-5, atol=1e-5)
    expected = grpo_metrics(logits, batch, kl_coef=0.1, clip_eps_high=0.28)
    for name in ("kl", "ratio_mean", "clip_fraction"):
        assert result[f"loss/{name}"] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-4)
    assert 0 < result["loss/clip_fraction"] < 1  # the comparison is not vacuous


async def test_token_budget_under_fsdp2_balances_ranks_by_tokens_and_equals_dp1(trainers):
    """DP=2 (FSDP) with a token budget, one half of the rows 20x longer than the other: the
    controller's split balances tokens, both ranks run as many microbatches (FSDP's
    collectives need it; a rank with fewer splits or pads), and the gradient equals DP=1's
    fixed-row gradient, even for the count split that sends every long row to rank 0."""
    from forge_ext.actors.reference import (
        ReferenceModel, data_parallel_rows, in_batch_order, split_for_data_parallel,
    )

    dp1, budget2 = trainers["dp1"], trainers["budget2"]
    weights = random_state_dict(await dp1.get_hf_state_dict(), seed=5, std=0.05)
    for handle in (dp1, budget2):
        await handle.load_hf_state_dict(weights)
    batch = make_lm_batch(GLOBAL_BATCH, 64, 256, seed=8)
    lengths = [60] * 4 + [3] * 4
    for row, n in enumerate(lengths):
        batch["labels"][row, n:] = -100
        batch["labels"][row, : n // 2] = -100  # a prompt
    await dp1.forward_backward(*split(batch, 1))
    want = await dp1.get_gradients()
    await dp1.optim_step()  # consumes (zeroes) the gradients: later tests accumulate from 0
    await dp1.load_hf_state_dict(weights)

    rows = data_parallel_rows(batch, budget2.config, 2)
    rank_tokens = [sum(lengths[i] for i in r) for r in rows]
    assert rank_tokens == [126, 126]
    for split_rows in (rows, [[0, 1, 2, 3], [4, 5, 6, 7]]):  # by tokens; by count
        inputs, targets = split_for_data_parallel(batch, 2, rows=split_rows)
        await budget2.load_hf_state_dict(weights)  # the train_step below moves them
        await budget2.forward_backward(inputs, targets)
        got = await budget2.get_gradients()
        for name in want:
            assert_grad_close(got[name], want[name], name)
        values = list((await budget2.actor.train_step.call(
            inputs, targets, return_metrics=True)).values())
        counts = [v["num_microbatches"] for v in values]
        assert counts[0] == counts[1], counts
        computed = [v["computed_tokens"] for v in values]
        if split_rows is rows:
            assert max(computed) <= 1.1 * min(computed), computed
        else:  # rank 1's 4 short rows fit one microbatch; it runs 4 (split, then padding)
            assert counts == [4, 4] and computed[0] > 10 * computed[1], computed
    # Reference log-probs through the token-balanced split come back in the batch's row order.
    await budget2.load_hf_state_dict(weights)
    ref = await ReferenceModel(budget2).logprobs(batch)
    want = await dp1.forward(*split(batch, 1), output="logprobs")
    assert rows != [[0, 1, 2, 3], [4, 5, 6, 7]]
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    # So do the log-probs of a train step's forward (before its update).
    await budget2.load_hf_state_dict(weights)
    result = await budget2.train_step(*split_for_data_parallel(batch, 2, rows=rows),
                                      return_metrics=True, return_logprobs=True)
    torch.testing.assert_close(in_batch_order(result["logprobs"], rows), want,
                               rtol=1e-5, atol=1e-5)


async def test_every_grpo_variant_under_dp2_equals_dp1(trainers):
    """Each aggregation and GSPO: DP=2 on real procs (ranks of 10 and 120 valid tokens, and
    unequal sequence counts: row 3 of rank 0 has no valid token) gives DP=1's loss and
    gradient, the float64 reference's loss (tests/grpo_reference.py), and the variants give
    different losses. Runs last in this module: it switches the trainers' losses and
    restores them."""
    from grpo_reference import ENGINE_VARIANTS, grpo_targets, reference_kwargs, reference_loss

    dp1, dp2 = trainers["dp1"], trainers["grpo"]
    prefix = [27, 28, 29, 31, 0, 1, 2, 1]
    batch = make_lm_batch(GLOBAL_BATCH, 32, 256, seed=8, ignore_prefix=prefix)
    weights = random_state_dict(await dp1.get_hf_state_dict(), seed=8, std=0.05)
    await asyncio.gather(dp1.load_hf_state_dict(weights), dp2.load_hf_state_dict(weights))
    logits = await dp1.forward(split(batch, 1)[0])
    batch.update(grpo_targets(logits, batch["labels"], seed=8))
    losses = []
    try:
        for variant in ENGINE_VARIANTS:
            loss = {"name": "grpo", "kl_coef": 0.1, **variant}
            await asyncio.gather(dp1.set_loss(loss), dp2.set_loss(loss))
            results = {}
            for name, handle, dp in (("dp1", dp1, 1), ("dp2", dp2, 2)):
                inputs, targets = split(batch, dp)
                for target, lo in zip(targets, range(0, GLOBAL_BATCH, GLOBAL_BATCH // dp)):
                    for key in ("generator_logprobs", "ref_logprobs", "advantages"):
                        target[key] = batch[key][lo : lo + GLOBAL_BATCH // dp]
                fb = await handle.forward_backward(inputs, targets)
                results[name] = (fb, await handle.get_gradients())
                await handle.optim_step()  # consumes (zeroes) the gradients
                await handle.load_hf_state_dict(weights)
            expected = float(reference_loss(logits, batch, **reference_kwargs(variant, 0.1)))
            (fb1, g1), (fb2, g2) = results["dp1"], results["dp2"]
            assert fb1["loss"] == pytest.approx(expected, rel=1e-5), variant
            assert fb2["loss"] == pytest.approx(expected, rel=1e-5), variant
            assert fb2["num_tokens"] == fb1["num_tokens"]
            for k in g1:
                atol = 1e-5 * float(g1[k].abs().max())
                torch.testing.assert_close(g2[k], g1[k], rtol=1e-4, atol=atol,
                                           msg=f"{variant} {k}")
            losses.append(expected)
    finally:
        await asyncio.gather(dp1.set_loss({"name": "cross_entropy"}), dp2.set_loss(GRPO_LOSS))
    values = sorted(losses)
    assert all(b - a > 1e-3 * abs(b) for a, b in zip(values, values[1:])), losses
    with pytest.raises(ValueError, match="loss.aggregation='nope'"):
        await dp2.set_loss({"name": "grpo", "aggregation": "nope"})


def critic_targets(values, seed):
    """``old_values`` near the given values (the clip binds on some tokens) and returns."""
    g = torch.Generator().manual_seed(seed)
    return {"old_values": values + 0.5 * torch.randn(values.shape, generator=g),
            "returns": torch.randn(values.shape, generator=g)}


async def test_critic_gradients_under_fsdp2_and_ga_equal_one_process_autograd(trainers):
    """The critic (value head, clipped value loss) on 2 FSDP ranks x 2 microbatches each,
    ranks of 10 and 120 valid tokens: its loss and every parameter's gradient equal plain
    autograd of the value loss over the whole batch in one process (no ranks, no
    microbatches, no loss weights)."""
    from forge_ext.engine import TitanEngine
    from forge_ext.engine.distributed import init_single_process_env

    critic = trainers["critic2"]
    init_single_process_env()
    config = trainer_config(1)
    config["model"]["value_head"] = True
    local = TitanEngine(config)
    weights = random_state_dict(local.hf_state_dict(), seed=12, std=0.1)
    local.load_model_state_dict(local.sd_adapter.from_hf(weights))
    await critic.load_hf_state_dict(weights)
    batch = make_lm_batch(GLOBAL_BATCH, 32, 256, seed=12, ignore_prefix=DP_PREFIX)
    values = (await critic.forward(split(batch, 2)[0], split(batch, 2)[1], output="values"))
    torch.testing.assert_close(values, local.forward_batch(batch)[..., 0])
    batch.update(critic_targets(values, seed=12))
    v = local.model_parts[0](batch["input_ids"])[..., 0]
    valid = batch["labels"] != -100
    old, ret = batch["old_values"], batch["returns"]
    token = 0.5 * torch.maximum((v - ret) ** 2, (old + (v - old).clamp(-0.2, 0.2) - ret) ** 2)
    expected = token[valid].mean()
    expected.backward()
    want = {n: full(p.grad) for n, p in local.model_parts[0].named_parameters()}
    inputs, targets = split(batch, 2)
    for target, lo in zip(targets, (0, GLOBAL_BATCH // 2)):
        for key in ("old_values", "returns"):
            target[key] = batch[key][lo : lo + GLOBAL_BATCH // 2]
    fb = await critic.forward_backward(inputs, targets)
    got = await critic.get_gradients()
    await critic.optim_step()  # consumes (zeroes) the gradients
    assert fb["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert 0 < fb["loss/clip_fraction"] < 1
    assert set(got) == set(want)
    for name in want:
        assert_grad_close(got[name], want[name], name)


async def test_critic_checkpoint_restores_its_weights_optimizer_and_schedule(trainers):
    """A critic reloaded from its checkpoint takes the next two steps exactly as the critic
    that saved it went on: the loss of the first shows the weights, the second's the Adam
    moments and the LR schedule."""
    critic = trainers["critic2"]
    batch = make_lm_batch(GLOBAL_BATCH, 32, 256, seed=13, ignore_prefix=DP_PREFIX)
    inputs, targets = split(batch, 2)
    values = await critic.forward(inputs, targets, output="values")
    extra = critic_targets(values, seed=13)
    for target, lo in zip(targets, (0, GLOBAL_BATCH // 2)):
        for key, value in extra.items():
            target[key] = value[lo : lo + GLOBAL_BATCH // 2]
    await critic.train_step(inputs, targets)  # Adam moments before the save
    saved = await critic.save_checkpoint()
    expected = [await critic.train_step(inputs, targets, return_metrics=True) for _ in range(2)]
    assert await critic.load_checkpoint(saved) == saved
    got = [await critic.train_step(inputs, targets, return_metrics=True) for _ in range(2)]
    for e, g in zip(expected, got):
        for key in ("loss", "grad_norm", "lr", "loss/clip_fraction"):
            assert g[key] == e[key], key
    assert expected[1]["loss"] != expected[0]["loss"]


class RecordingCritic(Critic):
    """The critic handle as shipped, plus the batch it hands to its trainer's update."""

    async def train_step(self, batch):
        self.handed = {k: v.clone() for k, v in batch.items()}
        return await super().train_step(batch)


async def test_a_ppo_step_trains_the_critic_on_the_gae_returns_against_its_own_values(trainers):
    """:meth:`Critic.advantages_and_update` on the FSDP critic: what it hands to the update
    is the GAE returns (with the KL penalty in the reward) of the critic's own values, as the
    float64 reference computes them, and those values as ``old_values``; the update's loss is
    the value loss of exactly those (``V = V_old`` at that forward: 0.5 (V - R)^2, token
    mean); the policy's advantages are the reference's, whitened. The fault it exists for:
    the critic trained on the advantages instead of the returns (every other test passed)."""
    from ppo_reference import reference_gae, reference_value_loss, reference_whiten

    from forge_ext.actors.critic_config import CriticConfig
    from forge_ext.rl.advantages import GAE

    handle = trainers["critic2"]
    await handle.load_hf_state_dict(
        random_state_dict(await handle.get_hf_state_dict(), seed=14, std=0.1))
    critic = RecordingCritic(handle, CriticConfig())
    batch = make_lm_batch(GLOBAL_BATCH, 32, 256, seed=14, ignore_prefix=DP_PREFIX)
    g = torch.Generator().manual_seed(14)
    rewards = torch.randn(GLOBAL_BATCH, generator=g)
    kl = 0.3 * torch.randn(batch["labels"].shape, generator=g)
    values = await critic.values(batch)
    labels = batch["labels"]
    valid = labels != -100
    assert values[valid].std() > 0.1  # the critic's values vary: not a zero head
    advantages, metrics = await critic.advantages_and_update(
        batch, rewards, GAE(gamma=0.99, lam=0.95, whiten=True, kl_coef=0.05), kl)

    adv, ret = reference_gae(rewards.tolist(), labels.tolist(), values.tolist(), 0.99, 0.95,
                             kl=kl.tolist(), kl_coef=0.05)
    ret = torch.tensor(ret)
    handed = critic.handed
    assert sorted(handed) == ["input_ids", "labels", "old_values", "returns"]
    assert torch.equal(handed["input_ids"], batch["input_ids"])
    assert torch.equal(handed["labels"], labels)
    torch.testing.assert_close(handed["old_values"], values, rtol=0, atol=1e-6)
    torch.testing.assert_close(handed["returns"][valid], ret[valid], rtol=1e-5, atol=1e-5)
    assert (handed["returns"][~valid] == 0).all()
    torch.testing.assert_close(advantages.double(),
                               torch.tensor(reference_whiten(adv, labels.tolist()),
                                            dtype=torch.float64), rtol=1e-4, atol=1e-5)
    expected = reference_value_loss(values.tolist(), labels.tolist(), ret.tolist(),
                                    values.tolist(), clip_value=0.2)
    assert metrics["critic/loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["critic/returns_mean"] == pytest.approx(float(ret[valid].mean()), rel=1e-5)
