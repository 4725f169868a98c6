"""Agents through an OpenAI-compatible endpoint: an agent's own model calls become trained
episodes, token for token.

An *agent* is an ``async def run(client, row)`` (``task.agent: "package.module:run"``) that
receives an ``openai.AsyncOpenAI`` bound to its episode's *session* and returns a reward (a
number), a final answer for the rubric to score (a string), or None (the rubric scores its
last call's completion). It may call the model any number of times, in parallel, with its own
tools and code between calls. ``task.agent: external`` hands each episode to a process
outside the run instead (the external protocol, below).

**The endpoint** (:class:`AgentEndpoint`) serves ``/v1/chat/completions`` (messages rendered
by the checkpoint's chat template, ``tools`` passed to it and the model's tool calls parsed
back by vLLM's tool parser for the model's format), ``/v1/completions`` (a text prompt, or token
ids) and ``/v1/models``, over the generator replicas' router, on 127.0.0.1 at a free port
(``task.agent_port`` to choose one). Every route needs the run's key (``Authorization: Bearer
<key>``, made per run); an episode's session is its URL: ``<base>/sessions/<id>/v1``. Each
call of a session is sampled on the session's replica (the router keeps a session there)
with the run's sampling (``generator.sampling``, so the samples stay the policy's), cut where
the request's stops end it, and recorded as cut: prompt token ids, completion token ids, the
log-prob and policy version of each sampled token. Every field of the request is honoured as
vLLM's own server honours it, or refused with a 400 naming it
(:mod:`forge_ext.rollout.openai_fields`: an agent's own ``temperature``, a ``seed``,
``stream``, a grammar are refused). A request whose prompt plus ``max_tokens`` exceeds the
context (``task.agent_max_tokens``, by default what the trainer and vLLM hold) gets a 400
saying so; a wrong key a 401; an unknown or finished session a 404; each is counted
(``agent/rejected_calls``).

**From calls to training rows** (:func:`merge_calls`), token-exact: the trainer trains on the
ids the engine saw and sampled, never a re-tokenization. A call whose prompt extends an earlier
call's prompt plus completion token for token continues that call's row: the tokens between
(tool results, the next user turn) are appended with loss mask 0, the new completion with
mask 1. A call whose prompt does not (a chat template that re-renders history, e.g. Qwen3
dropping earlier ``<think>`` blocks; an agent that edits its messages; a text prompt rebuilt
from decoded text, where the completion's end token is gone) starts a row of its own, whose
prompt is all mask 0. Parallel calls, and a call's ``n > 1`` choices, are all kept: the first
that extends a row continues it, the others start their own. Every row of an episode gets the
episode's advantage.

**External agents** (another language, ``curl``): with ``task.agent: external``, each episode
waits in a queue until a process claims it: ``POST <base>/forge/v1/episodes/claim`` (the run's
key; ``{"wait_s": 10}`` to wait for one) answers ``{"episode_id", "base_url", "api_key",
"row": {"prompt", "answer", "metadata"}}`` (204 when none comes); the process calls the model at
``base_url``, then posts ``{"reward": 1.0}``, ``{"answer": "42"}`` or ``{"error": "..."}`` to
``<base>/forge/v1/episodes/<episode_id>/result``. An episode not finished within
``task.agent_timeout_s`` of being queued costs its episode (``reward.on_error``), counted.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import socket
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request  # at module level: the routes' annotations are resolved here

from forge_ext.rollout.engines.base import Completion, SamplingConfig
from forge_ext.rollout.openai_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    Ending,
    RequestRefused,
    chat_logprobs,
    check_fields,
    completion_logprobs,
    ending,
    plain_message,
)

LOCALHOST = "127.0.0.1"


@dataclass(slots=True)
class Call:
    """One sampled completion of a session: what the engine saw and sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool


@dataclass(slots=True)
class AgentRow:
    """A training row made of one or more calls (:func:`merge_calls`)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    """1 on sampled tokens, 0 on every other token after the prompt."""
    logprobs: list[float] = field(default_factory=list)
    """The generator's log-prob of each sampled token; 0.0 elsewhere."""
    versions: list[int] = field(default_factory=list)
    """The policy version of each sampled token, in order."""
    calls: int = 0
    finished: bool = True
    """Its last call ended with an end token."""

    def extend(self, gap: list[int], call: Call) -> None:
        self.response_ids += gap + call.completion_ids
        self.response_mask += [0] * len(gap) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(gap) + call.logprobs
        self.versions += call.versions
        self.calls += 1
        self.finished = call.finished


def merge_calls(calls: Sequence[Call]) -> list[AgentRow]:
    """A session's calls, in the order they were made, as training rows (module docstring):
    a call continues the row whose ids (prompt + response) its prompt extends token for
    token (the longest such row), else starts a row of its own."""
    rows: list[AgentRow] = []
    for call in calls:
        best, length = None, -1
        for row in rows:
            full = len(row.prompt_ids) + len(row.response_ids)
            if (full > length and len(call.prompt_ids) >= full
                    and call.prompt_ids[: len(row.prompt_ids)] == row.prompt_ids
                    and call.prompt_ids[len(row.prompt_ids) : full] == row.response_ids):
                best, length = row, full
        if best is None:
            best, length = AgentRow(prompt_ids=list(call.prompt_ids)), len(call.prompt_ids)
            rows.append(best)
        best.extend(list(call.prompt_ids[length:]), call)
    return rows


@dataclass
class AgentSession:
    """An episode's session: its row, seed, router key and recorded calls."""

    id: str
    row: Any
    seed: int | None
    route: Hashable
    greedy: bool = False
    calls: list[Call] = field(default_factory=list)
    requests: int = 0
    open: bool = True


@dataclass
class ExternalEpisode:
    id: str
    session: AgentSession
    result: asyncio.Future
    claimed: bool = False


class AgentEndpoint:
    """The run's OpenAI-compatible endpoint over the generator replicas (module docstring).

    Args:
        sample: ``sample(prompt_ids, n, *, greedy, seed, session)`` (the replicas' router,
            :meth:`forge_ext.rollout.replicas.GeneratorReplicas.sample`).
        tok: the checkpoint's tokenizer (:class:`forge_ext.tasks.tokenizer.CheckpointTokenizer`).
        model: the name ``/v1/models`` lists.
        max_tokens: the longest prompt + completion a call may ask for.
        sampling: the run's ``generator.sampling``: ``max_new_tokens`` is the longest
            completion (a request's ``max_tokens`` may lower it); a request may repeat its
            ``temperature`` and ``top_p``, not change them.
        tool_parser: vLLM's tool parser name (``hermes`` for Qwen's ``<tool_call>`` format);
            None: tool calls are not parsed (they stay in ``content``).
        chat_template_kwargs: passed to the chat template (``prompt.chat_template_kwargs``).
        host, port: where to listen (port 0: a free one).
    """

    def __init__(self, sample, tok, *, model: str, max_tokens: int, sampling: SamplingConfig,
                 tool_parser: str | None = None, chat_template_kwargs: dict | None = None,
                 host: str = LOCALHOST, port: int = 0) -> None:
        self.sample, self.tok, self.model = sample, tok, model
        self.max_tokens, self.sampling = max_tokens, sampling
        self.max_new_tokens = sampling.max_new_tokens
        self.names = tuple(dict.fromkeys((model, "policy")))
        """The model names a request may give (``/v1/models``): the run serves one policy."""
        self.tool_parser_name = tool_parser
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.host, self.port = host, port
        self.key = secrets.token_urlsafe(24)
        """The run's key: every request needs it."""
        self.sessions: dict[str, AgentSession] = {}
        self.external: dict[str, ExternalEpisode] = {}
        self._queue: asyncio.Queue | None = None
        self._ids = itertools.count()
        self.rejected = 0
        """Requests refused (wrong key, unknown session, over the context, malformed)."""
        self._server = None
        self._task: asyncio.Task | None = None
        self._parser_class = None
        self._http = None

    # ---- life --------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Listen (on :attr:`host`, a free port unless one was given) and serve in this event
        loop."""
        import uvicorn

        if self.tool_parser_name is not None:
            from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

            self._parser_class = ToolParserManager.get_tool_parser(self.tool_parser_name)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._queue = asyncio.Queue()
        # Keep-alive longer than the client's: a connection the server closes while the
        # client reuses it fails that request ("Connection error").
        self._app = self.app()
        config = uvicorn.Config(self._app, log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=120, backlog=4096)
        self._server = uvicorn.Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.wait({self._task}, timeout=10)
            self._server = None

    # ---- sessions ----------------------------------------------------------------------
    def open_session(self, row: Any, *, seed: int | None, route: Hashable,
                     greedy: bool = False) -> AgentSession:
        """A new session for an episode of ``row``; its calls are seeded from ``seed`` and
        routed by ``route`` (the episode's group: one replica serves it)."""
        session = AgentSession(id=f"s{next(self._ids)}-{secrets.token_hex(4)}", row=row,
                               seed=seed, route=route, greedy=greedy)
        self.sessions[session.id] = session
        return session

    def session_url(self, session: AgentSession) -> str:
        """The ``base_url`` of an OpenAI client bound to ``session``."""
        return f"{self.base_url}/sessions/{session.id}/v1"

    def close_session(self, session: AgentSession) -> list[Call]:
        """End a session (later calls get a 404) and return its calls, in order."""
        session.open = False
        self.sessions.pop(session.id, None)
        return list(session.calls)

    def client(self, session: AgentSession, timeout: float):
        """An ``openai.AsyncOpenAI`` bound to ``session`` (no retries: a failed call is the
        agent's to handle), whose requests reach the endpoint's app in this process (the same
        routes an external agent reaches over HTTP). Every session's client shares one
        transport: do not ``close()`` it."""
        import httpx
        import openai

        if self._http is None:
            # In-process: requests go to the ASGI app directly, not through a socket
            # (httpx's connection pool scans every connection per request: with hundreds of
            # agents at once, 68 ms a call went to that alone). The same app and routes.
            self._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self._app))
        return openai.AsyncOpenAI(base_url=self.session_url(session), api_key=self.key,
                                  max_retries=0, timeout=timeout, http_client=self._http)

    async def run_external(self, session: AgentSession, timeout: float) -> Any:
        """Queue ``session``'s episode for an external process and wait for its result
        (``{"reward"}``, ``{"answer"}``; raises on ``{"error"}`` or after ``timeout``)."""
        episode = ExternalEpisode(id=session.id, session=session,
                                  result=asyncio.get_running_loop().create_future())
        self.external[episode.id] = episode
        await self._queue.put(episode)
        try:
            return await asyncio.wait_for(asyncio.shield(episode.result), timeout)
        finally:
            self.external.pop(episode.id, None)

    # ---- requests ----------------------------------------------------------------------
    def _authorize(self, headers) -> None:
        if headers.get("authorization", "") != f"Bearer {self.key}":
            raise RequestRefused(401, "a wrong or missing API key: use the run's key "
                                 "(the client the agent was given has it)",
                                 "authentication_error")

    def _session(self, session_id: str) -> AgentSession:
        session = self.sessions.get(session_id)
        if session is None or not session.open:
            raise RequestRefused(404, f"session {session_id!r} is unknown or its episode has "
                                 "ended", "not_found_error")
        return session

    def _limits(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        new = self.max_new_tokens if max_tokens is None else min(max_tokens, self.max_new_tokens)
        if new < 1:
            raise RequestRefused(400, f"max_tokens={max_tokens} must be >= 1")
        if len(prompt_ids) + new > self.max_tokens:
            raise RequestRefused(
                400, f"this request's prompt is {len(prompt_ids)} tokens and asks for up to "
                f"{new} more, over the context of {self.max_tokens} tokens; shorten the "
                "conversation or max_tokens (task.agent_max_tokens sets the context)")
        return new

    def _check(self, kind, body: dict[str, Any], table, session: AgentSession):
        """``body`` parsed as vLLM's request ``kind``, every field checked
        (:func:`forge_ext.rollout.openai_fields.check_fields`) and the model name known."""
        from pydantic import ValidationError

        try:
            request = kind(**body)
        except (ValidationError, TypeError, ValueError) as e:
            raise RequestRefused(400, f"not a valid {kind.__name__}: {e}") from None
        greedy = (0.0,) if session.greedy else ()
        check_fields(request, table, {"temperature": (self.sampling.temperature, *greedy),
                                      "top_p": (self.sampling.top_p,)})
        if request.model and request.model not in self.names:
            raise RequestRefused(404, f"model={request.model!r} does not exist here: use one "
                                 f"of {list(self.names)} (/v1/models)", "not_found_error")
        if (request.n or 1) < 1:
            raise RequestRefused(400, f"n={request.n} must be >= 1")
        return request

    def _ending(self, request):
        """The request's :func:`~forge_ext.rollout.openai_fields.ending` of sampled ids."""
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        return lambda prompt_ids, ids: ending(
            prompt_ids, ids, self.tok.tokenizer, end_ids=self.tok.stop_ids, stop=stop,
            stop_token_ids=list(request.stop_token_ids or []),
            include_stop=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens)

    async def _sample(self, session: AgentSession, prompt_ids: list[int], n: int,
                      max_new: int, end) -> list[tuple[Completion, Ending]]:
        """``n`` completions of ``prompt_ids`` on the session's replica, each cut where the
        request's ``end`` says (a stop, the request's ``max_new``) and recorded as cut: the
        tokens trained are the tokens the agent received."""
        from forge_ext.rollout.engines.base import derive_seed

        index = session.requests
        session.requests += 1
        seed = None if session.seed is None else derive_seed(session.seed, index)
        completions = await self.sample(prompt_ids, n, greedy=session.greedy, seed=seed,
                                        session=session.route)
        out = []
        for c in completions:  # the run's max_new_tokens; a request may ask for fewer
            done = end(prompt_ids, c.response_ids[:max_new])
            ids, logprobs, versions = (c.response_ids[: done.kept], c.logprobs[: done.kept],
                                       c.versions[: done.kept])
            finished = done.finish_reason == "stop"
            if session.open:
                session.calls.append(Call(list(prompt_ids), ids, logprobs, versions, finished))
            out.append((Completion(prompt_ids=list(prompt_ids), response_ids=ids,
                                   logprobs=logprobs, versions=versions, finished=finished,
                                   policy_version=c.policy_version), done))
        return out

    def _render(self, request) -> list[int]:
        """The chat request's prompt ids: its messages, tools and template arguments
        (``add_generation_prompt``, ``continue_final_message``, ``documents``,
        ``reasoning_effort``, ``chat_template_kwargs``, merged by vLLM's
        ``build_chat_params``, over the run's ``prompt.chat_template_kwargs``)."""
        if not self.tok.has_chat_template:
            raise RequestRefused(400, "model.hf_path's tokenizer has no chat template; use "
                                 "/v1/completions with a text prompt")
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
        chat = request.build_chat_params(None, "string").chat_template_kwargs
        kwargs = {**self.chat_template_kwargs, **chat, **({"tools": tools} if tools else {})}
        messages = [plain_message(m, i) for i, m in enumerate(request.messages)]
        try:
            return self.tok.encode_messages(messages, kwargs)
        except Exception as e:  # noqa: BLE001  (the template's own error: the request's)
            raise RequestRefused(400, f"the chat template cannot render these messages: {e}")

    async def chat(self, session: AgentSession, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/chat/completions``: check, render, sample, cut, parse tool calls, record
        (every field: :data:`~forge_ext.rollout.openai_fields.CHAT_FIELDS`)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = self._check(ChatCompletionRequest, body, CHAT_FIELDS, session)
        parse = (self._parser_class if request.tools and request.tool_choice != "none"
                 else None)
        if parse is not None:  # hermes keeps special tokens in the text it parses
            request = parse(self.tok.tokenizer, request.tools).adjust_request(request)
        prompt_ids = self._render(request)
        new = self._limits(prompt_ids, request.max_completion_tokens or request.max_tokens)
        sampled = await self._sample(session, prompt_ids, request.n or 1, new,
                                     self._ending(request))
        last = plain_message(request.messages[-1], len(request.messages) - 1)
        role = "assistant" if request.add_generation_prompt else last.get("role")
        echoed = (last.get("content") or "") if request.echo and last.get("role") == role else ""
        choices = []
        for index, (c, done) in enumerate(sampled):
            message: dict[str, Any] = {"role": role, "content": echoed + done.text}
            finish = done.finish_reason
            if parse is not None:
                parsed = parse(self.tok.tokenizer, request.tools).extract_tool_calls(
                    done.text, request)
                if parsed.tools_called:
                    calls = [t.model_dump() for t in parsed.tool_calls]
                    if request.parallel_tool_calls is False:
                        calls = calls[:1]
                    message.update(content=parsed.content, tool_calls=calls)
                    finish = "tool_calls"
            choice = {"index": index, "message": message, "finish_reason": finish,
                      "stop_reason": done.stop_reason, "token_ids": c.response_ids,
                      "logprobs": None}
            if request.logprobs:
                choice["logprobs"] = chat_logprobs(self.tok.tokenizer, c.response_ids,
                                                   c.logprobs, request.return_tokens_as_token_ids)
            choices.append(choice)
        return self._response("chat.completion", request, [prompt_ids],
                              [c for c, _ in sampled], choices)

    def _prompts(self, request) -> list[tuple[list[int], str]]:
        """``[(ids, text)]`` of the completion request's prompt: a string, token ids, or a
        list of either (``add_special_tokens`` for text)."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        out = []
        for p in prompt or []:
            if isinstance(p, str) and p:
                out.append((list(self.tok.tokenizer(
                    p, add_special_tokens=request.add_special_tokens)["input_ids"]), p))
            elif isinstance(p, list) and p:
                out.append((list(p), self.tok.tokenizer.decode(p)))
            else:
                out = []
                break
        if not out:
            raise RequestRefused(400, "prompt must be a non-empty string or list of token "
                                 "ids, or a list of those")
        return out

    async def completion(self, session: AgentSession, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/completions``: each prompt (text, encoded with the tokenizer's special tokens
        unless ``add_special_tokens`` is false, or token ids) sampled ``n`` times, cut and
        recorded (every field: :data:`~forge_ext.rollout.openai_fields.COMPLETION_FIELDS`)."""
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        request = self._check(CompletionRequest, body, COMPLETION_FIELDS, session)
        if request.echo and request.logprobs is not None:
            raise RequestRefused(400, "echo with logprobs asks for the prompt's log-probs, "
                                 "which are not computed; ask for echo or logprobs")
        prompts = self._prompts(request)
        # Unset (vLLM's schema then says 16): the run's max_new_tokens, as for chat.
        asked = request.max_tokens if body.get("max_tokens") is not None else None
        limits = [self._limits(ids, asked) for ids, _ in prompts]  # all checked first
        end = self._ending(request)
        sampled = await asyncio.gather(*(self._sample(session, ids, request.n, new, end)
                                         for (ids, _), new in zip(prompts, limits)))
        choices, completions = [], []
        for (ids, text), outs in zip(prompts, sampled):
            shown = text if request.echo else ""
            for c, done in outs:
                logprobs = None if request.logprobs is None else completion_logprobs(
                    self.tok.tokenizer, c.response_ids, c.logprobs,
                    request.return_tokens_as_token_ids, len(shown))
                choices.append({"index": len(choices), "text": shown + done.text,
                                "finish_reason": done.finish_reason,
                                "stop_reason": done.stop_reason, "logprobs": logprobs,
                                "token_ids": c.response_ids, "prompt_token_ids": ids})
                completions.append(c)
        return self._response("text_completion", request, [ids for ids, _ in prompts],
                              completions, choices)

    def _response(self, kind: str, request, prompts: list[list[int]],
                  completions: list[Completion], choices: list[dict]) -> dict[str, Any]:
        tokens = sum(len(c.response_ids) for c in completions)
        prompt_tokens = sum(len(ids) for ids in prompts)
        response = {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{request.request_id}",
            "object": kind, "created": int(time.time()), "model": self.model,
            "choices": choices, "prompt_token_ids": prompts[0],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                      "total_tokens": prompt_tokens + tokens},
        }
        if getattr(request, "return_prompt_text", None):
            response["prompt_text"] = self.tok.tokenizer.decode(prompts[0])
        return response

    async def claim(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """An external process takes the next queued episode (None if none comes within
        ``wait_s``)."""
        wait = float(body.get("wait_s", 0) or 0)
        try:
            episode = (self._queue.get_nowait() if wait <= 0 else
                       await asyncio.wait_for(self._queue.get(), wait))
        except (asyncio.QueueEmpty, asyncio.TimeoutError):
            return None
        while episode.result.done():  # timed out meanwhile: take the next one
            try:
                episode = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return None
        episode.claimed = True
        row = episode.session.row
        return {"episode_id": episode.id, "base_url": self.session_url(episode.session),
                "api_key": self.key,
                "row": {"prompt": row.prompt, "answer": row.answer,
                        "metadata": _jsonable(row.metadata)}}

    def result(self, episode_id: str, body: dict[str, Any]) -> None:
        episode = self.external.get(episode_id)
        if episode is None or episode.result.done():
            raise RequestRefused(404, f"episode {episode_id!r} is unknown or already finished",
                                 "not_found_error")
        if "error" in body:
            episode.result.set_exception(RuntimeError(f"the external agent reported: "
                                                      f"{str(body['error'])[:500]}"))
        elif "reward" in body or "answer" in body:
            episode.result.set_result(body.get("reward", body.get("answer")))
        else:
            raise RequestRefused(400, 'post {"reward": number}, {"answer": text} or '
                                 '{"error": text}')

    # ---- HTTP ----------------------------------------------------------------------------
    def app(self):
        """The ASGI app (FastAPI): the routes of the module docstring."""
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        def refused(e: RequestRefused) -> JSONResponse:
            self.rejected += 1
            return JSONResponse({"error": {"message": e.message, "type": e.kind,
                                           "code": e.status}}, status_code=e.status)

        async def handle(request: Request, session_id: str | None, work):
            try:
                self._authorize(request.headers)
                session = self._session(session_id) if session_id is not None else None
                try:
                    body = await request.json() if request.method == "POST" else {}
                except json.JSONDecodeError:
                    raise RequestRefused(400, "the body is not JSON") from None
                result = await work(session, body if isinstance(body, dict) else {})
            except RequestRefused as e:
                return refused(e)
            return Response(status_code=204) if result is None else JSONResponse(result)

        async def models(session, body):
            return {"object": "list", "data": [{"id": name, "object": "model",
                                                "owned_by": "forge_ext"} for name in self.names]}

        @app.get("/sessions/{session_id}/v1/models")
        async def session_models(session_id: str, request: Request):
            return await handle(request, session_id, models)

        @app.post("/sessions/{session_id}/v1/chat/completions")
        async def chat(session_id: str, request: Request):
            return await handle(request, session_id, self.chat)

        @app.post("/sessions/{session_id}/v1/completions")
        async def completions(session_id: str, request: Request):
            return await handle(request, session_id, self.completion)

        @app.post("/forge/v1/episodes/claim")
        async def claim(request: Request):
            return await handle(request, None, lambda _, body: self.claim(body))

        @app.post("/forge/v1/episodes/{episode_id}/result")
        async def result(episode_id: str, request: Request):
            async def post(_, body):
                self.result(episode_id, body)
                return {"ok": True}

            return await handle(request, None, post)

        return app


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return json.loads(json.dumps(value, default=str))


TOOL_PARSERS = {"qwen3": "hermes", "qwen2": "hermes", "llama3": "llama3_json"}
"""vLLM's tool parser of each model family's tool-call format (``task.agent_tool_parser:
auto``); a family not listed: none (tool calls stay in ``content``)."""


def write_address(endpoint: AgentEndpoint, path: str | os.PathLike) -> None:
    """``{"base_url": ..., "api_key": ...}`` of ``endpoint`` to ``path`` (JSON, readable by
    this user only, replaced atomically), for the agents that run outside the run."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + ".tmp")
    with open(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump({"base_url": endpoint.base_url, "api_key": endpoint.key}, f)
    staged.replace(path)
