"""The client parses streamed chat completions: TTFT on text (not the role chunk), llama.cpp
timings when present, OpenAI usage otherwise; turns of a session run in order with history."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from radixserve.bench import client as bench_client
from radixserve.bench.client import RequestOptions, chat_body, run_sessions
from radixserve.bench.scenarios import Session


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
        b"data: [DONE]\n\n"


def _delta(text: str | None, role: bool = False) -> dict:
    d = {"role": "assistant", "content": None} if role else {"content": text}
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}


_real_client = httpx.AsyncClient


def _run(monkeypatch: pytest.MonkeyPatch, handler, sessions: list[Session],
         concurrency: int = 1, api: str = "chat"):
    def patched(**kw):  # the client under test, over an in-process transport
        return _real_client(transport=httpx.MockTransport(handler), **kw)

    monkeypatch.setattr(bench_client.httpx, "AsyncClient", patched)
    return asyncio.run(run_sessions("http://x", sessions, concurrency,
                                    RequestOptions(n_predict=4, api=api)))


def _named(*events: tuple[str, dict]) -> bytes:
    return b"".join(f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in events)


def test_messages_api_turns_and_cache_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """Anthropic's stream: the system prompt apart, text from text deltas, computed = input +
    cache creation, reused = cache read."""
    seen: list[dict] = []

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.url.path == "/v1/messages"
        seen.append(json.loads(req.content))
        usage = {"input_tokens": 2, "cache_read_input_tokens": 10 * len(seen),
                 "cache_creation_input_tokens": 5, "output_tokens": 0}
        return httpx.Response(200, content=_named(
            ("message_start", {"type": "message_start", "message": {"usage": usage}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": f"r{len(seen)}"}}),
            ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 3}}),
            ("message_stop", {"type": "message_stop"})))

    recs, _ = _run(monkeypatch, handler, [Session("c", "chat", "sys", ("u1", "u2"))],
                   api="messages")
    assert seen[1]["system"] == "sys" and seen[1]["messages"] == [
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "r1"},
        {"role": "user", "content": "u2"}]
    assert (recs[1].cache_n, recs[1].prompt_n, recs[1].predicted_n) == (20, 7, 3)
    assert recs[1].reply == "r2" and recs[1].ttft_s is not None


def test_responses_api_chains_previous_response_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenAI responses: the first turn sends the conversation, later ones only the new
    message and the previous response's id; cached tokens from usage."""
    seen: list[dict] = []

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.url.path == "/v1/responses"
        seen.append(json.loads(req.content))
        n = len(seen)
        usage = {"input_tokens": 30 * n, "input_tokens_details": {"cached_tokens": 20 * n},
                 "output_tokens": 4}
        return httpx.Response(200, content=_named(
            ("response.created", {"type": "response.created", "response": {"id": f"resp_{n}"}}),
            ("response.output_text.delta", {"type": "response.output_text.delta",
                                            "delta": f"r{n}"}),
            ("response.completed", {"type": "response.completed",
                                    "response": {"id": f"resp_{n}", "usage": usage}})))

    recs, _ = _run(monkeypatch, handler, [Session("c", "chat", "sys", ("u1", "u2", "u3"))],
                   api="responses")
    assert "previous_response_id" not in seen[0] and seen[0]["input"][0]["role"] == "system"
    assert [b.get("previous_response_id") for b in seen[1:]] == ["resp_1", "resp_2"]
    assert seen[2]["input"] == [{"role": "user", "content": "u3"}]
    assert (recs[2].cache_n, recs[2].prompt_n, recs[2].predicted_n) == (60, 30, 4)
    assert [r.reply for r in recs] == ["r1", "r2", "r3"]


def test_timings_and_history(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[dict]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        seen.append(body["messages"])
        turn = len(seen)
        timings = {"cache_n": 10 * turn, "prompt_n": 5, "predicted_n": 4, "prompt_ms": 1.0}
        last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                "timings": timings}
        return httpx.Response(200, content=_sse(_delta(None, role=True), _delta(f"r{turn}"),
                                                _delta(" end"), last))

    recs, wall = _run(monkeypatch, handler, [Session("c", "chat", "sys", ("u1", "u2"))])
    assert [r.turn for r in recs] == [0, 1] and wall > 0
    assert recs[1].cache_n == 20 and recs[1].prompt_n == 5 and recs[1].predicted_n == 4
    assert all(r.ttft_s is not None and 0 <= r.ttft_s <= r.latency_s for r in recs)
    assert seen[1] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                       {"role": "assistant", "content": "r1 end"},
                       {"role": "user", "content": "u2"}]


def test_usage_fallback_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        if json.loads(req.content)["messages"][0]["content"] == "bad":
            return httpx.Response(500, json={"error": {"message": "no"}})
        usage = {"prompt_tokens": 30, "completion_tokens": 4,
                 "prompt_tokens_details": {"cached_tokens": 24}}
        return httpx.Response(200, content=_sse(_delta("hi"), {"choices": [], "usage": usage}))

    recs, _ = _run(monkeypatch, handler, [Session("a", "g", "ok", ("q",)), Session("b", "g", "bad", ("q",))],
                   concurrency=2)
    ok = next(r for r in recs if r.session == "a")
    bad = next(r for r in recs if r.session == "b")
    assert (ok.cache_n, ok.prompt_n, ok.predicted_n) == (24, 6, 4)
    assert bad.error is not None and "500" in bad.error


def test_chat_body_sets_strict_no_cache_and_fixed_length() -> None:
    b = chat_body([{"role": "user", "content": "x"}], RequestOptions(7, cache_prompt=False))
    assert b["cache_prompt"] is False and b["max_tokens"] == 7 and b["ignore_eos"] is True
    assert b["stream"] is True and b["temperature"] == 0.0


def test_a_scenarios_request_fields_reach_every_measured_body() -> None:
    from radixserve.bench.scenarios import load_scenario

    s = load_scenario("decode-4-json")
    assert s.request_fields["json_schema"]["minItems"] >= s.n_predict  # cannot end early
    b = chat_body([{"role": "user", "content": "x"}], RequestOptions(7, fields=s.request_fields))
    assert b["json_schema"] == s.request_fields["json_schema"] and b["ignore_eos"] is True


def test_speculation_timings_are_recorded_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        spec = json.loads(req.content)["messages"][0]["content"] == "spec"
        timings = {"cache_n": 0, "prompt_n": 5, "predicted_n": 4, "predicted_ms": 20.0,
                   "predicted_per_second": 150.0}
        if spec:
            timings |= {"draft_n": 6, "draft_n_accepted": 2}
        last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                "timings": timings}
        return httpx.Response(200, content=_sse(_delta("quoted"), _delta(" text"), last))

    recs, _ = _run(monkeypatch, handler, [Session("s", "g", "spec", ("q",)),
                                          Session("n", "g", "plain", ("q",))])
    spec = next(r for r in recs if r.session == "s")
    plain = next(r for r in recs if r.session == "n")
    assert (spec.draft_n, spec.draft_n_accepted) == (6, 2)
    assert plain.draft_n is None and plain.draft_n_accepted is None
    assert spec.predicted_per_second == plain.predicted_per_second == 150.0
    assert spec.reply == plain.reply == "quoted text"  # the content, kept for comparisons


def test_reply_ids_from_logprobs_feed_the_unshared_minimum(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A reply whose text re-tokenizes to other ids (here: 'ab' generated as a, b; the
    tokenizer merges it) counts by the ids the server generated when it sent them."""
    from radixserve.bench.client import sent_token_ids
    from radixserve.bench.stats import unshared_minimum

    def chat(req: httpx.Request) -> httpx.Response:
        lp = {"content": [{"id": 7, "token": "a", "logprob": 0.0},
                          {"id": 8, "token": "b", "logprob": 0.0}]}
        last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        return httpx.Response(200, content=_sse(
            {"choices": [{"index": 0, "delta": {"content": "ab"}, "logprobs": lp}]}, last))

    recs, _ = _run(monkeypatch, chat, [Session("c", "chat", "sys", ("u1",))])
    assert recs[0].reply == "ab" and recs[0].reply_ids == [7, 8]

    def server(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        if req.url.path == "/apply-template":
            return httpx.Response(200, json={"prompt": "P"})
        return httpx.Response(200, json={"tokens": {"P": [1, 2], "ab": [9]}[body["content"]]})

    monkeypatch.setattr(bench_client.httpx, "AsyncClient",
                        lambda **kw: _real_client(transport=httpx.MockTransport(server), **kw))
    sent = [(recs[0], [{"role": "user", "content": "u1"}])]
    ids = asyncio.run(sent_token_ids("http://x", sent))
    assert ids == [([1, 2], [7, 8])]
    recs[0].reply_ids = None  # a server that sends no ids: the text, tokenized alone
    assert asyncio.run(sent_token_ids("http://x", sent)) == [([1, 2], [9])]
    # a next prompt holding the generated ids shares them; by the text it would not
    assert unshared_minimum([([1, 2], [7, 8]), ([1, 2, 7, 8, 5], [])]) == 2 + 2
