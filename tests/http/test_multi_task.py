"""Several tasks per request (prompt arrays, n / n_cmpl), response_fields and --context-shift
over HTTP, in-process on the default model with the real engine (one engine for the module).

Every multi-task result is compared with real single requests (greedy, f32: cached ==
uncached bit for bit), each party's output checked.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from tests.http.harness import app_client

pytestmark = pytest.mark.model
N_CTX_SLOT = 256


@pytest.fixture(scope="module")
def client(default_path, default_f32_dequant):
    cfg = ServerConfig(model=default_path, dtype="f32", weights="dequant", n_parallel=2,
                       ctx_size=2 * N_CTX_SLOT, cache_ram_mib=0, context_shift=True)
    with app_client(Engine(default_f32_dequant, cfg), cfg) as c:
        yield c


def post(c: TestClient, path: str, **body: Any) -> Any:
    body = {"temperature": 0, "n_predict": 8, **body}
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def events(c: TestClient, path: str, **body: Any) -> list[Any]:
    body = {"temperature": 0, "n_predict": 8, "stream": True, **body}
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.split("\n"):
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


PROMPTS = ["The capital of France is", "Water boils at a temperature of"]


def test_prompt_array_returns_results_in_order_equal_to_single_requests(client):
    singles = [post(client, "/completion", prompt=p, cache_prompt=False) for p in PROMPTS]
    many = post(client, "/completion", prompt=PROMPTS)
    assert isinstance(many, list) and [r["index"] for r in many] == [0, 1]
    assert [r["content"] for r in many] == [s["content"] for s in singles]
    assert [r["tokens_evaluated"] for r in many] == [s["tokens_evaluated"] for s in singles]
    assert all(s["content"] for s in singles)

    text = post(client, "/v1/completions", prompt=PROMPTS, max_tokens=8)
    assert [ch["index"] for ch in text["choices"]] == [0, 1]
    assert [ch["text"] for ch in text["choices"]] == [s["content"] for s in singles]


def test_prompt_array_streams_chunks_with_their_index(client):
    singles = [post(client, "/completion", prompt=p, cache_prompt=False)["content"]
                for p in PROMPTS]
    evs = events(client, "/completion", prompt=PROMPTS)
    text = {0: "", 1: ""}
    finals = {}
    for e in evs:
        text[e["index"]] += e["content"]
        if e["stop"]:
            finals[e["index"]] = e
    assert [text[0], text[1]] == singles and sorted(finals) == [0, 1]
    assert "[DONE]" not in evs

    evs = events(client, "/v1/completions", prompt=PROMPTS, max_tokens=8)
    assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
    got = {0: "", 1: ""}
    for e in evs[:-1]:
        for ch in e["choices"]:
            got[ch["index"]] += ch["text"]
    assert [got[0], got[1]] == singles

    msgs = [{"role": "user", "content": "Name a fruit."}]
    one = post(client, "/v1/chat/completions", messages=msgs, max_tokens=6, cache_prompt=False)
    evs = events(client, "/v1/chat/completions", messages=msgs, max_tokens=6, n=2)
    assert evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
    got, roles, finish = {0: "", 1: ""}, set(), set()
    for e in evs[:-1]:
        for ch in e["choices"]:
            got[ch["index"]] += ch["delta"].get("content") or ""
            if ch["delta"].get("role"):
                roles.add(ch["index"])
            if ch["finish_reason"]:
                finish.add(ch["index"])
    assert roles == finish == {0, 1}
    assert [got[0], got[1]] == [one["choices"][0]["message"]["content"]] * 2


def test_n_completions_compute_the_prompt_once(client):
    prompt = "Once upon a time, in a small village by the sea, there lived"
    many = post(client, "/completion", prompt=prompt, n=2, n_predict=10)
    alone = post(client, "/completion", prompt=prompt, n_predict=10, cache_prompt=False)
    assert isinstance(many, list) and [r["index"] for r in many] == [0, 1]
    n = alone["tokens_evaluated"]
    assert many[0]["timings"]["prompt_n"] == n  # computed once, by the first
    assert (many[1]["timings"]["prompt_n"], many[1]["timings"]["cache_n"]) == (1, n - 1)
    assert [r["content"] for r in many] == [alone["content"]] * 2 and alone["content"]
    assert many[0]["id_slot"] != many[1]["id_slot"]

    msgs = [{"role": "user", "content": "Name a color."}]
    chat = post(client, "/v1/chat/completions", messages=msgs, n=2, max_tokens=8)
    one = post(client, "/v1/chat/completions", messages=msgs, max_tokens=8, cache_prompt=False)
    assert [ch["index"] for ch in chat["choices"]] == [0, 1]
    assert [ch["message"]["content"] for ch in chat["choices"]] == [
        one["choices"][0]["message"]["content"]] * 2

    r = client.post("/completion", json={"prompt": prompt, "n": 3})
    assert r.status_code == 400 and "Field 'n'" in r.json()["error"]["message"]


def test_response_fields_filter_the_completion(client):
    r = post(client, "/completion", prompt=PROMPTS[0],
             response_fields=["content", "generation_settings/n_predict", "timings/nope",
                              "stop_type"])
    assert set(r) == {"content", "generation_settings/n_predict", "stop_type"}
    assert r["generation_settings/n_predict"] == 8 and r["stop_type"] == "limit"
    assert r["content"] == post(client, "/completion", prompt=PROMPTS[0])["content"]


def test_generation_past_the_slot_context_with_context_shift(client):
    n_predict = N_CTX_SLOT + 40
    r = post(client, "/completion", prompt=PROMPTS[0], n_predict=n_predict, ignore_eos=True,
             n_keep=4)
    assert r["tokens_predicted"] == n_predict and r["truncated"] is True
    assert r["stop_type"] == "limit" and r["generation_settings"]["n_keep"] == 4
    assert r["tokens_cached"] < N_CTX_SLOT
