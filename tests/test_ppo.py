"""PPO's formulas against an independent float64 implementation (tests/ppo_reference.py):
GAE at several gammas and lambdas over responses of 1 to 64 tokens with prompts, padding and
multi-turn masks (environment tokens between turns), whitening over the valid tokens only,
RLOO, and the clipped value loss with its gradient, in every aggregation; what the app's PPO
step hands to the critic (rewards in row order, the KL's sign)."""

import math

import pytest
import torch
from ppo_reference import (
    reference_gae, reference_rloo, reference_value_loss, reference_whiten,
)

from forge_ext.rl.advantages import GAE, build_estimator, leave_one_out_advantages
from forge_ext.rl.algorithm import AlgorithmConfig
from forge_ext.rl.losses.config import AGGREGATIONS
from forge_ext.rl.losses.value import ValueLoss, value_loss_and_metrics

# (prompt tokens, response tokens) per row: 1 to 64 response tokens, and a row without any.
ROWS = ((3, 1), (1, 64), (5, 17), (2, 2), (4, 0), (6, 40))
SEQ = 72


def ppo_batch(seed, rows=ROWS, seq=SEQ, env_spans=None):
    """``labels`` (prompt, response, padding), ``values``/``kl`` with NaN off the model tokens
    (they must not leak), rewards. ``env_spans[b]``: (start, length) of environment tokens
    inside row b's response (their labels are -100, as pack_episodes masks them)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.full((len(rows), seq), -100)
    for b, (prompt, response) in enumerate(rows):
        labels[b, prompt - 1 : prompt - 1 + response] = torch.randint(3, 16, (response,), generator=g)
        for start, length in (env_spans or {}).get(b, ()):
            labels[b, prompt - 1 + start : prompt - 1 + start + length] = -100
    valid = labels != -100
    values = torch.where(valid, torch.randn(labels.shape, generator=g), math.nan)
    kl = torch.where(valid, 0.3 * torch.randn(labels.shape, generator=g), math.inf)
    rewards = torch.randn(len(rows), generator=g)
    return rewards, labels, values, kl


def assert_rows_close(got, want, labels, rtol=1e-5, atol=1e-6):
    want = torch.tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    assert (got[labels == -100] == 0).all()  # prompt, padding, environment: nothing


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0),
                                       (0.5, 0.7)])
def test_gae_advantages_and_returns_match_the_float64_reference(gamma, lam):
    rewards, labels, values, _ = ppo_batch(seed=1)
    out = GAE(gamma=gamma, lam=lam, whiten=False).token_advantages(rewards, labels, values)
    want_adv, want_ret = reference_gae(rewards.tolist(), labels.tolist(), values.tolist(), gamma, lam)
    assert_rows_close(out.advantages, want_adv, labels)
    assert_rows_close(out.returns, want_ret, labels)
    # gamma = lam = 1: every token's advantage is the episode's reward minus its value.
    if gamma == lam == 1.0:
        valid = labels != -100
        expected = (rewards[:, None] - values)[valid]
        torch.testing.assert_close(out.advantages[valid], expected, rtol=1e-5, atol=1e-6)


def test_gae_with_the_kl_penalty_in_the_reward_matches_the_reference():
    rewards, labels, values, kl = ppo_batch(seed=2)
    out = GAE(gamma=0.99, lam=0.9, whiten=False, kl_coef=0.05).token_advantages(
        rewards, labels, values, kl)
    want_adv, want_ret = reference_gae(rewards.tolist(), labels.tolist(), values.tolist(), 0.99,
                                       0.9, kl=kl.tolist(), kl_coef=0.05)
    assert_rows_close(out.advantages, want_adv, labels)
    assert_rows_close(out.returns, want_ret, labels)


def test_whitening_is_over_the_batch_valid_tokens_only():
    rewards, labels, values, _ = ppo_batch(seed=3)
    out = GAE(gamma=1.0, lam=0.95, whiten=True).token_advantages(rewards, labels, values)
    raw, _ = reference_gae(rewards.tolist(), labels.tolist(), values.tolist(), 1.0, 0.95)
    assert_rows_close(out.advantages, reference_whiten(raw, labels.tolist()), labels)
    valid = out.advantages[labels != -100].double()
    assert abs(float(valid.mean())) < 1e-6 and float(valid.std()) == pytest.approx(1.0, rel=1e-4)
    # Returns are never whitened; the metrics report the advantages before whitening.
    flat = torch.tensor([a for row, lab in zip(raw, labels.tolist()) for a, l in zip(row, lab)
                         if l != -100], dtype=torch.float64)
    assert out.metrics["advantage/mean"] == pytest.approx(float(flat.mean()), rel=1e-6)
    assert out.metrics["advantage/std"] == pytest.approx(float(flat.std(unbiased=False)), rel=1e-6)


def test_multi_turn_gae_skips_environment_tokens():
    """Environment tokens between turns (labels -100 inside the response) are not steps: the
    model tokens' advantages equal the reference's, and equal those of the same row with the
    environment tokens taken out; the environment tokens get nothing."""
    spans = {1: [(10, 5), (30, 12)], 2: [(3, 1)], 5: [(1, 20)]}
    rewards, labels, values, kl = ppo_batch(seed=4, env_spans=spans)
    estimator = GAE(gamma=0.95, lam=0.9, whiten=False, kl_coef=0.1)
    out = estimator.token_advantages(rewards, labels, values, kl)
    want_adv, want_ret = reference_gae(rewards.tolist(), labels.tolist(), values.tolist(), 0.95,
                                       0.9, kl=kl.tolist(), kl_coef=0.1)
    assert_rows_close(out.advantages, want_adv, labels)
    assert_rows_close(out.returns, want_ret, labels)
    # The same episodes without their environment tokens: model tokens moved together.
    valid = labels != -100
    squeezed = [torch.nonzero(valid[b]).flatten() for b in range(len(ROWS))]
    width = max(len(s) for s in squeezed) + 1
    labels2 = torch.full((len(ROWS), width), -100)
    values2 = torch.full((len(ROWS), width), math.nan)
    kl2 = torch.zeros(len(ROWS), width)
    for b, idx in enumerate(squeezed):
        labels2[b, : len(idx)], values2[b, : len(idx)], kl2[b, : len(idx)] = (
            labels[b, idx], values[b, idx], kl[b, idx])
    single = estimator.token_advantages(rewards, labels2, values2, kl2)
    for b, idx in enumerate(squeezed):
        torch.testing.assert_close(out.advantages[b, idx], single.advantages[b, : len(idx)])
        torch.testing.assert_close(out.returns[b, idx], single.returns[b, : len(idx)])


def test_explained_variance_and_means_are_over_valid_tokens():
    rewards, labels, values, _ = ppo_batch(seed=5)
    out = GAE(whiten=False).token_advantages(rewards, labels, values)
    valid = labels != -100
    r, v = out.returns[valid].double(), values[valid].double()
    expected = 1 - float((r - v).var(unbiased=False) / r.var(unbiased=False))
    assert out.metrics["critic/explained_variance"] == pytest.approx(expected, rel=1e-6)
    assert out.metrics["critic/values_mean"] == pytest.approx(float(v.mean()), rel=1e-6)
    assert out.metrics["critic/returns_mean"] == pytest.approx(float(r.mean()), rel=1e-6)
    # A critic that knows every return explains all of it.
    perfect = GAE(whiten=False).token_advantages(rewards, labels, torch.where(
        valid, rewards[:, None].expand_as(values), math.nan))
    assert perfect.metrics["critic/explained_variance"] == pytest.approx(1.0)


def test_rloo_matches_the_reference_and_gives_zero_to_equal_groups():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.35, 0.35, 0.35, 0.35, 3.0, -1.0, 2.0, 0.0])
    got = leave_one_out_advantages(rewards, 4)
    torch.testing.assert_close(got.double(), torch.tensor(reference_rloo(rewards.tolist(), 4),
                                                          dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert (got[4:8] == 0).all()
    estimator = build_estimator(AlgorithmConfig(advantage="rloo"), group_size=4)
    torch.testing.assert_close(estimator.episode_advantages(rewards), got)


def test_estimator_choice_is_refused_with_the_wrong_group_size_or_fields():
    with pytest.raises(ValueError, match="grpo.group_size=1 with algorithm.advantage=grpo"):
        build_estimator(AlgorithmConfig(), group_size=1)
    assert build_estimator(AlgorithmConfig(advantage="gae"), group_size=1).needs_critic
    with pytest.raises(ValueError, match="algorithm.advantage='ppo' must be one of"):
        AlgorithmConfig(advantage="ppo")
    with pytest.raises(ValueError, match="algorithm.lam=0.9 applies to algorithm.advantage=gae"):
        AlgorithmConfig(advantage="grpo", lam=0.9)
    with pytest.raises(ValueError, match="algorithm.gamma=1.5 must lie in"):
        AlgorithmConfig(advantage="gae", gamma=1.5)


def value_batch(seed, clip_value=0.2):
    """A value-head output and targets where the clip binds on some tokens: new values far
    from the old ones on both sides of the return."""
    _, labels, old_values, _ = ppo_batch(seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    valid = labels != -100
    values = torch.where(valid, old_values, 0.0) + torch.randn(labels.shape, generator=g)
    returns = torch.where(valid, torch.randn(labels.shape, generator=g), math.nan)
    return values, {"labels": labels, "returns": returns, "old_values": old_values}


def reference_value_gradient(values, mb, clip_value):
    """d(token_mean loss)/d(values), per the max's winning branch (float64)."""
    v, r, old = values.double(), mb["returns"].double(), mb["old_values"].double()
    valid = mb["labels"] != -100
    n = int(valid.sum())
    delta = v - old
    clipped = old + delta.clamp(-clip_value, clip_value)
    grad = torch.where((v - r) ** 2 >= (clipped - r) ** 2, v - r,
                       torch.where(delta.abs() < clip_value, clipped - r, 0.0))
    return torch.where(valid, grad / n, 0.0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_value_loss_matches_the_reference_in_every_aggregation(aggregation):
    values, mb = value_batch(seed=6)
    logits = values[..., None].clone().requires_grad_(True)
    loss, metrics = value_loss_and_metrics(logits, mb, clip_value=0.2, aggregation=aggregation,
                                           max_response_tokens=64)
    expected = reference_value_loss(values.tolist(), mb["labels"].tolist(), mb["returns"].tolist(),
                                     mb["old_values"].tolist(), 0.2, aggregation, 64)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert 0.1 < float(metrics["clip_fraction"]) < 0.9  # the clip binds on some tokens
    if aggregation == "token_mean":
        loss.backward()
        torch.testing.assert_close(logits.grad[..., 0].double(),
                                   reference_value_gradient(values, mb, 0.2), rtol=1e-5, atol=1e-8)


def test_value_loss_clips_against_the_old_values_not_the_new_ones():
    """Clipping against the current values (detached) would clip nothing: the loss would be
    the plain squared error. Against the old values it is larger wherever the clip binds."""
    values, mb = value_batch(seed=7)
    logits = values[..., None]
    clipped, _ = value_loss_and_metrics(logits, mb, clip_value=0.2)
    plain, _ = value_loss_and_metrics(logits, mb, clip_value=None)
    assert float(clipped) > 1.05 * float(plain)
    against_new = dict(mb, old_values=values)
    same, metrics = value_loss_and_metrics(logits, against_new, clip_value=0.2)
    assert float(same) == pytest.approx(float(plain)) and float(metrics["clip_fraction"]) == 0


def test_value_loss_weight_is_the_aggregation_unit_and_refuses_an_lm_head():
    values, mb = value_batch(seed=8)
    valid = mb["labels"] != -100
    assert int(ValueLoss(ValueLoss.Config()).weight(mb)) == int(valid.sum())
    assert int(ValueLoss(ValueLoss.Config(aggregation="seq_mean_token_mean")).weight(mb)) == int(
        valid.any(1).sum())
    with pytest.raises(ValueError, match="model.value_head: true"):
        value_loss_and_metrics(torch.zeros(*mb["labels"].shape, 16), mb)
    with pytest.raises(ValueError, match="critic.clip_value=0 must be > 0"):
        ValueLoss.Config(clip_value=0)


def test_the_ppo_step_hands_the_critic_each_rows_reward_and_kl_in_batch_order(
        demo_checkpoint, tmp_path):
    """``RLApp.critic_step`` (the app's side of a PPO step): the rewards it hands to the
    critic are the batch's episodes' in their row order, and the KL in the reward is
    ``log pi_gen - log pi_ref`` (not its negative: a KL bonus), with the run's estimator.
    The critic here records what it is handed (its own side: tests/test_trainer_actor.py)."""
    import asyncio
    from pathlib import Path

    from apps.grpo.config import load_config
    from apps.grpo.main import RLApp
    from forge_ext.rl.episode import Episode, pack_episodes

    config = load_config(
        str(Path(__file__).resolve().parent.parent / "configs" / "ppo_cpu_demo.yaml"),
        [f"model.hf_path={demo_checkpoint}", f"output_dir={tmp_path}", "task.num_train=16",
         "task.num_eval=2", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.05"])
    app = RLApp(config)
    g = torch.Generator().manual_seed(3)
    episodes = [Episode(prompt_ids=[1, 5, 6][: 1 + i], response_ids=[7, 8, 2][: 3 - i],
                        generator_logprobs=-torch.rand(3 - i, generator=g),
                        ref_logprobs=-torch.rand(3 - i, generator=g), advantage=0.0,
                        policy_version=0, reward=float(i) - 0.5) for i in range(3)]
    packed = pack_episodes(episodes, pad_id=0)

    class RecordingCritic:
        async def advantages_and_update(self, batch, rewards, estimator, kl):
            self.handed = rewards, estimator, kl
            out = estimator.token_advantages(rewards, batch["labels"],
                                             torch.zeros(batch["labels"].shape), kl)
            return out.advantages, {}

    app.critic = RecordingCritic()
    asyncio.run(app.critic_step(packed, episodes))
    rewards, estimator, kl = app.critic.handed
    assert rewards.tolist() == [-0.5, 0.5, 1.5]
    assert estimator is app.estimator and estimator.kl_coef == 0.05
    valid = packed["labels"] != -100
    expected = packed["generator_logprobs"] - packed["ref_logprobs"]
    assert torch.equal(kl[valid], expected[valid]) and (kl[valid] != 0).all()
