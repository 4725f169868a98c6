"""What a step trains on, chosen from its rollouts: DAPO's reward shaping and dynamic
sampling (arXiv:2503.14476, sections 3.2 and 3.4).

- :func:`shaped_rewards`: the rubric's rewards plus the soft overlong punishment
  (``reward.overlong``, :class:`forge_ext.tasks.rubric.OverlongConfig`);
- :class:`DynamicSampling`: roll out prompts of the stream until enough groups have reward
  spread (``grpo.dynamic_sampling``), and where each step's prompts begin, recorded beside
  the checkpoints so that a resumed run consumes every prompt once;
- :func:`check_training_rows`: a step's training rows fit the engines' microbatches.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from forge_ext.rl.advantages import groups_with_spread
from forge_ext.rollout.runner import EpisodeBatch
from forge_ext.tasks import PromptStream, Row
from forge_ext.tasks.rubric import OverlongConfig

PROMPT_STREAM_FILE = "prompt_stream.json"
"""In ``output_dir`` with ``grpo.dynamic_sampling``: ``{"positions": {step: position}}``, the
prompt stream position where each checkpointed step's prompts begin."""

Rollout = Callable[[list[Row], int], Awaitable[EpisodeBatch]]
"""``rollout(rows, seed)``: a group of episodes per row, sampled with ``seed``."""


def shaped_rewards(batch: EpisodeBatch, overlong: OverlongConfig) -> list[float]:
    """Per episode of ``batch``: the rubric's reward plus ``overlong``'s length penalty
    (DAPO's soft overlong punishment, :meth:`~forge_ext.tasks.rubric.OverlongConfig.penalty`;
    0 when not enabled). What the step trains on; the logged ``reward/mean`` stays the
    rubric's, comparable across variants."""
    return [r + overlong.penalty(len(t.response_ids))
            for r, t in zip(batch.rewards, batch.trajectories)]


def rollout_seed(seed: int, step: int, attempt: int = 0) -> int:
    """The sampling seed of ``step``'s rollout number ``attempt`` (dynamic sampling rolls out
    up to ``grpo.max_rollout_batches`` per step; the first has the seed of a step without
    it), from the run's ``seed``."""
    return seed * 1_000_003 + step + attempt * 10_000_019


class DynamicSampling:
    """DAPO's dynamic sampling over a prompt stream (:meth:`rollouts`), and the stream
    position where each step's prompts begin (:meth:`start`, saved and read back in
    ``<output_dir>/prompt_stream.json``).

    Args:
        prompts: the training rows, in the run's order.
        prompts_per_step, group_size, max_rollout_batches: ``grpo.*``.
        seed: the run's seed (the first rollout of a step has the seed a step without
            dynamic sampling has).
        output_dir: where :data:`PROMPT_STREAM_FILE` is kept.
        overlong: ``reward.overlong``: a group's spread is judged on its shaped rewards
            (:func:`shaped_rewards`), which it trains on.
    """

    def __init__(self, prompts: PromptStream, *, prompts_per_step: int, group_size: int,
                 max_rollout_batches: int, seed: int, output_dir: str,
                 overlong: OverlongConfig) -> None:
        self.prompts, self.wanted, self.group = prompts, prompts_per_step, group_size
        self.max_rollout_batches, self.seed, self.overlong = max_rollout_batches, seed, overlong
        self.path = Path(output_dir) / PROMPT_STREAM_FILE
        self.starts: dict[int, int] = {0: 0}
        """Where each step's prompts begin in the stream."""
        self.ranges: dict[int, tuple[int, int]] = {}
        """``[first, end)`` of the stream positions each built step consumed."""

    async def rollouts(self, step: int, rollout: Rollout):
        """Roll out the next prompts of the stream, keep the groups whose (shaped) rewards
        are not all equal, and roll out as many more prompts as groups are missing, up to
        ``max_rollout_batches`` rollouts. Every prompt rolled out is consumed (the next step
        starts after it), kept or dropped.

        A step built again (async mode drops stale rollouts) rolls out the same prompts,
        so the stream stays what the first build consumed.

        Returns:
            ``(batches, chosen, fillers, stats)``: the rollouts made; the ``(batch, group)``
            indices of the groups trained on, then of the dropped groups that fill the step
            when too few had spread (masked out of the loss); and metrics:
            ``rollout/dropped_groups`` (groups without spread), ``rollout/short_groups``
            (fillers), ``rollout/rollout_batches``, ``rollout/prompts_consumed``.
        """
        first = self.start(step)
        again = self.ranges.get(step)  # a rebuild: the same prompts as before
        position, batches, chosen, dropped = first, [], [], []
        for k in range(self.max_rollout_batches):
            count = again[1] - position if again else self.wanted - len(chosen)
            if count <= 0:
                break
            rows = self.prompts.slice(position, count)
            batch = await rollout(rows, rollout_seed(self.seed, step, k))
            shaped = shaped_rewards(batch, self.overlong)
            spread = groups_with_spread(torch.tensor(shaped), self.group)
            for g, keep in enumerate(spread.tolist()):
                (chosen if keep and len(chosen) < self.wanted else dropped).append(
                    (len(batches), g))
            batches.append(batch)
            position += count
            if again:
                break
        self.ranges[step] = (first, position)
        self.starts[step + 1] = position
        fillers = dropped[: self.wanted - len(chosen)]
        stats = {
            "rollout/dropped_groups": float(len(dropped)),
            "rollout/short_groups": float(len(fillers)),
            "rollout/rollout_batches": float(len(batches)),
            "rollout/prompts_consumed": float(position - first),
        }
        return batches, chosen, fillers, stats

    def start(self, step: int) -> int:
        """The prompt stream position where ``step``'s prompts begin (the steps before
        consumed a varying number).

        Raises:
            RuntimeError: the steps before ``step`` were not built, nor is it the resumed
                step.
        """
        if step not in self.starts:
            raise RuntimeError(
                f"the prompt stream position of step {step} is unknown: steps are built in "
                f"order, and a resumed run reads it from {self.path}"
            )
        return self.starts[step]

    def save_position(self, step: int) -> None:
        """Record where step ``step``'s prompts begin in ``<output_dir>/prompt_stream.json``
        (before the checkpoint of ``step`` is written, so a committed checkpoint always has
        its position); every saved step's position is kept."""
        positions = self._positions()
        positions[str(step)] = self.start(step)
        staged = self.path.with_name(self.path.name + ".tmp")
        staged.write_text(json.dumps({"positions": positions}, indent=1, sort_keys=True))
        staged.replace(self.path)

    def resume(self, step: int) -> None:
        """Begin at the resumed checkpoint ``step`` where its recorded position says.

        Raises:
            ValueError: no position is recorded for ``step``.
        """
        positions = self._positions()
        if str(step) not in positions:
            raise ValueError(
                f"{self.path} has no prompt stream position for step {step} (the checkpoint "
                "resumed); without it the resumed run cannot know which prompts the "
                "dropped groups consumed. Use a new output_dir"
            )
        self.starts[step] = positions[str(step)]

    def _positions(self) -> dict[str, int]:
        return json.loads(self.path.read_text())["positions"] if self.path.is_file() else {}


def check_training_rows(rows: int, batch_size: int,
                        sections: Mapping[str, Mapping[str, Any] | None]) -> None:
    """A step's ``rows`` training rows fit the engines that train on them: an agent's calls
    may make more rows than episodes (:mod:`forge_ext.rollout.agents`), and fixed-row
    microbatches need exactly ``batch_size`` (``grpo.batch_size``).

    Args:
        sections: ``{role: engine section}`` of the roles that take the rows (None: the
            role is not in the run).

    Raises:
        ValueError: naming the token budget that trains any number of rows.
    """
    if rows == batch_size:
        return
    for role, section in sections.items():
        if section is not None and not section.get("training", {}).get(
                "max_tokens_per_microbatch"):
            raise ValueError(
                f"this step made {rows} training rows from grpo.batch_size="
                f"{batch_size} episodes (an agent whose calls do not "
                "extend one another makes a row per call, docs/agents.md), but "
                f"{role}.training has fixed-row microbatches; set "
                f"{role}.training.max_tokens_per_microbatch (a token budget trains any "
                "number of rows)")
