"""GRPO loss: hand-computed case, per-token reference, clipping, masking, GA exactness, and
the off-policy correction (truncated importance sampling) against an independent
computation."""

import math

import pytest
import torch

from forge_ext.rl.advantages import compute_group_advantages
from forge_ext.rl.losses.grpo import (
    GRPOLoss,
    grpo_loss,
    grpo_metrics,
    token_logprobs,
    valid_token_count,
)
from forge_ext.rl.losses.off_policy import truncated_importance_weights

LOG4 = math.log(4.0)


def hand_case() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Uniform logits over 4 tokens, so the policy log-prob of every token is -log 4.

    Valid tokens (ratio = pi/pi_gen, ref ratio = pi_ref/pi, advantage):
      row 0, t=1: ratio 1.5, ref ratio 2.0, A=+1
      row 0, t=2: ratio 0.5, ref ratio 1.0, A=+1
      row 1, t=1: ratio 1.1, ref ratio 0.5, A=-1
    Ignored positions hold inf/nan, which must not leak into the loss.
    """
    logits = torch.zeros(2, 3, 4, requires_grad=True)
    logp = -LOG4
    nan, inf = math.nan, math.inf
    mb = {
        "labels": torch.tensor([[-100, 1, 2], [-100, 3, -100]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "generator_logprobs": torch.tensor(
            [
                [inf, logp - math.log(1.5), logp - math.log(0.5)],
                [nan, logp - math.log(1.1), -inf],
            ]
        ),
        "ref_logprobs": torch.tensor(
            [[nan, logp + math.log(2.0), logp], [inf, logp + math.log(0.5), nan]]
        ),
    }
    return logits, mb


def test_loss_matches_hand_computed_small_case():
    logits, mb = hand_case()
    beta = 0.04
    # k3: ref_ratio - log(ref_ratio) - 1
    kl = [2.0 - math.log(2.0) - 1.0, 0.0, 0.5 - math.log(0.5) - 1.0]
    # min(r A, clip(r, 0.8, 1.2) A): 1.5 -> clipped 1.2; 0.5 -> 0.5 (A > 0, min keeps it);
    # A = -1, r = 1.1 inside the clip range -> -1.1.
    surrogate = [1.2, 0.5, -1.1]
    expected = -sum(s - beta * k for s, k in zip(surrogate, kl)) / 3

    loss = grpo_loss(logits, mb, clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=beta)

    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_metrics_match_hand_computed_small_case():
    logits, mb = hand_case()
    metrics = grpo_metrics(logits, mb, kl_coef=0.04)

    assert metrics["num_valid_tokens"] == 3
    assert metrics["kl"] == pytest.approx((1 - math.log(2) + 0 + math.log(2) - 0.5) / 3, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1) / 3, abs=1e-6)
    # Only row 0, t=1 (ratio 1.5 > 1.2 with A > 0) has the clip binding.
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["loss"] == pytest.approx(grpo_loss(logits, mb, kl_coef=0.04).item(), abs=1e-6)


def test_clip_fraction_counts_only_clips_that_bind():
    # Ratio 1.5 with A < 0 and ratio 0.5 with A > 0 lie outside [0.8, 1.2], but min() picks
    # the unclipped term, so these tokens still get gradient: not clipped.
    logits = torch.zeros(2, 1, 4)
    mb = {
        "labels": torch.tensor([[0], [0]]),
        "advantages": torch.tensor([-1.0, 1.0]),
        "generator_logprobs": torch.tensor([[-LOG4 - math.log(1.5)], [-LOG4 - math.log(0.5)]]),
    }
    assert grpo_metrics(logits, mb, kl_coef=0.0)["clip_fraction"] == 0.0
    mb["advantages"] = -mb["advantages"]
    assert grpo_metrics(logits, mb, kl_coef=0.0)["clip_fraction"] == 1.0


def test_clip_higher_changes_only_the_upper_bound():
    logits, mb = hand_case()
    # eps_high=0.6 lets ratio 1.5 through unclipped; everything else is unchanged.
    loss = grpo_loss(logits, mb, clip_eps_low=0.2, clip_eps_high=0.6, kl_coef=0.0)
    assert loss.item() == pytest.approx(-(1.5 + 0.5 - 1.1) / 3, abs=1e-6)


def test_clipped_token_gets_no_policy_gradient():
    logits, mb = hand_case()
    grpo_loss(logits, mb, kl_coef=0.0).backward()
    grad = logits.grad
    assert torch.all(grad[0, 1] == 0)  # clip binds: ratio 1.5 > 1.2 with A > 0
    assert grad[0, 2].abs().sum() > 0  # ratio 0.5 with A > 0: unclipped term is the min
    assert grad[1, 1].abs().sum() > 0
    assert torch.all(grad[:, 0] == 0) and torch.all(grad[1, 2] == 0)  # ignored positions


def reference_grpo_loss(logits, mb, eps_low, eps_high, beta):
    """Straight per-token loop over DeepSeekMath eq. 3 with DAPO token-level averaging."""
    logp_all = torch.log_softmax(logits, dim=-1)
    terms = []
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            label = int(mb["labels"][b, t])
            if label == -100:
                continue
            logp = logp_all[b, t, label]
            ratio = torch.exp(logp - mb["generator_logprobs"][b, t])
            adv = mb["advantages"][b]
            surrogate = torch.minimum(
                ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
            )
            ref_ratio = torch.exp(mb["ref_logprobs"][b, t] - logp)
            kl = ref_ratio - torch.log(ref_ratio) - 1
            terms.append(-(surrogate - beta * kl))
    return torch.stack(terms).mean()


def random_batch(seed: int, batch: int = 3, seq: int = 6, vocab: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < 0.3] = -100
    labels[0, 0] = 3  # at least one valid token
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    mb = {
        "labels": labels,
        "advantages": torch.randn(batch, generator=g),
        # Near the policy so some ratios fall inside and some outside the clip range.
        "generator_logprobs": logp + 0.4 * torch.randn(batch, seq, generator=g),
        "ref_logprobs": logp + 0.4 * torch.randn(batch, seq, generator=g),
    }
    return logits, mb


def test_loss_and_gradient_match_per_token_reference():
    logits, mb = random_batch(seed=0)
    ours = logits.clone().requires_grad_(True)
    ref = logits.clone().requires_grad_(True)

    loss = grpo_loss(ours, mb, clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1)
    expected = reference_grpo_loss(ref, mb, 0.2, 0.28, 0.1)
    loss.backward()
    expected.backward()

    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(ours.grad, ref.grad)


def test_weighted_microbatch_means_equal_full_batch_loss_and_gradient():
    """The engine's accumulation: sum_i mean_i * count_i / total == full-batch token mean."""
    logits, mb = random_batch(seed=1, batch=4)
    mb["labels"][1, :] = -100
    mb["labels"][1, 2] = 5  # microbatches get unequal valid-token counts
    full = logits.clone().requires_grad_(True)
    grpo_loss(full, mb).backward()

    split = logits.clone().requires_grad_(True)
    parts = [slice(0, 1), slice(1, 4)]
    mbs = [{k: v[p] for k, v in mb.items()} for p in parts]
    total = sum(valid_token_count(m) for m in mbs)
    assert int(total) == int((mb["labels"] != -100).sum())
    accumulated = sum(
        grpo_loss(split[p], m) * valid_token_count(m) / total for p, m in zip(parts, mbs)
    )
    accumulated.backward()

    torch.testing.assert_close(accumulated, grpo_loss(logits, mb))
    torch.testing.assert_close(split.grad, full.grad)


def test_no_valid_tokens_gives_zero_loss_and_nan_metrics():
    logits, mb = hand_case()
    mb["labels"] = torch.full_like(mb["labels"], -100)
    loss = grpo_loss(logits, mb)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(logits.grad == 0)
    metrics = grpo_metrics(logits, mb)
    assert metrics["num_valid_tokens"] == 0
    assert math.isnan(metrics["kl"])


def test_kl_coef_zero_does_not_need_ref_logprobs():
    logits, mb = hand_case()
    del mb["ref_logprobs"]
    assert torch.isfinite(grpo_loss(logits, mb, kl_coef=0.0))
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logits, mb, kl_coef=0.04)


def test_kl_is_measured_without_a_penalty_when_kl_coef_is_zero():
    logits, mb = random_batch(seed=5)
    with_penalty = grpo_metrics(logits, mb, kl_coef=0.1)
    without = grpo_metrics(logits, mb, kl_coef=0.0)
    assert without["kl"] == pytest.approx(with_penalty["kl"]) and without["kl"] > 0
    # ... and it adds nothing to the loss or its gradient.
    torch.testing.assert_close(
        grpo_loss(logits, mb, kl_coef=0.0),
        grpo_loss(logits, {k: v for k, v in mb.items() if k != "ref_logprobs"}, kl_coef=0.0),
    )


def test_bad_microbatch_is_rejected_with_the_field_name():
    logits, mb = hand_case()
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logits, {**mb, "advantages": torch.zeros(3)})
    with pytest.raises(ValueError, match="labels"):
        token_logprobs(logits, mb["labels"][:, :2])


def test_token_logprobs_is_log_softmax_gather_with_zeros_at_ignored():
    logits, mb = random_batch(seed=2)
    labels = mb["labels"]
    expected = torch.zeros(labels.shape)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] != -100:
                row = logits[b, t].double()
                expected[b, t] = float(row[labels[b, t]] - torch.logsumexp(row, 0))
    torch.testing.assert_close(token_logprobs(logits, labels), expected)


def test_group_advantages_match_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    adv = compute_group_advantages(rewards, group_size=4, eps=1e-6)
    # group 1: mean 0.5, population std 0.5; group 2: constant -> 0;
    # group 3: mean 0.75, population std sqrt((3 * 0.75^2 + 2.25^2) / 4) = sqrt(27)/4.
    s1, s3 = 0.5 + 1e-6, math.sqrt(27) / 4 + 1e-6
    expected = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, 0, 0, 0, 0]
    expected += [-0.75 / s3] * 3 + [2.25 / s3]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_groups_with_spread_reads_consecutive_completions_as_one_group():
    # Groups of 2 (one prompt's completions side by side): equal, spread, equal. Read with
    # the wrong stride (every third reward one group), the last group would have spread.
    from forge_ext.rl.advantages import groups_with_spread

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])
    assert groups_with_spread(rewards, 2).tolist() == [False, True, False]
    assert groups_with_spread(rewards, 3).tolist() == [True, True]
    assert groups_with_spread(rewards, 1).tolist() == [False] * 6


def test_group_advantages_reject_bad_shapes_and_allow_group_of_one():
    assert torch.equal(compute_group_advantages(torch.tensor([3.0, 5.0]), 1), torch.zeros(2))
    with pytest.raises(ValueError, match="group_size=4"):
        compute_group_advantages(torch.ones(6), group_size=4)
    with pytest.raises(ValueError, match="group_size=0"):
        compute_group_advantages(torch.ones(6), group_size=0)


def test_grpo_loss_object_returns_the_loss_and_its_token_mean_metrics():
    # Weighting these across microbatches and ranks is the engine's job (test_engine).
    logits, mb = random_batch(seed=3, batch=4)
    loss_fn = GRPOLoss(GRPOLoss.Config(clip_eps_high=0.28, kl_coef=0.1))
    loss, metrics = loss_fn(logits, mb)
    torch.testing.assert_close(loss, grpo_loss(logits, mb, clip_eps_high=0.28, kl_coef=0.1))
    expected = grpo_metrics(logits, mb, clip_eps_high=0.28, kl_coef=0.1)
    assert set(metrics) == set(GRPOLoss.metric_names) == {"kl", "ratio_mean", "clip_fraction"}
    for name, value in metrics.items():
        assert not value.requires_grad, name
        assert float(value) == pytest.approx(expected[name], rel=1e-6), name


def test_grpo_loss_config_rejects_invalid_values():
    with pytest.raises(ValueError, match="kl_coef"):
        GRPOLoss.Config(kl_coef=-0.1)
    with pytest.raises(ValueError, match="clip_eps_low"):
        GRPOLoss.Config(clip_eps_low=1.0)


def test_engine_builds_grpo_from_a_loss_config():
    from forge_ext.rl.losses.registry import build_loss

    loss_fn, loss_weight_fn = build_loss(name="grpo", kl_coef=0.0, clip_eps_high=0.28)
    logits, mb = random_batch(seed=4)
    torch.testing.assert_close(
        loss_fn(logits, mb)[0], grpo_loss(logits, mb, kl_coef=0.0, clip_eps_high=0.28)
    )
    assert int(loss_weight_fn(mb)) == int((mb["labels"] != -100).sum())
    with pytest.raises(ValueError, match="grpo"):
        build_loss(name="grpo", clip_eps=0.2)


# ---- off-policy correction: token-level truncated importance sampling ---------------------
TIS = {"off_policy_correction": "token_tis"}


def off_policy_batch(seed: int):
    """A random batch whose generator log-probs are far enough from the policy's that some
    importance ratios exceed a cap of 1.5 and some do not."""
    logits, mb = random_batch(seed, batch=4, seq=8)
    g = torch.Generator().manual_seed(seed + 100)
    logp = token_logprobs(logits, mb["labels"])
    mb["generator_logprobs"] = logp + 0.8 * torch.randn(logp.shape, generator=g)
    return logits, mb


def reference_weights(logits, mb, cap):
    """``min(pi_trainer / pi_gen, cap)`` per valid token, in float64 from a log-softmax of the
    logits and math.exp: ``{(b, t): (weight, capped)}``."""
    logp_all = torch.log_softmax(logits.double(), dim=-1)
    out = {}
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            label = int(mb["labels"][b, t])
            if label != -100:
                ratio = math.exp(float(logp_all[b, t, label]) - float(mb["generator_logprobs"][b, t]))
                out[b, t] = (min(ratio, cap), ratio > cap)
    return out


def test_importance_weights_are_the_capped_exp_of_the_trainer_generator_log_prob_gap():
    logits, mb = off_policy_batch(seed=11)
    mask = mb["labels"] != -100
    weights, capped = truncated_importance_weights(
        token_logprobs(logits, mb["labels"]), mb["generator_logprobs"], mask, cap=1.5
    )
    expected = reference_weights(logits, mb, cap=1.5)
    for (b, t), (weight, over) in expected.items():
        assert float(weights[b, t]) == pytest.approx(weight, rel=1e-5), (b, t)
        assert bool(capped[b, t]) == over, (b, t)
    assert 0 < sum(over for _, over in expected.values()) < len(expected)  # not vacuous
    assert torch.all(weights[~mask] == 1) and not capped[~mask].any()


def test_corrected_loss_and_gradient_match_an_independent_per_token_computation():
    """With one optimizer step per batch the corrected objective is ``w * A`` per token in
    value and ``w * A * grad log pi`` in gradient, i.e. the gradient of ``w * A * log pi``
    with ``w`` held constant (REINFORCE weighted by the truncated ratio)."""
    logits, mb = off_policy_batch(seed=12)
    weights = reference_weights(logits, mb, cap=1.5)
    ours = logits.clone().requires_grad_(True)
    loss = grpo_loss(ours, mb, kl_coef=0.1, tis_imp_ratio_cap=1.5, **TIS)
    loss.backward()

    ref = logits.clone().requires_grad_(True)
    logp_all = torch.log_softmax(ref, dim=-1)
    values, surrogates = [], []
    for (b, t), (w, _) in weights.items():
        logp = logp_all[b, t, int(mb["labels"][b, t])]
        ref_ratio = torch.exp(mb["ref_logprobs"][b, t] - logp)
        kl = ref_ratio - torch.log(ref_ratio) - 1
        adv = float(mb["advantages"][b])
        values.append(-(w * adv) + 0.1 * float(kl.detach()))
        surrogates.append(-(w * adv * logp) + 0.1 * kl)
    torch.stack(surrogates).mean().backward()

    assert float(loss) == pytest.approx(sum(values) / len(values), rel=1e-5)
    torch.testing.assert_close(ours.grad, ref.grad)
    metrics = grpo_metrics(logits, mb, kl_coef=0.1, tis_imp_ratio_cap=1.5, **TIS)
    assert metrics["tis_weight_mean"] == pytest.approx(
        sum(w for w, _ in weights.values()) / len(weights), rel=1e-5
    )
    assert metrics["tis_capped_fraction"] == pytest.approx(
        sum(c for _, c in weights.values()) / len(weights)
    )
    assert metrics["clip_fraction"] == 0.0  # the ratio to the trainer's own policy is 1


def test_with_identical_policies_the_weights_are_1_and_the_loss_is_the_uncorrected_loss():
    logits, mb = random_batch(seed=13, batch=4, seq=8)
    mb["generator_logprobs"] = token_logprobs(logits, mb["labels"])  # generator == trainer
    metrics = grpo_metrics(logits, mb, kl_coef=0.1, **TIS)
    assert metrics["tis_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["tis_capped_fraction"] == 0.0
    grads = {}
    for name, extra in (("none", {}), ("token_tis", TIS)):
        x = logits.clone().requires_grad_(True)
        loss = grpo_loss(x, mb, kl_coef=0.1, **extra)
        loss.backward()
        grads[name] = (loss.detach(), x.grad)
    torch.testing.assert_close(grads["token_tis"][0], grads["none"][0])
    torch.testing.assert_close(grads["token_tis"][1], grads["none"][1])


def test_the_corrected_loss_object_returns_the_importance_weight_metrics():
    logits, mb = off_policy_batch(seed=14)
    loss_fn = GRPOLoss(GRPOLoss.Config(kl_coef=0.1, tis_imp_ratio_cap=1.5, **TIS))
    loss, metrics = loss_fn(logits, mb)
    expected = grpo_metrics(logits, mb, kl_coef=0.1, tis_imp_ratio_cap=1.5, **TIS)
    assert set(metrics) == {"kl", "ratio_mean", "clip_fraction", "tis_weight_mean",
                            "tis_capped_fraction"}
    for name, value in metrics.items():
        assert float(value) == pytest.approx(expected[name], rel=1e-6), name
    assert set(GRPOLoss(GRPOLoss.Config())(logits, mb)[1]) == set(GRPOLoss.metric_names)


def test_off_policy_correction_config_rejects_unknown_values():
    with pytest.raises(ValueError, match="off_policy_correction='tis'"):
        GRPOLoss.Config(off_policy_correction="tis")
    with pytest.raises(ValueError, match="tis_imp_ratio_cap=0"):
        GRPOLoss.Config(off_policy_correction="token_tis", tis_imp_ratio_cap=0)
    logits, mb = random_batch(seed=15)
    with pytest.raises(ValueError, match="loss.off_policy_correction='sequence'"):
        grpo_loss(logits, mb, off_policy_correction="sequence")
