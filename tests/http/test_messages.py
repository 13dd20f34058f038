"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens: radixserve/http/anthropic.py).

With the official `anthropic` SDK against one shared server process on the tiny GGUF (one slot,
a 2 MiB radix host tier with a 1 MiB pin budget, so a few long prompts evict): messages streamed
and not, tools, stop sequences, token counts, the cache fields and a `cache_control` pin. In
process: the translation, where breakpoints land in the prompt's tokens, the stream's framing
over scripted results (thinking and tool-call blocks, an error mid-stream), the error shape,
`x-api-key`, and a prefix pin in the radix tree.

The reference is llama-server (tools/server/server-chat.cpp, server-task.cpp, and its
tests/unit/test_compat_anthropic.py). Where radixserve goes beyond it, the test says so.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import uuid
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import pytest
from fastapi.testclient import TestClient

from radixserve.bench.scenarios import make_text
from radixserve.config import RequestDefaults, ServerConfig
from radixserve.engine.task import FinalResult, PartialResult, Timings
from radixserve.errors import TaskError
from radixserve.http.anthropic import count_tokens, parse_messages, to_chat
from radixserve.http.app import create_app
from radixserve.http.parse import ParseContext, render_chat, user_starts
from radixserve.http.schemas import ChatRequest, validate_body
from radixserve.memory.key import PromptKey
from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.model.loader import Model
from radixserve.text.chat_template import ChatTemplate
from tests.cache.test_radix import BPT, fake_pool, fill, stored_prompts
from tests.http.conftest import TINY_SDK
from tests.http.harness import ServerProcess
from tests.http.test_app import ScriptedEngine
from tests.text import chat_templates as T

# one slot; a radix host tier of 2 MiB (4096 tokens of the tiny f32 model's 512 bytes each), of
# which pins may hold 1 MiB; packed weights, f32: a cached prefix gives the bits a computed one does
POEM = [{"role": "user", "content": "Write a poem about the sea"}]  # greedy: varied text
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "Local time in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def srv(shared_server: Callable[[list[str]], ServerProcess], tiny_path: str) -> ServerProcess:
    return shared_server(["-m", tiny_path, *TINY_SDK])


@pytest.fixture(scope="module")
def sdk(srv: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)


GREEDY = {"extra_body": {"temperature": 0}}  # recent SDKs have no `temperature` argument


def create(sdk: anthropic.Anthropic, **kw: Any) -> Any:
    return sdk.messages.create(**{"model": "tiny", "max_tokens": 16, **GREEDY, **kw})


def unique_text(n_tokens: int) -> str:
    """About n_tokens tokens no other prompt of the session starts with."""
    return uuid.uuid4().hex + " " + make_text(random.Random(uuid.uuid4().int), n_tokens)


# ---- the SDK against a server ------------------------------------------------------------------


def test_a_message_streamed_and_not(sdk: anthropic.Anthropic) -> None:
    """As llama-server: a message with one text block, then the same greedy request streamed:
    message_start, each block's start, deltas and stop, message_delta, message_stop; the text
    deltas add up to the message's text. Beyond it: blocks are sent one after another (it
    keeps them all open until the end) and message_delta's usage repeats the input counts."""
    m = create(sdk, messages=POEM)
    assert (m.type, m.role, m.model) == ("message", "assistant", "tiny")  # the model echoed
    assert m.id.startswith("msg_") and [b.type for b in m.content] == ["text"]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 16 and m.content[0].text

    events = list(create(sdk, messages=POEM, stream=True))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    shape = "".join({"content_block_start": "(", "content_block_delta": "d",
                     "content_block_stop": ")"}[t] for t in types[1:-2])
    assert re.fullmatch(r"(\(d*\))+", shape), types
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(starts)))
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == m.content[0].text
    start, delta = events[0].message, events[-2]
    assert start.content == [] and start.usage.output_tokens == 0
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 16
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens + \
        m.usage.cache_creation_input_tokens
    assert start.usage.cache_read_input_tokens > 0  # the same prompt again: served by the slot
    assert start.usage.input_tokens + start.usage.cache_read_input_tokens + \
        start.usage.cache_creation_input_tokens == total

    with sdk.messages.stream(model="tiny", max_tokens=16, messages=POEM, **GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text and final.usage.output_tokens == 16


def test_a_forced_tool_call_its_result_and_the_answer(sdk: anthropic.Anthropic) -> None:
    """tool_choice {"type": "tool"} forces that call (llama-server maps it to "required", any
    tool; here the named one), streamed or not alike; its tool_result goes back as a tool
    message after the assistant's call, and the model answers."""
    call_kw = {"tools": [WEATHER, TIME], "tool_choice": {"type": "tool", "name": "get_weather"},
               "messages": ASK, "max_tokens": 64}
    m = create(sdk, **call_kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome") and call.id
    with sdk.messages.stream(model="tiny", **call_kw, **GREEDY) as s:
        streamed = s.get_final_message()  # input_json_delta events, parsed by the SDK
    assert streamed.content[0].input == call.input and streamed.stop_reason == "tool_use"
    m = create(sdk, messages=[{"role": "user", "content": "Weather in Paris?"}],
               tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=64)
    assert m.stop_reason == "tool_use" and m.content[-1].name == "get_weather"

    turn = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]}]
    result = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 25 C"}]}
    answer = create(sdk, tools=[WEATHER, TIME], messages=[*turn, result])
    assert answer.type == "message" and answer.stop_reason in ("end_turn", "max_tokens",
                                                              "tool_use")
    longer = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "Sunny, 25 C, a light westerly wind"}]}
    n = [sdk.messages.count_tokens(model="tiny", tools=[WEATHER, TIME],
                                   messages=[*turn, r]).input_tokens for r in (result, longer)]
    assert n[1] > n[0]  # the result is in the prompt


def test_stop_sequences(sdk: anthropic.Anthropic) -> None:
    """The text ends before the stop sequence; Anthropic's stop_reason "stop_sequence" with the
    sequence (llama-server says "end_turn" there, with stop_sequence set)."""
    text = create(sdk, messages=POEM).content[0].text
    k = next(k for k in range(1, len(text) - 3) if text.find(text[k : k + 3]) == k)
    stop = text[k : k + 3]
    for stream in (False, True):
        if stream:
            with sdk.messages.stream(model="tiny", max_tokens=16, messages=POEM,
                                     stop_sequences=["nowhere", stop], **GREEDY) as s:
                m = s.get_final_message()
        else:
            m = create(sdk, messages=POEM, stop_sequences=["nowhere", stop])
        assert m.content[0].text == text[:k]
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens_is_the_completion_s_prompt(sdk: anthropic.Anthropic) -> None:
    """count_tokens (no max_tokens needed, as llama-server) = the prompt the same request's
    completion ran: Anthropic's input + cache read + cache creation tokens."""
    body = {"system": [{"type": "text", "text": "You are a weather bot. " + uuid.uuid4().hex}],
            "tools": [WEATHER], "messages": ASK}
    n = sdk.messages.count_tokens(model="tiny", **body).input_tokens
    u = create(sdk, max_tokens=2, **body).usage
    assert n == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens > 0


def test_cache_fields_are_the_server_s_timings(srv: ServerProcess,
                                               sdk: anthropic.Anthropic) -> None:
    """Beyond llama-server (which reports cache reads only): a second request sharing the
    first's prefix reads `cache_read_input_tokens` = what /v1/chat/completions' timings report
    as cache_n for the same two prompts (run there under a cache_salt of their own: the same
    cache state). Without a cache_control breakpoint nothing is a cache write: the computed
    tokens are `input_tokens` (llama-server's n_prompt - cache_n); with one, those computed
    before it are `cache_creation_input_tokens` (Anthropic writes a cache at breakpoints)."""
    system = unique_text(60)
    bodies = [{"system": system, "messages": [{"role": "user", "content": q}]}
              for q in ("First question?", "A second, longer question?")]
    usage = [create(sdk, max_tokens=2, **b).usage for b in bodies]
    salt = uuid.uuid4().hex
    timings = []
    for b in bodies:
        chat = {**to_chat({**b, "max_tokens": 2}).chat, "temperature": 0, "cache_salt": salt}
        r = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        timings.append(r.json()["timings"])
    u, t = usage[1], timings[1]
    assert u.cache_read_input_tokens == t["cache_n"] > 0
    assert u.input_tokens == t["prompt_n"] > 0 and u.cache_creation_input_tokens == 0
    # a breakpoint at the end of a new system prompt: what was computed up to it is written
    marked = [{"type": "text", "text": unique_text(60), "cache_control": {"type": "ephemeral"}}]
    w = create(sdk, max_tokens=2, system=marked, messages=bodies[0]["messages"]).usage
    assert w.cache_creation_input_tokens > 60 and w.input_tokens > 0  # the question after it
    n = sdk.messages.count_tokens(model="tiny", system=marked,
                                  messages=bodies[0]["messages"]).input_tokens
    assert w.input_tokens + w.cache_creation_input_tokens + w.cache_read_input_tokens == n


def test_a_cache_control_pin_survives_an_eviction_that_takes_an_unpinned_prefix(
        srv: ServerProcess, sdk: anthropic.Anthropic) -> None:
    """Beyond llama-server (no pins): a system block with cache_control pins the prompt up to
    it in the radix host tier; long prompts afterwards evict what is not pinned (the LRU
    takes an unpinned system prompt of the same size), and the pinned one comes back from RAM
    for a new question."""
    pinned, unpinned = unique_text(500), unique_text(500)

    def ask(system: Any, q: str) -> Any:
        return create(sdk, max_tokens=1, system=system,
                      messages=[{"role": "user", "content": q}]).usage

    ask([{"type": "text", "text": pinned, "cache_control": {"type": "ephemeral"}}], "Hi?")
    ask(unpinned, "Hi?")
    for _ in range(4):  # 4 x ~1500 tokens through a 4096-token tier
        ask(unique_text(1500), "Go on.")
    back = ask(pinned, "Another question?")
    gone = ask(unpinned, "Another question?")
    # exactly the prompt up to the block's end (its text's tokens as the prompt has them)
    chat = to_chat({"system": pinned, "messages": ASK, "max_tokens": 1}).chat
    prompt = httpx.post(srv.url + "/apply-template", json=chat, timeout=60).json()["prompt"]
    head = prompt[: prompt.index(pinned) + len(pinned)]
    tokens = httpx.post(srv.url + "/tokenize", json={"content": head, "add_special": True},
                        timeout=60).json()["tokens"]
    assert back.cache_read_input_tokens == len(tokens) > 500
    assert gone.cache_read_input_tokens < 12  # the template's first tokens, nothing more


def test_bad_requests_in_anthropic_s_shape(srv: ServerProcess,
                                           sdk: anthropic.Anthropic) -> None:
    """400 invalid_request_error naming the field, in Anthropic's error shape, the SDK raising
    BadRequestError with the message; the server serves on. Beyond llama-server, which takes
    wrong roles to the template, a missing max_tokens as 4096 and an empty messages array as
    a prompt of its own, and answers bad JSON with a 500 in OpenAI's shape."""
    user = {"role": "user", "content": "Hi"}
    cases = [
        ([{"role": "system", "content": "Be brief"}, user], "messages[0].role"),
        ([user, {"role": "tool", "content": "x"}], "messages[1].role"),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                        "content": "x"}]}], "messages[0].content[0].tool_use_id"),
        ([user, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                                   "input": {}}]},
          user, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}],
         "messages[3].content[0].tool_use_id"),  # t1 was asked two messages before
        ([{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}],
         "messages[0].content[0].type"),
        ([], "messages"),
    ]
    for messages, field in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            create(sdk, messages=messages)
        assert e.value.status_code == 400 and f"'{field}'" in e.value.message, e.value.message
        assert e.value.body["type"] == "error"  # type: ignore[index]
        assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    for raw, needle in ((json.dumps({"model": "tiny", "messages": POEM}), "'max_tokens'"),
                        ('{"model": "tiny", "max_tokens": 4, "messages": [', "Invalid JSON")):
        r = httpx.post(srv.url + "/v1/messages", content=raw, timeout=60,
                       headers={"content-type": "application/json",
                                "anthropic-version": "2023-06-01"})
        body = r.json()
        assert r.status_code == 400 and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error" and needle in body["error"][
            "message"]
    assert create(sdk, messages=POEM, max_tokens=2).usage.output_tokens == 2


# ---- in process: the translation, breakpoints, framing -----------------------------------------


def test_the_translation(model: Model) -> None:
    """system blocks joined into one system message (llama-server); an assistant turn's
    thinking, text and tool_use blocks as one message; a user turn's blocks in order: tool
    results as tool messages, text as user messages (llama-server puts the text first);
    tools and tool_choice as OpenAI's; unknown fields ignored (as llama-server), llama.cpp's
    cache and length fields passed on (beyond llama-server)."""
    body = {
        "model": "m", "max_tokens": 8, "temperature": 0.5, "top_k": 3, "stream": True,
        "metadata": {"user_id": "u"}, "service_tier": "auto", "ignore_eos": True, "n_probs": 3, "stop_sequences": ["END"],
        "system": [{"type": "text", "text": "A. "}, {"type": "text", "text": "B."}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}},
                {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "Sun"}]},
                {"type": "tool_result", "tool_use_id": "t2", "is_error": True},
                {"type": "text", "text": "Thanks."}]},
        ],
    }
    tr = to_chat(body)
    assert tr.model == "m" and not tr.breakpoints
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}
    assert tr.chat == {
        "messages": [
            {"role": "system", "content": "A. B."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
             "tool_calls": [{"id": "t1", **call}, {"id": "t2", "type": "function", "function": {
                 "name": "get_weather", "arguments": "{}"}}],
             "reasoning_content": "Look it up."},
            {"role": "tool", "tool_call_id": "t1", "content": "Sun"},
            {"role": "tool", "tool_call_id": "t2", "content": ""},
            {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
        ],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}],
        "tool_choice": "required", "parallel_tool_calls": False, "stop": ["END"],
        "max_tokens": 8, "temperature": 0.5, "top_k": 3, "stream": True,
        "chat_template_kwargs": {"enable_thinking": True}, "ignore_eos": True,
    }
    assert to_chat({**body, "tool_choice": {"type": "tool", "name": "get_time"}}).chat[
        "tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    # Claude Code's per-request billing stamp made constant (llama-server): the prefix caches
    stamp = "x-anthropic-billing-header: cc_version=2.1; cch=a5145;You are Claude Code."
    assert to_chat({**body, "system": stamp}).chat["messages"][0]["content"] == \
        "x-anthropic-billing-header: cc_version=2.1; cch=fffff;You are Claude Code."


def ctx_of(model: Model, can_pin: bool = True, template: ChatTemplate | None = None
           ) -> ParseContext:
    d = dataclasses.replace(RequestDefaults.from_config(ServerConfig()), can_pin=can_pin)
    return ParseContext(model.tokenizer, template or model.chat_template, 2048, 2, d)


def cached(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}


def test_breakpoints_pin_the_prompt_up_to_their_block(model: Model) -> None:
    """Beyond llama-server (which ignores cache_control): each breakpoint's position is the
    prompt tokens that the rendered text up to the end of its block tokenizes to, exactly;
    the pin covers the prefix up to the last one, for the longest ttl, and every one is a
    context checkpoint position (`user_starts`). Without pins (no radix tier or
    --cache-pin-mib 0) breakpoints are accepted and only the checkpoints remain."""
    tok = model.tokenizer
    body = {"max_tokens": 4, "tools": [{**TIME, "cache_control": {"type": "ephemeral"}}, WEATHER],
            "system": [{"type": "text", "text": "Rules: be brief. "}, cached("Be kind.")],
            "messages": [
                {"role": "user", "content": [cached("First question"), {"type": "text",
                                                                         "text": "more"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                   "name": "get_time", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": "noon",
                                              "cache_control": {"type": "ephemeral",
                                                                "ttl": "1h"}}]}]}
    ctx = ctx_of(model)
    req = parse_messages(body, ctx)
    task = req.task
    prompt = render_chat(validate_body(ChatRequest, to_chat(body).chat), ctx.chat_template,
                         tok, ctx)
    assert tok.encode(prompt) == task.prompt_tokens
    ends = sorted(set(task.user_starts) - set(user_starts(task.prompt_tokens,
                                                           ctx.chat_template, tok)))
    heads = [tok.decode(task.prompt_tokens[:n]) for n in ends]
    for text in ("Be kind.", "First question", "noon"):  # each a block's end in the prompt
        end = prompt.index(text) + len(text)
        assert prompt[:end] in heads, (text, heads)
    # the first tool's: its JSON (as this template shows tools) to its closing brace, but
    # for the brace's own token, which the separator after it joins
    tools_end = next(h for h in heads if "get_time" in h and "get_weather" not in h)
    assert prompt.startswith(tools_end) and tools_end.rstrip().endswith("}")
    assert tools_end.count("{") == tools_end.count("}") + 1  # all but the tool's own
    assert task.pin_n == max(ends) and task.pin_s == 3600.0  # the longest ttl
    assert tok.decode(task.prompt_tokens[: task.pin_n]).endswith("noon")
    assert list(task.user_starts) == sorted(task.user_starts)

    off = parse_messages(body, ctx_of(model, can_pin=False)).task
    assert off.pin_s == 0.0 and off.user_starts == task.user_starts
    # a top-level cache_control (recent SDKs' "automatic caching"): the last block's end
    auto = parse_messages({"max_tokens": 4, "messages": ASK,
                           "cache_control": {"type": "ephemeral"}}, ctx).task
    assert tok.decode(auto.prompt_tokens[: auto.pin_n]).endswith(ASK[0]["content"])
    plain = parse_messages({"max_tokens": 4, "messages": ASK}, ctx).task  # no breakpoint
    assert (plain.pin_n, plain.pin_s) == (-1, 0.0)
    assert count_tokens(body, ctx) == {"input_tokens": len(task.prompt_tokens)}


def test_breakpoint_limits(model: Model) -> None:
    ctx = ctx_of(model)
    five = {"max_tokens": 4, "messages": [{"role": "user", "content": [
        cached(str(i)) for i in range(5)]}]}
    with pytest.raises(TaskError, match="A maximum of 4 blocks with cache_control"):
        parse_messages(five, ctx)
    bad = {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]}
    with pytest.raises(TaskError, match=r"messages\[0\].content\[0\].cache_control.ttl"):
        parse_messages(bad, ctx)


def test_bad_cache_control_ttl_and_tool_result_after_text_are_400s(model: Model) -> None:
    """A ttl that is not a string (a list or object: unhashable) and a tool_result after text
    in a user message (Anthropic wants the tool results first: the text would come between
    the calls and their results) are 400 invalid_request_error naming the field, not 500s."""
    c, _ = scripted(model, [final("Hi")])
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time",
                                              "input": {}}]}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "noon"}
    cases = [
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": ttl}}]}]},
         "messages[0].content[0].cache_control.ttl") for ttl in ([], {}, 5)
    ] + [
        ({"messages": ASK, "cache_control": {"type": "ephemeral", "ttl": []}},
         "cache_control.ttl"),
        ({"messages": [*ASK, call, {"role": "user", "content": [
            {"type": "text", "text": "Here:"}, result]}]}, "messages[2].content[1].type"),
        ({"messages": [*ASK, call, {"role": "user", "content": [
            result, {"type": "text", "text": "and"}, result]}]}, "messages[2].content[2].type"),
    ]
    for body, field in cases:
        r = c.post("/v1/messages", json={"max_tokens": 4, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert f"'{field}'" in err["error"]["message"], err
    ok = {"max_tokens": 4, "messages": [*ASK, call, {"role": "user", "content": [
        result, {"type": "text", "text": "Thanks."}]}]}  # results first, then text: fine
    assert c.post("/v1/messages", json=ok).status_code == 200


def test_a_cache_control_on_an_empty_thinking_block(model: Model) -> None:
    """A breakpoint on an empty thinking block (the message has other blocks) is accepted:
    the block adds nothing to the prompt, so it marks no position (no breakpoint); the other
    blocks' breakpoints are kept."""
    thinking = {"type": "thinking", "thinking": "", "signature": "s",
                "cache_control": {"type": "ephemeral"}}
    body = {"max_tokens": 4, "messages": [
        *ASK, {"role": "assistant", "content": [thinking, cached("Sunny.")]},
        {"role": "user", "content": "Thanks."}]}
    tr = to_chat(body)
    assert [b.kind for b in tr.breakpoints] == ["text"]
    assert "reasoning_content" not in tr.chat["messages"][1]
    task = parse_messages(body, ctx_of(model, template=ChatTemplate(T.QWEN3))).task
    assert model.tokenizer.decode(task.prompt_tokens[: task.pin_n]).rstrip().endswith("Sunny.")
    c, _ = scripted(model, [final("Hi")], T.QWEN3)
    r = c.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    only = {**body, "messages": [*ASK, {"role": "assistant", "content": [thinking]},
                                 {"role": "user", "content": "Go on."}]}
    assert c.post("/v1/messages", json=only).status_code == 200  # an empty turn: dropped


def test_a_prefix_pin_splits_the_stored_prompt_and_keeps_only_the_prefix() -> None:
    """A pin of a prompt's first tokens (PromptKey.prefix: a breakpoint's) keeps those from
    the LRU and lets the rest of the prompt go."""
    pool = fake_pool()
    cache = RadixPromptCache(limit_bytes=8 * BPT, pin_limit_bytes=6 * BPT)
    prompt = [1, 2, 3, 4, 5, 6]
    fill(pool, 0, prompt)
    assert cache.save(pool, 0, PromptKey("", prompt))
    assert cache.pin(PromptKey("", prompt).prefix(3), 100.0)
    assert cache.stats()["pinned_bytes"] == 3 * BPT
    for p in ([7, 7, 7, 7], [8, 8, 8, 8]):
        fill(pool, 0, p)
        assert cache.save(pool, 0, PromptKey("", p))
    cache.check()
    assert cache.tree.match(prompt).length == 3 and (1, 2, 3, 4, 5, 6) not in \
        stored_prompts(cache.tree)


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of each Anthropic event (`event: X` then `data: {...}`)."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n") if ": " in line)
        out.append((lines["event"], json.loads(lines["data"])))
        assert out[-1][1]["type"] == out[-1][0]
    return out


def scripted(model: Model, script: list[Any], template: str | None = None,
             **cfg: Any) -> tuple[TestClient, ScriptedEngine]:
    if template is not None:
        model = dataclasses.replace(model, chat_template=ChatTemplate(template))
    engine = ScriptedEngine(model, ServerConfig(**cfg), script)
    engine.n_ctx_slot = 2048
    return TestClient(create_app(engine, engine.cfg)), engine


def final(content: str, n: int = 3, stop: str = "eos") -> FinalResult:
    return FinalResult(content, list(range(10, 10 + n)), stop, "", False, 40, 45, 0,
                       Timings(cache_n=30, prompt_n=10))


def test_thinking_and_tool_call_blocks_streamed_and_not(model: Model) -> None:
    """A thinking template's reasoning comes back as a thinking block (empty signature: no
    one signs a local model's thoughts, as llama-server) before the tool_use block; streamed,
    each block opens, streams and closes in turn (a signature_delta closes a thinking block),
    and the deltas add up to the non-streamed blocks. thinking enabled / disabled reaches the
    template's enable_thinking."""
    text = ('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    script = [PartialResult(text[i : i + 7], [10 + i]) for i in range(0, len(text), 7)]
    body = {"model": "m", "max_tokens": 64, "tools": [WEATHER], "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    c, engine = scripted(model, [final(text, stop="eos")], T.QWEN3)
    m = c.post("/v1/messages", json=body).json()
    assert [b["type"] for b in m["content"]] == ["thinking", "tool_use"], m
    assert m["content"][0] == {"type": "thinking", "thinking": "The user wants weather.",
                               "signature": ""}
    assert m["content"][1]["input"] == {"city": "Paris"} and m["stop_reason"] == "tool_use"
    assert m["usage"] == {"input_tokens": 10, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 30, "output_tokens": 3}

    c, engine = scripted(model, [*script, final(text)], T.QWEN3)
    r = c.post("/v1/messages", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert engine.tasks[0].timings_per_token  # message_start's usage needs the first timings
    kinds = [(e, d.get("index"), (d.get("content_block") or d.get("delta") or {}).get("type"))
             for e, d in events if e.startswith("content_block")]
    opened = [(i, t) for e, i, t in kinds if e == "content_block_start"]
    assert opened == [(0, "thinking"), (1, "tool_use")]
    assert [k for k in kinds if k[0] != "content_block_delta" or k[2] == "signature_delta"] == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None), ("content_block_start", 1, "tool_use"),
        ("content_block_stop", 1, None)]
    deltas = [d["delta"] for e, d in events if e == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "The user wants weather."
    args = "".join(d.get("partial_json", "") for d in deltas)
    assert json.loads(args) == {"city": "Paris"}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-1] == ("message_stop", {"type": "message_stop"})

    c, engine = scripted(model, [final("Hi")], T.THINK_OPEN)
    for kind, tail in (("enabled", "<think>\n"), ("disabled", "<think>\n</think>")):
        body = {"max_tokens": 4, "messages": ASK, "thinking": {"type": kind}}
        assert c.post("/v1/messages", json=body).status_code == 200
        assert model.tokenizer.decode(engine.tasks[-1].prompt_tokens).endswith(tail)


def test_errors_before_and_during_a_stream(model: Model) -> None:
    """An error before the first result is the HTTP status in Anthropic's shape (a prompt past
    the context: 400 invalid_request_error); one mid-stream is an `event: error` (llama-server
    sends its OpenAI-shaped error object there)."""
    c, _ = scripted(model, [PartialResult("Hel", [10]), TaskError(500, "server_error", "boom")])
    r = c.post("/v1/messages", json={"max_tokens": 4, "messages": ASK, "stream": True})
    events = sse(r.text)
    assert [e for e, _ in events] == ["message_start", "content_block_start",
                                      "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    c, _ = scripted(model, [])
    long = {"max_tokens": 4, "messages": [{"role": "user", "content": "word " * 3000}]}
    r = c.post("/v1/messages", json=long)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "context" in r.json()["error"]["message"]
    r = c.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_x_api_key_and_anthropic_version(model: Model) -> None:
    """--api-key: Anthropic clients send `x-api-key` (llama-server reads it when there is no
    Authorization header); a wrong or missing key is a 401 authentication_error in Anthropic's
    shape on these routes (OpenAI's elsewhere). `anthropic-version` is accepted, not needed."""
    c, _ = scripted(model, [final("Hi")], api_key=["sekrit"])
    ok = {"x-api-key": "sekrit", "anthropic-version": "2023-06-01"}
    r = c.post("/v1/messages", json={"max_tokens": 4, "messages": ASK}, headers=ok)
    assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "Hi"}]
    r = c.post("/v1/messages/count_tokens", json={"messages": ASK}, headers=ok)
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    r = c.post("/v1/messages", json={"max_tokens": 4, "messages": ASK},
               headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json() == {
        "type": "error", "error": {"type": "authentication_error", "message": "Invalid API Key"}}
    assert c.post("/v1/chat/completions", json={"messages": ASK}).json()["error"]["code"] == 401
