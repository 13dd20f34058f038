"""OpenAI's Responses API (/v1/responses, radixserve/http/oai_responses.py).

Through the official `openai` SDK against one shared server process on the tiny random-weight
GGUF (greedy, f32 on native weights: a cached prefix gives the same tokens as a computed one):
streamed and not, a forced function call and its output, a JSON schema through `text.format`,
`previous_response_id` chains computing only each turn's new tokens, GET/DELETE, bad input in
OpenAI's error shape. In process (scripted engine, test_app.py's): the event sequence of a
reply with reasoning, text and a call, the translation of input items into the chat prompt,
the store's bounds.

llama-server (tools/server/server-chat.cpp, server-task.cpp, its
tests/unit/test_compat_oai_responses.py) is the reference for what both do: /v1/responses and
/responses, /responses/input_tokens, `instructions` as a system message, function tools and
items, `max_output_tokens`, resp_/msg_/fc_/call_ ids, usage with cached_tokens, the streamed
events framed `event: <type>` + `data:` with no [DONE], `timings` beside the completed response.
Where radixserve goes beyond it, the test says so ("beyond llama-server").
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from radixserve.errors import TaskError
from radixserve.http.response_store import ResponseStore
from radixserve.text.chat_template import ChatTemplate
from tests.http.conftest import TINY_SDK
from tests.http.test_tools import client as scripted_client
from tests.http.test_tools import scripted
from tests.text.chat_templates import QWEN3

NO_NEWLINE = {"logit_bias": {"198": False}}  # the tiny model's greedy reply is "\n" otherwise
INSTRUCTIONS = "Answer briefly."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(shared_server, tiny_path):
    return shared_server(["-m", tiny_path, *TINY_SDK])


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(api_key="none", base_url=server.url + "/v1", max_retries=0,
                         timeout=120)


def post(server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def extra(r: Any) -> dict[str, Any]:
    """What the SDK keeps of the fields beyond OpenAI's (`timings`, `reuse`)."""
    return r.model_extra or {}


def salt() -> str:
    return "test-" + uuid.uuid4().hex  # a namespace of its own: nothing cached, nothing stored


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def chat_prompt(server, messages: list[dict[str, Any]], **body: Any) -> list[int]:
    """The prompt tokens /v1/chat/completions makes of `messages`."""
    text = post(server, "/apply-template", {"messages": messages, **body})["prompt"]
    return post(server, "/tokenize", {"content": text, "add_special": True,
                                      "parse_special": True})["tokens"]


def assert_openai_error(e: openai.APIStatusError, status: int, *words: str) -> dict[str, Any]:
    assert e.status_code == status
    err = e.response.json()["error"]
    assert err["code"] == status and err["type"] == "invalid_request_error"
    for w in words:
        assert w in err["message"], err["message"]
    return err


# ---- create, streamed and not ------------------------------------------------------------


def test_create_streamed_and_not(oai, server):
    """A reply cut at max_output_tokens is `incomplete` (as OpenAI; llama-server says
    completed): non-streamed, its usage's cached_tokens is the server's timings.cache_n;
    streamed, the SDK reads every event, the deltas add up to the same greedy text and the
    stream ends in response.incomplete (OpenAI's sequence, with sequence numbers and output
    indexes llama-server does not send)."""
    kw = {"model": "any", "instructions": INSTRUCTIONS, "input": "Tell me about dragons.",
          "max_output_tokens": 6, "temperature": 0, "extra_body": NO_NEWLINE}
    r = oai.responses.create(**kw)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].id.startswith("msg_")
    assert r.output_text and r.usage.output_tokens == 6
    t = extra(r)["timings"]
    assert r.usage.input_tokens_details.cached_tokens == t["cache_n"]
    assert r.usage.input_tokens == t["cache_n"] + t["prompt_n"]
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    assert (r.instructions, r.max_output_tokens, r.temperature, r.store) == (
        INSTRUCTIONS, 6, 0.0, True)

    events = list(oai.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text == done.output_text == r.output_text
    assert events[2].item.id == done.output[0].id and done.id == events[0].response.id
    assert done.usage.input_tokens == r.usage.input_tokens

    # the wire: named events, each data's type its event's name, no [DONE] (as llama-server)
    with httpx.stream("POST", server.url + "/responses", timeout=120, json={
            "input": "Tell me about dragons.", "max_output_tokens": 3, "stream": True}) as raw:
        frames = [f for f in raw.read().decode().split("\n\n") if f.strip()]
    for f in frames:
        name, data = f.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == name[7:]
    assert "timings" in json.loads(frames[-1].split("\n")[1][6:])  # beside the response


def test_input_tokens_counts_the_prompt(oai, server):
    """/v1/responses/input_tokens (llama-server's route and shape) counts what create runs."""
    body = {"input": "How many tokens?", "instructions": INSTRUCTIONS}
    counted = post(server, "/v1/responses/input_tokens", body)
    assert counted["object"] == "response.input_tokens"
    r = oai.responses.create(model="any", **body, max_output_tokens=1, store=False)
    assert counted["input_tokens"] == r.usage.input_tokens


# ---- tools and structured output ---------------------------------------------------------


def test_forced_function_call_then_its_output(oai):
    """A call forced by tool_choice comes back as a function_call item (fc_ id, call_ id, the
    arguments valid for the tool's schema); its function_call_output, after the call through
    previous_response_id or with the whole conversation sent again, gets the same answer. The
    streamed call (the SDK's stream helper) has the argument deltas and done events."""
    r = oai.responses.create(model="any", input="Weather in Paris?", tools=[WEATHER],
                             tool_choice={"type": "function", "name": "get_weather"},
                             max_output_tokens=48, temperature=0)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    kw = {"model": "any", "tools": [WEATHER], "tool_choice": "none", "max_output_tokens": 6,
          "temperature": 0, "extra_body": NO_NEWLINE}
    chained = oai.responses.create(**kw, previous_response_id=r.id, input=[result])
    whole = oai.responses.create(**kw, store=False, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        result])
    assert chained.output[0].type == "message" and chained.output_text
    assert chained.output_text == whole.output_text
    assert chained.usage.input_tokens == whole.usage.input_tokens

    with oai.responses.stream(model="any", input="Weather in Paris?", tools=[WEATHER],
                              tool_choice="required", max_output_tokens=48,
                              temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = final.output[0]
    assert streamed.type == "function_call" and streamed.arguments == call.arguments
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    dones = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == dones[0].arguments == call.arguments
    assert events[-1].type == "response.completed"


def test_json_schema_text_format(oai):
    """text.format json_schema constrains the reply (the chat path's response_format): the
    text parses and validates; json_object gives a JSON object."""
    schema = {"type": "object", "additionalProperties": False, "required": ["answer", "n"],
              "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    r = oai.responses.create(model="any", input="Yes or no?", max_output_tokens=64,
                             temperature=0, text={"format": {
                                 "type": "json_schema", "name": "yes_no", "schema": schema,
                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    r = oai.responses.create(model="any", input="An object?", max_output_tokens=64,
                             temperature=0, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)


# ---- previous_response_id: the conversation rebuilt, its prefix reused -----------------------


def test_previous_response_chain_computes_only_new_tokens(oai, server):
    """Beyond llama-server (it refuses previous_response_id): 5 turns, each sending only its
    new user message. Each prompt is the chat prompt of the whole conversation so far; each
    turn computes only what the previous turn's prompt and reply (the slot's KV: the prompt
    and every generated token but the last) do not already cover (at most the prompt's last
    token, where the reply's text can merge with it into other tokens); cached_tokens is the
    server's timings.cache_n; the 5th answer equals the whole conversation's sent at once."""
    ns, chain = salt(), []
    kw = {"model": "any", "instructions": INSTRUCTIONS, "max_output_tokens": 6,
          "temperature": 0, "extra_body": {"cache_salt": ns, **NO_NEWLINE}}
    questions = [f"Question {i}: what comes after {w}?" for i, w in
                 enumerate(["spring", "summer", "autumn", "winter", "night"])]
    prev = None
    for q in questions:
        r = oai.responses.create(**kw, input=q, **({"previous_response_id": prev.id}
                                                   if prev else {}))
        chain.append(r)
        prev = r
    messages = [{"role": "system", "content": INSTRUCTIONS}]
    prompts, replies = [], []
    for q, r in zip(questions, chain):
        messages.append({"role": "user", "content": q})
        prompts.append(chat_prompt(server, messages))
        assert r.usage.input_tokens == len(prompts[-1])  # the chat prompt, exactly
        ref = post(server, "/completion", {  # the reply's tokens, uncached, greedy
            "prompt": prompts[-1], "n_predict": r.usage.output_tokens, "temperature": 0,
            "return_tokens": True, "cache_prompt": False, **NO_NEWLINE})
        assert ref["content"] == r.output_text
        replies.append(ref["tokens"])
        messages.append({"role": "assistant", "content": r.output_text})
    assert extra(chain[0])["timings"]["cache_n"] == 0  # a fresh namespace
    for k in range(1, len(chain)):
        t = extra(chain[k])["timings"]
        covered = common_prefix(prompts[k], prompts[k - 1] + replies[k - 1][:-1])
        assert covered >= len(prompts[k - 1]) - 1
        assert (t["cache_n"], t["prompt_n"]) == (covered, len(prompts[k]) - covered), k
        assert chain[k].usage.input_tokens_details.cached_tokens == t["cache_n"]
        assert chain[k].previous_response_id == chain[k - 1].id

    items: list[Any] = []
    for q, r in zip(questions, chain):
        items += [{"role": "user", "content": q}, *[o.to_dict() for o in r.output]]
    whole = oai.responses.create(**{**kw, "extra_body": {"cache_salt": salt(), **NO_NEWLINE}},
                                 input=items[:-1], store=False)
    assert whole.output_text == chain[-1].output_text
    assert whole.usage.input_tokens == chain[-1].usage.input_tokens
    assert extra(whole)["timings"]["cache_n"] == 0


# ---- stored responses: GET, DELETE, namespaces ------------------------------------------------


def test_retrieve_delete_and_namespaces(oai, server):
    """Beyond llama-server (no store, no GET/DELETE): a stored response is retrieved as it was
    created and deleted ({id, object, deleted}); then, as an unknown id, 404 in OpenAI's error
    shape. store false keeps nothing. A response lives in its cache_salt's namespace: another
    (or none) neither retrieves nor continues it."""
    r = oai.responses.create(model="any", input="Keep this.", max_output_tokens=2)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output == r.output and got.usage == r.usage
    gone = httpx.delete(f"{server.url}/v1/responses/{r.id}", timeout=60)
    assert gone.status_code == 200
    assert gone.json() == {"id": r.id, "object": "response", "deleted": True}
    for call in (lambda: oai.responses.retrieve(r.id), lambda: oai.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert_openai_error(e.value, 404, r.id, "not found")

    r = oai.responses.create(model="any", input="Forget this.", max_output_tokens=2,
                             store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)

    ns = salt()
    r = oai.responses.create(model="any", input="Salted.", max_output_tokens=2,
                             extra_body={"cache_salt": ns})
    assert oai.responses.retrieve(r.id, extra_query={"cache_salt": ns}).id == r.id
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="any", input="Go on.", previous_response_id=r.id,
                             max_output_tokens=2)
    err = assert_openai_error(e.value, 400, f"Previous response with id '{r.id}' not found.")
    assert err["param"] == "previous_response_id"


# ---- bad input ---------------------------------------------------------------------------


BAD = [
    # llama-server: "Cannot determine type of 'item'" (a 500 there: std::invalid_argument)
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    # beyond llama-server (it does not check): an output answering no call
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
     "No tool call found for function call output with call_id call_nope."),
    ({"input": [{"role": "tool", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "hi"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "not supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "arguments"),
    ({"input": "hi", "previous_response_id": "resp_unknown"},
     "Previous response with id 'resp_unknown' not found."),
    # llama-server skips non-function tools with a warning; refused here
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"instructions": "no input"}, "'input' is required"),
    ({"input": 7}, "input"),
    ({"input": []}, "must not be empty"),
]


def test_bad_input_is_a_400_in_openai_shape(server, oai):
    for body, words in BAD:
        for path in ("/v1/responses", "/v1/responses/input_tokens"):
            r = httpx.post(server.url + path, json={**body, "max_output_tokens": 2}, timeout=60)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert (err["code"], err["type"]) == (400, "invalid_request_error"), err
            assert words in err["message"], (words, err["message"])
    with pytest.raises(openai.BadRequestError):  # the SDK sees an OpenAI error
        oai.responses.create(model="any", input=[{"type": "nonsense"}])
    assert oai.responses.create(model="any", input="Still there?", max_output_tokens=2).output


# ---- in process: events, translation, store -----------------------------------------------


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in text.split("\n\n"):
        if frame.startswith("event: "):
            name, data = frame.split("\n", 1)
            out.append((name[7:], json.loads(data.removeprefix("data: "))))
    return out


def test_stream_of_reasoning_text_and_a_call(model):
    """A thinking template's reply with text and a call: reasoning item (done when the text
    starts), message item, function_call item, each added before its deltas and done before
    response.completed, every event valid for the SDK's types, in sequence; the completed
    Response equals the non-streamed one but for ids and times; the deltas add up to it."""
    m = dataclasses.replace(model, chat_template=ChatTemplate(QWEN3))
    text = ('<think>\nCheck the time.\n</think>\n\nLet me look.\n<tool_call>\n'
            '{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>')
    tool = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}
    c, _ = scripted_client(m, scripted(text, n=9))
    body = {"input": "Time in Rome?", "tools": [tool]}
    r = c.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    for name, data in events:
        assert data["type"] == name
        EVENTS.validate_python(data)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names.index("response.reasoning_text.done") < names.index(
        "response.output_text.delta")
    assert names[-1] == "response.completed"
    added = [d["item"]["type"] for n, d in events if n == "response.output_item.added"]
    done = [d["item"]["type"] for n, d in events if n == "response.output_item.done"]
    assert added == ["reasoning", "message", "function_call"] and sorted(done) == sorted(added)
    streamed = Response.model_validate(events[-1][1]["response"])
    assert streamed.output[0].content[0].text == "".join(
        d["delta"] for n, d in events if n == "response.reasoning_text.delta") == \
        "Check the time."
    assert streamed.output_text == "".join(
        d["delta"] for n, d in events if n == "response.output_text.delta") == "Let me look.\n"
    assert streamed.output[2].arguments == "".join(
        d["delta"] for n, d in events if n == "response.function_call_arguments.delta")

    c, _ = scripted_client(m, scripted(text, n=9))
    plain = Response.model_validate(c.post("/v1/responses", json=body).json())

    def strip(o: Any) -> Any:
        return {k: v for k, v in o.to_dict().items() if k not in ("id", "call_id")}
    assert [strip(o) for o in plain.output] == [strip(o) for o in streamed.output]
    assert plain.usage.output_tokens_details.reasoning_tokens > 0


def test_error_mid_stream_is_an_error_event_then_failed(model):
    """An engine error after the stream started: OpenAI's `error` event, then response.failed
    (llama-server sends a bare `data: {"error": ...}`); nothing is stored."""
    from radixserve.engine.task import PartialResult
    c, _ = scripted_client(model, [PartialResult("Hi", [10]),
                                   TaskError(500, "server_error", "boom")])
    events = sse_events(c.post("/v1/responses", json={"input": "x", "stream": True}).text)
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    err, failed = events[-2][1], events[-1][1]["response"]
    EVENTS.validate_python(err)
    assert err["message"] == "boom" and failed["status"] == "failed"
    assert c.get(f"/v1/responses/{failed['id']}").status_code == 404


def test_items_render_as_the_chat_conversation(model):
    """Input items become the chat request's messages: instructions a system message first;
    an assistant turn's reasoning, text and function calls one assistant message (tool_calls
    with the call_ids); each function_call_output a tool message; the prompt is the chat
    path's, token for token (as llama-server converts them)."""
    m = dataclasses.replace(model, chat_template=ChatTemplate(QWEN3))
    c, engine = scripted_client(m, scripted("ok"))
    items = [
        {"role": "developer", "content": "Be exact."},
        {"role": "user", "content": [{"type": "input_text", "text": "Time in Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_time",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
        {"role": "user", "content": "Thanks."},
    ]
    r = c.post("/v1/responses", json={"input": items, "instructions": "You tell the time."})
    assert r.status_code == 200, r.text
    messages = [
        {"role": "system", "content": "You tell the time."},
        {"role": "developer", "content": "Be exact."},
        {"role": "user", "content": "Time in Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_time", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "user", "content": "Thanks."},
    ]
    prompt = c.post("/apply-template", json={"messages": messages}).json()["prompt"]
    want = c.post("/tokenize", json={"content": prompt, "add_special": True,
                                      "parse_special": True}).json()["tokens"]
    assert engine.tasks[-1].prompt_tokens == want
    counted = c.post("/v1/responses/input_tokens", json={"input": items,
                                                         "instructions": "You tell the time."})
    assert counted.json() == {"object": "response.input_tokens", "input_tokens": len(want)}


def test_store_is_bounded_lru_and_thread_safe():
    """At most max_responses responses and max_chars characters (a response with its whole
    conversation); the least recently used go first (a lookup is a use); namespaces apart."""
    s = ResponseStore(max_responses=3, max_chars=10_000)
    for i in range(3):
        assert s.put("", f"r{i}", {"id": f"r{i}"}, [{"n": i}])
    assert s.get("", "r0") is not None  # r1 is now the least recently used
    s.put("", "r3", {"id": "r3"}, [])
    assert s.get("", "r1") is None and len(s) == 3
    assert s.get("other", "r0") is None and s.get("", "r0").conversation == [{"n": 0}]
    assert not s.put("", "huge", {"x": "y" * 20_000}, [])  # over the whole budget: not kept
    assert s.put("", "big", {"x": "y" * 9_990}, [])  # 10,000 characters: the others go
    assert len(s) == 1 and s.chars <= 10_000
    assert s.delete("", "big") and not s.delete("", "big") and s.chars == 0

    s = ResponseStore(max_responses=50, max_chars=1 << 20)

    def churn(t: int) -> None:
        for i in range(300):
            s.put(str(t % 2), f"{t}-{i}", {"i": i}, [{"t": t}])
            s.get(str(t % 2), f"{t}-{i - 1}")
            if i % 7 == 0:
                s.delete(str(t % 2), f"{t}-{i - 3}")
    threads = [threading.Thread(target=churn, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(s) <= 50 and s.chars == sum(e.chars for e in s._entries.values())


def test_llama_telemetry_on_the_events(model):
    """llama-server's telemetry, as its test_responses_stream_with_llama_telemetry reads it:
    with return_progress, response.in_progress events carry `prompt_progress`; with
    timings_per_token, a delta's event carries `timings`; response.completed carries the
    usage and, beside the response, the timings."""
    from radixserve.engine.task import PartialResult, Progress, Timings
    t = Timings(0, 3, 1.0, 1, 1.0)
    c, _ = scripted_client(model, [PartialResult("", [], progress=Progress(3, 0, 3, 1)),
                                   PartialResult("Hi", [10], timings=t), *scripted("Hi")[-1:]])
    events = sse_events(c.post("/responses", json={
        "input": "x", "stream": True, "return_progress": True,
        "timings_per_token": True}).text)
    names = [n for n, _ in events]
    assert names.count("response.created") == 1
    progress = [d for n, d in events if "prompt_progress" in d]
    assert progress and all(d["type"] == "response.in_progress" for d in progress)
    assert progress[0]["prompt_progress"]["total"] == 3
    assert any("timings" in d for n, d in events if n == "response.output_text.delta")
    assert names[-1] == "response.completed" and "timings" in events[-1][1]
    assert events[-1][1]["response"]["usage"]["input_tokens"] == 3


def test_final_items_no_delta_announced_are_added_and_done_in_order(model):
    """Items of the final parse that no delta announced (here: none was framed, the closing
    chunk alone) are each added, given their whole text or arguments as one delta and done
    with their final form, in order, before the next is added; every event is valid for the
    SDK's types; the completed Response is the non-streamed one and is stored."""
    from radixserve.config import RequestDefaults, ServerConfig
    from radixserve.http.oai_responses import ResponsesStream, parse_responses, response_body
    from radixserve.http.parse import ParseContext
    from radixserve.http.responses import ResponseContext
    from tests.http.test_tools import final

    m = dataclasses.replace(model, chat_template=ChatTemplate(QWEN3))
    ctx = ParseContext(m.tokenizer, m.chat_template, 2048, 2,
                       RequestDefaults.from_config(ServerConfig()))
    tool = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}
    text = ('<think>\nCheck the time.\n</think>\n\nLet me look.\n<tool_call>\n'
            '{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>')
    store = ResponseStore()
    body = {"input": "Time in Rome?", "tools": [tool], "stream": True}
    req = parse_responses(body, ctx, store)
    fmt = ResponsesStream(req, ResponseContext("m", m.tokenizer, 2048, id="resp_1"))
    closing = fmt.final(final(text, "eos"))[-1]
    assert "_final" in closing
    events = sse_events((fmt.frame(fmt.start()[0]) + fmt.frame(closing)).decode())
    for name, data in events:
        assert data["type"] == name
        EVENTS.validate_python(data)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = [d for n, d in events if n == "response.output_item.added"]
    done = [d for n, d in events if n == "response.output_item.done"]
    assert [d["output_index"] for d in added] == [d["output_index"] for d in done] == [0, 1, 2]
    assert [d["item"]["status"] for d in done] == ["completed"] * 3
    completed = events[-1][1]["response"]
    assert [d["item"] for d in done] == completed["output"]
    plain = response_body(final(text, "eos"), parse_responses(
        {**body, "stream": False, "store": False}, ctx, store), ResponseContext(
            "m", m.tokenizer, 2048, id="resp_2"))
    assert [o["type"] for o in plain["output"]] == ["reasoning", "message", "function_call"]
    assert [{k: v for k, v in o.items() if k not in ("id", "call_id")}
            for o in completed["output"]] == [
        {k: v for k, v in o.items() if k not in ("id", "call_id")} for o in plain["output"]]
    assert store.get("", "resp_1").response == completed


def test_a_chain_is_counted_by_its_new_items_only(model, monkeypatch):
    """The store's size of a response's conversation is the previous response's plus its new
    items' (its input and output): a turn serializes no list of items (the whole chain), and
    the counts are those of the whole conversations."""
    from radixserve.http import response_store

    dumped: list[Any] = []
    real = response_store._chars
    monkeypatch.setattr(response_store, "_chars", lambda obj: dumped.append(obj) or real(obj))
    stores: list[ResponseStore] = []
    put = ResponseStore.put
    monkeypatch.setattr(ResponseStore, "put",
                        lambda self, *a, **k: stores.append(self) or put(self, *a, **k))
    c, _ = scripted_client(model, scripted("Fine, thanks.", n=2))
    prev = None
    for q in ("Hello?", "How are you?", "And then?"):
        r = c.post("/v1/responses", json={"input": q, **({"previous_response_id": prev}
                                                         if prev else {})})
        assert r.status_code == 200, r.text
        prev = r.json()["id"]
    assert not [o for o in dumped if isinstance(o, list)]
    entries = list(stores[-1]._entries.values())
    assert [len(e.conversation) for e in entries] == [2, 4, 6]
    for e in entries:
        assert e.conversation_chars == response_store.items_chars(e.conversation)
        assert e.chars == real(e.response) + e.conversation_chars


def test_get_and_delete_at_responses_without_v1(model):
    """GET and DELETE of a stored response at /responses/{id} too, as POST /responses."""
    c, _ = scripted_client(model, scripted("Hi"))
    r = c.post("/responses", json={"input": "x"}).json()
    got = c.get(f"/responses/{r['id']}")
    assert got.status_code == 200 and got.json() == c.get(f"/v1/responses/{r['id']}").json()
    assert got.json()["id"] == r["id"] and got.json()["output"] == r["output"]
    gone = c.delete(f"/responses/{r['id']}")
    assert gone.json() == {"id": r["id"], "object": "response", "deleted": True}
    for missing in (c.get(f"/responses/{r['id']}"), c.delete(f"/responses/{r['id']}")):
        assert missing.status_code == 404
        err = missing.json()["error"]
        assert err["type"] == "invalid_request_error" and r["id"] in err["message"]


def test_input_tokens_does_not_build_the_task(model, monkeypatch):
    """/v1/responses/input_tokens counts the chat prompt's tokens (chat_tokens, as
    /v1/messages/count_tokens and /v1/chat/completions/input_tokens) without the whole chat
    parse (grammars, the task): the count is create's prompt length."""
    from radixserve.http import oai_responses

    c, engine = scripted_client(model, scripted("ok"))
    body = {"input": "How many tokens?", "instructions": "Count."}
    assert c.post("/v1/responses", json=body).status_code == 200
    n = len(engine.tasks[-1].prompt_tokens)

    def no_parse(*a: Any, **k: Any) -> Any:
        raise AssertionError("input_tokens ran parse_chat")
    monkeypatch.setattr(oai_responses, "parse_chat", no_parse)
    r = c.post("/v1/responses/input_tokens", json=body)
    assert r.json() == {"object": "response.input_tokens", "input_tokens": n}
