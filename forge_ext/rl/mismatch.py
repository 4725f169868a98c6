"""The train-inference mismatch of a step: how far the generator's log-probs of the sampled
tokens are from the trainer's under the weights that sampled them, measured every step, and
what the gate of a run whose mismatch explodes reads (``loop.max_mismatch_kl``,
:meth:`forge_ext.rl.loop.RLLoop.check_mismatch`).

The generator and the trainer compute one policy with different kernels, precisions and batch
shapes; that gap, not the algorithm, is what collapses RL runs at scale ("When Speed Kills
Stability", Liu, Li et al. 2025, https://richardli.xyz/rl-collapse; Yao et al. 2025,
https://fengyao.notion.site/off-policy-rl). slime logs ``train_rollout_logprob_abs_diff``,
verl's ``rollout_corr_helper.py`` (``compute_offpolicy_metrics``) k3 KL and the log-perplexity
difference, torchtitan's RL experiment ``bit_wise/logprob_diff``.

Source of the trainer's log-probs. The trainer's step forward (every microbatch runs before
the step's one optimizer step, :meth:`forge_ext.engine.base.BaseEngine.train_batch`) gives
each sampled token's log-prob under the weights of policy version ``s``, the trainer's at the
step's start, at no extra forward (``RLTrainer.train_step(return_logprobs=True)``). A sample
sampled by version ``g`` has policy age ``s - g``:

- age 0 (every sample of a ``loop.max_policy_age: 0`` run, sync or async): the trainer's
  weights *are* the weights that sampled it, and the gap is the mismatch alone. The
  ``mismatch/*`` metrics and the gate are computed over these samples and the probed ones
  below (a sample's version is the oldest that sampled any of its tokens, so age 0 means
  every token).
- age > 0 (async, or sync with ``max_policy_age > 0``): the weights that sampled it are gone
  from the trainer (it keeps no copy of old versions), and the gap mixes the mismatch with
  the ``s - g`` updates since. It is logged apart as ``offpolicy/*`` over every sample: it is
  what ``token_tis`` and ``decoupled`` weight by (``pi_prox / pi_gen``).

The probe (async runs whose samples are stale). With ``loop.max_policy_age > 0`` nearly
every sample of an async step is stale, and the age-0 samples alone would leave most steps
unmeasured (and the gate blind). So a step with fewer than ``loop.mismatch_probe_sequences``
age-0 samples asks the generator to *score* as many of its stale samples as make up the
difference (:func:`probe_rows`): their prompt and sampled tokens, teacher-forced, with the
weights of the trainer's version ``s``
(:meth:`forge_ext.rollout.engines.base.Engine.score`; each sample goes to the replica that
sampled it). The scores of a replica that served version ``s`` are the generator's side of
the gap under the same weights as the trainer's forward, and those rows join the age-0 rows
in ``mismatch/*`` (:class:`Probe`); a replica that scored with another version (or is lost)
is skipped and counted (``mismatch/probe_skipped``). What the probe measures is the prefill
(teacher-forced) side of the generator, where its samples' log-probs came from decoding:
the same weights and numerics, another kernel path (torchtitan's RL parity tests check
decode against prefill as a separate gap).

Metrics, over the valid tokens (response tokens the model sampled), with ``d_t = log
pi_trainer(o_t) - log pi_gen(o_t)``:

- ``k3_kl``: ``mean_t exp(d_t) - d_t - 1``, the k3 estimate of ``KL(pi_gen || pi_trainer)``
  from the generator's samples (Schulman 2020; verl ``k3_kl``), >= 0;
- ``abs_diff_mean``, ``abs_diff_max``: ``mean_t |d_t|``, ``max_t |d_t|`` (slime's
  ``train_rollout_logprob_abs_diff``);
- ``log_ppl_diff``: the mean over sequences of ``mean_t log pi_gen - mean_t log
  pi_trainer``, the log of the trainer's over the generator's perplexity (verl
  ``log_ppl_diff``; > 0: the trainer finds the samples less likely);
- ``ratio_outside_band``: the fraction of tokens whose ratio ``exp(d_t)`` leaves ``[1 / C, C]``,
  ``C`` = :data:`RATIO_BAND` (what ``token_mask`` with its default caps would reject);
- ``tokens``: how many tokens were measured;
- ``probed_sequences``, ``probe_skipped`` (``mismatch/`` only): the stale samples the
  probe measured, and those it asked for but could not (no replica at the trainer's
  version; a sequence longer than the generator's context).

With several generator replicas each replica's age-0 samples give ``mismatch/replica<i>/*``
too (a replica with another dtype or a failed load shows apart from the rest).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from forge_ext.engine.losses import IGNORE_INDEX
from forge_ext.rl.episode import Episode

RATIO_BAND = 2.0
"""``C`` of ``ratio_outside_band``: the band ``[1 / C, C]`` (verl's default
``rollout_rs_threshold`` 2.0)."""

SHOWN_ABOVE_KL = 1e-4
"""The step line shows the mismatch when ``mismatch/k3_kl`` (or ``offpolicy/k3_kl``) is above
this: fp32 on both sides stays far below it, a bf16 generator is above it."""

NAMES = ("k3_kl", "abs_diff_mean", "abs_diff_max", "log_ppl_diff", "ratio_outside_band", "tokens")
"""The figures of one group of samples (module docstring)."""


def mismatch_figures(trainer_logprobs: torch.Tensor, generator_logprobs: torch.Tensor,
                     mask: torch.Tensor, ratio_band: float = RATIO_BAND) -> dict[str, float]:
    """The figures of :data:`NAMES` (module docstring) over the tokens of ``mask``, in
    float64; NaN (``tokens`` 0) when it holds none.

    Args:
        trainer_logprobs: ``[B, S]`` the trainer's log-probs of the sampled tokens (nats).
        generator_logprobs: ``[B, S]`` the generator's log-probs of the same tokens.
        mask: ``[B, S]`` bool, the tokens to measure; each row is one sequence (packed
            episodes, :func:`forge_ext.rl.episode.pack_episodes`). Values elsewhere (even
            NaN or inf) are not read.
        ratio_band: ``C`` of ``ratio_outside_band``.

    Raises:
        ValueError: the three are not of one ``[B, S]`` shape.
    """
    shape = tuple(mask.shape)
    if tuple(trainer_logprobs.shape) != shape or tuple(generator_logprobs.shape) != shape:
        raise ValueError(f"trainer_logprobs {tuple(trainer_logprobs.shape)}, generator_logprobs "
                         f"{tuple(generator_logprobs.shape)} and mask {shape} must be one [B, S]")
    count = int(mask.sum())
    if count == 0:
        return {**{name: math.nan for name in NAMES}, "tokens": 0.0}
    zeros = torch.zeros(shape, dtype=torch.float64)
    trainer = torch.where(mask, trainer_logprobs.double(), zeros)
    generator = torch.where(mask, generator_logprobs.double(), zeros)
    d = trainer - generator
    k3 = torch.where(mask, torch.exp(d) - d - 1.0, zeros)
    per_row = mask.sum(dim=1)
    rows = per_row > 0
    # Per sequence: mean generator log-prob minus mean trainer log-prob (log PPL ratio).
    log_ppl = (generator.sum(dim=1) - trainer.sum(dim=1))[rows] / per_row[rows]
    outside = mask & (d.abs() > math.log(ratio_band))
    return {
        "k3_kl": float(k3.sum()) / count,
        "abs_diff_mean": float(d.abs().sum()) / count,
        "abs_diff_max": float(d.abs().max()),
        "log_ppl_diff": float(log_ppl.mean()),
        "ratio_outside_band": float(outside.sum()) / count,
        "tokens": float(count),
    }


def probe_rows(versions: Sequence[int], *, trainer_version: int, sequences: int) -> list[int]:
    """The rows of a step the probe scores (module docstring): none when ``sequences`` or
    more rows are of ``trainer_version`` (age 0: measured at no cost), otherwise as many
    stale rows as make up the difference, spread evenly over the stale rows in batch order.

    Args:
        versions: ``[B]`` the version that sampled each row.
        trainer_version: the trainer's version at the step's start.
        sequences: ``loop.mismatch_probe_sequences``, rows measured per step (0: no probe).
    """
    stale = [i for i, v in enumerate(versions) if v != trainer_version]
    wanted = min(max(sequences - (len(versions) - len(stale)), 0), len(stale))
    return [stale[(k * len(stale)) // wanted] for k in range(wanted)]


@dataclass(slots=True)
class Probe:
    """The generator's log-probs of stale rows, scored at the trainer's version."""

    logprobs: torch.Tensor
    """``[B, S]`` fp32 in the packed layout (``generator_logprobs``'), 0 outside ``rows``."""
    rows: torch.Tensor
    """``[B]`` bool: the rows scored at the trainer's version."""
    skipped: int = 0
    """Rows asked for but not scored at the trainer's version."""

    @classmethod
    def of(cls, episodes: Sequence[Episode], scores: Mapping[int, Sequence[float]],
           seq_len: int, skipped: int = 0) -> Probe:
        """A probe of the packed batch of ``episodes`` (``[B]``, rows ``seq_len`` long) from
        ``scores``: row -> ``[R]`` log-probs of that episode's response tokens
        (:attr:`forge_ext.rollout.engines.base.Scores.logprobs`), placed where
        :func:`forge_ext.rl.episode.pack_episodes` puts its ``generator_logprobs``.

        Raises:
            ValueError: a row's scores are not one per response token.
        """
        logprobs = torch.zeros(len(episodes), seq_len, dtype=torch.float32)
        rows = torch.zeros(len(episodes), dtype=torch.bool)
        for row, values in scores.items():
            ep = episodes[row]
            start, count = len(ep.prompt_ids) - 1, len(ep.response_ids)
            if len(values) != count:
                raise ValueError(f"row {row}: {len(values)} scores for {count} response tokens")
            logprobs[row, start : start + count] = torch.tensor(list(values))
            rows[row] = True
        return cls(logprobs=logprobs, rows=rows, skipped=skipped)


def step_mismatch(trainer_logprobs: torch.Tensor, batch: dict[str, torch.Tensor],
                  versions: Sequence[int], replicas: Sequence[int], *, trainer_version: int,
                  num_replicas: int = 1, probe: Probe | None = None) -> dict[str, float]:
    """A step's logged figures (module docstring): ``mismatch/<name>`` over its age-0 rows
    and the rows of ``probe`` (against the probe's log-probs),
    ``mismatch/replica<i>/<name>`` per replica when ``num_replicas > 1``, and
    ``offpolicy/<name>`` over every row.

    Args:
        trainer_logprobs: ``[B, S]`` the trainer's log-probs of ``batch["labels"]`` from the
            step's forward, before its update.
        batch: the packed batch (``labels`` ``[B, S]``, ``-100`` where nothing was sampled;
            ``generator_logprobs`` ``[B, S]``).
        versions: ``[B]`` the policy version that sampled each row.
        replicas: ``[B]`` the generator replica that sampled each row.
        trainer_version: the trainer's policy version at the step's start.
        num_replicas: ``generator.replicas``.
        probe: the generator's scores of stale rows at ``trainer_version`` (None: none).
    """
    valid = batch["labels"] != IGNORE_INDEX
    generator = batch["generator_logprobs"]
    fresh = torch.tensor([v == trainer_version for v in versions], dtype=torch.bool)
    out = {f"offpolicy/{k}": v
           for k, v in mismatch_figures(trainer_logprobs, generator, valid).items()}
    same = generator  # the generator's log-probs under the trainer's weights, per row
    probed = torch.zeros_like(fresh)
    if probe is not None:
        probed = probe.rows & ~fresh
        same = torch.where(probed[:, None], probe.logprobs, generator)
    measured = valid & (fresh | probed)[:, None]
    out.update({f"mismatch/{k}": v for k, v in
                mismatch_figures(trainer_logprobs, same, measured).items()})
    out["mismatch/probed_sequences"] = float(probed.sum())
    out["mismatch/probe_skipped"] = float(probe.skipped if probe is not None else 0)
    if num_replicas > 1:
        of = torch.tensor(list(replicas), dtype=torch.int64)[:, None]
        for i in range(num_replicas):
            figures = mismatch_figures(trainer_logprobs, same, measured & (of == i))
            out.update({f"mismatch/replica{i}/{k}": v for k, v in figures.items()})
    return out
