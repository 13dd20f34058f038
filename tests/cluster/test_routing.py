"""The cluster's parts that need no Ray instance: the prefix index, routing keys, the
replica choice rules, the summed /metrics and the ASGI bridge."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from radixserve.cluster import bridge
from radixserve.cluster.bridge import Forwarded, Head, run_asgi
from radixserve.cluster.metrics import aggregate
from radixserve.cluster.prefix_index import PrefixIndex
from radixserve.cluster.route_key import route_key
from radixserve.cluster.replica_router import PrefixRouter
from radixserve.text.chat_template import CHATML_TEMPLATE, ChatTemplate

DOC = "".join(f"sentence {i} of the shared document. " for i in range(40))


def test_index_matches_whole_leading_blocks_per_replica() -> None:
    ix = PrefixIndex(block_chars=16)
    ix.insert(DOC + "question one", "a")
    ix.insert("another document entirely " * 10, "b")
    held = ix.match(DOC + "question two", ["a", "b", "c"])
    assert held["a"] == (len(DOC) // 16) * 16 and held["b"] == held["c"] == 0
    assert ix.match("x" + DOC, ["a"])["a"] == 0  # a prefix, not a substring
    assert ix.match(DOC[:15], ["a"])["a"] == 0  # shorter than a block: nothing to save
    ix.remove("a")
    assert ix.match(DOC, ["a"])["a"] == 0 and ix.replicas() == ["b"]


def test_index_forgets_least_recent_prompts_tails_first() -> None:
    ix = PrefixIndex(block_chars=10, capacity_blocks=12)
    ix.insert("A" * 100, "r")  # 10 blocks
    ix.insert("B" * 40, "r")  # 4 more: two of A's go, its deepest ones
    assert ix.blocks("r") == 12
    assert ix.match("A" * 100, ["r"])["r"] == 80
    assert ix.match("B" * 40, ["r"])["r"] == 40


def chat_body(msgs: list[dict[str, str]], **extra: Any) -> bytes:
    return json.dumps({"messages": msgs, **extra}).encode()


def test_route_key_is_the_rendered_prompt_in_its_namespace() -> None:
    tmpl = ChatTemplate(CHATML_TEMPLATE)
    msgs = [{"role": "system", "content": DOC}, {"role": "user", "content": "Why?"}]
    chat = route_key("/v1/chat/completions", chat_body(msgs), tmpl)
    text = tmpl.render(msgs)
    # a chat and a /completion of its rendered text share KV on a replica: they route alike
    assert chat == route_key("/completion", json.dumps({"prompt": text}).encode(), None)
    assert chat == "\x00" + text
    salted = route_key("/v1/chat/completions", chat_body(msgs, cache_salt="t1"), tmpl)
    assert salted == "t1\x00" + text
    ix = PrefixIndex(block_chars=8)
    ix.insert(chat, "plain")
    assert ix.match(salted, ["plain"])["plain"] == 0  # tenants never match each other
    assert route_key("/v1/completions", b'{"prompt": [1, 2, 3]}', None) == "\x00\x00ids:1,2,3"
    assert route_key("/v1/completions", b'{"prompt": ["a b", "c"]}', None) == "\x00a b"
    for path, body in [("/tokenize", b'{"content": "x"}'), ("/completion", b"{bad"),
                       ("/completion", b"[1]"), ("/completion", b'{"prompt": ""}'),
                       ("/v1/chat/completions", b'{"messages": 3}')]:
        assert route_key(path, body, tmpl) is None, (path, body)


def test_unrenderable_chats_keep_their_conversation_order() -> None:
    broken = ChatTemplate("{{ raise_exception('no') }}")
    a = [{"role": "system", "content": DOC}, {"role": "user", "content": "first"}]
    b = [*a, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    ka = route_key("/chat/completions", chat_body(a), broken)
    kb = route_key("/chat/completions", chat_body(b), None)
    assert ka is not None and kb is not None and kb.startswith(ka)


def fake_router(held: dict[str, str], queues: dict[str, int], policy: str = "prefix",
                imbalance: int = 4) -> tuple[PrefixRouter, list[Any]]:
    """A PrefixRouter without Ray Serve around it: replicas are names, queues are given."""
    r = PrefixRouter.__new__(PrefixRouter)
    r.policy, r.imbalance = policy, imbalance
    r.index = PrefixIndex(block_chars=16)
    from collections import Counter

    r.decisions, r.routed = Counter(), Counter()
    for key, replica in held.items():
        r.index.insert(key, replica)
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda n=n: n))
                for n in queues]

    async def queue_lens(_: Any) -> dict[str, int]:
        return dict(queues)

    r._queue_lens = queue_lens  # type: ignore[method-assign,assignment]
    return r, replicas


def names(ranks: list[list[Any]]) -> list[list[str]]:
    return [[x.replica_id.to_full_id_str() for x in rank] for rank in ranks]


def test_the_longest_holder_first_unless_its_queue_is_much_longer() -> None:
    held = {DOC + "q1": "a", DOC[:200]: "b"}
    r, reps = fake_router(held, {"a": 3, "b": 0, "c": 0})
    ranks = asyncio.run(r._by_prefix(DOC + "q2", reps))
    assert names(ranks) == [["a"], ["b"], ["c"]]  # a holds more of it than b
    r, reps = fake_router(held, {"a": 3, "b": 0, "c": 0, "d": 0})
    ranks = asyncio.run(r._by_prefix(DOC[:100] + "another question", reps))
    assert names(ranks) == [["a", "b"], ["c", "d"]]  # equals share a rank (least loaded wins)
    r, reps = fake_router(held, {"a": 5, "b": 0, "c": 1})
    assert names(asyncio.run(r._by_prefix(DOC + "q2", reps))) == [["b"], ["a", "c"]]
    assert r.decisions == {"least_loaded": 1}  # the holder is 5 behind: the least loaded
    r, reps = fake_router({DOC + "q1": "a"}, {"a": 0, "b": 3, "c": 0})
    new = "nothing like it " * 9
    # a new prompt: to a replica holding nothing yet (c; b holds as little but is busier)
    assert names(asyncio.run(r._by_prefix(new, reps))) == [["c"], ["a", "b"]]
    # recorded at once: the next request of that document follows, before the first is sent
    assert r.index.match(new, ["a", "b", "c"]) == {"a": 0, "b": 0, "c": 144}
    assert names(asyncio.run(r._by_prefix(new + "?", reps)))[0] == ["c"]
    other = "a third document " * 9  # b now holds least
    assert names(asyncio.run(r._by_prefix(other, reps)))[0] == ["b"]
    assert r.decisions == {"new": 2, "prefix": 1}


def test_a_prompt_cache_key_routes_every_prompt_where_its_first_went() -> None:
    def key(prompt: str, name: str | None, salt: str | None = None) -> str | None:
        body = {"prompt": prompt, **({} if name is None else {"prompt_cache_key": name}),
                **({} if salt is None else {"cache_salt": salt})}
        return route_key("/v1/completions", json.dumps(body).encode(), None)

    k1, k2 = key(DOC, "user-7"), key("a different prompt altogether", "user-7")
    assert k1 == k2 != key(DOC, "user-8")  # the key, not the prompt, decides
    assert key(DOC, "user-7", salt="t") not in (k1, key(DOC, None, salt="t"))
    assert key(DOC, "") == key(DOC, None)  # an empty key is no key
    r, reps = fake_router({}, {"a": 0, "b": 0, "c": 0})
    first = names(asyncio.run(r._by_prefix(k1, reps)))[0]
    assert names(asyncio.run(r._by_prefix(k2, reps)))[0] == first  # every prompt after it
    # unless that replica is overloaded (the router's imbalance rule, as for any prefix)
    busy = {n: (9 if [n] == first else 0) for n in ("a", "b", "c")}
    r2, reps2 = fake_router({k1: first[0]}, busy)
    assert names(asyncio.run(r2._by_prefix(k2, reps2)))[0] != first
    assert r2.decisions == {"least_loaded": 1}


def test_choose_replicas_pins_targets_and_routes_keys_by_prefix() -> None:
    r, reps = fake_router({DOC + "q1": "b"}, {"a": 0, "b": 0})

    def pending(**kw: Any) -> Any:
        return SimpleNamespace(args=[Forwarded("POST", "/completion", **kw)],
                               routing_context=SimpleNamespace(should_backoff=False))

    p = pending(target="a", route_key=DOC)
    assert names(asyncio.run(r.choose_replicas(reps, p))) == [["a"]]
    assert p.routing_context.should_backoff  # a full replica is retried with backoff
    assert names(asyncio.run(r.choose_replicas(reps, pending(target="gone")))) == [[]]
    ranks = asyncio.run(r.choose_replicas(reps, pending(route_key=DOC + "q9")))
    assert names(ranks) == [["b"], ["a"]] and r.decisions == {"prefix": 1}


def test_metrics_add_up_one_servers_exposition() -> None:
    from radixserve.engine.counters import ServerMetrics
    from radixserve.http.prometheus import render_metrics

    def text(prompt: int, mx: int, decodes: int, busy: int, held: float) -> str:
        m = ServerMetrics(prompt_tokens_total=prompt, prompt_tokens_cached_total=prompt * 3,
                          n_tokens_max=mx, n_decode_total=decodes, n_busy_slots_total=busy)
        return render_metrics(m, {"bytes": held}).decode()

    one, two = text(100, 400, 10, 20, 1000.0), text(30, 900, 30, 30, 24.5)
    assert aggregate([one]) == one  # one server's text, line for line
    out = aggregate([one, two])
    assert [x for x in out.splitlines() if x.startswith("#")] == [
        x for x in one.splitlines() if x.startswith("#")]  # names, HELP and TYPE unchanged
    got = {s.name: s.value for fam in text_string_to_metric_families(out) for s in fam.samples}
    assert got["llamacpp:prompt_tokens_total"] == 130
    assert got["llamacpp:prompt_tokens_cached_total"] == 390
    assert got["llamacpp:n_tokens_max"] == 900
    assert got["llamacpp:n_decode_total"] == 40
    assert got["llamacpp:n_busy_slots_per_decode"] == (2.0 * 10 + 1.0 * 30) / 40
    assert got["radixserve:bytes"] == 1024.5


def tiny_app(seen: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        return {"body": (await request.body()).decode(), "q": request.url.query,
                "h": request.headers.get("x-k")}

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def gen() -> Any:
            i = 0
            try:  # Starlette cancels a streaming body when its client disconnects
                for i in range(1000):
                    yield f"{i}\n".encode()
                    await asyncio.sleep(0.01)
            finally:
                seen.append(f"ended at {i}")

        return StreamingResponse(gen(), media_type="text/plain")

    return app


def test_the_bridge_runs_a_request_and_tells_the_app_when_the_caller_leaves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bridge, "APP_EXIT_WAIT_S", 3600.0)  # no cancelling: the app must end
    seen: list[str] = []
    app = tiny_app(seen)

    async def main() -> None:
        items = [x async for x in run_asgi(app, Forwarded(
            "POST", "/echo", b"a=1", [(b"x-k", b"v")], b"hello"))]
        assert isinstance(items[0], Head) and items[0].status == 200
        body = b"".join(x for x in items[1:] if isinstance(x, bytes))
        assert json.loads(body) == {"body": "hello", "q": "a=1", "h": "v"}
        gen = run_asgi(app, Forwarded("GET", "/stream"))
        head = await gen.__anext__()
        assert isinstance(head, Head) and head.status == 200
        assert await gen.__anext__() == b"0\n"
        # what Ray does when the ingress cancels; the app, told, ends (else this hangs)
        await asyncio.wait_for(gen.aclose(), timeout=60)

    asyncio.run(main())
    assert len(seen) == 1 and int(seen[0].split()[-1]) < 50, seen  # not run to its end


@pytest.mark.parametrize("argv, says", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--imbalance", "-1"], "--imbalance must be at least 0"),
    (["--replica-cpus", "-0.5"], "--replica-cpus must be at least 0"),
    (["--max-ongoing-requests", "0"], "--max-ongoing-requests must be at least 1"),
    (["--no-such-flag"], "--no-such-flag"),
    (["-c", "many"], "-c"),
    (["--host", "/tmp/x.sock"], "one address, not a socket"),
])
def test_cluster_refuses_bad_flags_before_starting_ray(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    from radixserve.cluster.cli import main

    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("radixserve cluster: error:") and says in err, err



def test_the_ingress_refuses_a_body_over_max_body_mib_before_reading_it_whole() -> None:
    from starlette.requests import Request

    from radixserve.cluster.deployments import Ingress

    me = SimpleNamespace(cfg=SimpleNamespace(max_body_mib=1))
    mib = 1 << 20

    def request(chunks: list[bytes], length: int | None) -> tuple[Request, list[int]]:
        read: list[int] = []  # chunks handed to the ingress

        async def receive() -> dict[str, Any]:
            read.append(1)
            body = chunks[len(read) - 1]
            return {"type": "http.request", "body": body, "more_body": len(read) < len(chunks)}

        headers = [(b"content-length", str(length).encode())] if length is not None else []
        return Request({"type": "http", "method": "POST", "path": "/completion",
                        "headers": headers, "query_string": b""}, receive), read

    async def body(chunks: list[bytes], length: int | None) -> tuple[Any, int]:
        req, read = request(chunks, length)
        return await Ingress._body(me, req), len(read)  # type: ignore[arg-type]

    got, n = asyncio.run(body([b"x" * 100], 2 * mib))  # refused from Content-Length
    assert got.status_code == 413 and n == 0
    assert b"--max-body-mib" in got.body
    got, n = asyncio.run(body([b"x" * (mib // 2)] * 4, None))  # chunked: refused mid-way
    assert got.status_code == 413 and n == 3
    got, n = asyncio.run(body([b"ab", b"cd"], None))
    assert got == b"abcd" and n == 2
