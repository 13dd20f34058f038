"""Radix host cache over HTTP: identical tokens to no cache at all, shared prefixes computed
once, concurrent restores of one prefix, and restore faults that fall back cleanly."""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.http.app import create_app
from radixserve.model.loader import load_model
from tests.http.harness import running_server
from tests.http.test_host_cache import convo_schedule, metrics, parse_metrics, run_convos

TINY = ["--dtype", "f32", "--weights", "native", "-c", "2048", "--metrics"]


def docs_questions(seed: int, n_docs: int = 4, n_q: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    docs = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(150, 250))]
            for _ in range(n_docs)]
    return [d + [rng.randrange(1000, 40000) for _ in range(rng.randrange(5, 15))]
            for d in docs for _ in range(n_q)]


def complete(url: str, prompt: list[int], **kw) -> dict:
    body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, **kw}
    r = httpx.post(url + "/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def run_all(url: str, prompts: list[list[int]], concurrency: int, **kw) -> list[dict]:
    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(lambda p: complete(url, p, **kw), prompts))


@pytest.fixture(scope="module")
def workload(tiny_path, tmp_path_factory):
    prompts = docs_questions(11)
    chats = convo_schedule(5, 3, 6)
    log = str(tmp_path_factory.mktemp("ref") / "server.log")
    with running_server(["-m", tiny_path, *TINY, "-np", "4", "--cache-ram", "0"], log) as srv:
        ref_docs = run_all(srv.url, prompts, 1, cache_prompt=False)
        ref_chats = run_convos(srv.url, chats, cache_prompt=False, n_predict=6)
    return prompts, chats, ref_docs, ref_chats


@pytest.mark.parametrize("layout", [["-np", "4", "-kvu"], ["-np", "4"], ["-np", "2"]])
def test_radix_tokens_equal_no_cache(tiny_path, tmp_path, workload, layout):
    prompts, chats, ref_docs, ref_chats = workload
    with running_server(["-m", tiny_path, *TINY, *layout], str(tmp_path / "s.log")) as srv:
        got_docs = run_all(srv.url, prompts, 4)  # 4 clients: slots restore one prefix at once
        got_chats = run_convos(srv.url, chats, n_predict=6)
        m = metrics(srv.url)
    assert len(prompts) + len(chats) >= 50
    assert [r["tokens"] for r in got_docs] == [r["tokens"] for r in ref_docs]
    assert [r["tokens"] for r in got_chats] == [r["tokens"] for r in ref_chats]
    assert m["radixserve:fallbacks"] == 0
    if layout != ["-np", "4"]:  # 4 private slots can serve 4 docs without the host tier
        assert m["radixserve:hit_tokens"] > 0


def test_shared_prefixes_are_computed_once(tiny_path, tmp_path):
    """Sequentially, each request computes only what no earlier request shared, plus one."""
    prompts = docs_questions(12)
    random.Random(0).shuffle(prompts)
    with running_server(["-m", tiny_path, *TINY, "-np", "4", "-kvu"],
                        str(tmp_path / "s.log")) as srv:
        res = run_all(srv.url, prompts, 1)
        m = metrics(srv.url)
    seen: list[list[int]] = []
    for p, r in zip(prompts, res):
        best = max((next((i for i, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q)))
                    for q in seen), default=0)
        assert r["timings"]["prompt_n"] <= len(p) - best + 1
        seen.append(p + r["tokens"][:-1])
    assert m["radixserve:unique_tokens"] < m["radixserve:logical_tokens"]


def test_restore_fault_falls_back_and_the_tree_stays_usable(tiny_path, tmp_path):
    """A restore that fails mid-way (fault injected through the engine's constructor) falls
    back to a prefill: right tokens, the server up, the tree usable by the next request."""
    prompts = docs_questions(13, n_docs=1, n_q=3)
    cfg = ServerConfig(model=tiny_path, dtype="f32", weights="native", ctx_size=2048,
                       n_parallel=2, kv_unified=True, metrics=True)
    faulty = RadixPromptCache(cfg.cache_ram_mib * 2**20, fault_after_tokens=40, fault_restores=1)
    engine = Engine(load_model(tiny_path, "f32", weights="native"), cfg, cache=faulty)
    engine.start()
    try:
        with TestClient(create_app(engine, cfg)) as c:
            def post(prompt: list[int], **kw) -> dict:
                r = c.post("/completion", json={"prompt": prompt, "n_predict": 6,
                                                "temperature": 0, "ignore_eos": True,
                                                "return_tokens": True, **kw})
                assert r.status_code == 200, r.text
                return r.json()

            def scrape() -> dict[str, float]:
                return parse_metrics(c.get("/metrics").text)

            first = post(prompts[0])
            faulted = post(prompts[1], id_slot=0)  # restoring the doc fails mid-way
            m1 = scrape()
            hit = post(prompts[2], id_slot=1)  # slot 1 was cleared: from the tree
            m2 = scrape()
            health = c.get("/health")
    finally:
        engine.stop()
    with running_server(["-m", tiny_path, *TINY, "-np", "2", "--cache-ram", "0"],
                        str(tmp_path / "r.log")) as ref:
        expect = [complete(ref.url, p, cache_prompt=False)["tokens"] for p in prompts]
    assert [first["tokens"], faulted["tokens"], hit["tokens"]] == expect
    assert m1["radixserve:fallbacks"] == 1 and faulted["timings"]["cache_n"] == 0
    assert hit["timings"]["cache_n"] > 100 and m2["radixserve:loads"] > m1["radixserve:loads"]
    assert health.status_code == 200


def assert_numeric_timings(body: dict) -> None:
    """llama-server's `timings` holds numbers only (clients check each value is finite)."""
    t = body["timings"]
    assert t and all(isinstance(v, (int, float)) and math.isfinite(v) for v in t.values()), t


def test_every_completion_says_where_its_prefix_came_from(default_np2_server):
    """`reuse` beside `timings` (which stays numbers only, as llama-server's) on /completion
    (plain and streamed), on the chat endpoint (plain and streamed) and on /v1/completions, and
    the slot's last report in /slots (the fields' meaning: tests/engine/test_reuse.py). On the
    session's shared server: prompts of their own, read per slot."""
    url = default_np2_server.url
    rng = random.Random(36)
    doc = [rng.randrange(1000, 40000) for _ in range(120)]
    first = complete(url, doc + [7])
    assert_numeric_timings(first)
    assert (first["reuse"]["tier"], first["reuse"]["n_tokens"]) == ("none", 0)
    r = complete(url, doc + [9])
    assert_numeric_timings(r)
    assert r["reuse"]["tier"] == "slot" and r["reuse"]["n_tokens"] == r["timings"]["cache_n"] == 120
    assert r["reuse"]["n_held"] == r["reuse"]["first_diff"] == 120 and r["reuse"]["prompt_text"]
    body = {"prompt": doc + [11], "n_predict": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/completion", json=body, timeout=120) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: ")]
    last = json.loads(chunks[-1][6:])
    assert_numeric_timings(last)
    assert last["stop"] and last["reuse"]["n_tokens"] == 120
    slots = httpx.get(url + "/slots", timeout=60).json()
    assert slots[last["id_slot"]]["reuse"] == last["reuse"]
    text = httpx.post(url + "/v1/completions", json={"prompt": doc + [13], "max_tokens": 2},
                      timeout=120).json()
    assert_numeric_timings(text)
    assert text["reuse"]["n_tokens"] == text["timings"]["cache_n"] == 120
    chat = {"messages": [{"role": "user", "content": f"hi {rng.random()}"}], "max_tokens": 3}
    for _ in range(2):
        c = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120).json()
    assert_numeric_timings(c)
    assert c["reuse"]["tier"] == "slot"
    assert c["reuse"]["n_tokens"] == c["timings"]["cache_n"] > 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat | {"stream": True},
                      timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    closing = [e for e in events if "timings" in e]
    assert len(closing) == 1 and closing[0] is events[-1]
    assert_numeric_timings(closing[0])
    assert closing[0]["reuse"]["n_tokens"] == closing[0]["timings"]["cache_n"] > 0
