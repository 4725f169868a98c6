"""An independent float64 implementation of PPO's formulas, for tests: plain Python floats and
loops, one row at a time, no masks or code of ``forge_ext``.

- GAE: Schulman et al. 2016 (arXiv:1506.02438), eq. 11-16, over a row's model tokens only
  (a multi-turn row's environment tokens are not steps: verl's ``compute_gae_advantage_return``);
- whitening: verl ``masked_whiten`` (unbiased variance, ``+ 1e-8``), with ``statistics``;
- RLOO: Ahmadian et al. 2024 (arXiv:2402.14740), eq. 6;
- the clipped value loss: OpenAI baselines ``ppo2/model.py``
  ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``, aggregated as verl's
  ``agg_loss``.
"""

import math
import statistics


def model_positions(labels_row):
    """Indices of a row's model tokens (labels that are not -100), in order."""
    return [t for t, label in enumerate(labels_row) if int(label) != -100]


def reference_gae(rewards, labels, values, gamma, lam, kl=None, kl_coef=0.0):
    """``(advantages, returns)`` as lists of rows of floats (0.0 off the model tokens)."""
    adv_rows, ret_rows = [], []
    for b, labels_row in enumerate(labels):
        width = len(labels_row)
        adv, ret = [0.0] * width, [0.0] * width
        steps = model_positions(labels_row)
        running, next_value = 0.0, 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            r = -kl_coef * float(kl[b][t]) if kl_coef else 0.0
            if i == len(steps) - 1:
                r += float(rewards[b])
            v = float(values[b][t])
            running = r + gamma * next_value - v + gamma * lam * running
            adv[t], ret[t] = running, running + v
            next_value = v
        adv_rows.append(adv)
        ret_rows.append(ret)
    return adv_rows, ret_rows


def reference_whiten(rows, labels):
    flat = [rows[b][t] for b in range(len(rows)) for t in model_positions(labels[b])]
    mean = statistics.fmean(flat)
    scale = math.sqrt(statistics.variance(flat) + 1e-8)
    out = [[0.0] * len(r) for r in rows]
    for b in range(len(rows)):
        for t in model_positions(labels[b]):
            out[b][t] = (rows[b][t] - mean) / scale
    return out


def reference_rloo(rewards, group_size):
    out = []
    for lo in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[lo : lo + group_size]]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            out.append(r - sum(others) / len(others))
    return out


def reference_value_loss(values, labels, returns, old_values, clip_value, aggregation="token_mean",
                         max_response_tokens=None):
    """The step's value loss as a float (one sequence per row)."""
    per_sequence = []
    for b, labels_row in enumerate(labels):
        losses = []
        for t in model_positions(labels_row):
            v, r, old = float(values[b][t]), float(returns[b][t]), float(old_values[b][t])
            loss = (v - r) ** 2
            if clip_value is not None:
                clipped = old + min(max(v - old, -clip_value), clip_value)
                loss = max(loss, (clipped - r) ** 2)
            losses.append(0.5 * loss)
        if losses:
            per_sequence.append(losses)
    if aggregation == "token_mean":
        return sum(sum(l) for l in per_sequence) / sum(len(l) for l in per_sequence)
    if aggregation == "seq_mean_token_mean":
        return statistics.fmean(statistics.fmean(l) for l in per_sequence)
    if aggregation == "seq_mean_token_sum":
        return statistics.fmean(sum(l) for l in per_sequence)
    return statistics.fmean(sum(l) / max_response_tokens for l in per_sequence)
