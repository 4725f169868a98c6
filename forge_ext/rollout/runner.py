"""Episodes: from task rows to scored episodes, one turn or many, for every app and loop mode.

:meth:`EpisodeRunner.run` samples ``group`` episodes per row, every episode on its own: an
episode sends its next request as soon as it has what it needs (its environment's reply), so
a slow environment or a long response delays only its own episode, never the others of the
batch. Requests go through a :data:`SampleFn` callable (the generator replicas' router:
:meth:`forge_ext.rollout.replicas.GeneratorReplicas.sample`), each with a *session*: the
row's group, so every turn of an episode and every episode of a group go to one replica and
its prefix cache.

Without an environment an episode is one turn: one request per row for its ``group``
samples. With ``task.environment`` (:mod:`forge_ext.tasks.environments`) each episode has its
own environment instance, and turns alternate until the environment says done,
``task.max_turns`` model turns, or ``task.max_episode_tokens``:

1. ``reset(row)`` gives the first prompt, rendered once (:class:`~forge_ext.tasks.PromptRenderer`);
2. the episode's prompt is exactly its ids so far (token-in/token-out: never decoded and
   re-encoded); one request samples its turn;
3. the model's tokens are appended with mask 1, their log-probs and the policy version that
   sampled each; a turn cut at the generator's ``max_new_tokens`` (no end token) ends the
   episode as truncated;
4. ``step(decoded turn)`` gives a reply, a reward and done; the reply's ids
   (:meth:`~forge_ext.tasks.PromptRenderer.continuation`) are appended with mask 0 and no
   log-probs.

A truncated episode records why (:data:`TRUNCATION_CAUSES`, ``rollout/truncated/<cause>``):
its last turn was cut at ``max_new_tokens``, the episode ran out of ``max_episode_tokens``, or
out of ``max_turns``. An environment text (the first prompt, a reply) that the tokenizer maps
to its unknown token (``<unk>``: characters or words outside its vocabulary, e.g. English
under the demo's character tokenizer) is warned about once per environment, with the text,
and counted (``episode/env_unk_replies``): such a reply costs a token per unknown character
of ``max_episode_tokens`` and says nothing to the model.

An environment call that raises or runs past ``task.env_timeout_s`` ends its episode, which
then scores ``reward.on_error`` (counted in ``episode/env_errors`` / ``episode/env_timeouts``);
the others go on. An episode's reward is the rubric's score of its last model turn plus the sum
of its environment rewards (the environment's alone where the rubric has no functions: its
accuracy is then an episode reward >= 1); its policy version is that of its oldest token
(staleness is bounded by the oldest).

A batch in which one reward function's failed calls, or the failed episodes of the
environment or agent, reach ``reward.max_error_rate`` (default: all of them) raises
:class:`~forge_ext.tasks.rubric.RewardFailure` with the count and the first traceback: a run
does not train on ``reward.on_error`` values.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from forge_ext.rollout.engines.base import Completion, SamplingConfig, derive_seed
from forge_ext.tasks import EpisodeConfig, PromptRenderer, Row, Rubric, Sample, Scores
from forge_ext.tasks.rubric import check_failures, stops_the_run
from forge_ext.tasks.workers import DaemonPool
from forge_ext.tasks.tokenizer import CheckpointTokenizer

TRUNCATION_CAUSES = ("max_new_tokens", "max_episode_tokens", "max_turns")
"""Why a truncated episode ended, each logged as ``rollout/truncated/<cause>`` (the fraction
of episodes): its last model turn was cut at ``generator.sampling.max_new_tokens`` (no end
token; an agent's last call at its token limit); it reached ``task.max_episode_tokens`` (a
turn cut to fit, or no room for another turn after a reply); it used ``task.max_turns``
turns and the environment was not done."""

def truncation_causes(multi_turn: bool, agent: bool) -> tuple[str, ...]:
    """The causes of :data:`TRUNCATION_CAUSES` that can cut an episode of this kind (the
    ``rollout/truncated/<cause>`` a run logs): all for an environment's multi-turn episodes,
    only ``max_new_tokens`` for one turn and for an agent's calls."""
    return TRUNCATION_CAUSES if multi_turn and not agent else TRUNCATION_CAUSES[:1]


SampleFn = Callable[..., Awaitable[list[Completion]]]
"""``sample(prompt_ids: list[int], n: int, *, greedy: bool, seed: int | None, session)``: one
request's ``n`` completions (:meth:`forge_ext.rollout.replicas.GeneratorReplicas.sample`);
``session`` is hashable: requests of one session go to one replica."""


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
    """The policy version that sampled each model token, in order."""
    replica: int = 0
    """The generator replica that sampled its (last) model turn."""
    last_turn: list[int] = field(default_factory=list)
    """The last model turn's ids (what the rubric scores, decoded)."""
    env_reward: float = 0.0
    env_seconds: float = 0.0
    """Seconds the episode waited for its environment."""
    turns: int = 0
    truncated: bool = False
    """Ended by ``max_turns``, ``max_episode_tokens`` or a turn without an end token."""
    truncation: str | None = None
    """Why it was truncated: one of :data:`TRUNCATION_CAUSES` (None: not truncated)."""
    unknown_replies: int = 0
    """Environment texts (first prompt, replies) holding the tokenizer's unknown token."""
    env_error: str | None = None
    """``"error"`` or ``"timeout"`` if an environment call ended the episode."""
    done: bool = False
    env: object | None = None
    rows: list | None = None
    """An agent's episode: its training rows (:func:`forge_ext.rollout.agents.merge_calls`);
    None: the episode is one row (the fields above)."""
    answer: str | None = None
    """An agent's final answer, which the rubric scores instead of the last turn."""
    reward_value: float | None = None
    """A reward the agent returned itself (the rubric's score is then not used)."""

    def training_rows(self) -> list[tuple[list[int], list[int], list[int], list[float]]]:
        """``(prompt_ids, response_ids, response_mask, logprobs)`` of each row the episode
        trains on: itself, or an agent's rows (each gets the episode's advantage)."""
        if self.rows is None:
            return [(self.prompt_ids, self.response_ids, self.response_mask, self.logprobs)]
        return [(r.prompt_ids, r.response_ids, r.response_mask, r.logprobs) for r in self.rows]

    @property
    def policy_version(self) -> int:
        return min(self.versions)

    def add(self, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.response_mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def truncate(self, cause: str) -> None:
        """End the episode as truncated by ``cause`` (:data:`TRUNCATION_CAUSES`)."""
        self.truncated = self.done = True
        self.truncation = cause


@dataclass(slots=True)
class EpisodeBatch:
    """Scored episodes, ``group`` consecutive ones per row."""

    trajectories: list[Trajectory]
    scores: Scores
    rewards: list[float]
    """Per episode: the rubric's weighted reward (``reward.on_error`` if the environment
    failed) plus the environment's rewards."""
    env_seconds: float
    """Seconds the episodes waited for their environments (an agent's episodes: spent in
    its run), summed over episodes (they overlap: this is load, not wall time)."""
    reward_seconds: float
    multi_turn: bool
    agent: bool = False
    """Episodes of an agent (``task.agent``)."""

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
            agent=first.agent,
        )

    def samples(self, tok: CheckpointTokenizer, indices: list[int]) -> list[dict]:
        """Episodes ``indices`` as records for a samples file: the row's prompt text and
        answer, the ``completion`` the rubric scored (the last model turn decoded, or an
        agent's answer), whether it ``finished``, the episode's ``reward``, each reward
        function's score (``rewards``), ``response_tokens`` and ``turns``."""
        records = []
        for i in indices:
            t = self.trajectories[i]
            text, finished = tok.completion_text(t.last_turn)
            records.append({
                "prompt": t.row.text, "answer": t.row.answer,
                "completion": t.answer if t.answer is not None else text,
                "finished": finished, "reward": self.rewards[i],
                "rewards": {name: v[i] for name, v in self.scores.by_function.items()},
                "response_tokens": len(t.response_ids), "turns": t.turns,
            })
        return records

    def waited_seconds(self) -> dict[str, float]:
        """The mean seconds an episode spent outside the generator, by what it waited for:
        ``{"agent": s}`` for an agent's episodes (its own run: its code and its calls),
        ``{"env": s}`` for an environment's, ``{}`` for one-turn episodes (the step's
        ``time/<key>``)."""
        if not self.multi_turn or not self.trajectories:
            return {}
        return {"agent" if self.agent else "env": self.env_seconds / len(self.trajectories)}

    def metrics(self) -> dict[str, float]:
        """Per-function reward means and errors, and for multi-turn episodes
        ``episode/turns_mean``, ``_max``, ``episode/truncated`` (fraction, any cause),
        ``episode/env_errors``, ``episode/env_timeouts``, ``episode/env_unk_replies``
        (counts); for every batch ``rollout/truncated/<cause>`` (the fraction of episodes
        truncated by each cause of :data:`TRUNCATION_CAUSES` that applies: only
        ``max_new_tokens`` for single-turn and agent episodes) and
        ``rollout/versions_per_response_mean`` and ``_max`` (policy versions that sampled an
        episode's tokens)."""
        out = self.scores.metrics()
        causes = truncation_causes(self.multi_turn, self.agent)
        n = len(self.trajectories)
        for cause in causes:
            out[f"rollout/truncated/{cause}"] = sum(
                x.truncation == cause for x in self.trajectories) / n
        spans = [len(set(x.versions)) for x in self.trajectories if x.versions]
        if spans:  # > 1 where an in-flight weight update landed inside a response
            out["rollout/versions_per_response_mean"] = sum(spans) / len(spans)
            out["rollout/versions_per_response_max"] = float(max(spans))
        agents = self.trajectories if self.agent else []
        if agents:
            out.update({
                "agent/calls_mean": sum(x.turns for x in agents) / len(agents),
                "agent/rows_mean": sum(len(x.rows or []) for x in agents) / len(agents),
                "agent/errors": float(sum(x.env_error == "error" for x in agents)),
                "agent/timeouts": float(sum(x.env_error == "timeout" for x in agents)),
            })
            return out
        if self.multi_turn:
            t = self.trajectories
            out.update({
                "episode/turns_mean": sum(x.turns for x in t) / len(t),
                "episode/turns_max": float(max(x.turns for x in t)),
                "episode/truncated": sum(x.truncated for x in t) / len(t),
                "episode/env_errors": float(sum(x.env_error == "error" for x in t)),
                "episode/env_timeouts": float(sum(x.env_error == "timeout" for x in t)),
                "episode/env_unk_replies": float(sum(x.unknown_replies for x in t)),
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
        self._unk_warned: set[str] = set()  # environments warned about unknown tokens
        self._first_failure: str | None = None  # the environment's or agent's first traceback
        self._unprinted: list[str] = []  # first failures to print after their batch
        self._pool = DaemonPool(8)  # environments' sync reset/step
        self._runs = itertools.count()  # tells sessions of different calls apart
        self.endpoint = None
        """The agents' endpoint (:class:`forge_ext.rollout.agents.AgentEndpoint`), set by
        the app once the generator serves, for ``task.agent``."""
        self._agent = config.agent_function() if config.agent is not None else None

    @property
    def multi_turn(self) -> bool:
        """Episodes whose rows mix the model's tokens with others' (an environment's, an
        agent's tools and turns): their loss mask is explicit."""
        return self.config.environment is not None or self.config.agent is not None

    @property
    def truncation_causes(self) -> tuple[str, ...]:
        """The truncation causes its episodes log (:func:`truncation_causes`)."""
        return truncation_causes(self.multi_turn, self.config.agent is not None)

    async def run(self, rows: list[Row], group: int, sample: SampleFn, *,
                  greedy: bool = False, seed: int | None = None,
                  version: int = 0, sampling: SamplingConfig | None = None) -> EpisodeBatch:
        """``group`` scored episodes per row, each running on its own (module docstring).

        ``seed`` (None: unseeded) gives every sample a seed of its own: single-turn, row ``i``
        is one request of ``group`` samples seeded ``derive_seed(seed, i)`` (vLLM seeds its
        samples ``+ j``); multi-turn, episode ``e``'s turn ``k`` is seeded ``derive_seed(seed,
        e, k)``, whatever else runs meanwhile. So the episodes of a group, and two rows
        holding the same prompt, draw apart, and a step is reproducible from its seed.
        ``version`` stamps an episode whose environment failed before any turn (it is kept,
        with no valid token, so that its group stays whole). ``sampling`` overrides the
        generator's sampling settings for every request (an evaluation set's); agent
        episodes sample with the generator's own."""
        run = next(self._runs)
        if sampling is not None:  # only when set: a SampleFn need not take it otherwise
            sample = functools.partial(sample, sampling=sampling)
        if not self.multi_turn:
            results = await asyncio.gather(*(
                sample(self.render(row), group, greedy=greedy,
                       seed=None if seed is None else derive_seed(seed, i), session=(run, i))
                for i, row in enumerate(rows)
            ))
            trajectories = []
            for row, completions in zip(rows, results):
                for c in completions:
                    t = Trajectory(row=row, prompt_ids=c.prompt_ids, turns=1,
                                   versions=c.versions or [c.policy_version],
                                   replica=c.replica,
                                   last_turn=c.response_ids, truncated=not c.finished, done=True,
                                   truncation=None if c.finished else "max_new_tokens")
                    t.add(c.response_ids, True, c.logprobs)
                    trajectories.append(t)
            return await self._score(trajectories)
        trajectories = [Trajectory(row=row, prompt_ids=[], env=self.config.make())
                        for row in rows for _ in range(group)]
        episode = self._agent_episode if self.config.agent is not None else self._episode
        await asyncio.gather(*(
            episode(t, sample, greedy=greedy, session=(run, e // group),
                    seed=None if seed is None else functools.partial(derive_seed, seed, e))
            for e, t in enumerate(trajectories)
        ))
        for t in trajectories:
            if not t.turns:  # reset failed, or no call: a placeholder without any valid token
                t.rows = None
                try:
                    t.prompt_ids = t.prompt_ids or self.render(t.row)
                except ValueError:
                    t.prompt_ids = [self.tok.pad_id]
                t.versions = [version]
                t.add([self.tok.eos_id], False)
        return await self._score(trajectories)

    async def _episode(self, t: Trajectory, sample: SampleFn, *, greedy: bool, session,
                       seed: Callable[[int], int] | None) -> None:
        """Run one multi-turn episode to its end (module docstring); ``seed(turn)`` seeds a
        turn."""
        c = self.config
        first = await self._env_call(t, t.env.reset, t.row)
        if t.done:
            return
        try:
            t.prompt_ids = self.render(Row(prompt=first, answer=t.row.answer,
                                           metadata=t.row.metadata))
        except ValueError as e:
            self._fail(t, "error", e, "reset")
            return
        self._check_known(t, t.prompt_ids, first, "reset")
        for turn in range(c.max_turns):
            (x,) = await sample(t.prompt_ids + t.response_ids, 1, greedy=greedy,
                                seed=None if seed is None else seed(turn), session=session)
            room = c.max_episode_tokens - len(t.response_ids)
            ids, logprobs = x.response_ids[:room], x.logprobs[:room]
            t.add(ids, True, logprobs)
            t.turns += 1
            t.versions += (x.versions or [x.policy_version] * len(x.response_ids))[:room] or [
                x.policy_version]
            t.replica = x.replica
            t.last_turn = ids
            if len(ids) < len(x.response_ids):
                t.truncate("max_episode_tokens")  # cut to fit the episode's token budget
                return
            if not x.finished:
                t.truncate("max_new_tokens")  # no end token: the generator's limit
                return
            result = await self._env_call(t, t.env.step, self.tok.completion_text(ids)[0])
            if t.done:  # the call failed
                return
            try:
                reply, reward, done = result
                t.env_reward += float(reward)
            except (TypeError, ValueError):
                self._fail(t, "error", TypeError(
                    f"step() must return (reply or None, reward, done), got {result!r:.80}"
                ), "step")
                return
            if done or reply is None:
                t.done = True
                return
            if t.turns == c.max_turns:
                break
            try:
                reply_ids = self.render.continuation(reply)
            except (TypeError, ValueError, KeyError) as e:  # a reply of the wrong shape
                self._fail(t, "error", TypeError(
                    f"step()'s reply must be text or {{role, content}} messages, got "
                    f"{reply!r:.80} ({e})"), "step")
                return
            self._check_known(t, reply_ids, reply, "step")
            if len(t.response_ids) + len(reply_ids) >= c.max_episode_tokens:
                t.truncate("max_episode_tokens")  # no room for another model token
                return
            t.add(reply_ids, False)
        t.truncate("max_turns")  # the last model turn was answered, and not done

    async def _agent_episode(self, t: Trajectory, sample: SampleFn, *, greedy: bool, session,
                             seed: Callable[[int], int] | None) -> None:
        """Run one agent episode through the endpoint (:mod:`forge_ext.rollout.agents`): its
        session's calls become its rows; its result its reward or answer."""
        from forge_ext.rollout.agents import merge_calls

        c, endpoint = self.config, self.endpoint
        if endpoint is None:
            raise RuntimeError("task.agent is set but the agent endpoint was not started")
        opened = endpoint.open_session(t.row, seed=None if seed is None else seed(0),
                                       route=session, greedy=greedy)
        start = time.perf_counter()
        result = None
        try:
            if self._agent is None:  # external
                result = await endpoint.run_external(opened, c.agent_timeout_s)
            else:
                client = endpoint.client(opened, timeout=c.agent_timeout_s)
                result = await asyncio.wait_for(self._agent(client, t.row), c.agent_timeout_s)
        except asyncio.CancelledError:
            raise
        except (asyncio.TimeoutError, TimeoutError):
            self._fail(t, "timeout", TimeoutError(
                f"longer than task.agent_timeout_s={c.agent_timeout_s}"), "agent")
        except Exception as e:  # noqa: BLE001  (a user's agent: it costs the episode)
            self._fail(t, "error", e, "agent")
        finally:
            calls = endpoint.close_session(opened)
            t.env_seconds += time.perf_counter() - start
        t.rows = merge_calls(calls)
        t.turns = len(calls)
        t.done = True
        if t.env_error is None:
            if isinstance(result, bool) or not isinstance(result, (int, float, str, type(None))):
                self._fail(t, "error", TypeError(
                    f"an agent returns a reward (a number), a final answer (a string) or None, "
                    f"got {type(result).__name__} {result!r:.80}"), "agent")
            elif isinstance(result, str):
                t.answer = result
            elif result is not None:
                t.reward_value = float(result)
        if not t.rows:  # no call: a placeholder row without any valid token (as a failed reset)
            return
        first = t.rows[0]
        t.prompt_ids, t.response_ids = first.prompt_ids, first.response_ids
        t.response_mask, t.logprobs = first.response_mask, first.logprobs
        t.versions = [v for r in t.rows for v in r.versions]
        t.last_turn = calls[-1].completion_ids
        if not calls[-1].finished:
            t.truncated, t.truncation = True, "max_new_tokens"

    async def _env_call(self, t: Trajectory, method, argument):
        """``method(argument)`` (an environment's ``reset`` or ``step``, async or not: a sync
        one runs on a daemon worker) within ``task.env_timeout_s``; None if it failed, which
        ends the episode."""
        what, timeout = method.__name__, self.config.env_timeout_s
        start = time.perf_counter()
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
        finally:
            t.env_seconds += time.perf_counter() - start
        return None

    def _check_known(self, t: Trajectory, ids: list[int], text, what: str) -> None:
        """Count an environment text (``reset``'s first prompt, a ``step`` reply) whose ids
        hold the tokenizer's unknown token, and warn once per environment with the text
        (the app checks the task's prompts the same way before spawning)."""
        unknown = self.tok.unknown_count(ids)
        if not unknown:
            return
        t.unknown_replies += 1
        env = self.config.environment
        if env in self._unk_warned:
            return
        self._unk_warned.add(env)
        print(f"warning: the environment ({env})'s {what}() gave text the tokenizer of "
              f"model.hf_path maps to {self.tok.tokenizer.unk_token} ({unknown} of its "
              f"{len(ids)} tokens: characters or words outside its vocabulary); the model "
              "reads nothing there, and each such token counts toward "
              f"task.max_episode_tokens={self.config.max_episode_tokens}; later ones are only "
              f"counted (episode/env_unk_replies): {_text_of(text)!r:.300}",
              file=sys.stderr, flush=True)

    def _fail(self, t: Trajectory, kind: str, error: BaseException, what: str) -> None:
        t.env_error, t.done = kind, True
        key = f"{kind}:{what}"
        if key not in self._reported:
            self._reported.add(key)
            detail = "".join(traceback.format_exception(error)).rstrip()
            if self._first_failure is None:
                self._first_failure = detail
            who, metric = ((f"the agent ({self.config.agent})", f"agent/{kind}s")
                           if what == "agent" else
                           (f"the environment's {what}()", f"episode/env_{kind}s"))
            self._unprinted.append(
                f"{who} failed ({kind}); its episode ends and scores "
                f"reward.on_error={self.rubric.config.on_error}; later ones are only counted "
                f"({metric}):\n{detail}")

    async def _score(self, trajectories: list[Trajectory]) -> EpisodeBatch:
        start = time.perf_counter()
        samples = []
        for t in trajectories:
            text, finished = self.tok.completion_text(t.last_turn)
            if t.answer is not None:
                text = t.answer
            samples.append(Sample(row=t.row, completion=text, finished=finished,
                                  completion_ids=t.last_turn))
        scores = await self.rubric.score(samples)
        failed = sum(t.env_error is not None for t in trajectories)
        # The first failures, once: printed now unless this batch stops the run, whose error
        # then holds the first traceback (it was printed twice).
        if not stops_the_run(failed, len(trajectories), self.rubric.config.max_error_rate):
            for line in self._unprinted:
                print(line, file=sys.stderr, flush=True)
        self._unprinted.clear()
        self.rubric.check(scores)
        check_failures(f"the agent ({self.config.agent})" if self.config.agent is not None
                       else f"the environment ({self.config.environment})", failed,
                       len(trajectories), self._first_failure, self.rubric.config.max_error_rate)
        on_error = float(self.rubric.config.on_error)
        alone = not self.rubric.names  # the environment's rewards alone (no function, no model)
        rewards = []
        for i, t in enumerate(trajectories):
            if t.env_error is not None:
                scores.correct[i] = False
                rewards.append(on_error)
            elif t.reward_value is not None:  # an agent's own reward
                scores.correct[i] = t.reward_value >= 1.0
                rewards.append(t.reward_value)
            else:
                rewards.append(scores.rewards[i] + t.env_reward)
                if alone:
                    scores.correct[i] = t.env_reward >= 1.0
        return EpisodeBatch(trajectories=trajectories, scores=scores, rewards=rewards,
                            env_seconds=sum(t.env_seconds for t in trajectories),
                            multi_turn=self.multi_turn, agent=self.config.agent is not None,
                            reward_seconds=time.perf_counter() - start)


def _text_of(prompt) -> str:
    """An environment's text, a message or messages, as one string (for a warning)."""
    if isinstance(prompt, str):
        return prompt
    messages = [prompt] if isinstance(prompt, dict) else prompt
    try:
        return "".join(str(m["content"]) for m in messages)
    except (TypeError, KeyError):
        return str(prompt)
