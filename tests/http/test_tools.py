"""OpenAI tools, tool_choice and reasoning_content on /v1/chat/completions.

In-process (tiny model, scripted engine): the shape of messages, chunks and errors. Real
servers on the default model (`model` marker): an agent loop through the openai SDK in
llama.cpp's generic format (SmolLM2's template has no tools), a Hermes template given with
--chat-template, and a thinking template's reasoning split.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.engine.task import PartialResult, TokenProbs
from radixserve.http.app import create_app
from radixserve.model.loader import Model
from radixserve.text.chat_format import RESPOND_IN_JSON
from radixserve.text.chat_template import ChatTemplate
from tests.http.harness import running_server
from tests.http.test_app import ScriptedEngine, assert_error, final
from tests.text.chat_templates import QWEN3
from tests.text.test_harmony import GPT_OSS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'


def scripted(text: str, stop_type: str = "eos", n: int = 4) -> list[Any]:
    """An engine reply of `text`, released in n pieces."""
    k = -(-len(text) // n)
    parts = [PartialResult(text[i : i + k], [10]) for i in range(0, len(text), k)]
    return [*parts, dataclasses.replace(final(text, stop_type), tokens=[10] * len(parts))]


def client(model: Model, script: list[Any] | None = None, **cfg: Any
           ) -> tuple[TestClient, ScriptedEngine]:
    """test_app's client, with room in the context for the tools' description."""
    engine = ScriptedEngine(model, ServerConfig(**cfg), script)
    engine.n_ctx_slot = 4096
    return TestClient(create_app(engine, engine.cfg)), engine


def sse(r: httpx.Response | Any) -> list[dict[str, Any]]:
    return [json.loads(e[len("data: ") :]) for e in r.text.split("\n\n")
            if e.startswith("data: {")]


def reassemble(chunks: list[dict[str, Any]], index: int = 0) -> tuple[dict[str, Any], str]:
    """The message an OpenAI client builds from a stream's deltas, and the finish_reason."""
    msg: dict[str, Any] = {"content": None, "reasoning_content": None, "tool_calls": []}
    finish = ""
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] != index:
                continue
            d = ch["delta"]
            for key in ("content", "reasoning_content"):
                if d.get(key) is not None:
                    msg[key] = (msg[key] or "") + d[key]
            for tc in d.get("tool_calls", []):
                if tc["index"] == len(msg["tool_calls"]):
                    msg["tool_calls"].append({"type": tc["type"], "id": tc["id"], "function": {
                        "name": tc["function"]["name"], "arguments": ""}})
                msg["tool_calls"][tc["index"]]["function"]["arguments"] += \
                    tc["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    return msg, finish


def message_of(body: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return body["choices"][index]["message"]


# ------------------------------------------------------------------ in process


def test_a_tool_call_reply(model: Model) -> None:
    c, engine = client(model, scripted(CALL))
    body = {"messages": ASK, "tools": TOOLS}
    r = c.post("/v1/chat/completions", json=body).json()
    msg = message_of(r)
    assert msg["content"] is None and r["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and len(call["id"]) >= 9
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert engine.tasks[-1].grammar  # the generic format: the reply is JSON
    streamed, finish = reassemble(sse(c.post("/v1/chat/completions",
                                             json={**body, "stream": True})))
    assert finish == "tool_calls" and streamed["content"] is None
    assert [t["function"] for t in streamed["tool_calls"]] == [call["function"]]


def test_a_plain_reply_and_a_cut_call(model: Model) -> None:
    c, _ = client(model, scripted('{"response": "It is \\"sunny\\"."}'))
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}).json()
    assert message_of(r) == {"role": "assistant", "content": 'It is "sunny".'}
    assert r["choices"][0]["finish_reason"] == "stop"
    c, _ = client(model, scripted(CALL[: CALL.index("city") + 2], "limit"))
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert message_of(r)["tool_calls"][0]["function"]["arguments"] == '{"ci'


def test_each_choice_has_its_own_call_ids(model: Model) -> None:
    c, _ = client(model, scripted(CALL))
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "n": 2}).json()
    ids = [message_of(r, i)["tool_calls"][0]["id"] for i in range(2)]
    assert ids[0] != ids[1]
    chunks = sse(c.post("/v1/chat/completions",
                        json={"messages": ASK, "tools": TOOLS, "n": 2, "stream": True}))
    streamed = [reassemble(chunks, i)[0]["tool_calls"][0] for i in range(2)]
    assert streamed[0]["id"] != streamed[1]["id"]
    assert streamed[0]["function"] == streamed[1]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_held_back_logprobs_go_out_with_the_next_chunk(model: Model) -> None:
    probs = TokenProbs(10, "x", [120], 0.5, [(10, "x", 0.5)])
    script = [PartialResult(CALL[:20], [10], [probs]), PartialResult(CALL[20:], [10], [probs]),
              dataclasses.replace(final(CALL), tokens=[10, 10], probs=[probs, probs])]
    c, _ = client(model, script)
    chunks = sse(c.post("/v1/chat/completions", json={
        "messages": ASK, "tools": TOOLS, "stream": True, "logprobs": True}))
    sent = [x for ch in chunks for c_ in ch["choices"] for x in
            (c_.get("logprobs") or {"content": []})["content"]]
    assert len(sent) == 2


def test_skip_chat_parsing_leaves_the_reply_as_it_is(model: Model) -> None:
    c, _ = client(model, scripted(CALL), skip_chat_parsing=True)
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}).json()
    assert message_of(r) == {"role": "assistant", "content": CALL}


def test_reasoning_content(model: Model) -> None:
    m = dataclasses.replace(model, chat_template=ChatTemplate(QWEN3))
    text = "<think>\nParis is in France.\n</think>\n\nSunny."
    c, _ = client(m, scripted(text))
    r = c.post("/v1/chat/completions", json={"messages": ASK}).json()
    assert message_of(r) == {"role": "assistant", "content": "Sunny.",
                             "reasoning_content": "Paris is in France."}
    streamed, _ = reassemble(sse(c.post("/v1/chat/completions",
                                        json={"messages": ASK, "stream": True})))
    assert (streamed["content"], streamed["reasoning_content"]) == ("Sunny.",
                                                                    "Paris is in France.")
    r = c.post("/v1/chat/completions", json={"messages": ASK, "reasoning_format": "none"})
    assert message_of(r.json()) == {"role": "assistant", "content": text}
    c, _ = client(m, scripted(text), reasoning_format="none")
    assert message_of(c.post("/v1/chat/completions", json={"messages": ASK}).json()) == {
        "role": "assistant", "content": text}


def test_harmony_reasoning_and_calls(model: Model) -> None:
    m = dataclasses.replace(model, chat_template=ChatTemplate(GPT_OSS))
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris"}')
    c, _ = client(m, scripted(text))
    body = {"messages": ASK, "tools": TOOLS}
    msg = message_of(c.post("/v1/chat/completions", json=body).json())
    assert msg["reasoning_content"] == "Need the weather." and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": '{"city": "Paris"}'}
    streamed, finish = reassemble(sse(c.post("/v1/chat/completions",
                                             json={**body, "stream": True})))
    assert finish == "tool_calls" and streamed["reasoning_content"] == "Need the weather."
    assert streamed["tool_calls"][0]["function"] == msg["tool_calls"][0]["function"]
    c, _ = client(m, scripted("<|channel|>final<|message|>Sunny."))
    assert message_of(c.post("/v1/chat/completions", json={"messages": ASK}).json()) == {
        "role": "assistant", "content": "Sunny."}


def test_hermes_calls_with_a_tools_template(model: Model) -> None:
    m = dataclasses.replace(model, chat_template=ChatTemplate(QWEN3))
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n'
            "</tool_call>")
    c, engine = client(m, scripted(text, n=9))
    r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS}).json()
    assert engine.tasks[-1].grammar is None  # auto: the reply is free, parsed as it comes
    assert message_of(r)["content"] == "Let me check.\n"  # text before a call is kept
    assert message_of(r)["tool_calls"][0]["function"] == {"name": "get_time",
                                                          "arguments": '{"city": "Rome"}'}
    streamed, finish = reassemble(sse(c.post("/v1/chat/completions", json={
        "messages": ASK, "tools": TOOLS, "stream": True})))
    assert finish == "tool_calls" and streamed["content"] == "Let me check.\n"
    assert streamed["tool_calls"][0]["function"] == message_of(r)["tool_calls"][0]["function"]


@pytest.mark.parametrize("fields, message", [
    ({"tools": "get_weather"}, "Field 'tools': must be an array"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "Field 'tools[0]': 'function.name'"),
    ({"tools": TOOLS, "tool_choice": "any"}, "Field 'tool_choice': Invalid tool_choice: any"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "no function named 'nope'"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "Field 'parallel_tool_calls'"),
    ({"tools": TOOLS, "grammar": 'root ::= "a"'}, "Cannot use custom grammar constraints with"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}], "tool_choice": "required"}, "Field 'tools'"),
    ({"reasoning_format": "o1"}, "Field 'reasoning_format': Unknown reasoning format: o1"),
])
def test_bad_tools_are_400_before_the_engine(model: Model, fields: dict, message: str) -> None:
    c, engine = client(model, scripted(CALL))
    r = c.post("/v1/chat/completions", json={"messages": ASK, **fields})
    assert_error(r, 400, "invalid_request_error")
    assert message in r.json()["error"]["message"]
    assert not engine.tasks
    assert c.post("/v1/chat/completions", json={"messages": ASK}).status_code == 200


def test_apply_template_renders_the_tools(model: Model) -> None:
    c, _ = client(model)
    body = {"messages": ASK, "tools": TOOLS}
    prompt = c.post("/apply-template", json=body).json()["prompt"]
    assert RESPOND_IN_JSON in prompt and '"name": "get_time"' in prompt
    plain = c.post("/apply-template", json={"messages": ASK}).json()["prompt"]
    assert plain == c.post("/apply-template", json={**body, "tool_choice": "none"}).json()[
        "prompt"]
    assert RESPOND_IN_JSON not in plain


# ------------------------------------------------------------------ real servers


@pytest.fixture(scope="module")
def server(default_np2_server: Any) -> Any:
    """The session's default-model 2-slot server (tests/http/conftest.py), shared with
    test_constrained.py: these tests read only answers of their own requests."""
    return default_np2_server


def openai_client(srv: Any) -> Any:
    import openai
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none")


def create(srv: Any, **kw: Any) -> Any:
    kw = {"model": "x", "temperature": 0, "max_tokens": 64, **kw}
    return openai_client(srv).chat.completions.create(**kw)


def streamed(srv: Any, **kw: Any) -> tuple[dict[str, Any], str]:
    """The message the openai SDK's chunks add up to, and the finish_reason."""
    msg: dict[str, Any] = {"content": None, "tool_calls": []}
    finish = ""
    for ch in create(srv, stream=True, **kw):
        if not ch.choices:
            continue
        d, finish = ch.choices[0].delta, ch.choices[0].finish_reason or finish
        if d.content is not None:
            msg["content"] = (msg["content"] or "") + d.content
        for tc in d.tool_calls or []:
            if tc.index == len(msg["tool_calls"]):
                msg["tool_calls"].append({"id": tc.id, "name": tc.function.name,
                                          "arguments": ""})
            msg["tool_calls"][tc.index]["arguments"] += tc.function.arguments or ""
    return msg, finish


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def check_call(name: str, arguments: str, tools: list[dict[str, Any]] = TOOLS) -> None:
    """A declared tool, with arguments valid for its schema."""
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[name]
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.model
def test_agent_loop(server: Any) -> None:
    messages: list[Any] = list(ASK)
    r = create(server, messages=messages, tools=TOOLS, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call.function.name, call.function.arguments)
    messages.append(choice.message)
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"sky": "sunny", "celsius": 21})})
    answer = create(server, messages=messages, tools=TOOLS, tool_choice="none",
                    max_tokens=24).choices[0]
    assert answer.message.content and not answer.message.tool_calls
    prompt = httpx.post(server.url + "/apply-template", timeout=60, json={
        "messages": [m if isinstance(m, dict) else m.model_dump(exclude_none=True)
                     for m in messages]}).json()["prompt"]
    assert json.dumps({"tool_calls": [{"name": call.function.name, "arguments": json.loads(
        call.function.arguments), "id": call.id}]}, indent=2) in prompt
    assert '"tool_response": {' in prompt and f'"tool_call_id": "{call.id}"' in prompt


@pytest.mark.model
def test_streamed_call_equals_the_non_streamed_one(server: Any) -> None:
    kw = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    whole = create(server, **kw).choices[0]
    msg, finish = streamed(server, **kw)
    assert finish == whole.finish_reason == "tool_calls" and msg["content"] is None
    assert [(c["name"], c["arguments"]) for c in msg["tool_calls"]] == calls_of(whole.message)


@pytest.mark.model
def test_tool_choice_none_named_and_parallel(server: Any) -> None:
    r = create(server, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    named = {"type": "function", "function": {"name": "get_time"}}
    (call,) = calls_of(create(server, messages=ASK, tools=TOOLS, tool_choice=named)
                       .choices[0].message)
    assert call[0] == "get_time"
    check_call(*call)
    r = create(server, messages=ASK, tools=TOOLS, tool_choice="required",
               parallel_tool_calls=True, max_tokens=96)
    calls = r.choices[0].message.tool_calls
    assert calls and all(len(c.id) >= 4 for c in calls)  # ids the model wrote
    check_call(calls[0].function.name, calls[0].function.arguments)


@pytest.mark.model
def test_bad_requests_leave_the_server_serving(server: Any) -> None:
    for body in ({"tools": [{"type": "function"}]}, {"tools": TOOLS, "tool_choice": "all"},
                 {"tools": TOOLS, "grammar": 'root ::= "x"'}):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": ASK, **body})
        assert r.status_code == 400, r.text
    assert create(server, messages=ASK, max_tokens=4).choices[0].message.content


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The default model with a Hermes template that thinks (Qwen3's, shortened)."""
    log = str(tmp_path_factory.mktemp("tools-qwen3") / "server.log")
    args = ["--dtype", "f32", "-np", "2", "-c", "4096", "--chat-template", QWEN3]
    with running_server(args, log) as srv:
        yield srv


@pytest.mark.model
def test_hermes_template_call(qwen3_server: Any) -> None:
    kw = {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    prompt = httpx.post(qwen3_server.url + "/apply-template", timeout=60,
                        json={"messages": ASK, "tools": TOOLS}).json()["prompt"]
    assert "<tools>\n" + json.dumps(WEATHER) in prompt
    whole = create(qwen3_server, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = calls_of(whole.message)
    check_call(*call)
    msg, _ = streamed(qwen3_server, **kw)
    assert [(c["name"], c["arguments"]) for c in msg["tool_calls"]] == [call]


THINK_GRAMMAR = 'root ::= "<think>\\n" [a-z ]{3,30} "\\n</think>\\n\\n" [A-Za-z ]{1,20} "."'


@pytest.mark.model
def test_reasoning_split(qwen3_server: Any) -> None:
    body = {"messages": ASK, "grammar": THINK_GRAMMAR, "temperature": 0, "max_tokens": 64}
    r = httpx.post(qwen3_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    msg = message_of(r)
    assert msg["reasoning_content"] and msg["content"].endswith(".")
    assert "<think>" not in msg["content"] and "</think>" not in msg["content"]
    chunks = []
    with httpx.stream("POST", qwen3_server.url + "/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    got, _ = reassemble(chunks)
    assert (got["content"], got["reasoning_content"]) == (msg["content"],
                                                          msg["reasoning_content"])
    body["reasoning_format"] = "none"
    raw = httpx.post(qwen3_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert message_of(raw)["content"].startswith("<think>\n" + msg["reasoning_content"])
