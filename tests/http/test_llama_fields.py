"""llama-server's request fields and routes beside the completion itself, in-process on the tiny
model's real engine: `verbose` (`__verbose`), assistant prefill and `continue_final_message`,
`return_progress`, `/chat/completions/input_tokens`, content-part embedding inputs, and
`timings` holding numbers only with `reuse` beside it. What llama-server does is cited from its
source (tools/server/server-common.cpp, server-task.cpp, server-context.cpp) at each test.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.flags import parse_serve
from radixserve.model.loader import Model
from tests.http.harness import app_client

USER = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def c(model: Model) -> Iterator[TestClient]:
    """One engine for the module: every test reads answers and counts of its own prompts."""
    cfg = ServerConfig(ctx_size=1024, n_parallel=1, batch_size=16, ubatch_size=16,
                       embeddings=True, pooling="last")
    with app_client(Engine(model, cfg), cfg) as client:
        yield client


def events(c: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with c.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def assert_numeric_timings(body: dict[str, Any]) -> None:
    t = body["timings"]
    assert t and all(isinstance(v, (int, float)) and math.isfinite(v) for v in t.values()), t


def test_timings_hold_numbers_only_and_reuse_sits_beside_them(c: TestClient) -> None:
    """llama-server's `timings` (server-task.cpp result_timings::to_json) holds numbers only;
    our `reuse` report goes next to it, in every shape (the slow tier checks the streamed
    ones on a server process: tests/http/test_radix_http.py)."""
    body = {"messages": USER + [{"role": "user", "content": "again"}], "max_tokens": 2}
    for _ in range(2):
        chat = c.post("/v1/chat/completions", json=body).json()
    assert_numeric_timings(chat)
    assert chat["reuse"]["tier"] == "slot" and chat["reuse"]["n_tokens"] == chat["timings"][
        "cache_n"] > 0
    native = c.post("/completion", json={"prompt": "abc", "n_predict": 2}).json()
    assert_numeric_timings(native) or native["reuse"]["tier"] in ("slot", "none")


def test_verbose_adds_the_native_result(model: Model, c: TestClient) -> None:
    """`verbose: true` (server-schema.cpp) puts `__verbose`, the native result with the prompt
    as rendered and the raw text (to_json_non_oaicompat), on OpenAI answers: non-streamed,
    and on a stream's final chunk (server-task.cpp: the final deltas' front)."""
    body = {"messages": USER, "max_tokens": 4, "temperature": 0}
    plain = c.post("/v1/chat/completions", json=body).json()
    assert "__verbose" not in plain
    r = c.post("/v1/chat/completions", json=body | {"verbose": True}).json()
    v = r["__verbose"]
    rendered = c.post("/apply-template", json={"messages": USER}).json()["prompt"]
    assert v["prompt"] == rendered and v["content"] == r["choices"][0]["message"]["content"]
    assert v["stop"] is True and v["tokens_predicted"] == r["usage"]["completion_tokens"]
    text = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "verbose": True})
    assert text.json()["__verbose"]["content"] == text.json()["choices"][0]["text"]
    chunks = events(c, "/v1/chat/completions", body | {"verbose": True})
    marked = [e for e in chunks if "__verbose" in e]
    assert len(marked) == 1 and marked[0]["choices"][0]["finish_reason"] is not None
    assert marked[0]["__verbose"]["content"] == v["content"]


def test_verbose_flag_is_the_default_a_request_can_turn_off(model: Model) -> None:
    """llama-server: params.verbose = verbosity > 9 (-v sets it to infinity); the request's
    field wins."""
    cfg = parse_serve(["-v", "-c", "512", "-np", "1"], environ={}).cfg
    assert cfg.log_verbosity > 9
    with app_client(Engine(model, cfg), cfg) as client:
        body = {"messages": USER, "max_tokens": 2}
        assert "__verbose" in client.post("/v1/chat/completions", json=body).json()
        off = client.post("/v1/chat/completions", json=body | {"verbose": False}).json()
        assert "__verbose" not in off


def prompt_of(c: TestClient, body: dict[str, Any]) -> str:
    return c.post("/v1/chat/completions", json=body | {"max_tokens": 1, "verbose": True}
                  ).json()["__verbose"]["prompt"]


def test_a_final_assistant_message_is_continued(c: TestClient) -> None:
    """server-common.cpp oaicompat_chat_params_parse: a final assistant message is continued
    (prefill) whatever add_generation_prompt says; `continue_final_message` (true or
    "content") asks for it with add_generation_prompt false; the contradictions are 400s
    with llama-server's messages."""
    head = c.post("/apply-template", json={"messages": USER}).json()["prompt"]
    prefill = USER + [{"role": "assistant", "content": "Red, green"}]
    assert prompt_of(c, {"messages": prefill}) == head + "Red, green"
    asked = {"messages": prefill, "add_generation_prompt": False}
    for value in (True, "content"):
        assert prompt_of(c, asked | {"continue_final_message": value}) == head + "Red, green"
    assert prompt_of(c, asked) == head + "Red, green"  # prefill whatever add_generation_prompt

    # the answer's message starts with the continued text (llama-server's chat parser reads
    # the prompt's tail); a stream sends it first, unless continue_final_message asked
    body = {"messages": prefill, "max_tokens": 3, "temperature": 0}
    done = c.post("/v1/chat/completions", json=body).json()
    text = done["choices"][0]["message"]["content"]
    assert text.startswith("Red, green") and len(text) > len("Red, green")

    def streamed(extra: dict[str, Any]) -> str:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events(
            c, "/v1/chat/completions", body | extra) if e.get("choices"))

    assert streamed({}) == text
    assert streamed({"continue_final_message": True, "add_generation_prompt": False}) == \
        text[len("Red, green"):]

    def refused(body: dict[str, Any], message: str) -> None:
        r = c.post("/v1/chat/completions", json=body | {"max_tokens": 1})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text

    two = prefill + [{"role": "assistant", "content": "and blue"}]
    refused({"messages": two}, "Cannot have 2 or more assistant messages at the end of the list.")
    refused({"messages": prefill, "continue_final_message": True},
            "Cannot set both add_generation_prompt and continue_final_message to true.")
    refused({"messages": USER, "add_generation_prompt": False, "continue_final_message": True},
            "the last message must be the assistant's")
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    refused({"messages": USER + [{"role": "assistant", "content": "", "tool_calls": calls}]},
            "Cannot continue an assistant message that contains tool calls.")
    refused(asked | {"continue_final_message": "reasoning_content"}, "continue_final_message")


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions"])
def test_return_progress_streams_prompt_progress(c: TestClient, path: str) -> None:
    """`return_progress` (server-context.cpp send_partial_response(is_progress)): a stream
    gets `prompt_progress` {total, cache, processed, time_ms} when the prompt starts and as it
    is computed (batches of 16 here), before the text; a cached prefix shows in `cache`."""
    words = " ".join(f"w{i}" for i in range(40)) + path
    body = ({"prompt": words, "n_predict": 2} if path == "/completion"
            else {"messages": [{"role": "user", "content": words}], "max_tokens": 2})
    for run in range(2):
        got = events(c, path, body | {"return_progress": True})
        progress = [e["prompt_progress"] for e in got if "prompt_progress" in e]
        total = progress[0]["total"]
        assert len(progress) >= (3 if run == 0 else 2) and total > 40
        assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)
        assert progress[-1]["processed"] == total and all(p["total"] == total for p in progress)
        assert progress[0]["processed"] == progress[0]["cache"]
        first_text = next(i for i, e in enumerate(got) if "prompt_progress" not in e
                          and (e.get("content") or e.get("choices", [{}])[0].get("delta", {})
                               .get("content")))
        assert all("prompt_progress" not in e for e in got[first_text:])
        if path != "/completion":  # as llama-server: the role delta carries it
            assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": None}
                       for e in got if "prompt_progress" in e)
        if run == 1:
            assert progress[0]["cache"] >= total - 16  # the first run's prompt, served
    assert not any("prompt_progress" in e for e in events(c, path, body))


def test_chat_input_tokens_count_what_the_completion_reports(c: TestClient) -> None:
    """/chat/completions/input_tokens (server-context.cpp post_chat_completions_tok):
    {input_tokens} without running the prompt; the completion's usage agrees."""
    body = {"messages": USER + [{"role": "assistant", "content": "Red"},
                                {"role": "user", "content": "More?"}]}
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        n = c.post(path, json=body).json()
        assert n == {"input_tokens": n["input_tokens"], "object": "response.input_tokens"}
        assert n["input_tokens"] > 10
    done = c.post("/v1/chat/completions", json=body | {"max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == n["input_tokens"]
    bad = c.post("/v1/chat/completions/input_tokens", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_embedding_inputs_as_content_parts(c: TestClient) -> None:
    """llama-server's handle_embeddings_impl reads `{"content": [parts]}` inputs as the text
    of their parts (tokenize_oai_content_array); a part alone reads the same here; media
    parts are refused as llama-server refuses them without a projector."""
    def vectors(inp: Any) -> list[list[float]]:
        r = c.post("/v1/embeddings", json={"input": inp})
        assert r.status_code == 200, r.text
        return [d["embedding"] for d in r.json()["data"]]

    text = vectors(["The sky is blue.", "Grass"])
    parts = [{"type": "text", "text": "The sky "}, {"type": "text", "text": "is blue."}]
    assert vectors([{"content": parts}, {"type": "text", "text": "Grass"}]) == text
    assert vectors({"content": parts}) == text[:1]
    for bad, message in (({"content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                          "image input is not supported"),
                         ({"content": [{"type": "mystery"}]}, "unsupported content[].type"),
                         ({"content": "x"}, '"content" must be an array')):
        r = c.post("/v1/embeddings", json={"input": [bad]})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
