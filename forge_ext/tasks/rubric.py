"""The rubric: a task's reward functions with weights, called once per completion, with a time
bound and error accounting written once for every task.

A completion's reward is ``sum_i weight_i * score_i`` over ``reward.functions`` (as TRL's
``reward_weights`` and verifiers' ``Rubric`` do). A call that raises, runs past
``reward.timeout_s``, or returns anything but a finite real number (a string, None, NaN, inf)
scores ``reward.on_error`` for that function and sample, is counted in
``reward/errors/<name>``, and the first traceback of each function is printed once (to
stderr); the run goes on. Logged per batch: ``reward/<name>`` (the function's mean score),
``reward/errors/<name>``.

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

``accuracy`` of a batch is the fraction of completions whose ``reward.accuracy`` function
(default: the first) scored at least 1.0: exact answers, not partial credit.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import pickle
import sys
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from forge_ext.tasks.base import RewardFn, Row, Task
from forge_ext.tasks.rewards import resolve_reward
from forge_ext.tasks.workers import DaemonPool, ProcessPool, default_workers

# Keyword arguments a reward function may ask for; the first four are always offered.
REWARD_KWARGS = ("completion", "prompt", "answer", "row", "finished", "completion_ids")


@dataclass(kw_only=True, slots=True)
class RewardFunctionConfig:
    """One entry of ``reward.functions``."""

    fn: str
    """A built-in (``math_verify``, ``exact_match``), one of the task's own (the addition
    task's ``addition``, the reasoning-gym source's ``reasoning_gym``), or
    ``"package.module:function"``."""
    weight: float = 1.0
    """Its weight in the completion's reward."""
    name: str | None = None
    """Its metric name (``reward/<name>``); default: ``fn``'s name (after the ``:``)."""


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

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0")
        if not math.isfinite(self.on_error):
            raise ValueError(f"reward.on_error={self.on_error} must be a finite number")
        if self.isolation not in ("process", "thread"):
            raise ValueError(f"reward.isolation={self.isolation!r} must be 'process' or 'thread'")
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers} must be >= 1")


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


class Rubric:
    """``reward:`` resolved against a task (module docstring).

    Raises (on construction), each naming the field:
        ValueError: no functions (and the task has no default), an unknown function or one
            that needs an argument the rubric does not pass, duplicate names, weights summing
            to 0, an unknown ``reward.accuracy``; a task whose ``rewards()`` or
            ``default_rewards()`` returns the wrong type; under ``reward.isolation:
            process``, a function that cannot be sent to a worker process.

    ``max_concurrency``: worker threads for synchronous reward functions under
    ``reward.isolation: thread`` (calls beyond it queue; a call's timeout counts from when it
    starts). Under ``process`` the workers are ``reward.num_workers``.
    """

    def __init__(self, config: RewardConfig, task: Task, *, max_concurrency: int = 16) -> None:
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
        if not entries:
            raise ValueError(
                f"reward.functions is empty and the task ({task.name}) has no default reward; "
                "set e.g. reward.functions=[{fn: math_verify}] or [{fn: exact_match}], or "
                "[{fn: 'my_module:my_reward'}]"
            )
        self.config = config
        self.functions: dict[str, tuple[RewardFn, float, set[str] | None]] = {}
        sent: dict[str, bytes] = {}  # pickled for the worker processes
        for i, entry in enumerate(entries):
            where = f"reward.functions[{i}].fn"
            fn = resolve_reward(entry.fn, task_rewards, where)
            name = entry.name or entry.fn.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
            if name in self.functions:
                raise ValueError(
                    f"reward.functions[{i}]: a second function named {name!r}; give one a name"
                )
            if not math.isfinite(entry.weight):
                raise ValueError(f"reward.functions[{i}].weight={entry.weight} must be finite")
            self.functions[name] = (fn, float(entry.weight), _accepted_kwargs(fn, where))
            if config.isolation == "process":
                sent[name] = _by_reference(fn, f"{where}={entry.fn!r}")
        if sum(w for _, w, _ in self.functions.values()) == 0:
            raise ValueError(
                "reward.functions weights sum to 0: every completion would get reward 0"
            )
        self.accuracy_name = config.accuracy or next(iter(self.functions))
        if self.accuracy_name not in self.functions:
            raise ValueError(
                f"reward.accuracy={config.accuracy!r} is not one of the reward functions "
                f"{list(self.functions)}"
            )
        self.error_counts = {name: 0 for name in self.functions}
        """Errors per function over the rubric's life."""
        self._reported: set[str] = set()
        # Futures are made per call in the running loop, so score_sync (a new loop each
        # time) and an app's loop can share the rubric.
        self._threads: DaemonPool | None = None
        self._processes: ProcessPool | None = None
        if config.isolation == "process":
            self._processes = ProcessPool(sent, config.num_workers or default_workers(),
                                          config.timeout_s)
            weakref.finalize(self, self._processes.close)
        else:
            self._threads = DaemonPool(max_concurrency)

    @property
    def names(self) -> list[str]:
        return list(self.functions)

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
        """Score every sample with every function, concurrently (module docstring)."""
        names = list(self.functions)
        results = await asyncio.gather(*(
            self._call(name, sample) for sample in samples for name in names
        ))
        by_function = {name: [] for name in names}
        errors = {name: 0 for name in names}
        for k, (value, failed) in enumerate(results):
            name = names[k % len(names)]
            by_function[name].append(value)
            errors[name] += failed
        rewards = [
            sum(self.functions[n][1] * by_function[n][i] for n in names)
            for i in range(len(samples))
        ]
        correct = [v >= 1.0 for v in by_function[self.accuracy_name]]
        return Scores(rewards=rewards, by_function=by_function, errors=errors, correct=correct)

    def score_sync(self, samples: Sequence[Sample]) -> Scores:
        """:meth:`score` from synchronous code (no event loop running in this thread)."""
        return asyncio.run(self.score(samples))

    async def _call(self, name: str, sample: Sample) -> tuple[float, bool]:
        fn, _, accepted = self.functions[name]
        offered = {
            "completion": sample.completion, "prompt": sample.row.prompt,
            "answer": sample.row.answer, "row": sample.row, "finished": sample.finished,
            "completion_ids": list(sample.completion_ids),
        }
        kwargs = offered if accepted is None else {k: offered[k] for k in accepted}
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
            self.error_counts[name] += 1
            if name not in self._reported:
                self._reported.add(name)
                detail = "".join(traceback.format_exception(e)).rstrip()
                print(
                    f"reward function {name!r} failed; its sample scores reward.on_error="
                    f"{self.config.on_error}, and later failures are only counted "
                    f"(reward/errors/{name}):\n{detail}",
                    file=sys.stderr, flush=True,
                )
            return float(self.config.on_error), True


def as_reward(value: Any) -> float:
    """``value`` as a finite float (what a reward function must return).

    Raises:
        TypeError: not a real number (a string, None, a list, a tensor of several values).
        ValueError: NaN or infinite.
    """
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"a reward must be a number, got {type(value).__name__} {value!r:.80}")
    if not isinstance(value, numbers.Real):  # a one-element tensor or numpy array
        item = getattr(value, "item", None)
        try:
            scalar = item() if callable(item) else None
        except (ValueError, RuntimeError):  # more than one element
            scalar = None
        if not isinstance(scalar, numbers.Real):
            raise TypeError(f"a reward must be a number, got {type(value).__name__} {value!r:.80}")
        value = scalar
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"a reward must be finite, got {value}")
    return value


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


def _accepted_kwargs(fn: RewardFn, field: str) -> set[str] | None:
    """The keyword arguments to pass ``fn``: all of :data:`REWARD_KWARGS` (None) if it takes
    ``**kwargs`` or has no inspectable signature, else those it names.

    Raises:
        ValueError: ``fn`` requires an argument the rubric does not pass.
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
    if unknown:
        raise ValueError(
            f"{field}: the reward function requires {unknown}, but reward functions are called "
            f"with keyword arguments from {list(REWARD_KWARGS)}"
        )
    return {p.name for p in params if p.name in REWARD_KWARGS}
