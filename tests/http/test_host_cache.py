"""Host prompt cache end to end: conversations that lose their slot come back from host RAM
(legacy and radix), with exactly the tokens a no-cache server produces."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.http.harness import running_server

# packed weights with exact f32 activations: the native path, cached == uncached to the bit
NATIVE_F32 = ["--dtype", "f32", "--weights", "native"]


def convo_schedule(seed: int, n_convs: int, turns: int, vocab: tuple[int, int] = (1000, 40000)):
    """Interleaved multi-turn conversations as token prompts: (conv, turn, new tokens)."""
    rng = random.Random(seed)
    firsts = {c: [rng.randrange(*vocab) for _ in range(rng.randrange(40, 90))] for c in range(n_convs)}
    order = [(c, t) for t in range(turns) for c in range(n_convs)]
    return [(c, t, firsts[c] if t == 0 else [rng.randrange(*vocab) for _ in range(12)])
            for c, t in order]


def complete(url: str, prompt: list[int], n_predict: int, cache_prompt: bool = True,
             timeout: float = 120) -> dict:
    """One greedy /completion of a token prompt (EOS ignored), its tokens returned."""
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": cache_prompt}
    r = httpx.post(url + "/completion", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def run_convos(url: str, schedule, cache_prompt: bool = True, n_predict: int = 8) -> list[dict]:
    history: dict[int, list[int]] = {}
    out = []
    for conv, _turn, new in schedule:
        prompt = history.get(conv, []) + new
        res = complete(url, prompt, n_predict, cache_prompt)
        history[conv] = prompt + res["tokens"]
        out.append(res)
    return out


def parse_metrics(text: str) -> dict[str, float]:
    vals = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            vals[k] = float(v)
    return vals


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=60).text)


@pytest.fixture(scope="module")
def no_host_cache_server(tiny_path, tmp_path_factory):
    """A server with no host cache (--cache-ram 0): the reference's, then
    test_cache_ram_zero_disables_the_host_tier's (its host-tier counters cannot move whatever
    ran before, and its own prompts lose their slots all the same)."""
    log = str(tmp_path_factory.mktemp("ref") / "server.log")
    with running_server(["-m", tiny_path, *NATIVE_F32, "-np", "2", "-c", "1024", "--metrics",
                         "--cache-ram", "0"], log) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(no_host_cache_server):
    """The same conversations on a server with no host cache, every token computed."""
    schedule = convo_schedule(7, 6, 3)
    return schedule, run_convos(no_host_cache_server.url, schedule, cache_prompt=False)


@pytest.mark.parametrize("backend,extra", [
    ("legacy", ["--cache-radix-prompt", "off"]),
    ("radix", []),
    ("radix-unified", ["-kvu"]),
])
def test_conversations_come_back_from_host_ram(tiny_path, tmp_path, reference, backend, extra):
    schedule, expect = reference
    args = ["-m", tiny_path, *NATIVE_F32, "-np", "2", "-c", "1024", "--metrics", *extra]
    with running_server(args, str(tmp_path / "server.log")) as srv:
        got = run_convos(srv.url, schedule)
        m = metrics(srv.url)
        props = httpx.get(srv.url + "/props").json()["prompt_cache"]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in expect]
    # 6 conversations on 2 slots: every later turn lost its slot and came back from host RAM
    for (conv, turn, _), r in zip(schedule, got):
        if turn > 0:
            assert r["timings"]["cache_n"] > 0, (conv, turn)
    n_returns = sum(1 for _, t, _ in schedule if t > 0)
    loads = m["radixserve:loads"]
    assert loads is not None and loads >= n_returns
    assert props["backend"] == backend.split("-")[0]


def test_cache_ram_zero_disables_the_host_tier(reference, no_host_cache_server):
    schedule, expect = reference
    srv = no_host_cache_server  # -m tiny, native f32, -np 2 -c 1024 --metrics --cache-ram 0
    got = run_convos(srv.url, schedule)
    props = httpx.get(srv.url + "/props").json()["prompt_cache"]
    m = metrics(srv.url)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in expect]
    assert props["backend"] == "none" and props["cache_idle_slots"] is False
    # the same figures as with a cache (names never depend on the backend), all zero
    assert m["radixserve:loads"] == m["radixserve:saves"] == m["radixserve:bytes"] == 0
    # the slots still reuse their own KV, but a conversation whose slot was taken recomputes
    returns = [r for (_, t, _), r in zip(schedule, got) if t > 0]
    assert any(r["timings"]["cache_n"] == 0 for r in returns)


def test_cache_ram_unlimited_is_capped_by_tokens(tiny_path, tmp_path):
    """-1: no byte limit; the legacy cache still holds at most n_ctx tokens (llama.cpp)."""
    args = ["-m", tiny_path, *NATIVE_F32, "-np", "2", "-c", "256", "--metrics",
            "--cache-ram", "-1", "--cache-radix-prompt", "off"]
    with running_server(args, str(tmp_path / "server.log")) as srv:
        run_convos(srv.url, convo_schedule(3, 6, 1))
        props = httpx.get(srv.url + "/props").json()["prompt_cache"]
    assert props["limit_bytes"] == 0 and props["limit_tokens"] == 256
    assert 0 < props["unique_tokens"] <= 256 and props["evicted_tokens"] > 0
