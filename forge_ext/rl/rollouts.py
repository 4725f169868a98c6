"""One step's rollouts as training data: from the scored episode batches of a step to the
episodes it trains on.

The app rolls out task rows (:class:`forge_ext.rollout.runner.EpisodeRunner`), one batch,
or several under dynamic sampling (DAPO, arXiv:2503.14476, section 3.2), and picks the groups
the step trains on; :meth:`Rollouts.of` then makes the step's data, in order:

1. the chosen groups' trajectories and their shaped rewards
   (:func:`forge_ext.rl.sampling.shaped_rewards`: DAPO's soft overlong punishment,
   ``reward.overlong``), then the filler groups' (too few groups with spread: they keep the
   step's batch shape and carry no loss);
2. the chosen groups' per-episode advantages (``algorithm.advantage``: ``grpo``, ``rloo``;
   ``gae``'s are per token, from the critic at train time);
3. the episodes, their token data as tensors (:func:`episodes_from_trajectories`).

The reference's log-probs are added by the app (:func:`forge_ext.rl.episode
.set_ref_logprobs`), and the trainer's batch is :func:`forge_ext.rl.episode.pack_episodes` of
the replay buffer's sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from forge_ext.rl.advantages import AdvantageEstimator, groups_with_spread
from forge_ext.rl.episode import Episode
from forge_ext.rl.sampling import shaped_rewards
from forge_ext.rollout.runner import EpisodeBatch, Trajectory
from forge_ext.tasks import Row
from forge_ext.tasks.rubric import OverlongConfig


@dataclass
class Rollouts:
    """One step's samples: ``group_size`` consecutive episodes per prompt."""

    rows: list[Row]
    episodes: list[Episode]
    rewards: list[float]
    correct: list[bool]
    batch: EpisodeBatch
    generator_version: int
    seconds: dict[str, float]
    stats: dict[str, float] = field(default_factory=dict)
    """Rollout metrics logged with the step (dynamic sampling's counts, overlong penalty)."""

    @classmethod
    def of(cls, batches: Sequence[EpisodeBatch], chosen: Sequence[tuple[int, int]],
           fillers: Sequence[tuple[int, int]], *, group: int, estimator: AdvantageEstimator,
           overlong: OverlongConfig) -> Rollouts:
        """The step's rollouts (module docstring), ``seconds`` empty.

        Args:
            batches: the step's scored batches, ``group`` consecutive episodes per row.
            chosen: ``(batch, group)`` indices of the groups trained on, in order.
            fillers: ``(batch, group)`` indices of the groups that fill the step's batch
                shape, masked out of the loss.
            group: episodes per row (``grpo.group_size``).
            estimator: the advantage estimator of ``algorithm.advantage``.
            overlong: ``reward.overlong``, which shapes the rewards trained on.

        Returns:
            The rollouts; ``stats`` has ``rollout/groups_without_spread``, the fraction of
            all the batches' groups whose shaped rewards are all equal (their advantages
            are 0: no signal), logged on every run (a group of identical episodes shows here
            first), and with ``overlong.enable`` ``reward/overlong_penalty``, the mean
            penalty of all the batches' episodes.
        """
        shaped = [shaped_rewards(b, overlong) for b in batches]
        spread = torch.cat([groups_with_spread(torch.tensor(r), group) for r in shaped])
        groups = [*chosen, *fillers]
        trajectories = [t for k, g in groups
                        for t in batches[k].trajectories[g * group : (g + 1) * group]]
        rewards = [r for k, g in groups for r in shaped[k][g * group : (g + 1) * group]]
        advantages = estimator.episode_advantages(torch.tensor(rewards[: len(chosen) * group]))
        batch = EpisodeBatch.concat(list(batches)) if len(batches) > 1 else batches[0]
        episodes = episodes_from_trajectories(trajectories, rewards, advantages,
                                              multi_turn=batch.multi_turn)
        stats = {"rollout/groups_without_spread": 1.0 - spread.float().mean().item()}
        if overlong.enable:
            penalties = [s - r for b, sh in zip(batches, shaped) for s, r in zip(sh, b.rewards)]
            stats["reward/overlong_penalty"] = sum(penalties) / len(penalties)
        return cls(
            rows=[batches[k].trajectories[g * group].row for k, g in groups],
            episodes=episodes, rewards=batch.rewards, correct=batch.scores.correct,
            batch=batch, generator_version=min(ep.policy_version for ep in episodes),
            seconds={}, stats=stats,
        )


def episodes_from_trajectories(
    trajectories: Sequence[Trajectory], rewards: Sequence[float], advantages: torch.Tensor,
    *, multi_turn: bool,
) -> list[Episode]:
    """The training episodes of a step's trajectories: their token ids, generator log-probs
    and loss masks as tensors (read once from the rollout side's lists).

    Args:
        trajectories: ``N`` scored trajectories; an agent's trajectory trains on several rows
            (:meth:`~forge_ext.rollout.runner.Trajectory.training_rows`), each an episode
            with the trajectory's advantage, reward and policy version.
        rewards: ``[N]`` the (shaped) reward of each trajectory, kept for logging and PPO.
        advantages: ``[T]``, ``T <= N``: the advantage of each of the first ``T``
            trajectories. The trajectories after them are fillers (dynamic sampling found too
            few groups with spread): they keep the step's batch shape but carry no loss, with
            advantage 0 and every response token masked.
        multi_turn: the trajectories mix the model's tokens with others' (an environment's,
            an agent's): their response masks are kept; otherwise every response token is
            the model's (``response_mask`` None).

    Returns:
        The episodes, in the trajectories' order (an agent's rows in order).

    Raises:
        ValueError: ``len(rewards) != N`` or ``T > N``.
    """
    trained = len(advantages)
    if len(rewards) != len(trajectories) or trained > len(trajectories):
        raise ValueError(
            f"{len(trajectories)} trajectories need as many rewards and at most as many "
            f"advantages, got {len(rewards)} rewards and {trained} advantages"
        )
    advantage_of = advantages.tolist()
    episodes = []
    for i, (t, reward) in enumerate(zip(trajectories, rewards)):
        advantage = advantage_of[i] if i < trained else 0.0
        for prompt_ids, response_ids, mask, logprobs in t.training_rows():
            if i >= trained:
                mask = torch.zeros(len(response_ids), dtype=torch.bool)
            episodes.append(Episode(  # the lists become tensors here
                prompt_ids=prompt_ids, response_ids=response_ids, generator_logprobs=logprobs,
                advantage=advantage, reward=reward, policy_version=t.policy_version,
                replica=t.replica,
                response_mask=mask if multi_turn or i >= trained else None,
                truncated=t.truncated,
            ))
    return episodes
