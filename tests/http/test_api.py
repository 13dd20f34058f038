"""A real server process on the default model, driven by the `openai` client and raw HTTP."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.http.harness import running_server

pytestmark = pytest.mark.model

DOC = (
    "The Amazon rainforest covers much of the Amazon basin of South America. "
    "It spans nine nations and holds the largest biodiversity of any tropical forest. "
) * 8


# Both weight paths, each where cached and uncached runs agree to the bit: the dequantized
# weights in f32, and the native path as a server runs by default (packed Q4_1 in our kernels,
# bf16 activations, the deterministic mode, which keeps a fresh and an in-slot-cached prompt's
# logits bitwise equal; it used to run in f32 on torch's int4 kernel, ~10x slower).
WEIGHT_ARGS = {"dequant": ["--dtype", "f32", "--weights", "dequant"],
               "native": ["--weights", "native", "--deterministic", "on"]}


@pytest.fixture(scope="module", params=list(WEIGHT_ARGS))
def server(tmp_path_factory, request):
    log = str(tmp_path_factory.mktemp("srv") / "server.log")
    args = [*WEIGHT_ARGS[request.param], "-np", "4", "-c", "8192", "--metrics", "--cache-ram",
            "0"]
    with running_server(args, log) as srv:
        yield srv


def post(srv, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120, **kw)


def tokenize(srv, text: str) -> list[int]:
    return post(srv, "/tokenize", {"content": text}).json()["tokens"]


def complete(srv, prompt, **fields) -> dict:
    body = {"prompt": prompt, "temperature": 0, "n_predict": 16, **fields}
    r = post(srv, "/completion", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_client_chat_and_completions(server):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    # greedy, the default model answers this in one sentence and stops (as llama-server on the
    # same GGUF, whose 8-bit activations ours match: without "Answer in one word." both say
    # "L'Étoile, la Marseillaise, ..." until the length runs out)
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    chat = client.chat.completions.create(model="x", messages=msgs, temperature=0, max_tokens=20)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens > 0

    stream = client.chat.completions.create(model="x", messages=msgs, temperature=0,
                                            max_tokens=20, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for ch in stream:
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == chat.choices[0].message.content
    assert finish == "stop" and usage is not None and usage.completion_tokens > 0
    # the same prompt again: its slot still holds it, all but the last token is reused
    assert usage.prompt_tokens == chat.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1

    comp = client.completions.create(model="x", prompt="The capital of France is",
                                     temperature=0, max_tokens=8)
    text = comp.choices[0].text
    assert text and comp.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="The capital of France is", temperature=0, max_tokens=8, stream=True)
        if c.choices)
    assert streamed == text


def stream_tokens(srv, prompt: str, n: int) -> str:
    body = {"prompt": prompt, "temperature": 0, "n_predict": n, "stream": True}
    out = []
    with httpx.stream("POST", srv.url + "/completion", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:])["content"])
    return "".join(out)


def test_eight_concurrent_streams_on_four_slots_equal_alone(server):
    prompts = [f"Story {i}: once upon a time in a land of {w}," for i, w in
               enumerate(["ice", "fire", "sand", "glass", "rain", "iron", "salt", "wind"])]
    alone = [stream_tokens(server, p, 24) for p in prompts]
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(lambda p: stream_tokens(server, p, 24), prompts))
    assert together == alone
    assert all(alone)


def test_follow_up_reuses_the_slot_prefix(server):
    first = complete(server, DOC + "Question one: how many nations?", id_slot=1)
    n_shared = len(tokenize(server, DOC))
    follow = DOC + "Question two: what does it hold?"
    second = complete(server, follow, id_slot=1)
    t = second["timings"]
    assert t["cache_n"] >= n_shared - 1
    assert t["prompt_n"] == len(tokenize(server, follow)) - t["cache_n"]
    fresh = complete(server, follow, id_slot=2, cache_prompt=False)
    assert fresh["timings"]["cache_n"] == 0
    assert second["content"] == fresh["content"]
    assert first["timings"]["cache_n"] < t["cache_n"]


def test_identical_request_recomputes_only_the_last_token(server):
    p = DOC + "Summarize."
    complete(server, p, id_slot=3)
    again = complete(server, p, id_slot=3)
    n = len(tokenize(server, p))
    assert again["timings"]["cache_n"] == n - 1 and again["timings"]["prompt_n"] == 1


def test_cache_reuse_shifts_the_tail_unless_deterministic(server):
    head = tokenize(server, "Notes:\n")
    tail = tokenize(server, DOC)
    inserted = tokenize(server, " An inserted remark about rivers and fish.")
    complete(server, head + tail, id_slot=0)
    prompt = head + inserted + tail
    reused = complete(server, prompt, id_slot=0, n_cache_reuse=16)
    t = reused["timings"]
    if httpx.get(server.url + "/props").json()["deterministic"]:
        # the mode never shifts (a shifted key's bits differ from a computed one's): the head
        # by prefix match only
        assert t["cache_n"] == len(head)
    else:
        # the head by prefix match, the tail by shifting (minus the one token always evaluated)
        assert t["cache_n"] >= len(head) + len(tail) - 1
    assert t["prompt_n"] == len(prompt) - t["cache_n"]
    full = complete(server, prompt, id_slot=0, cache_prompt=False)
    assert reused["content"] == full["content"]


def test_disconnect_mid_stream_frees_the_slot(server):
    body = {"prompt": "Count forever:", "n_predict": 4000, "ignore_eos": True, "stream": True,
            "id_slot": 2}
    with httpx.stream("POST", server.url + "/completion", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 3:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        slots = httpx.get(server.url + "/slots").json()
        if not slots[2]["is_processing"]:
            break
        time.sleep(0.2)
    assert not slots[2]["is_processing"]
    assert complete(server, "Hello", id_slot=2)["content"] is not None


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_counters_move_by_known_amounts(server):
    before = {n: metric(server, f"llamacpp:{n}") for n in
              ("prompt_tokens_total", "tokens_predicted_total", "n_decode_total")}
    res = complete(server, "Metrics check: one two three", n_predict=5, ignore_eos=True,
                   cache_prompt=False, id_slot=1)
    after = {n: metric(server, f"llamacpp:{n}") for n in before}
    assert (after["prompt_tokens_total"] - before["prompt_tokens_total"]
            == res["timings"]["prompt_n"])
    assert after["tokens_predicted_total"] - before["tokens_predicted_total"] == 5
    assert after["n_decode_total"] - before["n_decode_total"] >= 5
