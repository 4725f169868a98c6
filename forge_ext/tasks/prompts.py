"""How a task row becomes the prompt ids the generator receives and the trainer trains on.

A row's prompt is text or chat messages (:class:`~forge_ext.tasks.base.Row`). Text is first
formatted with ``prompt.template`` (``{prompt}`` is the row's text, and every metadata field
may be named, e.g. ``"What is {a}+{b}?"`` for the addition task). Then:

- with a chat template (``prompt.chat_template: true``, or unset and the checkpoint's
  tokenizer has one), the messages (a text prompt is one user message) go through
  ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``;
- without one, the text is encoded as it is (with the tokenizer's special tokens, e.g.
  ``<bos>``); chat messages are refused, since there is no faithful way to render them.

The ids are made once, here, and travel as ids: the generator gets them as a token prompt and
the trainer trains on the same list (no decode and re-encode between the two).

An environment's reply in a multi-turn episode (:meth:`PromptRenderer.continuation`) is
appended to the episode's ids as the chat template renders that message after an assistant
turn: the template's tokens after the assistant's end token, the message, and the opening of
the next assistant turn, taken as the difference of two renderings of a fixed conversation
(``[user, assistant]`` and ``[user, assistant, reply]``). The model's own tokens are never
re-rendered. A template whose rendering of the longer conversation does not start with that of
the shorter one (one that rewrites earlier turns, e.g. drops an earlier ``<think>`` block) is
refused by :meth:`PromptRenderer.check_continuation`: it could not reproduce the episode the
model saw. Without a chat template a reply is its text's ids (no special tokens).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

from forge_ext.tasks.base import Row, format_prompt
from forge_ext.tasks.tokenizer import CheckpointTokenizer


@dataclass(kw_only=True, slots=True)
class PromptConfig:
    """YAML ``prompt:`` section."""

    template: str = "{prompt}"
    """Format string of a text prompt (or of a chat prompt's last user message): ``{prompt}``
    is the row's prompt text, other names are the row's metadata fields."""
    chat_template: bool | None = None
    """Render prompts with the checkpoint tokenizer's chat template (``null``: when it has
    one). ``true`` with a tokenizer without one is a config error."""
    chat_template_kwargs: dict[str, Any] = field(
        default_factory=lambda: {"enable_thinking": False}
    )
    """Extra arguments of ``apply_chat_template`` (Qwen3's ``enable_thinking``; templates
    ignore names they do not use)."""


class PromptRenderer:
    """Rows to prompt ids for one tokenizer and ``prompt:`` section (module docstring).

    Raises (on construction):
        ValueError: ``prompt.chat_template: true`` but the tokenizer has no chat template.
    """

    def __init__(self, tok: CheckpointTokenizer, config: PromptConfig) -> None:
        if config.chat_template and not tok.has_chat_template:
            raise ValueError(
                "prompt.chat_template=true but model.hf_path's tokenizer has no chat_template; "
                "set prompt.chat_template=false or use a chat checkpoint"
            )
        self.tok = tok
        self.config = config
        # id(row) -> (weak reference to the row, its ids). Weak: a multi-turn episode renders a
        # row of its own, and keeping every such row would grow the controller by a group
        # of rows per prompt per step for the whole run (issue 32); an entry goes with its row.
        self._made: dict[int, tuple[weakref.ref, list[int]]] = {}
        self.chat = tok.has_chat_template if config.chat_template is None else config.chat_template

    def messages(self, row: Row) -> list[dict[str, str]] | str:
        """:func:`format_prompt` of ``row`` with this renderer's template."""
        return format_prompt(row, self.config.template)

    def __call__(self, row: Row) -> list[int]:
        """The prompt ids of ``row`` (module docstring), made once per row object.

        Raises:
            ValueError: chat messages without a chat template, or a template error.
        """
        key = id(row)
        made = self._made.get(key)
        if made is None or made[0]() is not row:
            made = self._made[key] = (weakref.ref(row, functools.partial(self._forget, key)),
                                      self._encode(row))
        return made[1]

    def _forget(self, key: int, ref: weakref.ref) -> None:
        """The row behind ``ref`` is gone: drop its entry (unless a new row took its id)."""
        made = self._made.get(key)
        if made is not None and made[0] is ref:
            del self._made[key]

    def cached_rows(self) -> int:
        """How many rows' ids are cached (every one of them a row still alive)."""
        return len(self._made)

    def continuation(self, reply: str | dict[str, str] | list[dict[str, str]]) -> list[int]:
        """The ids that follow a model turn's end token when the environment answers
        ``reply`` (text: a user message; or messages with their roles), up to the next
        assistant turn's opening (module docstring).

        Raises:
            ValueError: the chat template is not prefix-preserving.
        """
        messages = [reply] if isinstance(reply, dict) else reply
        if not self.chat:
            text = messages if isinstance(messages, str) else "".join(
                m["content"] for m in messages)
            return self.tok.tokenizer(text, add_special_tokens=False)["input_ids"]
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        before, after = self._render_pair(messages)
        return after[len(before):]

    def _render_pair(self, reply: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """``(rest of [user, assistant] after the assistant's end token, ... of [user,
        assistant, *reply] with the next assistant opening)``, checked to be prefix-preserving."""
        turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
        kwargs = self.config.chat_template_kwargs
        short = self.tok.encode_messages_plain(turns, kwargs)
        long = self.tok.encode_messages(turns + reply, kwargs)
        if long[: len(short)] != short:
            raise ValueError(
                "the chat template of model.hf_path is not prefix-preserving: rendering "
                "[user, assistant, reply] does not start with the rendering of [user, "
                "assistant] (it rewrites earlier turns, e.g. drops a <think> block), so "
                "multi-turn episodes (task.environment) cannot be kept token-in/token-out; use a "
                "template that keeps earlier turns as they were"
            )
        # Where the model's turn ends: after the last stop id of the short rendering.
        ends = [i for i, t in enumerate(short) if t in self.tok.stop_ids]
        if not ends:
            raise ValueError("the chat template's assistant turn ends with none of the "
                             f"tokenizer's stop ids {list(self.tok.stop_ids)}")
        return short[: ends[-1] + 1], long

    def check_continuation(self) -> None:
        """Raise ``ValueError`` now if environment replies cannot be rendered
        (:meth:`continuation`); a no-op without a chat template."""
        if self.chat:
            self.continuation("ok")

    def _encode(self, row: Row) -> list[int]:
        prompt = self.messages(row)
        if not self.chat:
            if not isinstance(prompt, str):
                raise ValueError(
                    "the task's rows are chat messages (a list prompt, or task.system_prompt) "
                    "but the tokenizer of model.hf_path has no chat_template (or "
                    "prompt.chat_template=false); give text prompts or use a chat tokenizer"
                )
            return self.tok.encode_prompt(prompt)
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        return self.tok.encode_messages(prompt, self.config.chat_template_kwargs)


def render_splits(render: PromptRenderer, splits: dict[str, list[Row]],
                  tokenizer_field: str = "model.hf_path"
                  ) -> tuple[dict[str, list[list[int]]], str | None]:
    """Every row's prompt ids, per split (``{"training": rows, "held-out": rows}``), and a
    warning if any holds the tokenizer's unknown token (None if none does): what an app
    checks before it trains, so that a row that does not render is a config error then,
    not a traceback after training. ``tokenizer_field``: the field that names the
    checkpoint whose tokenizer it is (for the warning).

    Raises:
        ValueError: naming the split and row (``held-out row 3: prompt.template=...``).
    """
    ids: dict[str, list[list[int]]] = {}
    for split, rows in splits.items():
        ids[split] = []
        for i, row in enumerate(rows):
            try:
                ids[split].append(render(row))
            except ValueError as e:
                raise ValueError(f"{split} row {i}: {e}") from None
    tok = render.tok
    unknown = [(split, i) for split, prompts in ids.items()
               for i, x in enumerate(prompts) if tok.unknown_count(x) > 0]
    total = sum(len(prompts) for prompts in ids.values())
    warning = None
    if unknown:  # e.g. the demo's character tokenizer on English prompts
        shown = "; ".join(_unknown_example(tok, split, i, splits[split][i])
                          for split, i in unknown[:UNKNOWN_SHOWN])
        warning = (f"warning: {len(unknown)} of {total} prompts hold text the tokenizer of "
                   f"{tokenizer_field} maps to {tok.tokenizer.unk_token} (characters or words "
                   f"outside its vocabulary), the first {min(len(unknown), UNKNOWN_SHOWN)}: "
                   f"{shown}")
    return ids, warning


UNKNOWN_SHOWN = 3
"""How many prompts holding the unknown token :func:`render_splits`' warning names."""


def _unknown_example(tok: CheckpointTokenizer, split: str, index: int, row: Row) -> str:
    """``training row 4: 'What is 6+7' (unknown: 'W', 'h', ...)``: the row's prompt (its
    first 60 characters) and the characters the tokenizer maps to its unknown token alone
    (none listed where only longer text does, e.g. a word-level vocabulary)."""
    prompt = row.prompt if isinstance(row.prompt, str) else " ".join(
        str(m.get("content", "")) for m in row.prompt)
    text = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    chars = [c for c in dict.fromkeys(prompt)
             if tok.unknown_count(tok.tokenizer.encode(c, add_special_tokens=False)) > 0]
    listed = ", ".join(repr(c) for c in chars[:8]) + (", ..." if len(chars) > 8 else "")
    return f"{split} row {index}: {text!r}" + (f" (unknown: {listed})" if chars else "")
