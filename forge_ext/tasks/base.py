"""What a task is: rows (a prompt, a reference answer, free metadata) in a training stream and a
held-out split, plus the reward functions it brings.

Every source of :mod:`forge_ext.tasks` (the embedded addition task, local dataset files,
reasoning-gym's generators, a user's own ``"package.module:factory"``) returns a :class:`Task`;
the apps read prompts only through :meth:`Task.train_rows` / :meth:`Task.eval_rows` and score
completions only through a :class:`~forge_ext.tasks.rubric.Rubric`, so no app knows which
source it trains on. :func:`format_prompt` fills ``prompt.template`` with a row (the renderer
of :mod:`forge_ext.tasks.prompts` and the SFT app's alphabet both start from it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""


# weakref_slot: caches keyed by a row (PromptRenderer) let it go when nothing else holds it.
@dataclass(frozen=True, slots=True, weakref_slot=True)
class Row(Mapping):
    """One prompt of a task with its reference answer, and a read-only mapping over its
    columns: ``row["gold"]`` is ``row.metadata["gold"]`` (a dataset row's column, a
    reasoning-gym entry's field), and ``row["prompt"]`` / ``row["answer"]`` are
    :attr:`prompt` / :attr:`answer` where the metadata has no such key. ``row.get``,
    ``"gold" in row``, ``dict(row)`` work as on a dict.

    Raises ``ValueError`` on construction if ``prompt`` is neither a non-empty string nor a
    non-empty list of ``{role, content}`` messages with string values, or ``answer`` is not a
    string.
    """

    prompt: str | list[Message]
    """The prompt as text, or as chat messages (rendered with the tokenizer's chat template)."""
    answer: str
    """The reference answer: what the SFT app trains the response to be, and what reward
    functions receive as ``answer``."""
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free metadata: the source's whole record (a dataset row's columns, a reasoning-gym
    entry, the addition operands). Reward functions receive the row as ``row``; the prompt
    template may name these fields."""

    def __post_init__(self) -> None:
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise ValueError("a task row's prompt is empty")
        elif isinstance(self.prompt, list) and self.prompt:
            for message in self.prompt:
                if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                        and isinstance(message.get("content"), str)):
                    raise ValueError(
                        f"a task row's prompt message {message!r} is not a "
                        "{role: str, content: str} mapping"
                    )
        else:
            raise ValueError(
                f"a task row's prompt must be a non-empty string or list of {{role, content}} "
                f"messages, not {type(self.prompt).__name__} {self.prompt!r:.80}"
            )
        if not isinstance(self.answer, str):
            raise ValueError(
                f"a task row's answer must be a string, not {type(self.answer).__name__} "
                f"{self.answer!r:.80}"
            )

    def __getitem__(self, key: str) -> Any:
        if key in self.metadata:
            return self.metadata[key]
        if key in _ROW_FIELDS:
            return getattr(self, key)
        raise KeyError(f"{key!r}: the row's columns are {list(self)}")

    def __iter__(self) -> Iterator[str]:
        yield from self.metadata
        yield from (k for k in _ROW_FIELDS if k not in self.metadata)

    def __len__(self) -> int:
        return len(self.metadata) + sum(k not in self.metadata for k in _ROW_FIELDS)

    @property
    def text(self) -> str:
        """The prompt's text: the prompt itself, or its messages' contents joined by blank
        lines (for character alphabets and logs; rendering uses the chat template)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n\n".join(m["content"] for m in self.prompt)


_ROW_FIELDS = ("prompt", "answer")


def format_prompt(row: Row, template: str = "{prompt}") -> list[dict[str, str]] | str:
    """The row's prompt after ``prompt.template``: text, or messages whose last user message
    is formatted.

    Raises:
        ValueError: the template names a field the row lacks.
    """
    def fill(text: str) -> str:
        if template == "{prompt}":
            return text
        try:
            return template.format(**{**row.metadata, "prompt": text})
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise ValueError(
                f"prompt.template={template!r} does not format with the row "
                f"(prompt and fields {sorted(row.metadata)}): {e!r}"
            ) from None

    if isinstance(row.prompt, str):
        return fill(row.prompt)
    messages = [dict(m) for m in row.prompt]
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if users:
        messages[users[-1]]["content"] = fill(messages[users[-1]]["content"])
    return messages


def prompt_characters(rows, template: str = "{prompt}") -> set[str]:
    """Every character of the rows' formatted prompts and answers (a character tokenizer's
    alphabet must cover what the template adds, e.g. the ``=`` of ``"{word}="``)."""
    chars: set[str] = set()
    for row in rows:
        prompt = format_prompt(row, template)
        chars.update(prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt))
        chars.update(row.answer)
    return chars


RewardFn = Callable[..., Any]
"""A reward function: called with keyword arguments ``completion`` (str: the decoded response
up to its end token), ``prompt`` (the row's prompt, str or messages), ``answer`` (str),
``row`` (:class:`Row`), and, where its signature names them, ``finished`` (bool: the response
ended with an end token) and ``completion_ids`` (list[int]). Returns a number (sync) or an
awaitable of one (async). An optional ``prepare()`` attribute runs once in each reward worker
process before its first call, outside ``reward.timeout_s`` (:mod:`forge_ext.tasks.workers`)."""


class Task:
    """A source of rows and, optionally, reward functions of its own.

    Subclasses implement :meth:`train_rows` and :meth:`eval_rows`; both must be pure functions
    of the task's config (the same rows, in the same order, in every process and every run),
    so that a resumed run continues the same prompt stream.
    """

    name: str = "task"
    """Shown in logs."""

    def train_rows(self) -> Sequence[Row]:
        """The training rows (the prompt stream reshuffles them per epoch)."""
        raise NotImplementedError

    def eval_rows(self) -> Sequence[Row]:
        """The held-out rows, disjoint from :meth:`train_rows`."""
        raise NotImplementedError

    def rewards(self) -> dict[str, RewardFn]:
        """Reward functions this task provides, by the name ``reward.functions`` uses. Under
        ``reward.isolation: process`` (the default) each must pickle by reference, to reach the
        reward worker processes: a module-level function, or an object of an importable class
        (the addition task's :class:`~forge_ext.tasks.addition.AdditionReward`); a closure
        over the task is refused."""
        return {}

    def default_rewards(self) -> list[str]:
        """Reward functions used when ``reward.functions`` is empty (weight 1 each)."""
        return []

    def characters(self) -> str:
        """The alphabet of a character-level tokenizer for this task (the SFT app's random
        init uses it): every character of every row's prompt and answer, sorted."""
        return "".join(sorted(prompt_characters([*self.train_rows(), *self.eval_rows()])))
