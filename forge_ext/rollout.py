"""Rollouts: from task rows to scored episodes, one turn or many, for every app and loop mode.

:func:`run_episodes` samples ``group`` episodes per row. Without an environment an episode is
one turn: the row's prompt ids and one completion (one ``generate`` call for the whole batch,
``group`` samples per prompt). With ``task.environment`` (:mod:`forge_ext.tasks.environments`)
each episode has its own environment instance, and turns alternate until the environment says
done, ``task.max_turns`` model turns, or ``task.max_episode_tokens``:

1. ``reset(row)`` gives the first prompt, rendered once (:class:`~forge_ext.tasks.PromptRenderer`);
2. every running episode's prompt is exactly its ids so far (token-in/token-out: never decoded
   and re-encoded); the generator samples one turn for each, in one call per turn;
3. the model's tokens are appended with mask 1 and their log-probs; a turn cut at the
   generator's ``max_new_tokens`` (no end token) ends the episode as truncated;
4. ``step(decoded turn)`` gives a reply, a reward and done; the reply's ids
   (:meth:`~forge_ext.tasks.PromptRenderer.continuation`) are appended with mask 0 and no
   log-probs.

An environment call that raises or runs past ``task.env_timeout_s`` ends its episode, which
then scores ``reward.on_error`` (counted in ``episode/env_errors`` / ``episode/env_timeouts``);
the others go on. An episode's reward is the rubric's score of its last model turn plus the sum
of its environment rewards; its policy version is that of its oldest turn (staleness is bounded
by the oldest).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from forge_ext.generation import Completion
from forge_ext.tasks import EpisodeConfig, PromptRenderer, Row, Rubric, Sample, Scores
from forge_ext.tasks.workers import DaemonPool
from forge_ext.tasks.tokenizer import CheckpointTokenizer

Generate = Callable[..., Awaitable[list[Completion]]]
"""``generate(prompts: list[list[int]], n: int, *, greedy: bool, seed: int | None)``: ``n``
completions per prompt, prompt-major (the Generator actor's endpoint)."""


@dataclass(slots=True)
class Trajectory:
    """One episode: its first prompt and everything after it, model and environment tokens."""

    row: Row
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    """Every token after the first prompt, in order."""
    response_mask: list[int] = field(default_factory=list)
    """1 on the model's tokens, 0 on the environment's."""
    logprobs: list[float] = field(default_factory=list)
    """The generator's log-prob of each model token; 0.0 on environment tokens."""
    versions: list[int] = field(default_factory=list)
    """The policy version of each model turn."""
    last_turn: list[int] = field(default_factory=list)
    """The last model turn's ids (what the rubric scores, decoded)."""
    env_reward: float = 0.0
    turns: int = 0
    truncated: bool = False
    """Ended by ``max_turns``, ``max_episode_tokens`` or a turn without an end token."""
    env_error: str | None = None
    """``"error"`` or ``"timeout"`` if an environment call ended the episode."""
    done: bool = False
    env: object | None = None

    @property
    def policy_version(self) -> int:
        return min(self.versions)

    def add(self, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.response_mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


@dataclass(slots=True)
class EpisodeBatch:
    """Scored episodes, ``group`` consecutive ones per row."""

    trajectories: list[Trajectory]
    scores: Scores
    rewards: list[float]
    """Per episode: the rubric's weighted reward (``reward.on_error`` if the environment
    failed) plus the environment's rewards."""
    env_seconds: float
    reward_seconds: float
    multi_turn: bool

    @classmethod
    def concat(cls, batches: list[EpisodeBatch]) -> EpisodeBatch:
        """One batch of several (e.g. an evaluation made in chunks), in order."""
        first = batches[0]
        names = list(first.scores.by_function)
        scores = Scores(
            rewards=[r for b in batches for r in b.scores.rewards],
            by_function={n: [v for b in batches for v in b.scores.by_function[n]] for n in names},
            errors={n: sum(b.scores.errors[n] for b in batches) for n in names},
            correct=[c for b in batches for c in b.scores.correct],
        )
        return cls(
            trajectories=[t for b in batches for t in b.trajectories], scores=scores,
            rewards=[r for b in batches for r in b.rewards],
            env_seconds=sum(b.env_seconds for b in batches),
            reward_seconds=sum(b.reward_seconds for b in batches), multi_turn=first.multi_turn,
        )

    def metrics(self) -> dict[str, float]:
        """Per-function reward means and errors, and for multi-turn episodes
        ``episode/turns_mean``, ``_max``, ``episode/truncated`` (fraction),
        ``episode/env_errors``, ``episode/env_timeouts`` (counts); :attr:`env_seconds` is
        the environment's share of the time."""
        out = self.scores.metrics()
        if self.multi_turn:
            t = self.trajectories
            out.update({
                "episode/turns_mean": sum(x.turns for x in t) / len(t),
                "episode/turns_max": float(max(x.turns for x in t)),
                "episode/truncated": sum(x.truncated for x in t) / len(t),
                "episode/env_errors": float(sum(x.env_error == "error" for x in t)),
                "episode/env_timeouts": float(sum(x.env_error == "timeout" for x in t)),
            })
        return out


class EpisodeRunner:
    """Runs and scores episodes for one tokenizer, renderer, rubric and ``task:`` episode
    config (module docstring).

    Raises (on construction):
        ValueError: an environment with a chat template that is not prefix-preserving.
    """

    def __init__(self, tok: CheckpointTokenizer, render: PromptRenderer, rubric: Rubric,
                 config: EpisodeConfig) -> None:
        self.tok, self.render, self.rubric, self.config = tok, render, rubric, config
        if config.environment is not None:
            render.check_continuation()
        self._reported: set[str] = set()
        self._pool = DaemonPool(8)  # environments' sync reset/step

    @property
    def multi_turn(self) -> bool:
        return self.config.environment is not None

    async def run(self, rows: list[Row], group: int, generate: Generate, *,
                  greedy: bool = False, seed: int | None = None,
                  version: int = 0) -> EpisodeBatch:
        """``group`` scored episodes per row (module docstring); ``seed`` seeds turn ``k``'s
        sampling with ``seed + 104_729 * k`` (None: unseeded). ``version`` stamps an episode whose
        environment failed before any turn (it is kept, with no valid token, so that its
        group stays whole)."""
        if not self.multi_turn:
            completions = await generate([self.render(r) for r in rows], group,
                                         greedy=greedy, seed=seed)
            trajectories = []
            for i, c in enumerate(completions):
                t = Trajectory(row=rows[i // group], prompt_ids=c.prompt_ids, turns=1,
                               versions=[c.policy_version], last_turn=c.response_ids,
                               truncated=not c.finished, done=True)
                t.add(c.response_ids, True, c.logprobs)
                trajectories.append(t)
            return await self._score(trajectories, 0.0)
        return await self._run_multi_turn(rows, group, generate, greedy, seed, version)

    async def _run_multi_turn(self, rows, group, generate, greedy, seed, version
                              ) -> EpisodeBatch:
        c = self.config
        trajectories = [Trajectory(row=row, prompt_ids=[], env=c.make())
                        for row in rows for _ in range(group)]
        env_seconds = 0.0
        start = time.perf_counter()
        firsts = await asyncio.gather(*(self._env_call(t, t.env.reset, t.row)
                                        for t in trajectories))
        env_seconds += time.perf_counter() - start
        for t, first in zip(trajectories, firsts):
            if t.done:
                continue
            try:
                t.prompt_ids = self.render(Row(prompt=first, answer=t.row.answer,
                                               metadata=t.row.metadata))
            except ValueError as e:
                self._fail(t, "error", e, "reset")
        for turn in range(c.max_turns):
            running = [t for t in trajectories if not t.done]
            if not running:
                break
            completions = await generate(
                [t.prompt_ids + t.response_ids for t in running], 1, greedy=greedy,
                seed=None if seed is None else seed + 104_729 * turn,
            )
            replies = []
            for t, x in zip(running, completions, strict=True):
                room = c.max_episode_tokens - len(t.response_ids)
                ids, logprobs = x.response_ids[:room], x.logprobs[:room]
                t.add(ids, True, logprobs)
                t.turns += 1
                t.versions.append(x.policy_version)
                t.last_turn = ids
                if len(ids) < len(x.response_ids) or not x.finished:
                    t.truncated = t.done = True  # cut by the token budget or max_new_tokens
                replies.append(t)
            stepping = [t for t in replies if not t.done]
            start = time.perf_counter()
            results = await asyncio.gather(*(
                self._env_call(t, t.env.step, self.tok.completion_text(t.last_turn)[0])
                for t in stepping
            ))
            env_seconds += time.perf_counter() - start
            for t, result in zip(stepping, results):
                if t.done:  # the call failed
                    continue
                try:
                    reply, reward, done = result
                    t.env_reward += float(reward)
                except (TypeError, ValueError):
                    self._fail(t, "error", TypeError(
                        f"step() must return (reply or None, reward, done), got {result!r:.80}"
                    ), "step")
                    continue
                if done or reply is None:
                    t.done = True
                    continue
                if t.turns == c.max_turns:
                    t.truncated = t.done = True
                    continue
                try:
                    ids = self.render.continuation(reply)
                except (TypeError, ValueError, KeyError) as e:  # a reply of the wrong shape
                    self._fail(t, "error", TypeError(
                        f"step()'s reply must be text or {{role, content}} messages, got "
                        f"{reply!r:.80} ({e})"), "step")
                    continue
                if len(t.response_ids) + len(ids) >= c.max_episode_tokens:
                    t.truncated = t.done = True  # no room for another model token
                    continue
                t.add(ids, False)
        for t in trajectories:
            if not t.done:  # the last model turn was answered: max_turns reached
                t.truncated = t.done = True
            if not t.turns:  # reset failed: a placeholder without any valid token
                try:
                    t.prompt_ids = t.prompt_ids or self.render(t.row)
                except ValueError:
                    t.prompt_ids = [self.tok.pad_id]
                t.versions = [version]
                t.add([self.tok.eos_id], False)
        return await self._score(trajectories, env_seconds)

    async def _env_call(self, t: Trajectory, method, argument):
        """``method(argument)`` (an environment's ``reset`` or ``step``, async or not: a sync
        one runs on a daemon worker) within ``task.env_timeout_s``; None if it failed, which
        ends the episode."""
        what, timeout = method.__name__, self.config.env_timeout_s
        try:
            if inspect.iscoroutinefunction(method):
                return await asyncio.wait_for(method(argument), timeout)
            result = await self._pool.call(functools.partial(method, argument), {}, timeout)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, timeout)
            return result
        except asyncio.CancelledError:
            raise
        except (asyncio.TimeoutError, TimeoutError):
            self._fail(t, "timeout", TimeoutError(
                f"longer than task.env_timeout_s={self.config.env_timeout_s}"), what)
        except Exception as e:  # noqa: BLE001  (a user's environment: it costs the episode)
            self._fail(t, "error", e, what)
        return None

    def _fail(self, t: Trajectory, kind: str, error: BaseException, what: str) -> None:
        t.env_error, t.done = kind, True
        key = f"{kind}:{what}"
        if key not in self._reported:
            self._reported.add(key)
            detail = "".join(traceback.format_exception(error)).rstrip()
            print(f"the environment's {what}() failed ({kind}); its episode ends and scores "
                  f"reward.on_error={self.rubric.config.on_error}; later ones are only counted "
                  f"(episode/env_{kind}s):\n{detail}", file=sys.stderr, flush=True)

    async def _score(self, trajectories: list[Trajectory], env_seconds: float) -> EpisodeBatch:
        start = time.perf_counter()
        samples = []
        for t in trajectories:
            text, finished = self.tok.completion_text(t.last_turn)
            samples.append(Sample(row=t.row, completion=text, finished=finished,
                                  completion_ids=t.last_turn))
        scores = await self.rubric.score(samples)
        on_error = float(self.rubric.config.on_error)
        rewards = []
        for i, t in enumerate(trajectories):
            if t.env_error is not None:
                scores.correct[i] = False
                rewards.append(on_error)
            else:
                rewards.append(scores.rewards[i] + t.env_reward)
        return EpisodeBatch(trajectories=trajectories, scores=scores, rewards=rewards,
                            env_seconds=env_seconds, multi_turn=self.multi_turn,
                            reward_seconds=time.perf_counter() - start)
