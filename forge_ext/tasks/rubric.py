"""The rubric: a task's reward functions with weights, called once per completion, with a time
bound and error accounting written once for every task.

A completion's reward is ``sum_i weight_i * score_i`` over ``reward.functions`` (as TRL's
``reward_weights`` and verifiers' ``Rubric`` do). A call that raises, runs past
``reward.timeout_s``, or returns anything but a finite real number (a string, None, NaN, inf)
scores ``reward.on_error`` for that function and sample, is counted in
``reward/errors/<name>``, and the first traceback of each function is printed once (to
stderr); the run goes on, unless a function's failed calls in one rollout batch (a step's
episodes, an evaluation chunk) reach ``reward.max_error_rate`` (default 1.0: every call
failed): then the batch raises :class:`RewardFailure` with the count and that first traceback,
and the run stops rather than train on ``on_error`` values
(:meth:`forge_ext.rollout.runner.EpisodeRunner.run` checks). Logged per batch:
``reward/<name>`` (the function's mean score), ``reward/errors/<name>``.

A reward function is called with the keyword arguments its signature names (a function taking
``**kwargs`` gets them all): ``completion``, ``prompt``, ``answer``, ``row``, ``finished``,
``completion_ids`` (:data:`~forge_ext.tasks.base.RewardFn`), and the row's columns as TRL
passes them (``def f(completion, gold)`` gets the row's ``gold``; the row itself is a mapping
too: ``row["gold"]``). A column named like one of the six is shadowed by it.

A task with an environment may have no reward functions (``reward.functions`` empty and no
task default, :class:`Rubric` built with ``environment=True``): the environment's rewards are
then the episode's reward.

Where the calls run (``reward.isolation``, :mod:`forge_ext.tasks.workers`):

- ``process`` (default): every function, sync or async, in a pool of ``reward.num_workers``
  worker processes; the calls of a batch spread over them. A call past ``reward.timeout_s``
  has its worker SIGKILLed and replaced, so no function, not even one stuck in a C call that
  holds the GIL (sympy's big-int power under math-verify), can stop the controller: its event
  loop, the other calls and the next batch go on. Functions are sent by reference (a
  module-level function, a callable object of an importable class): a lambda or closure is
  refused when the rubric is built. Module globals a function writes live in its worker,
  not in the controller. Workers start at the first batch or at
  :meth:`Rubric.start`, all at once, and end at :meth:`Rubric.close`, when the rubric is
  garbage collected, or with the controller.
- ``thread``: sync functions on daemon threads (:class:`~forge_ext.tasks.workers.DaemonPool`),
  async ones on the caller's event loop; any callable works, and a call that never returns
  costs its sample and a thread, but one that holds the GIL stops the whole controller until
  it returns.

A reward may also be a learned model (``reward.functions[i].model``, an HF
sequence-classification checkpoint): it runs frozen in its own procs
(:mod:`forge_ext.actors.reward_model`, spawned by the app and attached with
:meth:`Rubric.attach_model`) and scores a batch's completions in one call, beside the
functions' calls; its scores are weighted, summed and logged (``reward/<name>``) like a
function's. A call that fails costs that batch's scores of the model (``reward.on_error``
each, all counted in ``reward/errors/<name>``), never the run: ``reward.max_error_rate``,
``reward.timeout_s`` and ``reward.isolation`` apply to functions only.

``accuracy`` of a batch is the fraction of completions whose ``reward.accuracy`` function
(default: the first) scored at least 1.0: exact answers, not partial credit.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import pickle
import sys
import traceback
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from forge_ext.tasks.base import RewardFn, Row, Task
from forge_ext.tasks.rewards import check_reward_model, resolve_reward
from forge_ext.tasks.workers import DaemonPool, ProcessPool, as_reward, default_workers

ModelScorer = Callable[[list[Any], list[str]], Awaitable[Sequence[float | None]]]
"""A reward model's scoring call: ``(prompts, completions) -> scores`` (None: no score)."""

# Keyword arguments a reward function may ask for; the first four are always offered.
REWARD_KWARGS = ("completion", "prompt", "answer", "row", "finished", "completion_ids")


@dataclass(kw_only=True, slots=True)
class RewardFunctionConfig:
    """One entry of ``reward.functions``: a function (``fn``) or a reward model (``model``),
    exactly one of them."""

    fn: str | None = None
    """A built-in (``math_verify``, ``exact_match``), one of the task's own (the addition
    task's ``addition``, the reasoning-gym source's ``reasoning_gym``), or
    ``"package.module:function"``."""
    model: str | None = None
    """A reward model instead of a function: an HF sequence-classification checkpoint
    directory (``Qwen3ForSequenceClassification`` or ``LlamaForSequenceClassification``,
    ``num_labels: 1``, with its tokenizer), run frozen in its own procs
    (:mod:`forge_ext.actors.reward_model`); a completion's score is the model's value at
    the last token of its chat-templated conversation that is not the checkpoint's pad
    token, as transformers' ``AutoModelForSequenceClassification`` pools (``pooling``)."""
    weight: float = 1.0
    """Its weight in the completion's reward."""
    name: str | None = None
    """Its metric name (``reward/<name>``); default: ``fn``'s name (after the ``:``), or the
    ``model`` directory's name."""
    procs: int | None = None
    """``model`` only: data-parallel processes of the reward model (each holds the whole
    model; a step's completions are split between them by tokens); default 1."""
    max_tokens_per_microbatch: int | None = None
    """``model`` only: the token budget of one forward microbatch per process (padded
    positions); default 4096."""
    env: dict[str, str] = field(default_factory=dict)
    """``model`` only: environment of the reward model's procs, e.g.
    ``{CUDA_VISIBLE_DEVICES: "6,7"}`` to give it GPUs of its own beside the roles' (its procs
    otherwise take the first ones, as a role without ``procs.<role>.env`` does); reward
    models with an ``env`` are spawned after the roles, one at a time."""
    seq_len: int | None = None
    """``model`` only: the longest conversation it scores (tokens of its own tokenizer,
    chat template included); a longer one scores ``reward.on_error``, counted. Default: the
    checkpoint's ``max_position_embeddings``."""
    pooling: str | None = None
    """``model`` only: where a conversation's score is read. ``last_non_pad`` (the default):
    as transformers' ``*ForSequenceClassification``, the last token that is not the
    checkpoint's ``pad_token_id`` (with pad == eos, the token before a final end token);
    ``last_token``: the conversation's last token whatever it is, for reward models trained
    to score at the end token (OpenRLHF's convention)."""

    @property
    def metric_name(self) -> str:
        """``name``, or the default above."""
        if self.name:
            return self.name
        if self.model is not None:
            return os.path.basename(os.path.normpath(self.model))
        return self.fn.rsplit(":", 1)[-1].rsplit(".", 1)[-1]

    def check(self, field: str) -> None:
        """Raise ValueError naming ``field`` (``reward.functions[i]``): neither or both of
        ``fn`` and ``model``, a reward model's engine fields on a function, or one < 1."""
        if (self.fn is None) == (self.model is None):
            raise ValueError(
                f"{field} needs exactly one of fn (a reward function) and model (a reward "
                f"model's checkpoint directory); it has "
                f"{'both' if self.fn is not None else 'neither'}")
        engine = ("procs", "max_tokens_per_microbatch", "seq_len")
        for key in engine:
            value = getattr(self, key)
            if value is None:
                continue
            if self.model is None:
                raise ValueError(f"{field}.{key} is a reward model's setting; {field} is a "
                                 f"function (fn={self.fn!r}): remove it, or set model")
            if isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}.{key}={value!r} must be an int >= 1")
        for key in ("env", "pooling"):
            if getattr(self, key) and self.model is None:
                raise ValueError(f"{field}.{key} is a reward model's setting; {field} is a "
                                 f"function (fn={self.fn!r}): remove it, or set model")
        if self.pooling not in (None, "last_non_pad", "last_token"):
            raise ValueError(f"{field}.pooling={self.pooling!r} must be last_non_pad "
                             "(transformers' classifier pooling, the default) or last_token "
                             "(the conversation's last token)")


@dataclass(kw_only=True, slots=True)
class OverlongConfig:
    """YAML ``reward.overlong``: DAPO's soft overlong punishment (Yu et al. 2025,
    arXiv:2503.14476, section 3.4, eq. 13), added to each response's reward.

    With ``L_max = max_tokens``, ``L_cache = cache_tokens`` and ``|y|`` the response's tokens
    (everything after the first prompt; a multi-turn episode's environment tokens count, as
    they count toward ``task.max_episode_tokens``)::

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                 if |y| > L_max

    times ``penalty_factor``: a penalty growing linearly to ``-1`` over the last ``L_cache``
    tokens before the limit.
    """

    enable: bool = False
    """Add the length penalty to each response's reward (the ``dapo`` preset turns it on)."""
    cache_tokens: int | None = None
    """``L_cache``, the interval before the limit over which the penalty grows; unset: a
    fifth of ``max_tokens`` (the paper's 4096 of 20480)."""
    max_tokens: int | None = None
    """``L_max``; unset: the response limit (``generator.sampling.max_new_tokens``, or
    ``task.max_episode_tokens`` for multi-turn tasks)."""
    penalty_factor: float = 1.0
    """Scale of the penalty (verl's ``overlong_buffer.penalty_factor``)."""

    def __post_init__(self) -> None:
        if self.cache_tokens is not None and self.cache_tokens < 1:
            raise ValueError(f"reward.overlong.cache_tokens={self.cache_tokens} must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"reward.overlong.max_tokens={self.max_tokens} must be >= 1")
        if not (math.isfinite(self.penalty_factor) and self.penalty_factor >= 0):
            raise ValueError(
                f"reward.overlong.penalty_factor={self.penalty_factor} must be finite and >= 0"
            )
        if (self.cache_tokens is not None and self.max_tokens is not None
                and self.cache_tokens > self.max_tokens):
            raise ValueError(
                f"reward.overlong.cache_tokens={self.cache_tokens} > reward.overlong."
                f"max_tokens={self.max_tokens}: the interval must fit below the limit"
            )

    def penalty(self, length: int) -> float:
        """``penalty_factor * R_length`` of a response of ``length`` tokens (eq. 13 above);
        0.0 when not enabled. ``max_tokens`` and ``cache_tokens`` must be set (the GRPO app
        fills them)."""
        if not self.enable:
            return 0.0
        start = self.max_tokens - self.cache_tokens
        if length <= start:
            return 0.0
        if length > self.max_tokens:
            return -self.penalty_factor
        return self.penalty_factor * (start - length) / self.cache_tokens


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """YAML ``reward:`` section."""

    functions: list[RewardFunctionConfig] = field(default_factory=list)
    """Reward functions and weights; empty: the task's default (the addition task's
    ``addition``, reasoning-gym's ``reasoning_gym``; the dataset source has none)."""
    timeout_s: float = 30.0
    """Longest a single reward call may take (seconds); a slower one scores ``on_error``."""
    on_error: float = 0.0
    """Score of a call that raised, timed out, or returned a non-number or non-finite value."""
    accuracy: str | None = None
    """Name of the function whose 1.0 rate is the logged accuracy (default: the first)."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO's soft overlong punishment (:class:`OverlongConfig`), off by default."""
    isolation: str = "process"
    """Where reward functions run: ``process`` (worker processes; a call past ``timeout_s``
    is killed, even one stuck in a C call holding the GIL; functions must be importable:
    module-level, no lambdas or closures) or ``thread`` (the controller's threads and event
    loop; any callable, but a call holding the GIL stops the whole run until it returns)."""
    num_workers: int | None = None
    """Worker processes under ``isolation: process``; unset: the CPUs this process may use,
    at most 8."""
    max_error_rate: float | None = 1.0
    """Stop the run when one reward function's failed calls (raised, timed out, not a finite
    number), or an environment's or agent's failed episodes, reach this fraction of a rollout
    batch (a step's episodes, an evaluation chunk): the error names the function, the count
    and its first traceback. 1.0: only when every call of the batch failed; None: never (the
    failures score ``on_error`` and are counted)."""

    def __post_init__(self) -> None:
        for i, entry in enumerate(self.functions):
            entry.check(f"reward.functions[{i}]")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0")
        if not math.isfinite(self.on_error):
            raise ValueError(f"reward.on_error={self.on_error} must be a finite number")
        if self.isolation not in ("process", "thread"):
            raise ValueError(f"reward.isolation={self.isolation!r} must be 'process' or 'thread'")
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers} must be >= 1")
        if self.max_error_rate is not None and not 0 < self.max_error_rate <= 1:
            raise ValueError(f"reward.max_error_rate={self.max_error_rate} must be in (0, 1], "
                             "or null (never stop)")


@dataclass(slots=True)
class Sample:
    """One completion to score."""

    row: Row
    completion: str
    """Decoded response up to (not including) its end token."""
    finished: bool = True
    """False when the response was cut at the length limit."""
    completion_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Scores:
    """A batch's scores: ``rewards[i]`` is sample i's weighted reward, ``by_function[name][i]``
    its score from one function, ``correct[i]`` whether the accuracy function gave >= 1."""

    rewards: list[float]
    by_function: dict[str, list[float]]
    errors: dict[str, int]
    correct: list[bool]

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """``{prefix}/<name>`` means and ``{prefix}/errors/<name>`` counts."""
        n = max(len(self.rewards), 1)
        out = {f"{prefix}/{name}": sum(v) / n for name, v in self.by_function.items()}
        out.update({f"{prefix}/errors/{name}": float(c) for name, c in self.errors.items()})
        return out


class RewardTimeout(Exception):
    pass


class RewardFailure(RuntimeError):
    """A reward function, environment or agent failed at or above ``reward.max_error_rate``
    of a rollout batch's calls; the message has the count and the first traceback."""


@contextlib.contextmanager
def failures_of(batch: str) -> Iterator[None]:
    """Name the batch (``"the rollouts of step 3"``, ``"the held-out evaluation at step
    0"``) in front of a :class:`RewardFailure` raised within."""
    try:
        yield
    except RewardFailure as failure:
        raise RewardFailure(f"{batch}: {failure}") from None


def stops_the_run(failed: int, calls: int, max_error_rate: float | None) -> bool:
    """Whether ``failed`` of a batch's ``calls`` reach ``reward.max_error_rate``."""
    return max_error_rate is not None and calls > 0 and failed >= max_error_rate * calls


def check_failures(what: str, failed: int, calls: int, first: str | None,
                   max_error_rate: float | None) -> None:
    """Raise :class:`RewardFailure` if ``failed`` of ``calls`` reaches ``max_error_rate``.

    ``what``: names the failing function ("reward function 'gold'"); ``first``: its first
    traceback (None if not kept)."""
    if not stops_the_run(failed, calls, max_error_rate):
        return
    rate = "every call" if failed == calls else f"{failed / calls:.0%} of the calls"
    raise RewardFailure(
        f"{what} failed on {failed} of {calls} calls of this batch ({rate}; "
        f"reward.max_error_rate={max_error_rate}): the run stops rather than train on "
        "reward.on_error values; fix it, or set reward.max_error_rate "
        + ("higher or null." if max_error_rate < 1 else "null (never stop).")
        + (f" Its first failure:\n{first}" if first else "")
    )


class Rubric:
    """``reward:`` resolved against a task (module docstring).

    Raises (on construction), each naming the field:
        ValueError: no functions (and the task has no default), an unknown function or one
            that needs an argument the rubric does not pass, duplicate names, weights summing
            to 0, an unknown ``reward.accuracy``; a task whose ``rewards()`` or
            ``default_rewards()`` returns the wrong type; under ``reward.isolation:
            process``, a function that cannot be sent to a worker process; an entry with
            both or neither of ``fn`` and ``model``, or a reward model's checkpoint that
            :func:`forge_ext.tasks.rewards.check_reward_model` refuses.

    ``max_concurrency``: worker threads for synchronous reward functions under
    ``reward.isolation: thread`` (calls beyond it queue; a call's timeout counts from when it
    starts). Under ``process`` the workers are ``reward.num_workers``.

    ``environment``: episodes have an environment whose rewards may stand alone: no
    functions is then allowed (every score is empty, the reward the environment's).
    """

    def __init__(self, config: RewardConfig, task: Task, *, max_concurrency: int = 16,
                 environment: bool = False) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
        defaults, task_rewards = list(task.default_rewards()), task.rewards()
        if not all(isinstance(f, str) for f in defaults):
            raise ValueError(
                f"the task ({task.name})'s default_rewards() must return reward function names "
                f"(a list of str), got {defaults!r:.100}"
            )
        if not (isinstance(task_rewards, dict) and all(
                isinstance(k, str) and callable(v) for k, v in task_rewards.items())):
            raise ValueError(
                f"the task ({task.name})'s rewards() must return {{name: function}}, got "
                f"{task_rewards!r:.100}"
            )
        entries = config.functions or [RewardFunctionConfig(fn=f) for f in defaults]
        if not entries and not environment:
            raise ValueError(
                f"reward.functions is empty and the task ({task.name}) has no default reward; "
                "set e.g. reward.functions=[{fn: math_verify}] or [{fn: exact_match}], or "
                "[{fn: 'my_module:my_reward'}]"
            )
        self.config = config
        self.functions: dict[str, tuple[RewardFn, float, set[str] | None]] = {}
        self.models: dict[str, tuple[RewardFunctionConfig, float]] = {}
        """Reward models by name: their entries (which say how to spawn each,
        :mod:`forge_ext.actors.reward_model`) and weights. They score once a scorer is
        attached (:meth:`attach_model`)."""
        self._order: list[str] = []  # reward.functions order
        sent: dict[str, bytes] = {}  # pickled for the worker processes
        for i, entry in enumerate(entries):
            entry.check(f"reward.functions[{i}]")
            name = entry.metric_name
            if name in self._order:
                raise ValueError(
                    f"reward.functions[{i}]: a second function named {name!r}; give one a name"
                )
            if not math.isfinite(entry.weight):
                raise ValueError(f"reward.functions[{i}].weight={entry.weight} must be finite")
            self._order.append(name)
            if entry.model is not None:
                check_reward_model(entry.model, f"reward.functions[{i}].model")
                self.models[name] = (entry, float(entry.weight))
                continue
            where = f"reward.functions[{i}].fn"
            fn = resolve_reward(entry.fn, task_rewards, where)
            self.functions[name] = (fn, float(entry.weight),
                                    _accepted_kwargs(fn, where, task))
            if config.isolation == "process":
                sent[name] = _by_reference(fn, f"{where}={entry.fn!r}")
        weights = self.weights
        if weights and sum(weights.values()) == 0:
            raise ValueError(
                "reward.functions weights sum to 0: every completion would get reward 0"
            )
        self.accuracy_name = config.accuracy or next(iter(weights), None)
        if self.accuracy_name not in weights and (weights or config.accuracy):
            raise ValueError(
                f"reward.accuracy={config.accuracy!r} is not one of the reward functions "
                f"{list(self.weights)}"
            )
        self.error_counts = {name: 0 for name in self.weights}
        """Errors per function or reward model (per sample) over the rubric's life."""
        self.first_failures: dict[str, str] = {}
        """Each failed function's (or reward model's) first traceback."""
        self._reported: set[str] = set()
        self._unprinted: dict[str, str] = {}  # name: the first failure's line, to print
        self._scorers: dict[str, ModelScorer] = {}
        # Futures are made per call in the running loop, so score_sync (a new loop each
        # time) and an app's loop can share the rubric.
        self._threads: DaemonPool | None = None
        self._processes: ProcessPool | None = None
        if config.isolation == "process" and self.functions:
            self._processes = ProcessPool(sent, config.num_workers or default_workers(),
                                          config.timeout_s)
            weakref.finalize(self, self._processes.close)
        else:
            self._threads = DaemonPool(max_concurrency)

    @property
    def names(self) -> list[str]:
        return list(self._order)

    @property
    def weights(self) -> dict[str, float]:
        """Every function's and reward model's weight, in ``reward.functions`` order."""
        return {n: (self.functions[n] if n in self.functions else self.models[n])[1]
                for n in self._order}

    def attach_model(self, name: str, scorer: ModelScorer) -> None:
        """Score the reward model ``name`` with ``scorer(prompts, completions)``: one call
        per batch, returning a score per completion, or None for one it cannot score (e.g.
        :meth:`forge_ext.actors.reward_model.RewardModel.score`). Until then its samples
        score ``reward.on_error``, counted.

        Raises:
            KeyError: ``name`` is not one of the rubric's reward models.
        """
        if name not in self.models:
            raise KeyError(f"{name!r} is not a reward model of the rubric ({list(self.models)})")
        self._scorers[name] = scorer

    def start(self) -> None:
        """Start the worker processes now, all at once, without waiting for them (else the
        first batch starts them); nothing under ``reward.isolation: thread``."""
        if self._processes is not None:
            self._processes.start()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker processes running now (none under ``thread``)."""
        return self._processes.pids if self._processes is not None else []

    def close(self) -> None:
        """Kill the worker processes (idempotent; a later :meth:`score` raises for each call,
        counted as errors). Garbage collection of the rubric does the same."""
        if self._processes is not None:
            self._processes.close()

    def __enter__(self) -> Rubric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def score(self, samples: Sequence[Sample]) -> Scores:
        """Score every sample with every function, and every sample with each reward model
        in one call per model, all concurrently (module docstring)."""
        names = list(self.functions)
        calls = [self._call(name, sample) for sample in samples for name in names]
        models = list(self.models)
        results = await asyncio.gather(
            *calls, *(self._score_model(name, samples) for name in models))
        weights = self.weights
        by_function: dict[str, list[float]] = {name: [] for name in weights}
        errors = {name: 0 for name in weights}
        for k, (value, failed) in enumerate(results[: len(calls)]):
            name = names[k % len(names)]
            by_function[name].append(value)
            errors[name] += failed
        for name, (values, failed) in zip(models, results[len(calls):]):
            by_function[name], errors[name] = values, failed
        rewards = [
            sum(w * by_function[n][i] for n, w in weights.items())
            for i in range(len(samples))
        ]
        correct = ([v >= 1.0 for v in by_function[self.accuracy_name]]
                   if self.accuracy_name else [False] * len(samples))
        self._print_first_failures(errors, len(samples))
        return Scores(rewards=rewards, by_function=by_function, errors=errors, correct=correct)

    def _print_first_failures(self, errors: dict[str, int], calls: int) -> None:
        """Print each function's or model's first failure once, after its batch, except a
        function's whose batch stops the run: :meth:`check`'s error then holds it (it was
        printed twice: here, and in the run's last line)."""
        for name, detail in self._unprinted.items():
            if name in self.functions and stops_the_run(errors.get(name, 0), calls,
                                                         self.config.max_error_rate):
                continue
            print(detail, file=sys.stderr, flush=True)
        self._unprinted.clear()

    def check(self, scores: Scores) -> None:
        """Raise :class:`RewardFailure` for the first function whose failed calls in
        ``scores`` reach ``reward.max_error_rate`` (module docstring). Reward models are not
        checked: a failed call of one costs its batch's scores, never the run (issue 35)."""
        for name, failed in scores.errors.items():
            if name in self.models:
                continue
            check_failures(f"reward function {name!r}", failed, len(scores.rewards),
                           self.first_failures.get(name), self.config.max_error_rate)

    def score_sync(self, samples: Sequence[Sample]) -> Scores:
        """:meth:`score` from synchronous code (no event loop running in this thread)."""
        return asyncio.run(self.score(samples))

    async def _call(self, name: str, sample: Sample) -> tuple[float, bool]:
        fn, _, accepted = self.functions[name]
        offered = {  # the row's columns, then the rubric's arguments (they win a clash)
            **sample.row.metadata,
            "completion": sample.completion, "prompt": sample.row.prompt,
            "answer": sample.row.answer, "row": sample.row, "finished": sample.finished,
            "completion_ids": list(sample.completion_ids),
        }
        kwargs = offered if accepted is None else {k: offered[k] for k in accepted
                                                   if k in offered}
        timeout = self.config.timeout_s
        try:
            if self._processes is not None:  # bounded by the worker's thread
                value = await self._processes.call(name, kwargs)
            elif inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(**kwargs), timeout)
            else:
                value = await self._threads.call(fn, kwargs, timeout)
                if inspect.isawaitable(value):  # a sync function that returned a coroutine
                    value = await asyncio.wait_for(value, timeout)
            return as_reward(value), False
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (a user's function: any error costs the sample)
            if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
                e = RewardTimeout(f"took longer than reward.timeout_s={timeout}" + (
                    "; its worker process was killed and replaced" if self._processes else ""))
            self._failed(name, 1, "reward function", "its sample scores", e)
            return float(self.config.on_error), True

    async def _score_model(self, name: str, samples: Sequence[Sample]
                           ) -> tuple[list[float], int]:
        """Reward model ``name``'s scores of ``samples`` (one call) and its failed count: a
        call that raises costs every sample (``reward.on_error``), a None or non-finite
        score its own sample."""
        on_error = float(self.config.on_error)
        if not samples:
            return [], 0
        try:
            scorer = self._scorers.get(name)
            if scorer is None:
                raise RuntimeError(f"reward model {name!r} is not running (no scorer attached: "
                                   "Rubric.attach_model)")
            values = list(await scorer([s.row.prompt for s in samples],
                                       [s.completion for s in samples]))
            if len(values) != len(samples):
                raise ValueError(f"reward model {name!r} returned {len(values)} scores for "
                                 f"{len(samples)} completions")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (the role's failure costs the step's scores)
            self._failed(name, len(samples), "reward model", "this batch's samples score", e)
            return [on_error] * len(samples), len(samples)
        scores, failed = [], 0
        for value in values:
            try:
                if value is None:
                    raise ValueError("no score: the conversation is longer than the reward "
                                     "model's seq_len (reward.functions[i].seq_len), or empty")
                scores.append(as_reward(value))
            except (TypeError, ValueError) as e:
                self._failed(name, 1, "reward model", "its sample scores", e)
                scores.append(on_error)
                failed += 1
        return scores, failed

    def _failed(self, name: str, count: int, kind: str, cost: str, error: Exception) -> None:
        """Count ``count`` failed samples of ``name``; keep the first failure's traceback
        (printed after the batch, :meth:`_print_first_failures`)."""
        self.error_counts[name] += count
        if name in self._reported:
            return
        self._reported.add(name)
        detail = "".join(traceback.format_exception(error)).rstrip()
        self.first_failures[name] = detail
        self._unprinted[name] = (
            f"{kind} {name!r} failed; {cost} reward.on_error={self.config.on_error}, and "
            f"later failures are only counted (reward/errors/{name}):\n{detail}")


def columns(task: Task) -> set[str] | None:
    """The columns of ``task``'s rows as a reward function receives them (its first training
    row's keys, :class:`~forge_ext.tasks.base.Row`), or None if it has no rows to look at."""
    try:
        rows = task.train_rows()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return set(rows[0]) if rows else None


def _by_reference(fn: RewardFn, field: str) -> bytes:
    """``fn`` pickled for a worker process: a module-level function as its module and name,
    a callable object as its class and state (module docstring).

    Raises:
        ValueError: it cannot be (a lambda, a closure, a function of ``__main__``, which a
            worker does not import), naming ``field`` and the two fixes.
    """
    try:
        if getattr(fn, "__module__", None) == "__main__":
            raise pickle.PicklingError("it is defined in __main__, which a worker does not "
                                       "import")
        return pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001  (pickle raises several types)
        raise ValueError(
            f"{field} ({fn!r:.80}) cannot be sent to a reward worker process ({e}); define "
            "it at module level of an importable module (a 'package.module:function', or "
            "a task's rewards() returning such functions or picklable callable objects), or "
            "set reward.isolation=thread (then a call holding the GIL stops the run)"
        ) from None


def _accepted_kwargs(fn: RewardFn, field: str, task: Task) -> set[str] | None:
    """The keyword arguments to pass ``fn``: all of :data:`REWARD_KWARGS` and the row's
    columns (None) if it takes ``**kwargs`` or has no inspectable signature, else those it
    names (a named column a row lacks is not passed: its default applies, or the call fails
    and is counted).

    The task's columns (:func:`columns`) are read only for a function requiring names
    outside :data:`REWARD_KWARGS`.

    Raises:
        ValueError: ``fn`` requires an argument that is neither in :data:`REWARD_KWARGS` nor
            one of the task's columns.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    required = [
        p.name for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    unknown = [n for n in required if n not in REWARD_KWARGS]
    known = columns(task) if unknown else None
    if known is not None and not set(unknown) <= known:
        raise ValueError(
            f"{field}: the reward function requires {unknown}, but reward functions are called "
            f"with keyword arguments from {list(REWARD_KWARGS)} and the row's columns "
            f"{sorted(known)}"
        )
    return {p.name for p in params
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)}
