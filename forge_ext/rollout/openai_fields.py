"""What the agent endpoint does with each field of an OpenAI request: honoured as vLLM's own
OpenAI server honours it, or refused with a 400 that names the field; never ignored.

The schemas are vLLM's (``vllm.entrypoints.openai.chat_completion.protocol.
ChatCompletionRequest`` and ``...completion.protocol.CompletionRequest``); :data:`CHAT_FIELDS`
and :data:`COMPLETION_FIELDS` give every one of their fields a rule (tests/test_agents.py
checks that the tables and the schemas name the same fields, so a field a new vLLM adds
fails a test until it gets one). A field outside the schema is refused too (vLLM would log
and drop it). Three kinds of rule:

- :class:`Honoured`: the endpoint does what vLLM does with it (``stop`` cuts the completion
  where vLLM's own detokenizer does, :func:`ending`; ``continue_final_message`` reaches the chat
  template; ``logprobs`` returns each sampled token's log-prob; ...);
- :class:`Inert`: accepted with no effect, because vLLM's server gives it none on these
  routes either (``user``; ``stream_interval`` without streaming; render-only fields);
- :class:`Refused`: only values that change nothing are accepted (the field's "off" values,
  or the run's own ``generator.sampling`` value); any other gets a 400 saying why. What the
  run refuses is what would make a trained token differ from the policy's sample (another
  temperature, a penalty, a grammar, a seed of the agent's choosing), or what it does not
  compute (streaming, top-k log-probs, prompt log-probs).

docs/agents.md prints the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class RequestRefused(Exception):
    """A request the endpoint answers with an HTTP error (status, OpenAI-style message)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass(frozen=True)
class Honoured:
    how: str


@dataclass(frozen=True)
class Inert:
    why: str


@dataclass(frozen=True)
class Refused:
    allowed: tuple | Callable[[Any], bool]
    """The values accepted (they change nothing), or a predicate of the value."""
    why: str
    run: str | None = None
    """A ``generator.sampling`` field whose value the request may also repeat."""
    shown: str = ""
    """The accepted values in words (docs), for a predicate."""

    def accepts(self, value: Any, run: dict[str, Any]) -> bool:
        if callable(self.allowed):
            return self.allowed(value)
        return any(value == a for a in self.allowed) or (
            self.run is not None and value in run.get(self.run, ()))


SAMPLING = "sampling is the run's (generator.sampling): every trained token stays the policy's"
UNSET = (None,)

COMMON: dict[str, Honoured | Inert | Refused] = {
    "model": Honoured("one of /v1/models' names (404 otherwise, as vLLM); unset: the policy"),
    "n": Honoured("n completions, each recorded"),
    "max_tokens": Honoured("lowers generator.sampling.max_new_tokens (never raises it; "
                           "unset: that, where vLLM's completions take 16); a prompt plus "
                           "it over the context is refused"),
    "stop": Honoured("a string or a list: the completion ends with the token that completes "
                     "the first one (text before it), finish_reason 'stop', trained as cut"),
    "stop_token_ids": Honoured("the completion ends at that token (kept, as vLLM keeps it)"),
    "include_stop_str_in_output": Honoured("the text keeps the stop string / stop token"),
    "skip_special_tokens": Honoured("special tokens left out of the text (vLLM's default); "
                                    "the token ids keep them"),
    "return_token_ids": Honoured("token_ids and prompt_token_ids are always returned"),
    "return_tokens_as_token_ids": Honoured("log-prob tokens as 'token_id:<id>'"),
    "request_id": Honoured("the response's id"),
    "user": Inert("vLLM ignores it too"),
    "session_id": Inert("vLLM's routing hint; the session is the URL here"),
    "stream_interval": Inert("vLLM ignores it without streaming (refused here)"),
    "stream_options": Inert("vLLM refuses it without stream=true, and stream is refused"),
    "return_token_offsets": Inert("vLLM uses it only on the /render routes"),
    "mm_payload": Inert("vLLM uses it only on the /render routes"),
    "return_mm_kwargs": Inert("vLLM uses it only on the /render routes"),
    "routed_experts_prompt_start": Inert("vLLM returns no routed experts unless its server "
                                         "is started to"),
    "temperature": Refused(UNSET, SAMPLING, run="temperature"),
    "top_p": Refused(UNSET, SAMPLING, run="top_p"),
    "top_k": Refused((None, 0, -1), SAMPLING),
    "min_p": Refused((None, 0.0), SAMPLING),
    "presence_penalty": Refused((None, 0.0), SAMPLING),
    "frequency_penalty": Refused((None, 0.0), SAMPLING),
    "repetition_penalty": Refused((None, 1.0), SAMPLING),
    "logit_bias": Refused((None, {}), SAMPLING),
    "allowed_token_ids": Refused((None, []), SAMPLING),
    "bad_words": Refused((None, []), SAMPLING),
    "min_tokens": Refused((0,), SAMPLING),
    "ignore_eos": Refused((False,), SAMPLING),
    "thinking_token_budget": Refused((None, -1), SAMPLING),
    "structured_outputs": Refused(UNSET, SAMPLING + " (a grammar changes it)"),
    "response_format": Refused(lambda v: v is None or getattr(v, "type", v) == "text",
                               SAMPLING + " (a grammar changes it)",
                               shown='null, {"type": "text"}'),
    "watermarking": Refused((None, False), SAMPLING),
    "use_beam_search": Refused((False,), SAMPLING + " (beam search is not sampling)"),
    "length_penalty": Refused((1.0,), "it only weighs beam search, which is refused"),
    "seed": Refused(UNSET, "each call is seeded from the run's seed, the step, the episode "
                    "and the call's index, so that a resumed run samples the same tokens"),
    "repetition_detection": Refused(UNSET, "the completion is not cut by repetition here"),
    "stream": Refused((None, False), "the endpoint answers whole responses only"),
    "prompt_logprobs": Refused(UNSET, "prompt log-probs are not computed"),
    "logprob_token_ids": Refused((None, []), "only the sampled token's log-prob is computed"),
    "spaces_between_special_tokens": Refused((True,), "the text is decoded with vLLM's "
                                             "default only"),
    "truncate_prompt_tokens": Refused(UNSET, "the prompt is never cut (the trainer would "
                                      "train on one the agent did not write); shorten it"),
    "truncation_side": Refused(UNSET, "the prompt is never cut (truncate_prompt_tokens)"),
    "priority": Refused((0,), "the generator does not schedule by priority"),
    "cache_salt": Refused(UNSET, "the prefix cache is the run's, unsalted"),
    "kv_transfer_params": Refused(UNSET, "no disaggregated serving here"),
    "ec_transfer_params": Refused(UNSET, "no disaggregated serving here"),
    "vllm_xargs": Refused(UNSET, "no vLLM extensions read request arguments here"),
}

CHAT_FIELDS: dict[str, Honoured | Inert | Refused] = {
    **COMMON,
    "messages": Honoured("rendered by the checkpoint's chat template (text parts only: "
                         "other content parts are refused)"),
    "max_completion_tokens": Honoured("as max_tokens (it wins over max_tokens)"),
    "logprobs": Honoured("each sampled token's log-prob, as recorded for training"),
    "top_logprobs": Refused((None, 0), "only the sampled token's log-prob is computed"),
    "tools": Honoured("passed to the chat template; the reply's tool calls parsed by "
                      "task.agent_tool_parser"),
    "tool_choice": Refused((None, "none", "auto"), "'required' and named tools need a "
                           "grammar, which would change the sampling"),
    "parallel_tool_calls": Honoured("false keeps the first tool call only"),
    "reasoning_effort": Honoured("passed to the chat template, and enable_thinking unless "
                                 "chat_template_kwargs sets it (as vLLM)"),
    "include_reasoning": Refused((True,), "no reasoning parser: the reasoning stays in "
                                 "content"),
    "add_generation_prompt": Honoured("passed to the chat template"),
    "continue_final_message": Honoured("the final (assistant) message is continued, not "
                                       "closed; not with add_generation_prompt"),
    "add_special_tokens": Refused((False,), "the chat template places the special tokens"),
    "documents": Honoured("passed to the chat template"),
    "chat_template": Refused(UNSET, "the checkpoint's template renders every call (vLLM "
                             "refuses it too unless started with "
                             "--trust-request-chat-template)"),
    "chat_template_kwargs": Honoured("passed to the chat template, over "
                                     "prompt.chat_template_kwargs"),
    "media_io_kwargs": Refused(UNSET, "text models only"),
    "mm_processor_kwargs": Refused(UNSET, "text models only"),
    "return_prompt_text": Honoured("prompt_text: the rendered prompt"),
    "echo": Honoured("the final message's content is prepended when the reply continues its "
                     "role (vLLM's server adds the prompt's log-probs too: not computed "
                     "here, prompt_logprobs is left out)"),
}

COMPLETION_FIELDS: dict[str, Honoured | Inert | Refused] = {
    **COMMON,
    "prompt": Honoured("a string, token ids, or a list of either: n completions each"),
    "logprobs": Refused((None, 0), "only the sampled token's log-prob is computed "
                        "(logprobs=0 returns it)"),
    "add_special_tokens": Honoured("a text prompt is encoded with (default) or without the "
                                   "tokenizer's special tokens"),
    "echo": Honoured("the prompt's text is prepended (not with logprobs: the prompt's "
                     "log-probs are not computed, a 400)"),
    "suffix": Refused(UNSET, "no fill-in-the-middle (vLLM refuses it too)"),
    "prompt_embeds": Refused(UNSET, "prompts are tokens"),
}


def refused(table: dict[str, Honoured | Inert | Refused]) -> set[str]:
    """The fields of ``table`` refused for some values."""
    return {name for name, rule in table.items() if isinstance(rule, Refused)}


def _rule_text(rule: Honoured | Inert | Refused) -> tuple[str, str]:
    """``(kind, what happens)`` of a rule, as docs/agents.md prints it."""
    import json

    if isinstance(rule, Honoured):
        return "honoured", rule.how
    if isinstance(rule, Inert):
        return "accepted, no effect", rule.why
    allowed = rule.shown or ", ".join(json.dumps(v) for v in rule.allowed)
    allowed += f", or generator.sampling.{rule.run}" if rule.run else ""
    return "refused", f"unless {allowed}: {rule.why}"


def fields_markdown() -> str:
    """The table of every field and its rule (docs/agents.md holds it; tests/test_agents.py
    checks that it is current)."""
    rows = []
    for name in dict.fromkeys([*CHAT_FIELDS, *COMPLETION_FIELDS]):
        chat, text = CHAT_FIELDS.get(name), COMPLETION_FIELDS.get(name)
        if chat == text:
            rows.append((name, "both", *_rule_text(chat)))
            continue
        for route, rule in (("chat", chat), ("completions", text)):
            if rule is not None:
                rows.append((name, route, *_rule_text(rule)))
    order = {"honoured": 0, "accepted, no effect": 1, "refused": 2}
    rows.sort(key=lambda row: order[row[2]])
    lines = ["| field | route | | what the endpoint does |", "| --- | --- | --- | --- |"]
    lines += [f"| `{n}` | {route} | {kind} | {how} |" for n, route, kind, how in rows]
    return "\n".join(lines) + "\n"


def check_fields(request: Any, table: dict[str, Honoured | Inert | Refused],
                 run: dict[str, Sequence[Any]]) -> None:
    """Refuse ``request`` (a parsed vLLM request) if it sets a field outside its schema, or a
    :class:`Refused` field to a value it does not accept.

    Args:
        run: ``{generator.sampling field: the values it means here}``.

    Raises:
        RequestRefused: 400, naming the field, its value and why.
    """
    extra = sorted(request.model_extra or {})
    if extra:
        raise RequestRefused(400, f"unknown field(s) {extra}: not part of the request schema "
                             "(docs/agents.md lists what this endpoint honours)")
    for name, rule in table.items():
        if isinstance(rule, Refused):
            value = getattr(request, name, None)
            if not rule.accepts(value, run):
                told = f" (the run's: {list(run[rule.run])[0]})" if rule.run in run else ""
                raise RequestRefused(400, f"{name}={value!r} is not supported here: "
                                     f"{rule.why}{told}; leave {name} unset")


# ---- the end of a completion, as vLLM's detokenizer finds it -----------------------------

@dataclass(frozen=True)
class Ending:
    """Where a sampled completion ends for a request (:func:`ending`)."""

    kept: int
    """How many of the sampled tokens the completion keeps (and training records)."""
    text: str
    finish_reason: str
    """'stop' (an end token, a stop token or a stop string) or 'length'."""
    stop_reason: int | str | None = None
    """The stop string or the request's stop token that ended it (None: an end token)."""


def ending(prompt_ids: Sequence[int], ids: Sequence[int], tokenizer: Any, *,
           end_ids: Sequence[int], stop: Sequence[str], stop_token_ids: Sequence[int],
           include_stop: bool, skip_special_tokens: bool) -> Ending:
    """The completion a request gets from the sampled ``ids``: what vLLM's server returns
    for a request that sampled them, found by vLLM's own code one token at a time: its
    scheduler's ``check_stop`` rule (an end token, ``end_ids``, or one of the request's
    ``stop_token_ids`` ends it, that token kept) and its incremental detokenizer
    (``vllm/v1/engine/detokenizer.py``: the text, left without the end or stop token unless
    ``include_stop``; a stop string ends it at the token that completes it, the text cut
    before the string, or after it with ``include_stop``). Sampling with a stop and cutting
    an unstopped sample there give the same distribution: the tokens before the stop are
    sampled alike.

    Args:
        prompt_ids: the prompt (vLLM's detokenizer starts from it: a first token's leading
            space decodes as it does after the prompt).
        ids: ``[n]`` sampled ids (ending with an end token, or cut at the length limit).
        tokenizer: the transformers tokenizer.
    """
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids),
                            include_stop_str_in_output=include_stop,
                            skip_special_tokens=skip_special_tokens, max_tokens=max(len(ids), 1))
    request = SimpleNamespace(request_id="agent", prompt_token_ids=list(prompt_ids),
                              prompt_embeds=None, sampling_params=params)
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    stops, requested = set(end_ids) | set(stop_token_ids), set(stop_token_ids) - set(end_ids)
    for token in ids:
        ended = token in stops
        string = detokenizer.update([token], ended)
        if ended or string is not None:
            reason = string if string is not None else (token if token in requested else None)
            return Ending(len(detokenizer.output_token_ids),
                          detokenizer.get_next_output_text(True, False), "stop", reason)
    return Ending(len(ids), detokenizer.get_next_output_text(True, False), "length")


# ---- log-probs as vLLM's server formats them -----------------------------------------------

def _token(tokenizer: Any, token: int, as_id: bool) -> str:
    return f"token_id:{token}" if as_id else tokenizer.decode([token])


def chat_logprobs(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float],
                  as_ids: bool) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion: each sampled token's log-prob (no
    alternatives: ``top_logprobs`` is refused above 0)."""
    content = []
    for token, logprob in zip(ids, logprobs):
        text = _token(tokenizer, token, as_ids)
        content.append({"token": text, "logprob": max(logprob, -9999.0),
                        "bytes": list(text.encode("utf-8", errors="replace")),
                        "top_logprobs": []})
    return {"content": content}


def completion_logprobs(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float],
                        as_ids: bool, offset: int) -> dict[str, Any]:
    """``choices[i].logprobs`` of a text completion (``logprobs=0``): ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (the sampled token alone, as vLLM gives for 0) and
    ``text_offset`` (characters, from ``offset``: the echoed prompt's length)."""
    tokens = [_token(tokenizer, t, as_ids) for t in ids]
    values = [max(lp, -9999.0) for lp in logprobs]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": values,
            "top_logprobs": [{t: v} for t, v in zip(tokens, values)], "text_offset": offsets}


# ---- chat messages -------------------------------------------------------------------------

def plain_message(message: Any, index: int) -> dict[str, Any]:
    """A chat message as the plain dict a chat template reads (vLLM's request keeps some as
    typed objects; tool calls' arguments as JSON text, as the OpenAI API sends them).

    Raises:
        RequestRefused: a content part other than text (an image, audio, a file).
    """
    import json

    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        kinds = {part.get("type") for part in content if isinstance(part, dict)} - {"text"}
        if kinds:
            raise RequestRefused(400, f"messages[{index}].content has {sorted(kinds)} parts: "
                                 "this endpoint serves text models (text parts only)")
        message["content"] = "\n".join(  # vLLM's joining of text parts
            part.get("text", "") for part in content if isinstance(part, dict))
    calls = message.get("tool_calls")
    if calls:
        message["tool_calls"] = [dict(c) if not hasattr(c, "model_dump") else c.model_dump()
                                 for c in calls]
        for call in message["tool_calls"]:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):  # templates (Qwen's) read a mapping
                try:
                    function["arguments"] = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
    return message
