"""Environments of multi-turn episodes: what answers the model between its turns.

An environment is a class with two methods, one instance per episode (as TRL's
``environment_factory``, OpenEnv's ``reset``/``step`` and torchtitan's ``MessageEnv``), async
or not (a sync one runs on a daemon worker thread, so a hung call costs only its episode)::

    async def reset(self, row: Row) -> str | list[Message]   # the first prompt
    async def step(self, completion: str) -> tuple[str | Message | None, float, bool]
        # (the reply to show the model, or None; this turn's reward; whether the episode is done)

``completion`` is the model's turn decoded up to its end token. ``task.environment`` picks one:
a built-in name (:data:`ENVIRONMENTS`) or ``"package.module:Class"`` (called with
``task.environment_options`` as keyword arguments). An episode's reward is the rubric's score of
its last model turn plus the sum of the environment's rewards.

Built-ins:

- ``feedback``: the row's prompt; a turn whose answer (stripped; the text inside
  ``<answer>...</answer>`` if tagged) equals the row's answer ends the episode, a wrong one gets
  ``feedback`` (default ``"wrong, try again"``) and another try, up to ``task.max_turns``.
- ``calculator``: a tool. A turn containing ``<calc>EXPR</calc>`` (``+ - * / ( )``, numbers) is
  answered with ``<result>VALUE</result>`` (or ``<result>error</result>``) and the model goes
  on; a turn without a call is the final answer and ends the episode.
- ``openenv``: an OpenEnv ``Environment`` in this process (:class:`OpenEnvAdapter`).
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from typing import Any

from forge_ext.tasks.base import Message, Row
from forge_ext.tasks.rewards import extract_answer, load_object


@dataclass(kw_only=True, slots=True)
class EpisodeConfig:
    """The multi-turn fields of ``task:`` (they apply to every source)."""

    environment: str | None = None
    """``feedback``, ``calculator``, or ``"package.module:Class"``; None: one turn, no
    environment."""
    environment_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = 4
    """Model turns per episode at most; an episode still running then ends (truncated)."""
    max_episode_tokens: int = 256
    """Tokens after the first prompt (the model's and the environment's) at most; an episode
    that reaches it ends there (truncated; its last turn cut to fit)."""
    env_timeout_s: float = 30.0
    """Longest one ``reset`` or ``step`` call may take (seconds); a slower one ends its episode
    with ``reward.on_error``, counted."""
    agent: str | None = None
    """``"package.module:run"``: an ``async def run(client, row)`` that gets an
    ``openai.AsyncOpenAI`` bound to its episode and returns a reward, a final answer (scored
    by the rubric) or None (its last completion is scored); or ``external``: episodes wait
    for a process outside the run (docs/agents.md). None: no agent. A call that does not
    extend an earlier one trains as a row of its own, so a step's rows vary: the roles that
    train on them without ``training.max_tokens_per_microbatch`` get ``training.seq_len`` x
    the rows of their fixed microbatch as their token budget."""
    agent_timeout_s: float = 300.0
    """Longest an agent's episode may take (seconds, from its start; an external one's from
    when it was queued); a slower one costs its episode (``reward.on_error``), counted."""
    agent_tool_parser: str | None = "auto"
    """vLLM's tool parser for the model's tool-call format (``hermes``, ``llama3_json``,
    ...); ``auto``: ``hermes`` for Qwen2/Qwen3, ``llama3_json`` for Llama; None: none."""
    agent_max_tokens: int | None = None
    """The longest prompt + completion an agent's call may ask for (default: the trainer's
    ``seq_len``, or vLLM's ``max_model_len`` if smaller); a longer one is refused (400)."""
    agent_port: int = 0
    """The endpoint's port on 127.0.0.1 (0: a free one)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"task.max_turns={self.max_turns} must be >= 1")
        if self.max_episode_tokens < 1:
            raise ValueError(f"task.max_episode_tokens={self.max_episode_tokens} must be >= 1")
        if not self.env_timeout_s > 0:
            raise ValueError(f"task.env_timeout_s={self.env_timeout_s} must be > 0")
        if self.environment is not None:
            environment_class(self.environment)  # raises on an unknown name or import path
        if self.agent is not None:
            if self.environment is not None:
                raise ValueError(
                    f"task.agent={self.agent!r} and task.environment={self.environment!r}: an "
                    "agent drives its own episode (its tools are its own code); set one")
            if not self.agent_timeout_s > 0:
                raise ValueError(f"task.agent_timeout_s={self.agent_timeout_s} must be > 0")
            if self.agent_max_tokens is not None and self.agent_max_tokens < 2:
                raise ValueError(f"task.agent_max_tokens={self.agent_max_tokens} must be >= 2")
            if not 0 <= self.agent_port < 65536:
                raise ValueError(f"task.agent_port={self.agent_port} must be a port (0: any)")
            self.agent_function()  # raises on a bad import path

    @property
    def rows_vary(self) -> bool:
        """Whether an episode may train as more than one row, so that a step's rows are not
        its episodes: an agent's calls that do not extend one another are rows of their
        own (:func:`forge_ext.rollout.agents.merge_calls`). An environment's turns extend
        one row."""
        return self.agent is not None

    def agent_function(self):
        """The agent's ``run`` (None for ``external``).

        Raises:
            ValueError: ``task.agent`` does not name an async function.
        """
        import inspect

        from forge_ext.tasks.rewards import load_object

        if self.agent is None or self.agent == "external":
            return None
        if ":" not in self.agent:
            raise ValueError(f"task.agent={self.agent!r}: use a 'package.module:function' "
                             "import path, or 'external'")
        fn = load_object(self.agent, "task.agent")
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(f"task.agent={self.agent!r} must name an `async def run(client, "
                             "row)` (it awaits the model through the client)")
        return fn

    def make(self):
        """A new environment instance (one per episode), or None without an environment."""
        if self.environment is None:
            return None
        cls = environment_class(self.environment)
        try:
            return cls(**self.environment_options)
        except TypeError as e:
            raise ValueError(f"task.environment={self.environment!r} refused "
                             f"task.environment_options={self.environment_options}: {e}") from None


EPISODE_FIELDS = tuple(EpisodeConfig.__dataclass_fields__)
"""The ``task:`` keys that configure episodes rather than the source."""


class FeedbackEnv:
    """``feedback`` (module docstring)."""

    def __init__(self, feedback: str = "wrong, try again") -> None:
        self.feedback = feedback
        self.row: Row | None = None

    async def reset(self, row: Row) -> str | list[Message]:
        self.row = row
        return row.prompt

    async def step(self, completion: str) -> tuple[str | None, float, bool]:
        if extract_answer(completion) == self.row.answer.strip():
            return None, 0.0, True
        return self.feedback, 0.0, False


_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression of numbers, ``+ - * /`` and parentheses.

    Raises:
        ValueError: anything else (names, calls, powers), a syntax error, division by zero,
            or an expression longer than 200 characters.
    """
    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")

    return value(tree.body)


class CalculatorEnv:
    """``calculator`` (module docstring)."""

    async def reset(self, row: Row) -> str | list[Message]:
        return row.prompt

    async def step(self, completion: str) -> tuple[str | None, float, bool]:
        calls = _CALL.findall(completion)
        if not calls:
            return None, 0.0, True  # the final answer
        try:
            result = calculate(calls[-1])
            if isinstance(result, float) and result.is_integer():
                result = int(result)
            text = str(result)
        except (ValueError, ArithmeticError):
            text = "error"
        return f"<result>{text}</result>", 0.0, False


class OpenEnvAdapter:
    """``openenv``: an OpenEnv (``openenv-core``) ``Environment`` run in this process through
    the same interface. Options (``task.environment_options``):

    - ``env``: ``"package.module:Class"`` of an ``openenv.core.env_server.interfaces.
      Environment`` subclass, built with ``env_options``;
    - ``action``: ``"package.module:Class"`` of its ``Action`` type; the model's completion
      goes into its field ``action_field`` (default ``"message"``);
    - ``observation_field``: the ``Observation`` field shown to the model (default
      ``"message"``); the first prompt is the row's prompt when ``reset``'s is empty.

    ``reset_async()`` starts an episode and ``step_async(action)`` plays a turn; the
    observation's ``reward`` (None: 0) and ``done`` are the turn's.

    Raises (on construction):
        ValueError: ``env`` or ``action`` does not import.
    """

    def __init__(self, env: str, action: str, env_options: dict | None = None,
                 action_field: str = "message", observation_field: str = "message") -> None:
        env_cls = load_object(env, "task.environment_options.env")
        self.action_cls = load_object(action, "task.environment_options.action")
        self.env = env_cls(**(env_options or {}))
        self.action_field, self.observation_field = action_field, observation_field

    def _text(self, observation: Any) -> str:
        return str(getattr(observation, self.observation_field, "") or "")

    async def reset(self, row: Row) -> str | list[Message]:
        first = self._text(await self.env.reset_async())
        return first or row.prompt

    async def step(self, completion: str) -> tuple[str | None, float, bool]:
        observation = await self.env.step_async(
            self.action_cls(**{self.action_field: completion}))
        reward = float(observation.reward or 0.0)
        if observation.done:
            return None, reward, True
        return self._text(observation), reward, False


ENVIRONMENTS: dict[str, type] = {
    "feedback": FeedbackEnv, "calculator": CalculatorEnv, "openenv": OpenEnvAdapter,
}


def environment_class(name: str) -> Any:
    """The environment class ``task.environment`` names.

    Raises:
        ValueError: an unknown name, or an import path that does not import or names an
            object without async ``reset`` and ``step``.
    """
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" not in name:
        raise ValueError(f"task.environment={name!r} is not an environment: use one of "
                         f"{sorted(ENVIRONMENTS)} or a 'package.module:Class' import path")
    cls = load_object(name, "task.environment")
    if not (callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ValueError(f"task.environment={name!r} has no reset() and step() methods")
    return cls
