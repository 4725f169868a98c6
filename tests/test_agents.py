"""Agents through the OpenAI-compatible endpoint (forge_ext/rollout/agents.py): an agent's own
model calls, made with the official ``openai`` client, become trained episodes, token-exact.

What must hold (issue 34): the merge rule (calls whose prompts extend the previous call's
prompt and completion token for token are one row, the tokens between masked; a re-rendered
history starts a row of its own; parallel calls and ``n > 1`` choices are all kept); a
calculator agent using ``tools=`` on a chat model made here, sampled by vLLM, trains with the
importance ratio 1 on every trained token and no gradient from tool and prompt tokens; the
model's tool calls are parsed by vLLM's tool parser; an agent that raises, hangs or returns
garbage, a call with a wrong key, to an unknown session or over the context, each costs its
episode or call, counted, never the run; an external process (``curl``) can take a row and a
session and post the result; a run killed mid-step and resumed trains every row of the stream
once.
"""

import asyncio
import json
import os
import subprocess

import pytest
import pytest_asyncio
from conftest import Recording, chat_checkpoint, history, small

from apps.grpo.config import load_config
from forge_ext.rollout.agents import AgentEndpoint, Call, merge_calls
from forge_ext.rollout.engines.base import Completion, SamplingConfig
from forge_ext.rollout.engines.hf import HFEngine
from forge_ext.tasks.base import Row

module_loop = pytest.mark.asyncio(loop_scope="module")

# A ChatML template that renders tools, tool calls and tool results as Qwen2.5's does (the
# hermes format, <tool_call>{"name", "arguments"}</tool_call>).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
    "{{ m['content'] or '' }}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}"
)
# Short: the model made here has 256 positions, and its small tokenizer spends about a token
# per byte of the rendered schema.
CALCULATOR = {"type": "function", "function": {
    "name": "calc", "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}


async def calculator_agent(client, row):
    """A user's agent: asks with ``tools=``, runs the calculator on the model's call (or on
    the question's numbers if it made none), answers the tool, asks again; the second reply is
    the final answer."""
    messages = [{"role": "user", "content": row.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages,
                                                 tools=[CALCULATOR], max_tokens=12)
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if message.tool_calls:
        call = message.tool_calls[0]
        expression = json.loads(call.function.arguments).get("e", "")
        result = {"role": "tool", "tool_call_id": call.id}
    else:
        expression, result = f"{row.metadata['a']}+{row.metadata['b']}", {"role": "user"}
    try:
        value = str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and +
    except Exception:  # noqa: BLE001 - a malformed call is the model's mistake
        value = "error"
    messages.append({**result, "content": value})
    second = await client.chat.completions.create(model="policy", messages=messages,
                                                  tools=[CALCULATOR], max_tokens=12)
    return second.choices[0].message.content


def tools_chat_checkpoint(root) -> str:
    from transformers import AutoTokenizer

    path = chat_checkpoint(root, end_prone=2.0)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(path)
    return path


# ---- the merge rule --------------------------------------------------------------------------

def call(prompt, completion, version=0):
    return Call(list(prompt), list(completion), [-0.5] * len(completion),
                [version] * len(completion), True)


def test_calls_that_extend_one_another_are_one_row_with_the_tokens_between_masked():
    first = call([1, 2, 3], [7, 8, 2])
    second = call([1, 2, 3, 7, 8, 2, 40, 41], [9, 2], version=1)
    (row,) = merge_calls([first, second])
    assert row.prompt_ids == [1, 2, 3]
    assert row.response_ids == [7, 8, 2, 40, 41, 9, 2]  # the engine's tokens, in order
    assert row.response_mask == [1, 1, 1, 0, 0, 1, 1]
    assert row.logprobs == [-0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert row.versions == [0, 0, 0, 1, 1] and row.calls == 2


def test_a_re_rendered_history_starts_a_row_of_its_own_and_parallel_calls_are_all_kept():
    first = call([1, 2, 3], [7, 8, 2])
    rerendered = call([1, 2, 3, 7, 99, 2, 40], [9, 2])  # the history re-tokenised: 99 for 8
    parallel = [call([1, 2, 3, 7, 8, 2, 5], [6, 2]), call([1, 2, 3, 7, 8, 2, 5], [4, 2])]
    rows = merge_calls([first, rerendered, *parallel])
    assert [r.prompt_ids for r in rows] == [[1, 2, 3], [1, 2, 3, 7, 99, 2, 40],
                                            [1, 2, 3, 7, 8, 2, 5]]
    assert rows[0].response_ids == [7, 8, 2, 5, 6, 2]  # the first parallel call extends it
    assert rows[1].response_mask == [1, 1] and rows[2].response_ids == [4, 2]
    assert sum(r.calls for r in rows) == 4  # every call kept, once


# ---- the endpoint, in process, on the transformers engine ----------------------------------

@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    return tools_chat_checkpoint(tmp_path_factory.mktemp("agents_model"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def endpoint(tools_model):
    from forge_ext.tasks.tokenizer import CheckpointTokenizer

    tok = CheckpointTokenizer(tools_model)
    engine = HFEngine(tools_model, sampling=SamplingConfig(max_new_tokens=12),
                      stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)
    scripted = {}  # session route -> the text the "model" answers (tool-call parsing test)

    async def sample(prompt_ids, n, *, greedy, seed, session):
        if session in scripted:
            ids = tok.tokenizer(scripted[session], add_special_tokens=False)["input_ids"]
            ids.append(tok.eos_id)
            return [Completion(prompt_ids=list(prompt_ids), response_ids=ids,
                               logprobs=[-1.0] * len(ids), versions=[0] * len(ids),
                               finished=True, policy_version=0)] * n
        return await engine.sample(prompt_ids, n, greedy=greedy, seed=seed)

    server = AgentEndpoint(sample, tok, model="policy", max_tokens=256,
                           sampling=SamplingConfig(max_new_tokens=128),
                           tool_parser="hermes")
    server.scripted = scripted
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@module_loop
async def test_a_chat_call_returns_and_records_exactly_the_engines_tokens(endpoint):
    session = endpoint.open_session(Row(prompt="What is 1 plus 2?", answer="3"), seed=4,
                                    route="plain")
    client = endpoint.client(session, timeout=30)
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "What is 1 plus 2?"}],
        tools=[CALCULATOR], n=2, max_tokens=12)
    (recorded_a, recorded_b) = endpoint.close_session(session)
    assert [c.token_ids for c in reply.choices] == [recorded_a.completion_ids,
                                                     recorded_b.completion_ids]
    assert reply.prompt_token_ids == recorded_a.prompt_ids  # the tools rendered in the prompt
    rendered = endpoint.tok.tokenizer.decode(recorded_a.prompt_ids)
    assert '"name": "calc"' in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert reply.usage.prompt_tokens == len(recorded_a.prompt_ids)


@module_loop
async def test_the_models_tool_calls_are_parsed_by_vllms_tool_parser(endpoint):
    session = endpoint.open_session(Row(prompt="q", answer="a"), seed=1, route="tool")
    endpoint.scripted["tool"] = ('<tool_call>\n{"name": "calc", "arguments": '
                                 '{"e": "12+30"}}\n</tool_call>')
    client = endpoint.client(session, timeout=30)
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "q"}], tools=[CALCULATOR],
        max_tokens=90)
    endpoint.close_session(session)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "calc"
    assert json.loads(tool_call.function.arguments) == {"e": "12+30"}


@module_loop
async def test_a_wrong_key_an_unknown_session_and_an_over_long_call_are_refused_and_counted(
    endpoint
):
    import openai

    session = endpoint.open_session(Row(prompt="q", answer="a"), seed=1, route="bad")
    before = endpoint.rejected
    wrong_key = openai.AsyncOpenAI(base_url=endpoint.session_url(session), api_key="nope",
                                   max_retries=0, http_client=endpoint.client(session, 30)._client)
    with pytest.raises(openai.AuthenticationError):
        await wrong_key.completions.create(model="policy", prompt="q")
    other = endpoint.open_session(Row(prompt="q", answer="a"), seed=1, route="other")
    endpoint.close_session(other)
    with pytest.raises(openai.NotFoundError, match="unknown or its episode has ended"):
        await endpoint.client(other, 30).completions.create(model="policy", prompt="q")
    with pytest.raises(openai.BadRequestError, match="over the context of 256 tokens"):
        await endpoint.client(session, 30).completions.create(model="policy", prompt="q " * 300)
    assert endpoint.rejected - before == 3
    assert endpoint.close_session(session) == []  # nothing refused was sampled or recorded


@module_loop
async def test_an_external_process_takes_a_row_and_a_session_and_posts_its_result(endpoint):
    """The external protocol with ``curl``, as an agent harness in another language would."""
    row = Row(prompt="What is 5 plus 2?", answer="7", metadata={"a": 5, "b": 2})
    session = endpoint.open_session(row, seed=2, route="external")
    waiting = asyncio.ensure_future(endpoint.run_external(session, timeout=60))
    key = f"Authorization: Bearer {endpoint.key}"

    def curl(path, body):
        return subprocess.run(["curl", "-s", "-X", "POST", "-H", key, "-H",
                               "Content-Type: application/json", "-d", json.dumps(body),
                               endpoint.base_url + path], capture_output=True, text=True,
                              timeout=30)

    claimed = json.loads((await asyncio.to_thread(curl, "/forge/v1/episodes/claim",
                                                  {"wait_s": 5})).stdout)
    assert claimed["row"] == {"prompt": row.prompt, "answer": "7", "metadata": {"a": 5, "b": 2}}
    reply = json.loads((await asyncio.to_thread(
        curl, claimed["base_url"].removeprefix(endpoint.base_url) + "/completions",
        {"model": "policy", "prompt": "5+2="})).stdout)
    assert reply["choices"][0]["token_ids"]
    await asyncio.to_thread(curl, f"/forge/v1/episodes/{claimed['episode_id']}/result",
                            {"answer": "7"})
    assert await waiting == "7"
    (recorded,) = endpoint.close_session(session)
    assert recorded.completion_ids == reply["choices"][0]["token_ids"]


# ---- every field of the request schemas: honoured as vLLM honours it, or refused (issue 49) --

def scripted_session(endpoint, text, route):
    """A session whose "model" answers ``text`` (its tokens, then the end token)."""
    endpoint.scripted[route] = text
    return endpoint.open_session(Row(prompt="q", answer="a"), seed=1, route=route)


def scripted_ids(endpoint, text):
    return endpoint.tok.tokenizer(text, add_special_tokens=False)["input_ids"] + [
        endpoint.tok.eos_id]


REACT = "Thought: add them\nObservation: 42\nThought: done"


@module_loop
@pytest.mark.parametrize("route", ["chat", "text"])
@pytest.mark.parametrize(("stop", "include"), [("Observation:", False),
                                               (["nothing", "Observation:"], False),
                                               ("Observation:", True)])
async def test_a_stop_string_cuts_the_text_and_the_trained_tokens_at_the_same_token(
    endpoint, route, stop, include
):
    """vLLM's semantics: the tokens end with the one that completes the stop string (what
    the engine sampled, and what is recorded for training), the text before it (or through
    it with ``include_stop_str_in_output``), ``finish_reason`` "stop", ``stop_reason`` the
    string."""
    session = scripted_session(endpoint, REACT, f"stop-{route}")
    client = endpoint.client(session, timeout=30)
    extra = {"include_stop_str_in_output": True} if include else {}
    if route == "chat":
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "q"}], stop=stop,
            extra_body=extra)
        text = reply.choices[0].message.content
    else:
        reply = await client.completions.create(model="policy", prompt="q", stop=stop,
                                                extra_body=extra)
        text = reply.choices[0].text
    (recorded,) = endpoint.close_session(session)
    choice = reply.choices[0]
    assert text == ("Thought: add them\nObservation:" if include else "Thought: add them\n")
    assert (choice.finish_reason, choice.stop_reason) == ("stop", "Observation:")
    everything = scripted_ids(endpoint, REACT)
    kept = recorded.completion_ids
    assert choice.token_ids == kept == everything[: len(kept)]  # a prefix of the sample
    decode = endpoint.tok.tokenizer.decode
    assert decode(kept).endswith("Observation:") or "Observation:" in decode(kept[-2:])
    assert "Observation:" not in decode(kept[:-1])  # the last kept token completes it
    assert recorded.finished and len(recorded.logprobs) == len(kept) == len(recorded.versions)


@module_loop
async def test_a_stop_on_the_engine_trains_a_prefix_of_the_same_sample_with_its_log_probs(
    endpoint
):
    """On the transformers engine: a call with a stop string that its sample completes at
    the k-th token records and returns the first k tokens of what the engine sampled (the
    engine asked directly, with the call's seed), with their log-probs and versions exactly:
    no token past the stop, no re-tokenisation, no shifted log-prob."""
    from forge_ext.rollout.engines.base import derive_seed

    decode, prompt = endpoint.tok.tokenizer.decode, "What is 12 plus 30? The answer is"
    prompt_ids = endpoint.tok.tokenizer(prompt)["input_ids"]
    for seed in range(40):  # a sample long enough (the model made here often ends at once)
        (raw,) = await endpoint.sample(prompt_ids, 1, greedy=False,
                                       seed=derive_seed(seed, 0), session="plain")
        ids = raw.response_ids
        k = next((k for k in range(3, len(ids)) if decode(ids[k - 1 : k]).strip()
                  and decode(ids[k - 1 : k]) not in decode(ids[: k - 1])), None)
        if k is not None:
            break
    stop = decode(ids[k - 1 : k])
    session = endpoint.open_session(Row(prompt="q", answer="a"), seed=seed, route="plain")
    cut = (await endpoint.client(session, 30).completions.create(
        model="policy", prompt=prompt, max_tokens=12, stop=[stop])).choices[0]
    (stopped,) = endpoint.close_session(session)
    assert cut.token_ids == stopped.completion_ids == ids[:k]
    assert stopped.logprobs == raw.logprobs[:k] and stopped.versions == raw.versions[:k]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.text == decode(ids[: k - 1])


@module_loop
async def test_stop_token_ids_end_the_completion_at_that_token(endpoint):
    session = scripted_session(endpoint, REACT, "stop-ids")
    everything = scripted_ids(endpoint, REACT)
    stop_id = everything[3]
    reply = await endpoint.client(session, 30).completions.create(
        model="policy", prompt="q", extra_body={"stop_token_ids": [stop_id]})
    (recorded,) = endpoint.close_session(session)
    choice = reply.choices[0]
    assert choice.token_ids == recorded.completion_ids == everything[:4]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop_id)
    assert choice.text == endpoint.tok.tokenizer.decode(everything[:3])  # not the stop token


@module_loop
async def test_a_prefilled_assistant_message_is_continued_not_closed(endpoint):
    session = scripted_session(endpoint, " 42.", "prefill")
    client = endpoint.client(session, timeout=30)
    messages = [{"role": "user", "content": "What is 12 plus 30?"},
                {"role": "assistant", "content": "The answer is"}]
    reply = await client.chat.completions.create(
        model="policy", messages=messages,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "echo": True})
    rendered = endpoint.tok.tokenizer.decode(reply.prompt_token_ids)
    assert rendered.endswith("<|im_start|>assistant\nThe answer is"), rendered
    assert reply.choices[0].message.content == "The answer is 42."  # echo: the prefill first
    plain = await client.chat.completions.create(
        model="policy", messages=messages[:1], extra_body={"add_generation_prompt": False})
    assert endpoint.tok.tokenizer.decode(plain.prompt_token_ids).endswith(
        "What is 12 plus 30?<|im_end|>\n")
    import openai

    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        await client.chat.completions.create(
            model="policy", messages=messages, extra_body={"continue_final_message": True})
    endpoint.close_session(session)


@module_loop
@pytest.mark.parametrize("extra", [{"chat_template_kwargs": {"enable_thinking": True}},
                                   {"reasoning_effort": "high"}])
async def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(endpoint, extra):
    session = scripted_session(endpoint, "ok", "kwargs")
    client = endpoint.client(session, timeout=30)
    messages = [{"role": "user", "content": "q"}]
    thinking = await client.chat.completions.create(model="policy", messages=messages,
                                                    extra_body=extra)
    plain = await client.chat.completions.create(model="policy", messages=messages)
    endpoint.close_session(session)
    decode = endpoint.tok.tokenizer.decode
    assert decode(thinking.prompt_token_ids).endswith("<|im_start|>assistant\n<think>\n")
    assert decode(plain.prompt_token_ids).endswith("<|im_start|>assistant\n")


@module_loop
async def test_completions_return_logprobs_and_echo_when_asked(endpoint):
    session = scripted_session(endpoint, "Thought: x", "logprobs")
    client = endpoint.client(session, timeout=30)
    reply = await client.completions.create(model="policy", prompt="12+30=", logprobs=0)
    echoed = await client.completions.create(model="policy", prompt="12+30=", echo=True)
    batch = await client.completions.create(model="policy", prompt=["1", "2"], n=2)
    recorded = endpoint.close_session(session)
    choice = reply.choices[0]
    assert choice.logprobs.token_logprobs == recorded[0].logprobs
    decode = endpoint.tok.tokenizer.decode
    assert choice.logprobs.tokens == [decode([t]) for t in recorded[0].completion_ids]
    assert [list(top) for top in choice.logprobs.top_logprobs] == [
        [t] for t in choice.logprobs.tokens]
    assert choice.logprobs.text_offset[:2] == [0, len(choice.logprobs.tokens[0])]
    assert echoed.choices[0].text == "12+30=Thought: x"
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # every prompt, n each
    assert len(recorded) == 1 + 1 + 4


@module_loop
async def test_what_the_endpoint_cannot_serve_is_refused_naming_it_not_dropped(endpoint):
    """An image part (dropped silently before), an unknown model name, echo with
    log-probs (the prompt's are not computed): each a 4xx naming what to change."""
    import openai

    session = scripted_session(endpoint, "ok", "refused")
    client = endpoint.client(session, timeout=30)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content has \['image_url'\]"):
        await client.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": [{"type": "text", "text": "q"}, image]}])
    with pytest.raises(openai.NotFoundError, match="model='gpt-4o' does not exist"):
        await client.completions.create(model="gpt-4o", prompt="q")
    with pytest.raises(openai.BadRequestError, match="echo with logprobs"):
        await client.completions.create(model="policy", prompt="q", echo=True, logprobs=0)
    assert endpoint.close_session(session) == []


# One request value per field that the endpoint refuses: each must get a 400 naming it.
REFUSED_CHAT = {
    "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"5": 10.0},
    "seed": 7, "stream": True, "top_logprobs": 2, "response_format": {"type": "json_object"},
    "tool_choice": "required", "use_beam_search": True, "length_penalty": 0.5,
    "watermarking": True, "ignore_eos": True, "min_tokens": 2, "allowed_token_ids": [5],
    "bad_words": ["x"], "logprob_token_ids": [5], "prompt_logprobs": 1,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 10,
    "truncation_side": "left", "thinking_token_budget": 5, "include_reasoning": False,
    "chat_template": "{{ messages }}", "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"x": 1}, "structured_outputs": {"regex": "a+"}, "priority": 1,
    "cache_salt": "salt", "kv_transfer_params": {"x": 1}, "ec_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1}, "repetition_detection": {"max_pattern_size": 2, "min_count": 3},
    "add_special_tokens": True, "functions": [{"name": "f"}],
}
REFUSED_TEXT = {
    **{k: v for k, v in REFUSED_CHAT.items() if k not in (
        "top_logprobs", "tool_choice", "include_reasoning", "chat_template",
        "media_io_kwargs", "mm_processor_kwargs", "add_special_tokens")},
    "logprobs": 2, "suffix": "x", "prompt_embeds": "AAAA", "best_of": 2,
}


@module_loop
@pytest.mark.parametrize(("route", "field", "value"),
                         [("chat", k, v) for k, v in REFUSED_CHAT.items()]
                         + [("text", k, v) for k, v in REFUSED_TEXT.items()])
async def test_a_field_the_endpoint_cannot_honour_is_refused_naming_it(
    endpoint, route, field, value
):
    """Never silently ignored: an agent that asks for what the run cannot give (its own
    sampling, streaming, grammars, top log-probs, ...) gets a 400 that names the field."""
    import openai

    session = scripted_session(endpoint, "ok", "refused")
    client = endpoint.client(session, timeout=30)
    body = {field: value}
    if field == "logprob_token_ids":
        body["logprobs"] = True if route == "chat" else 0
    if field == "top_logprobs":
        body["logprobs"] = True
    if field == "tool_choice":
        body["tools"] = [CALCULATOR]
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "chat":
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "q"}], extra_body=body)
        else:
            await client.completions.create(model="policy", prompt="q", extra_body=body)
    assert field in str(refused.value)
    assert endpoint.close_session(session) == []  # nothing sampled


def test_every_field_of_both_request_schemas_is_either_honoured_or_refused():
    """The table (forge_ext/rollout/openai_fields.py) names every field of vLLM's
    ChatCompletionRequest and CompletionRequest; the refused ones are each tried above."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from forge_ext.rollout.openai_fields import (CHAT_FIELDS, COMPLETION_FIELDS,
                                                 fields_markdown, refused)

    assert set(CHAT_FIELDS) == set(ChatCompletionRequest.model_fields)
    assert set(COMPLETION_FIELDS) == set(CompletionRequest.model_fields)
    assert refused(CHAT_FIELDS) == set(REFUSED_CHAT) - {"functions"}
    assert refused(COMPLETION_FIELDS) == set(REFUSED_TEXT) - {"functions", "best_of"}
    docs = os.path.join(os.path.dirname(__file__), "..", "docs", "agents.md")
    with open(docs) as f:
        assert fields_markdown() in f.read(), "docs/agents.md: paste fields_markdown()"


# ---- faults, through the episode runner -------------------------------------------------------

async def raising_agent(client, row):
    await client.completions.create(model="policy", prompt=row.prompt)
    raise RuntimeError("an agent bug")


async def hanging_agent(client, row):
    await asyncio.sleep(60)


async def garbage_agent(client, row):
    return {"not": "a reward"}


async def rogue_agent(client, row):
    """Calls with a wrong key, an unknown session and over the context: each refused (the
    agent handles the errors), then answers normally."""
    import openai

    for make in (lambda: openai.AsyncOpenAI(base_url=str(client.base_url), api_key="x",
                                            max_retries=0, http_client=client._client),
                 lambda: client.with_options(base_url=str(client.base_url).replace(
                     "/sessions/", "/sessions/gone-")),
                 lambda: client):
        try:
            await make().completions.create(model="policy", prompt="q " * 300)
        except openai.APIStatusError:
            pass
    reply = await client.completions.create(model="policy", prompt=row.prompt)
    return reply.choices[0].text


@module_loop
@pytest.mark.parametrize(("agent", "kind"), [("raising_agent", "errors"),
                                              ("hanging_agent", "timeouts"),
                                              ("garbage_agent", "errors"),
                                              ("rogue_agent", None)])
async def test_a_failing_agent_costs_its_episode_counted_and_the_others_score(
    endpoint, agent, kind
):
    from forge_ext.rollout.runner import EpisodeRunner
    from forge_ext.tasks import (PromptConfig, PromptRenderer, RewardConfig,
                                 RewardFunctionConfig, Rubric, episode_config)
    from test_multiturn import _NoTask

    rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="exact_match")],
                                 on_error=-1.0, isolation="thread", max_error_rate=None),
                    _NoTask())
    config = episode_config({"agent": f"{__name__}:{agent}", "agent_timeout_s": 2})
    runner = EpisodeRunner(endpoint.tok, PromptRenderer(endpoint.tok, PromptConfig()), rubric,
                           config)
    runner.endpoint = endpoint
    before = endpoint.rejected
    rows = [Row(prompt="What is 1 plus 2?", answer="3")] * 2
    batch = await runner.run(rows, 2, endpoint.sample, seed=3)
    metrics = batch.metrics()
    if kind is None:  # the rogue calls were refused; the episodes scored normally
        assert endpoint.rejected - before == 3 * 4
        assert metrics["agent/errors"] == metrics["agent/timeouts"] == 0
        assert all(t.rows and t.turns == 1 for t in batch.trajectories)
    else:
        assert metrics[f"agent/{kind}"] == 4 and batch.rewards == [-1.0] * 4
    assert not endpoint.sessions  # every session closed


# ---- the app: vLLM, on-policy, masked tools; kill and resume ---------------------------------

@pytest.fixture(scope="module")
def agent_task(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("agent_app")
    datasets.Dataset.from_list([
        {"prompt": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1), "a": i, "b": i + 1}
        for i in range(16)]).to_json(str(root / "train.jsonl"))
    return root, tools_chat_checkpoint(root)


def agent_argv(root, checkpoint, output_dir, *extra):
    return small(
        output_dir, checkpoint, "task.source=dataset", f"task.train_path={root}/train.jsonl",
        "task.num_eval=2", f"task.agent={__name__}:calculator_agent", "task.agent_timeout_s=120",
        "reward.functions=[{fn: exact_match}]", "reward.isolation=thread",
        "trainer.training.seq_len=256", "reference.training.seq_len=256",
        # Each call may be a row of its own (the template re-renders the assistant's decoded
        # text): any number of rows a step, and the run derives a token budget for the
        # trainer and the reference (issue 50; none is given here).
        "generator.sampling.max_new_tokens=12", "generator.vllm.max_model_len=256", *extra,
    )


@module_loop
async def test_a_tool_using_agent_on_vllm_trains_on_policy_with_tool_and_prompt_tokens_masked(
    agent_task, tmp_path
):
    from conftest import assert_masked_tokens_carry_no_gradient

    root, checkpoint = agent_task
    config = load_config(
        str(os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_cpu_vllm.yaml")),
        agent_argv(root, checkpoint, str(tmp_path / "run"), "reference=null", "loss.kl_coef=0"))
    app = Recording(config)
    await app.run()
    assert app.gap and max(app.gap.values()) <= 1e-4, app.gap  # ratio 1 on every token
    episodes = [ep for r in app.rollouts.values() for ep in r.episodes]
    assert any(0 in ep.response_mask for ep in episodes)  # tool / user tokens between calls
    assert all(sum(ep.response_mask) > 0 for ep in episodes)
    for row in history(str(tmp_path / "run")):
        if "loss" in row:
            assert row["agent/calls_mean"] == 2 and row["agent/errors"] == 0
            assert row["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert_masked_tokens_carry_no_gradient(checkpoint, episodes[:8], app.tok.pad_id)


@module_loop
async def test_a_killed_agent_run_resumes_and_trains_every_prompt_of_the_stream_once(
    agent_task, tmp_path
):
    """Killed mid-step 3 (after the checkpoint of step 2) and run again: the rerun resumes
    at step 2, its agent episodes are the same calls and tokens as before the crash (every
    call seeded from the step, the episode and the call's index), and every prompt of the
    stream is trained once.

    The agent is issue 50's: two text calls, the second prompt rebuilt from the first
    answer's text (an episode of two rows where the first answer ended), on the demo
    config as it is: a step's rows then exceed ``grpo.batch_size``, which fixed-row
    microbatches refused at step 1 (``trainer.training has fixed-row microbatches``)."""
    from conftest import assert_every_prompt_trained_once

    root, checkpoint = agent_task
    demo = os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_cpu_demo.yaml")
    extra = ["loop.steps=3", "loop.save_every=1", "trainer.checkpoint.enable=true",
             "reference=null", "loss.kl_coef=0",
             "task.agent=forge_ext.tasks.agents:answer_then_check"]
    output_dir = str(tmp_path / "run")
    crashed = Recording(load_config(demo, agent_argv(root, checkpoint, output_dir, *extra,
                                                     "debug.fail_at_step=3")))
    with pytest.raises(Exception, match="gradient norm is nan"):
        await crashed.run()
    resumed = Recording(load_config(demo, agent_argv(root, checkpoint, output_dir, *extra)))
    await resumed.run()
    assert sorted(crashed.trained) == [0, 1] and sorted(resumed.trained) == [2]
    assert_every_prompt_trained_once(crashed, resumed)
    rows = [len(r.episodes) for run in (crashed, resumed) for r in run.trained.values()]
    assert max(rows) > crashed.config.grpo.batch_size, rows  # more rows than episodes


def test_an_agents_time_is_labelled_agent_and_an_environments_env():
    """Issue 50: the seconds an episode spent in an agent's own run (its code and its calls)
    were shown as ``env``: they are ``agent`` (``time/agent``, the step line's ``agent
    1.50s``); an environment's stay ``env``; one-turn episodes wait for neither."""
    from forge_ext.rl.report import step_line
    from forge_ext.rollout.runner import EpisodeBatch, Trajectory
    from forge_ext.tasks.rubric import Scores

    def batch(**kind) -> EpisodeBatch:
        episodes = [Trajectory(Row("1+1=", "2"), [1], env_seconds=s) for s in (1.0, 2.0)]
        return EpisodeBatch(episodes, Scores([0.0, 0.0], {}, {}, [False, False]), [0.0, 0.0],
                            env_seconds=3.0, reward_seconds=0.0, **kind)

    assert batch(multi_turn=True, agent=True).waited_seconds() == {"agent": 1.5}
    assert batch(multi_turn=True).waited_seconds() == {"env": 1.5}
    assert batch(multi_turn=False).waited_seconds() == {}
    m = {"reward/mean": 0.5, "rollout/accuracy": 0.5, "rollout/groups_without_spread": 0.0,
         "loss": 0.0, "policy_version": 1, "generator_version": 0,
         "rollout/policy_age_mean": 0.0, "rollout/policy_age_max": 0,
         "rollout/dropped_samples": 0, "time/generate": 2.0, "time/agent": 1.5,
         "time/generator_idle": 0.0, "time/trainer_idle": 0.0,
         "throughput/samples_per_s": 10.0}
    line = step_line(1, m, steps=2, group_size=2, replicas=1, kl=False)
    assert "generate 2.00s agent 1.50s" in line, line
