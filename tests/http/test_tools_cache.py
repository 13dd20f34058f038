"""Tools and grammars take the same cache path as any prompt (issue #14): an agent's system
prompt and tool definitions, rendered by the chat template into text tokens, are reused by the
next request whole - from its slot, and from the radix host tier once both slots have served
something else - and the answer computed on the reused prefix equals the one computed without
any cache (f32: bf16 near-ties are issue #15's)."""

from __future__ import annotations

import random

import httpx
import pytest

from radixserve.bench.scenarios import make_text
from tests.http.harness import running_server

pytestmark = pytest.mark.model

SYSTEM = ("You are the support agent of a weather service. Use the tools to look things up. "
          "Policies: " + make_text(random.Random(3), 300))
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                  "maxLength": 20}},
                       "required": ["city"]}}},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("tools-cache") / "server.log")
    with running_server(["--dtype", "f32", "-np", "2", "-c", "8192", "--metrics"], log) as srv:
        yield srv


def post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def agent_body(question: str, **kw) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}],
            "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 48,
            **kw}


def prompt_tokens(srv, body: dict) -> list[int]:
    text = post(srv, "/apply-template", body)["prompt"]
    return post(srv, "/tokenize", {"content": text, "add_special": True,
                                   "parse_special": True})["tokens"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_tools_prefix_is_reused_from_the_slot_and_the_radix_tier(server):
    questions = ["What is the weather in Paris?", "What time is it in Tokyo?",
                 "Is it raining in Lima right now?"]
    toks = [prompt_tokens(server, agent_body(q)) for q in questions]
    shared = min(common_prefix(toks[0], toks[1]), common_prefix(toks[0], toks[2]))
    system_only = post(server, "/tokenize", {"content": SYSTEM})["tokens"]
    assert shared > len(system_only) + 100  # the tools' description is in the shared part

    first = post(server, "/v1/chat/completions", agent_body(questions[0], id_slot=0))
    second = post(server, "/v1/chat/completions", agent_body(questions[1], id_slot=0))
    assert second["timings"]["cache_n"] >= shared  # from the slot

    # both slots serve unrelated prompts: the tools prefix survives only in the host tier
    other = {"temperature": 0, "max_tokens": 4}
    for slot in (0, 1):
        post(server, "/completion", {"prompt": make_text(random.Random(slot), 400),
                                     "id_slot": slot, "n_predict": 4, **other})
    third = post(server, "/v1/chat/completions", agent_body(questions[2]))
    assert third["timings"]["cache_n"] >= shared  # from the radix tree

    # every party's answer equals the same request computed without any cache
    for q, got in zip(questions, (first, second, third)):
        ref = post(server, "/v1/chat/completions", agent_body(q, cache_prompt=False))
        assert ref["timings"]["cache_n"] == 0
        assert calls_of(got) == calls_of(ref)
        assert calls_of(got) and calls_of(got)[0][0] in ("get_weather", "get_time")


def calls_of(resp: dict) -> list[tuple[str, str]]:
    """The (name, arguments) of a reply's tool calls (ids are random per request)."""
    msg = resp["choices"][0]["message"]
    return [(c["function"]["name"], c["function"]["arguments"])
            for c in msg.get("tool_calls") or []]
