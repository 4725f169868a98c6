"""What an RL run shows of its metrics: the console's step line, the plot's panels, the
warning of a run whose groups carry no signal, and the closing accuracy line.

Every function reads a step's metric dict (the keys the loop and the app log,
:mod:`forge_ext.rl.loop`) and the few facts of the run it needs, given as arguments; none
keeps state but :class:`FlatGroupsWatch`'s streak.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from forge_ext.rl.mismatch import RATIO_BAND, SHOWN_ABOVE_KL
from forge_ext.rollout.runner import TRUNCATION_CAUSES
from forge_ext.rollout.replicas import replica_name
from forge_ext.runtime.metrics import PlotPanel

ALGORITHM_NAMES = {"grpo": "GRPO", "rloo": "RLOO", "gae": "PPO"}
"""How the run calls itself on the console, by ``algorithm.advantage``."""

TIMED = ("generate", "env", "agent", "reward", "reference", "critic", "train", "push", "fetch")
"""The ``time/<part>`` seconds the step line shows, in its order."""


class FlatGroupsWatch:
    """Warns once per streak of ``steps`` consecutive steps whose every group scored alike
    (``rollout/groups_without_spread`` = 1): GRPO's advantages are then all 0 and the run
    trains nothing while looking healthy (a reward that never varies, a task the model
    cannot start, prompts the tokenizer maps to ``<unk>``)."""

    def __init__(self, group_size: int, steps: int = 3):
        self.group_size, self.steps, self.streak = group_size, steps, 0

    def update(self, metrics: dict[str, float]) -> str | None:
        """The warning line, on the step that completes a streak; else None."""
        flat = metrics.get("rollout/groups_without_spread")
        if self.group_size < 2 or flat is None:  # a group of one (PPO) is always flat
            return None
        self.streak = self.streak + 1 if flat >= 1.0 else 0
        if self.streak != self.steps:
            return None
        return (f"warning: every group of the last {self.steps} steps scored alike (flat "
                "groups 100%): their advantages are 0 and nothing trains. Check that the "
                "rewards vary between a prompt's samples (samples.jsonl holds each function's "
                "score), that the model can start the task (an <unk> warning above?), and "
                "that generator.sampling.temperature > 0")


class KLDriftWatch:
    """Warns when the KL to the reference passes ``threshold`` while the training accuracy
    has not moved (issue 50: KL 2.2, accuracy flat, nothing said): the mean
    ``rollout/accuracy`` of the last ``window`` steps within ``min_gain`` of the run's first
    ``window`` steps. The policy then drifts away from the reference without learning the
    task: a learning rate too high, a KL coefficient too low, or a reward the model games.
    Once per crossing: a KL that falls below half the threshold and climbs again warns
    again."""

    def __init__(self, threshold: float = 1.0, window: int = 3, min_gain: float = 0.02):
        self.threshold, self.window, self.min_gain = threshold, window, min_gain
        self.first: list[float] = []
        self.recent: list[float] = []
        self.armed = True

    def update(self, metrics: dict[str, float]) -> str | None:
        """The warning line, on the step whose KL passes the threshold with the accuracy
        flat; else None (also on a step without ``loss/kl`` or ``rollout/accuracy``)."""
        kl, accuracy = metrics.get("loss/kl"), metrics.get("rollout/accuracy")
        if kl is None or accuracy is None or math.isnan(kl) or math.isnan(accuracy):
            return None
        if len(self.first) < self.window:
            self.first.append(accuracy)
        self.recent = [*self.recent, accuracy][-self.window:]
        if kl < self.threshold / 2:
            self.armed = True
        if not self.armed or kl <= self.threshold:
            return None
        start, now = sum(self.first) / len(self.first), sum(self.recent) / len(self.recent)
        if now - start >= self.min_gain:
            return None
        self.armed = False
        return (f"warning: KL to the reference {kl:.2f} > {self.threshold:g} while the training "
                f"accuracy {now:.1%} (last {len(self.recent)} steps) is where it started "
                f"({start:.1%}): the policy drifts from the reference without learning the "
                "task. Lower trainer.optimizer.lr, raise loss.kl_coef, or check what the "
                "rewards pay for (samples.jsonl)")


# ---- the step line ---------------------------------------------------------------------
def step_line(step: int, m: dict[str, float], *, steps: int, group_size: int, replicas: int,
              kl: bool, eval_sets: Sequence[Any] = (),
              flat_groups: FlatGroupsWatch | None = None,
              kl_drift: KLDriftWatch | None = None) -> str:
    """The console's line of ``step`` (of ``steps``) from its metrics ``m``, parts joined by
    ``" | "``: reward, accuracy, loss and what went wrong in the rollouts, then the trainer's
    and the generators' side and the timings (on a training step, which logs
    ``reward/mean``), then held-out accuracy and each evaluation set's metrics (those
    logged). ``kl``: the run has a KL reference (shows ``loss/kl``); ``replicas``:
    ``generator.replicas``; ``flat_groups``, ``kl_drift``: their warnings follow, each on a
    line of its own."""
    parts = [f"step {step:>3}/{steps}"]
    if "reward/mean" in m:
        parts += _rollout_parts(m, group_size)
        parts += _training_parts(m, kl=kl, replicas=replicas)
    if "eval/accuracy" in m:
        parts.append(
            f"held-out acc {m['eval/accuracy']:.1%} ({int(m['eval/num_prompts'])} prompts)"
        )
    for s in eval_sets:  # each set's own metrics, e.g. "gsm8k pass@1 12.5% ..."
        shown = [f"{name} {m[f'eval/{s.name}/{name}']:.1%}" for name in s.metrics
                 if f"eval/{s.name}/{name}" in m]
        if shown:
            parts.append(f"{s.name} " + " ".join(shown))
    watches = [w for w in (flat_groups, kl_drift) if w is not None] if "loss" in m else []
    warnings = [line for line in (w.update(m) for w in watches) if line]
    return "\n".join([" | ".join(parts), *warnings])


def _rollout_parts(m: dict[str, float], group_size: int) -> list[str]:
    """Reward, accuracy, flat groups, loss, failed reward calls, truncation by cause,
    turns, agent calls and dynamic sampling's dropped groups."""
    parts = [
        f"reward {m['reward/mean']:.3f}",
        f"acc {m['rollout/accuracy']:.3f}",
        # A group of one (PPO) is always flat: nothing to say.
        *([f"flat groups {m['rollout/groups_without_spread']:.0%}"] if group_size > 1 else []),
        f"loss {m['loss']:+.4f}",
    ]
    failed = {k.rsplit("/", 1)[1]: int(v) for k, v in m.items()
              if k.startswith("reward/errors/") and v}
    if failed:  # a user's reward function raised, hung or returned garbage
        parts.append("reward errors " + ", ".join(f"{k} {v}" for k, v in failed.items()))
    # Truncated episodes by the limit that cut them (the field to raise), if any.
    cut = {c: m[f"rollout/truncated/{c}"] for c in TRUNCATION_CAUSES
           if m.get(f"rollout/truncated/{c}")}
    causes = " ".join(f"{c} {v:.0%}" for c, v in cut.items())
    if "episode/turns_mean" in m:  # multi-turn episodes
        env_failed = int(m["episode/env_errors"] + m["episode/env_timeouts"])
        unknown = int(m.get("episode/env_unk_replies", 0))
        parts.append(
            f"turns {m['episode/turns_mean']:.2f} (max {int(m['episode/turns_max'])}, "
            f"truncated {m['episode/truncated']:.0%}" + (f": {causes}" if cut else "")
            + (f", env errors {int(m['episode/env_errors'])} timeouts "
               f"{int(m['episode/env_timeouts'])}" if env_failed else "")
            + (f", env replies with <unk> {unknown}" if unknown else "") + ")"
        )
    elif cut:  # one turn: a response cut at generator.sampling.max_new_tokens
        parts.append(f"truncated {causes}")
    if "agent/calls_mean" in m:  # task.agent
        failed_calls = int(m["agent/errors"] + m["agent/timeouts"])
        parts.append(
            f"agent calls {m['agent/calls_mean']:.2f} rows {m['agent/rows_mean']:.2f}"
            + (f" (errors {int(m['agent/errors'])} timeouts "
               f"{int(m['agent/timeouts'])})" if failed_calls else "")
            + (f" refused {int(m['agent/rejected_calls'])}"
               if m.get("agent/rejected_calls") else "")
        )
    if "rollout/dropped_groups" in m:  # grpo.dynamic_sampling
        parts.append(
            f"groups dropped {int(m['rollout/dropped_groups'])} short "
            f"{int(m['rollout/short_groups'])} ({int(m['rollout/rollout_batches'])} "
            "rollouts)"
        )
    return parts


def _training_parts(m: dict[str, float], *, kl: bool, replicas: int) -> list[str]:
    """KL, the critic (PPO), importance weights, the replicas, policy versions and ages,
    the timings of the step's parts, idle time and throughput."""
    parts = []
    if kl and "loss/kl" in m:
        parts.append(f"kl {max(m['loss/kl'], 0.0):.4f}")  # k3 >= 0; no "-0.0000"
    if "critic/loss" in m:  # PPO
        parts.append(
            f"critic loss {m['critic/loss']:.4f} explained var "
            f"{m['critic/explained_variance']:+.3f}"
            + (" (warm-up: policy frozen)" if math.isnan(m["loss"]) else ""))
    if "loss/tis_weight_mean" in m:
        parts.append(
            f"is weight {m['loss/tis_weight_mean']:.3f} "
            f"(capped {m['loss/tis_capped_fraction']:.1%})"
        )
    if "loss/rejected_fraction" in m:  # token_mask, sequence_mask
        parts.append(f"rejected {m['loss/rejected_fraction']:.1%}")
    parts += _mismatch_parts(m, replicas)
    if replicas > 1 or m.get("generator/resubmitted"):
        parts.append(
            f"replicas {int(m['generator/live_replicas'])}/{replicas} (resubmitted "
            f"{int(m['generator/resubmitted'])}, versions per response max "
            f"{int(m.get('rollout/versions_per_response_max', 1))})"
        )
    parts.append(
        f"policy v{int(m['policy_version'])} (sampled v{int(m['generator_version'])}, "
        f"age {m['rollout/policy_age_mean']:.2f} max {int(m['rollout/policy_age_max'])}, "
        f"dropped {int(m['rollout/dropped_samples'])})"
    )
    parts.append(" ".join(f"{k} {m['time/' + k]:.2f}s" for k in TIMED if f"time/{k}" in m))
    parts.append(
        f"idle generator {m['time/generator_idle']:.2f}s "
        f"trainer {m['time/trainer_idle']:.2f}s | "
        f"{m['throughput/samples_per_s']:.0f} samples/s"
    )
    return parts


def _mismatch_parts(m: dict[str, float], replicas: int) -> list[str]:
    """The train-inference mismatch (:mod:`forge_ext.rl.mismatch`) when its k3 KL is above
    :data:`~forge_ext.rl.mismatch.SHOWN_ABOVE_KL`: over the samples of the trainer's own
    version (``mismatch``, with the worst replica when there are several), and over every
    sample (``off-policy``: mismatch and staleness) when that differs."""
    parts = []
    kl = m.get("mismatch/k3_kl", math.nan)
    if kl > SHOWN_ABOVE_KL:
        worst = max(range(replicas), key=lambda i: m.get(f"mismatch/replica{i}/k3_kl", -1.0))
        parts.append(
            f"mismatch kl {kl:.2e} |dlogp| mean {m['mismatch/abs_diff_mean']:.3f} max "
            f"{m['mismatch/abs_diff_max']:.3f} outside [1/{RATIO_BAND:g}, {RATIO_BAND:g}] "
            f"{m['mismatch/ratio_outside_band']:.1%}"
            + (f" (worst {replica_name(worst, replicas)} "
               f"{m[f'mismatch/replica{worst}/k3_kl']:.2e})" if replicas > 1 else ""))
    off = m.get("offpolicy/k3_kl", math.nan)
    if off > SHOWN_ABOVE_KL and m.get("offpolicy/tokens") != m.get("mismatch/tokens"):
        parts.append(f"off-policy kl {off:.2e} outside band "
                     f"{m['offpolicy/ratio_outside_band']:.1%}")
    return parts


# ---- the plot ----------------------------------------------------------------------------
def plot_spec(*, title: str, eval_label: str, reward_names: Sequence[str], replicas: int,
              multi_turn: bool, eval_sets: Sequence[Any], critic: bool,
              on_policy: bool = False, clip_can_bind: bool = True,
              truncation_causes: Sequence[str] = TRUNCATION_CAUSES) -> dict[str, Any]:
    """Keyword arguments of :meth:`forge_ext.runtime.metrics.MetricLogger.close`: reward and
    held-out accuracy (labelled ``eval_label``) on the main axes, then one panel per concern
    (loss and KL, each of ``reward_names``, response length, truncation by each of
    ``truncation_causes``, the clip and flat groups, dynamic sampling, idle time, turns if
    ``multi_turn``, ``eval_sets``, the critic if ``critic``, throughput, each of the
    ``replicas``' rate and idle time, policy ages).

    What is 0 by construction in the run's mode is left out (issue 50), not drawn flat:
    policy ages and stale samples ``on_policy`` (every sample from the latest weights), the
    clip fraction unless ``clip_can_bind`` (the clipped ratio is 1 but for the generator's
    and the trainer's numerics: on-policy on a generator computing as the trainer does, or
    ``token_tis``'s ratio against the trainer itself)."""
    return {
        "plot_keys": ["reward/mean", "eval/accuracy"],
        "labels": {"reward/mean": "reward (training rollouts, sampled)",
                   "eval/accuracy": eval_label},
        "panels": [*_training_panels(reward_names, multi_turn, clip_can_bind,
                                     truncation_causes),
                   *_run_panels(replicas, eval_sets, critic, on_policy)],
        "title": title,
    }


def _training_panels(reward_names: Sequence[str], multi_turn: bool, clip_can_bind: bool,
                     causes: Sequence[str]) -> list[PlotPanel]:
    """How training went (issue 38): loss and KL, rewards, length, truncation, clip, flat
    groups, the train-inference mismatch, dropped groups, idle time, turns."""
    return [
        PlotPanel(keys=["loss", "loss/kl"], ylabel="loss / KL",
                  labels={"loss": "loss", "loss/kl": "KL to the reference (k3)"}),
        PlotPanel(keys=[f"reward/{name}" for name in reward_names], ylabel="mean score",
                  labels={f"reward/{name}": name for name in reward_names}),
        PlotPanel(keys=["rollout/response_tokens"], ylabel="tokens",
                  labels={"rollout/response_tokens": "response length (mean)"}),
        # Why episodes were cut (rollout/truncated/<cause>: the limit to raise), how often
        # the clip bound, and how many groups carried no signal.
        PlotPanel(keys=[f"rollout/truncated/{c}" for c in causes],
                  ylabel="truncated (fraction)", ylim=(-0.02, 1.02),
                  labels={f"rollout/truncated/{c}": f"cut by {c}" for c in causes}),
        PlotPanel(keys=[*(["loss/clip_fraction"] if clip_can_bind else []),
                        "rollout/groups_without_spread"],
                  ylabel="fraction", ylim=(-0.02, 1.02),
                  labels={"loss/clip_fraction": "clip fraction (tokens)",
                          "rollout/groups_without_spread":
                              "groups without reward spread (no signal)"}),
        # The train-inference mismatch (forge_ext.rl.mismatch): numerics alone on the samples
        # of the trainer's own version; with staleness on all of them.
        PlotPanel(keys=["mismatch/k3_kl", "offpolicy/k3_kl"], ylabel="k3 KL",
                  labels={"mismatch/k3_kl": "train-inference mismatch (own version)",
                          "offpolicy/k3_kl": "trainer at step start vs generator (all)"}),
        PlotPanel(keys=["rollout/dropped_groups"], ylabel="groups",
                  labels={"rollout/dropped_groups": "groups dropped (dynamic sampling)"}),
        PlotPanel(keys=["time/step", "time/generator_idle", "time/trainer_idle"],
                  ylabel="seconds per step",
                  labels={"time/step": "step (wall)", "time/generator_idle": "generator idle",
                          "time/trainer_idle": "trainer idle"}),
        *([PlotPanel(keys=["episode/turns_mean", "episode/turns_max"], ylabel="turns",
                     labels={"episode/turns_mean": "turns per episode (mean)",
                             "episode/turns_max": "turns per episode (max)"})]
          if multi_turn else []),
    ]


def _run_panels(replicas: int, eval_sets: Sequence[Any], critic: bool,
                on_policy: bool) -> list[PlotPanel]:
    """The evaluation sets, the critic, throughput, each replica, policy ages (unless
    ``on_policy``)."""
    names = [replica_name(r, replicas) for r in range(replicas)]
    return [
        *([PlotPanel(
            keys=[f"eval/{s.name}/{name}" for s in eval_sets for name in s.metrics],
            ylabel="evaluation sets", ylim=(-0.02, 1.02),
            labels={f"eval/{s.name}/{name}": f"{s.name} {name}"
                    for s in eval_sets for name in s.metrics},
        )] if eval_sets else []),
        *([PlotPanel(  # PPO: how much of the returns the critic explains
            keys=["critic/explained_variance", "critic/loss"],
            ylabel="explained variance / value loss",
            labels={"critic/explained_variance": "critic explained variance",
                    "critic/loss": "critic value loss"},
        )] if critic else []),
        PlotPanel(keys=["throughput/samples_per_s"], ylabel="samples/s",
                  labels={"throughput/samples_per_s": "samples trained per second"}),
        PlotPanel(  # each replica's sampling rate
            keys=[f"generator/{n}/tokens_per_s" for n in names], ylabel="sampled tokens/s",
            labels={f"generator/{n}/tokens_per_s": n for n in names},
        ),
        PlotPanel(  # ... and the time it had nothing to run, or held requests
            keys=[f"generator/{n}/{k}" for n in names
                  for k in ("idle_seconds", "paused_seconds")],
            ylabel="seconds per step",
            labels={f"generator/{n}/{k}": f"{n} {what}" for n in names
                    for k, what in (("idle_seconds", "idle"),
                                    ("paused_seconds", "paused for updates"))},
        ),
        *([] if on_policy else [PlotPanel(
            keys=["rollout/policy_age_mean", "rollout/policy_age_max",
                  "rollout/dropped_samples"],
            ylabel="policy versions / samples",
            labels={"rollout/policy_age_mean": "sample policy age (mean)",
                    "rollout/policy_age_max": "sample policy age (max)",
                    "rollout/dropped_samples": "dropped samples (stale)"},
        )]),
    ]


def accuracy_summary(evals: Sequence[tuple[int, float]], *, warm_start: bool, how: str,
                     prompts: int, algorithm: str) -> str:
    """The run's closing line: held-out accuracy (``prompts`` prompts, ``how``: greedy or
    sampled) of the first and the last evaluation in ``evals`` (``(step, accuracy)``), and
    the change in points. The first is called ``warm-start`` when it is step 0 of a model
    an SFT run wrote (``warm_start``)."""
    (first_step, before), (last_step, after) = evals[0], evals[-1]
    start = f"step {first_step}" if first_step or not warm_start else "warm-start"
    return (f"held-out accuracy ({prompts} prompts, {how}): {start} "
            f"{before:.1%} | after {ALGORITHM_NAMES[algorithm]} "
            f"(step {last_step}) {after:.1%} | "
            f"{100 * (after - before):+.1f} points")
