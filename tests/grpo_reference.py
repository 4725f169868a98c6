"""An independent float64 implementation of the GRPO variants' formulas, for tests.

Written from the papers, one sequence at a time with plain loops (no grouping helper, no
masks, no code of ``forge_ext.rl.losses``):

- token ratio: DeepSeekMath (arXiv:2402.03300) eq. 3, ``min(r_t A, clip(r_t) A) - beta k3``;
- off-policy corrections: truncated IS and decoupled PPO (Hilton et al. 2021, AReaL
  arXiv:2505.24298: clip against the proximal policy, weight by proximal / behaviour
  truncated), rejection of tokens / sequences whose ratio leaves ``[1/C_low, C_high]`` (verl
  ``rollout_corr_helper.py``, ``rollout_rs`` token / geometric);
- sequence ratio: GSPO (arXiv:2507.18071) eq. 5-7, ``s_i = exp(mean_t log r_t)``;
- aggregation: verl ``core_algos.py`` ``agg_loss`` / Dr. GRPO eq. 3 (sequences without a
  valid token are not counted);
- advantages: DeepSeekMath section 4.1.2, Dr. GRPO section 3.1, TRL ``scale_rewards``,
  with ``statistics.pstdev``.
"""

import math
import statistics

import torch


def sequences_of(mb):
    """``{sequence key: [(b, t), ...]}`` of the valid tokens, in order."""
    labels = mb["labels"]
    out = {}
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if int(labels[b, t]) == -100:
                continue
            if "sequence_ids" in mb:
                sid = int(mb["sequence_ids"][b, t])
                if sid < 0:
                    continue
                key = sid
            else:
                key = b
            out.setdefault(key, []).append((b, t))
    return out


def reference_loss(logits, mb, *, aggregation="token_mean", ratio_level="token",
                   clip=(0.2, 0.2), kl_coef=0.0, max_response_tokens=None,
                   correction="none", cap=2.0, mask_truncated=False, mask_caps=(2.0, 2.0)):
    """The step loss in float64; differentiable w.r.t. ``logits``."""
    logp_all = torch.log_softmax(logits.double(), dim=-1)
    labels = mb["labels"]
    low, high = clip
    losses = []
    for toks in sequences_of(mb).values():
        if mask_truncated:
            b0, t0 = toks[0]
            trunc = mb["truncated"]
            if bool(trunc[b0] if trunc.dim() == 1 else trunc[b0, t0]):
                continue
        bs = torch.tensor([b for b, _ in toks])
        ts = torch.tensor([t for _, t in toks])
        logp = logp_all[bs, ts, labels[bs, ts]]
        gen = mb["generator_logprobs"][bs, ts].double()
        adv_t = mb["advantages"]
        adv = (adv_t[bs] if adv_t.dim() == 1 else adv_t[bs, ts]).double()
        keep = torch.ones(len(toks), dtype=torch.float64)
        if correction in ("token_tis", "decoupled"):
            # Decoupled PPO (Hilton et al. 2021; AReaL): clip against the proximal policy,
            # weight by proximal / behaviour, truncated at the cap.
            if "proximal_logprobs" in mb and correction == "decoupled":
                old = mb["proximal_logprobs"][bs, ts].double()
            else:
                old = logp.detach()
            gap = old - gen
            if ratio_level == "sequence":
                w = torch.full_like(gap, min(math.exp(float(gap.mean())), cap))
            else:
                w = torch.clamp(torch.exp(gap), max=cap)
        else:
            old, w = gen, torch.ones_like(gen)
        if correction in ("token_mask", "sequence_mask"):
            # Rejection (verl rollout_rs token / geometric): a ratio outside [1/low, high].
            gap = [float(logp[i]) - float(gen[i]) for i in range(len(toks))]
            if correction == "sequence_mask":
                gap = [sum(gap) / len(gap)] * len(gap)
            keep = torch.tensor([1.0 if 1 / mask_caps[0] <= math.exp(g) <= mask_caps[1] else 0.0
                                 for g in gap], dtype=torch.float64)
        if ratio_level == "sequence":
            ratio = torch.exp((logp - old).mean()).expand(len(toks))
        else:
            ratio = torch.exp(logp - old)
        surrogate = w * torch.minimum(ratio * adv, torch.clamp(ratio, 1 - low, 1 + high) * adv)
        if kl_coef:
            ref = mb["ref_logprobs"][bs, ts].double()
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            surrogate = surrogate - kl_coef * kl
        losses.append(-surrogate * keep)
    if not losses:
        return logits.double().sum() * 0.0
    if aggregation == "token_mean":
        return torch.cat(losses).sum() / sum(len(l) for l in losses)
    if aggregation == "seq_mean_token_mean":
        per_sequence = [l.mean() for l in losses]
    elif aggregation == "seq_mean_token_sum":
        per_sequence = [l.sum() for l in losses]
    elif aggregation == "seq_mean_token_sum_norm":
        per_sequence = [l.sum() / max_response_tokens for l in losses]
    else:
        raise ValueError(aggregation)
    return torch.stack(per_sequence).mean()


def reference_advantages(rewards, group_size, scaling, eps=1e-6):
    """Group-relative advantages as lists of floats."""
    rewards = [float(r) for r in rewards]
    batch_std = statistics.pstdev(rewards)
    out = []
    for lo in range(0, len(rewards), group_size):
        group = rewards[lo : lo + group_size]
        mean = sum(group) / len(group)
        if max(group) == min(group):
            out += [0.0] * len(group)
            continue
        scale = {"group_std": statistics.pstdev(group) + eps, "none": 1.0,
                 "batch_std": batch_std + eps}[scaling]
        out += [(r - mean) / scale for r in group]
    return out


ENGINE_VARIANTS = (
    {"aggregation": "token_mean"},
    {"aggregation": "seq_mean_token_mean"},
    {"aggregation": "seq_mean_token_sum"},
    {"aggregation": "seq_mean_token_sum_norm", "max_response_tokens": 32},
    {"aggregation": "seq_mean_token_mean", "ratio_level": "sequence"},  # GSPO
)
"""Loss fields of the variants the engine-level tests run (GRPO, Dr. GRPO, DAPO, GSPO
aggregations and ratio levels), each with ``kl_coef`` added by the test."""


def variant_name(variant):
    return "-".join(str(v) for v in variant.values())


def reference_kwargs(variant, kl_coef):
    """``reference_loss`` keyword arguments of an ``ENGINE_VARIANTS`` entry."""
    from forge_ext.rl.losses.config import default_clip_eps

    level = variant.get("ratio_level", "token")
    return {**variant, "kl_coef": kl_coef, "clip": default_clip_eps(level)}


def grpo_targets(logits, labels, seed, noise=0.3):
    """``generator_logprobs``, ``ref_logprobs`` (the policy's log-probs of ``labels`` under
    ``logits`` plus noise) and ``advantages [B]`` for a GRPO step on an LM batch."""
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(logits.double(), -1).gather(
        -1, labels.clamp(min=0)[..., None])[..., 0].float()
    logprobs = torch.where(labels == -100, 0.0, logprobs)
    return {
        "generator_logprobs": logprobs + noise * torch.randn(logprobs.shape, generator=g),
        "ref_logprobs": logprobs + noise * torch.randn(logprobs.shape, generator=g),
        "advantages": torch.randn(labels.shape[0], generator=g),
    }


def parity_reward(completion, **_):
    """A reward whose groups are often all equal: 1.0 when the completion's first character
    has an odd code point (about half of them), else 0.0 (a group of 2 has no spread half
    the time)."""
    return float(bool(completion) and ord(completion[0]) % 2 == 1)
