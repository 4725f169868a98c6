"""GRPO variants against an independent float64 implementation of each paper's formula
(tests/grpo_reference.py): the four loss aggregations, GSPO's sequence ratio and clip, its
importance weights, advantage scalings, truncation masking, packed rows, and the microbatch
weights that keep every mode exact under any split."""

import math

import pytest
import torch
from grpo_reference import reference_advantages, reference_loss

from forge_ext.rl.advantages import compute_group_advantages
from forge_ext.rl.losses.config import (
    AGGREGATIONS, OFF_POLICY_CORRECTIONS, RATIO_LEVELS, default_clip_eps,
)
from forge_ext.rl.losses.grpo import GRPOLoss, grpo_loss, grpo_metrics, token_logprobs
from forge_ext.rl.losses.off_policy import MASK_CORRECTIONS

# Very unequal response lengths, and a row without any valid token (it must not count as a
# sequence in the seq_mean modes).
LENGTHS = (1, 11, 3, 0, 7)
MAX_RESPONSE_TOKENS = 16


def variant_batch(seed, lengths=LENGTHS, seq=12, vocab=7, noise=0.4, on_policy_row=2):
    """Responses at the end of each row (as packed episodes are); ignored positions of the
    log-prob tensors hold NaN/inf, which must not leak. Row ``on_policy_row`` has generator
    log-probs equal to the policy's (ratio 1: inside any clip range)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    logits = torch.randn(batch, seq, vocab, generator=g)
    labels = torch.full((batch, seq), -100)
    for b, n in enumerate(lengths):
        if n:
            labels[b, seq - 1 - n : seq - 1] = torch.randint(0, vocab, (n,), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    valid = labels != -100
    generator = logp + noise * torch.randn(batch, seq, generator=g)
    if on_policy_row is not None:
        generator[on_policy_row] = logp[on_policy_row]
    mb = {
        "labels": labels,
        "advantages": torch.randn(batch, generator=g),
        "generator_logprobs": torch.where(valid, generator, math.nan),
        "ref_logprobs": torch.where(valid, logp + noise * torch.randn(batch, seq, generator=g),
                                    math.inf),
    }
    return logits, mb


CORRECTION_FIELDS = ("off_policy_correction", "tis_imp_ratio_cap", "mask_imp_ratio_cap_low",
                     "mask_imp_ratio_cap_high")


def ours_and_reference(logits, mb, **kwargs):
    """``(loss, grad)`` of forge_ext's loss and of the float64 reference on the same logits."""
    level = kwargs.get("ratio_level", "token")
    clip = kwargs.pop("clip", default_clip_eps(level))
    ours = logits.clone().requires_grad_(True)
    loss = grpo_loss(ours, mb, clip_eps_low=clip[0], clip_eps_high=clip[1], **kwargs)
    loss.backward()
    ref = logits.clone().requires_grad_(True)
    ref_kwargs = {k: v for k, v in kwargs.items() if k not in CORRECTION_FIELDS}
    expected = reference_loss(
        ref, mb, clip=clip, correction=kwargs.get("off_policy_correction", "none"),
        cap=kwargs.get("tis_imp_ratio_cap", 2.0),
        mask_caps=(kwargs.get("mask_imp_ratio_cap_low", 2.0),
                   kwargs.get("mask_imp_ratio_cap_high", 2.0)), **ref_kwargs,
    )
    expected.backward()
    return (loss.detach(), ours.grad), (expected.detach(), ref.grad)


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_and_gradient_match_the_float64_reference(aggregation, ratio_level):
    logits, mb = variant_batch(seed=0)
    # Row 1's sequence ratio is above 1 + 4e-4: with A > 0 GSPO's clip binds on it, while
    # row 0's (below 1, A > 0) and the on-policy row 2's (exactly 1) stay unclipped.
    mb["advantages"][1] = abs(float(mb["advantages"][1]))
    kwargs = dict(aggregation=aggregation, ratio_level=ratio_level, kl_coef=0.1,
                  max_response_tokens=MAX_RESPONSE_TOKENS)
    (loss, grad), (expected, expected_grad) = ours_and_reference(logits, mb, **kwargs)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    torch.testing.assert_close(grad, expected_grad.float(), rtol=1e-4, atol=1e-7)
    # The engine's weight: the unit the microbatch mean is over.
    loss_fn = GRPOLoss(GRPOLoss.Config(aggregation=aggregation, ratio_level=ratio_level,
                                       kl_coef=0.1, max_response_tokens=MAX_RESPONSE_TOKENS))
    expected_weight = sum(LENGTHS) if aggregation == "token_mean" else 4  # row 3 is empty
    assert int(loss_fn.weight(mb)) == expected_weight
    # Not vacuous: the clip binds on some tokens (sequences) and not on others.
    clip_fraction = grpo_metrics(logits, mb, **kwargs)["clip_fraction"]
    assert 0 < clip_fraction < 1


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_importance_weights_match_the_reference_at_each_ratio_level(ratio_level):
    logits, mb = variant_batch(seed=1, noise=0.8)
    kwargs = dict(aggregation="seq_mean_token_mean", ratio_level=ratio_level, kl_coef=0.1,
                  off_policy_correction="token_tis", tis_imp_ratio_cap=1.2)
    (loss, grad), (expected, expected_grad) = ours_and_reference(logits, mb, **kwargs)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    torch.testing.assert_close(grad, expected_grad.float(), rtol=1e-4, atol=1e-7)
    capped = grpo_metrics(logits, mb, **kwargs)["tis_capped_fraction"]
    assert 0 < capped < 1


@pytest.mark.parametrize("aggregation", ("token_mean", "seq_mean_token_mean"))
@pytest.mark.parametrize("correction", MASK_CORRECTIONS)
def test_rejection_matches_the_reference_and_counts_what_it_rejects(correction, aggregation):
    # noise 0.8: some tokens' (sequences') ratio leaves [1/2.5, 1.25], others' do not; the
    # on-policy row 2 (ratio 1) is always kept.
    logits, mb = variant_batch(seed=3, noise=0.8)
    kwargs = dict(aggregation=aggregation, kl_coef=0.1, off_policy_correction=correction,
                  mask_imp_ratio_cap_low=2.5, mask_imp_ratio_cap_high=1.25)
    (loss, grad), (expected, expected_grad) = ours_and_reference(logits, mb, **kwargs)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    torch.testing.assert_close(grad, expected_grad.float(), rtol=1e-4, atol=1e-7)
    rejected = grpo_metrics(logits, mb, **kwargs)["rejected_fraction"]
    assert 0 < rejected < 1
    # A rejected token gets no gradient: its logits' gradient is exactly 0 (kl included).
    gap = torch.log_softmax(logits, -1).gather(-1, mb["labels"].clamp(min=0)[..., None])[..., 0]
    gap = torch.where(mb["labels"] != -100, gap - mb["generator_logprobs"], 0.0)
    if correction == "token_mask":
        out = (mb["labels"] != -100) & ((gap > math.log(1.25)) | (gap < -math.log(2.5)))
        assert out.any() and torch.all(grad[out] == 0)


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
def test_decoupled_clips_against_the_proximal_policy_and_weights_by_proximal_over_behaviour(
        ratio_level):
    logits, mb = variant_batch(seed=3, noise=0.5)
    # A proximal policy apart from both the behaviour policy and the current one (as after
    # an optimizer step on part of the batch): the clip now binds on some tokens.
    g = torch.Generator().manual_seed(4)
    logp = torch.log_softmax(logits, -1).gather(-1, mb["labels"].clamp(min=0)[..., None])[..., 0]
    mb["proximal_logprobs"] = logp + 0.3 * torch.randn(logp.shape, generator=g)
    kwargs = dict(aggregation="token_mean", ratio_level=ratio_level, kl_coef=0.1,
                  off_policy_correction="decoupled", tis_imp_ratio_cap=1.5)
    (loss, grad), (expected, expected_grad) = ours_and_reference(logits, mb, **kwargs)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    torch.testing.assert_close(grad, expected_grad.float(), rtol=1e-4, atol=1e-7)
    metrics = grpo_metrics(logits, mb, **kwargs)
    assert 0 < metrics["clip_fraction"] < 1 and 0 < metrics["tis_capped_fraction"] < 1


def test_decoupled_without_proximal_logprobs_is_token_tis_bitwise():
    # The trainer takes one optimizer step per batch: the proximal policy is this forward's.
    logits, mb = variant_batch(seed=5, noise=0.6)
    grads = {}
    for correction in ("token_tis", "decoupled"):
        ours = logits.clone().requires_grad_(True)
        loss = grpo_loss(ours, mb, kl_coef=0.1, off_policy_correction=correction)
        loss.backward()
        grads[correction] = (loss.detach(), ours.grad)
    assert torch.equal(grads["token_tis"][0], grads["decoupled"][0])
    assert torch.equal(grads["token_tis"][1], grads["decoupled"][1])


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_every_correction_without_mismatch_is_the_uncorrected_loss_and_gradient_bitwise(
        aggregation, ratio_level):
    # Zero mismatch: the generator's log-probs are exactly the trainer's (as fp32 on both
    # sides can give), so every weight is 1 and nothing is rejected.
    logits, mb = variant_batch(seed=6, on_policy_row=None)
    valid = mb["labels"] != -100
    mb["generator_logprobs"] = torch.where(valid, token_logprobs(logits, mb["labels"]), math.nan)
    base = dict(aggregation=aggregation, ratio_level=ratio_level, kl_coef=0.1,
                max_response_tokens=MAX_RESPONSE_TOKENS)
    results = {}
    for correction in OFF_POLICY_CORRECTIONS:
        ours = logits.clone().requires_grad_(True)
        loss = grpo_loss(ours, mb, off_policy_correction=correction, tis_imp_ratio_cap=1.01,
                         mask_imp_ratio_cap_low=1.01, mask_imp_ratio_cap_high=1.01, **base)
        loss.backward()
        results[correction] = (loss.detach(), ours.grad)
    for correction, (loss, grad) in results.items():
        assert torch.equal(loss, results["none"][0]), correction
        assert torch.equal(grad, results["none"][1]), correction
    assert results["none"][1].abs().sum() > 0  # not vacuous


def test_gspo_on_one_token_responses_equals_token_level_grpo():
    logits, mb = variant_batch(seed=2, lengths=(1, 1, 1, 0, 1))
    grads = {}
    for level in RATIO_LEVELS:
        x = logits.clone().requires_grad_(True)
        loss = grpo_loss(x, mb, aggregation="seq_mean_token_mean", ratio_level=level,
                         clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1)
        loss.backward()
        grads[level] = (loss.detach(), x.grad)
    torch.testing.assert_close(grads["sequence"][0], grads["token"][0])
    torch.testing.assert_close(grads["sequence"][1], grads["token"][1])


def test_seq_mean_token_mean_on_equal_lengths_equals_token_mean():
    logits, mb = variant_batch(seed=3, lengths=(5, 5, 5, 5))
    grads = {}
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        x = logits.clone().requires_grad_(True)
        loss = grpo_loss(x, mb, aggregation=aggregation, kl_coef=0.1)
        loss.backward()
        grads[aggregation] = (loss.detach(), x.grad)
    torch.testing.assert_close(grads["seq_mean_token_mean"][0], grads["token_mean"][0])
    torch.testing.assert_close(grads["seq_mean_token_mean"][1], grads["token_mean"][1])


def test_the_modes_differ_on_unequal_lengths():
    logits, mb = variant_batch(seed=4)
    losses = {a: float(grpo_loss(logits, mb, aggregation=a, kl_coef=0.1,
                                 max_response_tokens=MAX_RESPONSE_TOKENS))
              for a in AGGREGATIONS}
    values = sorted(losses.values())
    assert all(b - a > 1e-3 * abs(b) for a, b in zip(values, values[1:])), losses


def pack_two_rows(logits, mb, rows=(1, 2)):
    """The responses of ``rows`` as two sequences in one row: ``sequence_ids`` 0 then 1,
    -1 on the padding; per-token advantages. Returns the packed ``(logits, mb)`` and, per
    packed position, the ``(row, t)`` it came from."""
    seq = logits.shape[1]
    where = []
    for sid, b in enumerate(rows):
        where += [(b, t, sid) for t in range(seq) if int(mb["labels"][b, t]) != -100]
    length = len(where) + 1
    packed_logits = torch.zeros(1, length, logits.shape[2])
    packed = {
        "labels": torch.full((1, length), -100),
        "sequence_ids": torch.full((1, length), -1),
        "advantages": torch.zeros(1, length),
        "generator_logprobs": torch.full((1, length), math.nan),
        "ref_logprobs": torch.zeros(1, length),
    }
    for i, (b, t, sid) in enumerate(where):
        packed_logits[0, i] = logits[b, t]
        packed["labels"][0, i] = mb["labels"][b, t]
        packed["sequence_ids"][0, i] = sid
        packed["advantages"][0, i] = mb["advantages"][b]
        for key in ("generator_logprobs", "ref_logprobs"):
            packed[key][0, i] = mb[key][b, t]
    return packed_logits, packed, where


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_sequences_packed_in_one_row_equal_the_same_sequences_in_two_rows(
    aggregation, ratio_level
):
    logits, mb = variant_batch(seed=5)
    two_rows = {k: v[1:3] for k, v in mb.items()}
    packed_logits, packed, where = pack_two_rows(logits, mb)
    loss_fn = GRPOLoss(GRPOLoss.Config(aggregation=aggregation, ratio_level=ratio_level,
                                       kl_coef=0.1, max_response_tokens=MAX_RESPONSE_TOKENS,
                                       off_policy_correction="token_tis"))
    x_rows = logits[1:3].clone().requires_grad_(True)
    loss_rows, metrics_rows = loss_fn(x_rows, two_rows)
    loss_rows.backward()
    x_packed = packed_logits.clone().requires_grad_(True)
    loss_packed, metrics_packed = loss_fn(x_packed, packed)
    loss_packed.backward()

    torch.testing.assert_close(loss_packed, loss_rows)
    assert int(loss_fn.weight(packed)) == int(loss_fn.weight(two_rows))
    for name in metrics_rows:
        torch.testing.assert_close(metrics_packed[name], metrics_rows[name], msg=name)
    for i, (b, t, _) in enumerate(where):
        torch.testing.assert_close(x_packed.grad[0, i], x_rows.grad[b - 1, t])


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_microbatch_means_weighted_by_the_loss_weight_equal_the_full_batch(
    aggregation, ratio_level
):
    """The engine's accumulation, ``sum_i w_i * loss_i / sum_i w_i``, on microbatches of very
    unequal token and sequence counts (one of them with an empty row)."""
    logits, mb = variant_batch(seed=6)
    loss_fn = GRPOLoss(GRPOLoss.Config(aggregation=aggregation, ratio_level=ratio_level,
                                       kl_coef=0.1, max_response_tokens=MAX_RESPONSE_TOKENS))
    full = logits.clone().requires_grad_(True)
    loss_fn(full, mb)[0].backward()
    split = logits.clone().requires_grad_(True)
    parts = [slice(0, 1), slice(1, 2), slice(2, 5)]
    mbs = [{k: v[p] for k, v in mb.items()} for p in parts]
    weights = [loss_fn.weight(m) for m in mbs]
    total = sum(weights)
    accumulated = sum(loss_fn(split[p], m)[0] * w / total for p, m, w in zip(parts, mbs, weights))
    accumulated.backward()
    torch.testing.assert_close(accumulated, loss_fn(logits, mb)[0])
    torch.testing.assert_close(split.grad, full.grad)


@pytest.mark.parametrize("scaling", ["group_std", "none", "batch_std"])
def test_advantage_scalings_match_the_reference(scaling):
    # Groups of 4: spread, all equal (must be exactly 0), a large-magnitude outlier.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.35, 0.35, 0.35, 0.35, 0.0, 0.0, 0.0, 3.0])
    ours = compute_group_advantages(rewards, group_size=4, scaling=scaling)
    expected = reference_advantages(rewards.tolist(), 4, scaling)
    torch.testing.assert_close(ours, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    assert torch.all(ours[4:8] == 0)
    others = [compute_group_advantages(rewards, 4, scaling=s) for s in ("group_std", "none",
                                                                         "batch_std")]
    assert len({tuple(a.tolist()) for a in others}) == 3  # three different scalings


def test_mask_truncated_drops_truncated_responses_from_loss_and_weight():
    logits, mb = variant_batch(seed=7)
    mb["truncated"] = torch.tensor([False, True, False, False, True])
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        config = GRPOLoss.Config(aggregation=aggregation, kl_coef=0.1, mask_truncated=True)
        loss_fn = GRPOLoss(config)
        dropped = {**mb, "labels": mb["labels"].clone()}
        dropped["labels"][mb["truncated"]] = -100
        plain = GRPOLoss(GRPOLoss.Config(aggregation=aggregation, kl_coef=0.1))
        torch.testing.assert_close(loss_fn(logits, mb)[0], plain(logits, dropped)[0])
        assert int(loss_fn.weight(mb)) == int(plain.weight(dropped))
        x = logits.clone().requires_grad_(True)
        (loss_fn(x, mb)[0]).backward()
        assert torch.all(x.grad[1] == 0) and torch.all(x.grad[4] == 0)
        (expected,) = [reference_loss(logits, mb, aggregation=aggregation, kl_coef=0.1,
                                      mask_truncated=True)]
        assert float(loss_fn(logits, mb)[0]) == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match="loss.mask_truncated=true needs mb\\['truncated'\\]"):
        GRPOLoss(GRPOLoss.Config(mask_truncated=True))(logits, {k: v for k, v in mb.items()
                                                               if k != "truncated"})


@pytest.mark.parametrize("fields, message", [
    ({"aggregation": "seq_mean"}, "loss.aggregation='seq_mean' must be one of"),
    ({"ratio_level": "sentence"}, "loss.ratio_level='sentence' must be one of"),
    ({"ratio_level": "sequence", "clip_eps_high": 1.5}, "loss.clip_eps_high=1.5 with "
     "loss.ratio_level=sequence must lie in \\(0, 1\\)"),
    ({"ratio_level": "sequence", "clip_eps_low": 0.0}, "loss.clip_eps_low=0.0 with"),
    ({"preset": "ppo"}, "loss.preset='ppo' must be one of"),
    ({"max_response_tokens": 0}, "loss.max_response_tokens=0 must be >= 1"),
])
def test_bad_loss_config_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        GRPOLoss.Config(**fields)


def test_sequence_ratio_defaults_to_gspo_clip_range_and_sum_norm_needs_its_constant():
    config = GRPOLoss.Config(ratio_level="sequence")
    assert (config.clip_eps_low, config.clip_eps_high) == (3e-4, 4e-4)
    assert (GRPOLoss.Config().clip_eps_low, GRPOLoss.Config().clip_eps_high) == (0.2, 0.2)
    with pytest.raises(ValueError, match="loss.max_response_tokens=None"):
        GRPOLoss(GRPOLoss.Config(aggregation="seq_mean_token_sum_norm"))


# ---- config: presets and bad combinations, refused before any process is spawned --------
def demo_without_loss_section(tmp_path):
    """configs/grpo_cpu_demo.yaml without its ``loss:`` section (which sets clip and KL
    explicitly, and explicit fields win over a preset)."""
    from pathlib import Path

    import yaml

    demo = Path(__file__).resolve().parent.parent / "configs" / "grpo_cpu_demo.yaml"
    mapping = yaml.safe_load(demo.read_text())
    mapping.pop("loss")
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(mapping))
    return str(path)


# Each preset's fields as its paper (or, where the paper is silent, the upstream code cited)
# gives them, written out here rather than read from forge_ext.rl.losses.presets.PRESETS: a
# preset that loses a field, or whose value drifts, then fails the test below.
PAPER_FIELDS = {
    # DeepSeekMath (arXiv:2402.03300), eq. 3: 1/G sum_i 1/|o_i| sum_t; token ratios; std of
    # the group (4.1.2); KL beta 0.04 (4.2). Clip 0.2 / 0.2: PPO's epsilon (arXiv:1707.06347),
    # TRL's GRPOConfig default.
    "grpo": {"loss.aggregation": "seq_mean_token_mean", "loss.ratio_level": "token",
             "loss.clip_eps_low": 0.2, "loss.clip_eps_high": 0.2, "loss.kl_coef": 0.04,
             "grpo.advantage_scaling": "group_std", "grpo.dynamic_sampling": False,
             "reward.overlong.enable": False},
    # Dr. GRPO (arXiv:2503.20783), eq. 3: no 1/|o_i| (a constant), no std division; beta 0 in
    # its recipes (understand-r1-zero examples/*.sh: --beta 0).
    "dr_grpo": {"loss.aggregation": "seq_mean_token_sum_norm", "loss.ratio_level": "token",
                "loss.clip_eps_low": 0.2, "loss.clip_eps_high": 0.2, "loss.kl_coef": 0.0,
                "grpo.advantage_scaling": "none", "grpo.dynamic_sampling": False,
                "reward.overlong.enable": False},
    # DAPO (arXiv:2503.14476): clip-higher 0.2 / 0.28 (3.1), dynamic sampling (3.2),
    # token-level loss (3.3), soft overlong punishment (3.4), no KL (2.3).
    "dapo": {"loss.aggregation": "token_mean", "loss.ratio_level": "token",
             "loss.clip_eps_low": 0.2, "loss.clip_eps_high": 0.28, "loss.kl_coef": 0.0,
             "grpo.advantage_scaling": "group_std", "grpo.dynamic_sampling": True,
             "reward.overlong.enable": True},
    # GSPO (arXiv:2507.18071): sequence ratio (eq. 7) clipped at 3e-4 / 4e-4 (5.1), one term
    # per sequence, group std advantages (eq. 6); no KL (TRL's GSPO recipe: beta 0).
    "gspo": {"loss.aggregation": "seq_mean_token_mean", "loss.ratio_level": "sequence",
             "loss.clip_eps_low": 3e-4, "loss.clip_eps_high": 4e-4, "loss.kl_coef": 0.0,
             "grpo.advantage_scaling": "group_std", "grpo.dynamic_sampling": False,
             "reward.overlong.enable": False},
}


def resolved(record, dotted):
    """The value of the dotted field ``dotted`` in the nested mapping ``record``."""
    for key in dotted.split("."):
        record = record[key]
    return record


@pytest.mark.parametrize("preset", sorted(PAPER_FIELDS))
def test_presets_set_their_papers_fields_and_each_field_stays_overridable(tmp_path, preset):
    from dataclasses import asdict

    from apps.grpo.config import load_config
    from forge_ext.rl.losses.presets import PRESETS, preset_fields

    assert sorted(PRESETS) == sorted(PAPER_FIELDS)
    paper = PAPER_FIELDS[preset]
    path = demo_without_loss_section(tmp_path)
    config = load_config(path, [f"loss.preset={preset}"], check_model=False)
    record = asdict(config)  # what RLApp writes to run_config.yaml (resolved values)
    assert {name: resolved(record, name) for name in paper} == paper
    # Every field the paper fixes is one the preset sets, even where the paper's value is
    # today's default (a field left to its default would follow it wherever it moves).
    assert sorted(preset_fields(preset)) == sorted(paper)
    assert record["loss"]["preset"] == preset
    assert record["loss"]["max_response_tokens"] == 5  # generator.sampling.max_new_tokens
    summary = config.variant_summary()
    assert summary.startswith(f"GRPO variant: {preset} |") and "(preset" not in summary
    overridden = load_config(path, [f"loss.preset={preset}", "loss.kl_coef=0.5",
                                    "grpo.advantage_scaling=batch_std"], check_model=False)
    assert overridden.loss.kl_coef == 0.5 and overridden.grpo.advantage_scaling == "batch_std"
    assert overridden.loss.aggregation == paper["loss.aggregation"]
    assert "loss.kl_coef=0.5 (preset" in overridden.variant_summary()


def test_no_preset_keeps_todays_defaults_and_dapo_resolves_its_overlong_interval(tmp_path):
    from apps.grpo.config import load_config

    path = demo_without_loss_section(tmp_path)
    config = load_config(path, [], check_model=False)
    assert (config.loss.aggregation, config.loss.ratio_level, config.grpo.advantage_scaling,
            config.loss.clip_eps_low, config.loss.clip_eps_high, config.grpo.dynamic_sampling,
            config.reward.overlong.enable) == ("token_mean", "token", "group_std", 0.2, 0.2,
                                               False, False)
    dapo = load_config(path, ["loss.preset=dapo", "generator.sampling.max_new_tokens=20"],
                       check_model=False)
    overlong = dapo.reward.overlong
    assert (overlong.enable, overlong.max_tokens, overlong.cache_tokens) == (True, 20, 4)
    assert [overlong.penalty(n) for n in (16, 17, 18, 20)] == [0.0, -0.25, -0.5, -1.0]


@pytest.mark.parametrize("overrides, message", [
    (["loss.aggregation=seq_mean"], "loss.aggregation"),
    (["loss.preset=ppo"], "loss.preset='ppo' must be one of"),
    (["loss.ratio_level=sequence", "loss.clip_eps_high=1.5"],
     "loss.clip_eps_high=1.5 with loss.ratio_level=sequence must lie in \\(0, 1\\)"),
    (["loss.preset=gspo", "loss.clip_eps_low=0"], "loss.clip_eps_low=0"),
    (["reward.overlong.enable=true", "reward.overlong.cache_tokens=8"],
     "reward.overlong.cache_tokens=8 is longer than reward.overlong.max_tokens=5 "
     "\\(generator.sampling.max_new_tokens=5\\)"),
    (["reward.overlong.max_tokens=9"], "reward.overlong.max_tokens=9 > "
     "generator.sampling.max_new_tokens=5"),
    (["grpo.advantage_scaling=std"], "grpo.advantage_scaling"),
    (["grpo.dynamic_sampling=true", "grpo.max_rollout_batches=0"],
     "grpo.max_rollout_batches=0 must be >= 1"),
])
def test_bad_variant_config_is_refused_before_any_spawn_naming_the_field(
    tmp_path, overrides, message
):
    from apps.grpo.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(demo_without_loss_section(tmp_path), overrides, check_model=False)
