"""`radixserve cluster` with the prefix-aware router: 2 replicas on a local Ray instance, the
default model. Each document's requests stay on one replica, so the cluster computes the
prompt tokens one server would, with the same replies; streaming, errors, per-replica and
summed /metrics go through Ray Serve's ingress; a replica killed mid-run costs its streaming
request an error event, its not-yet-answered request a retry elsewhere, and nothing else."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.server_proc import ServerProcess
from radixserve.memory.tiers.prefix import common_prefix
from tests.cluster.workload import (Answer, chat, cluster, documents, replicas, requests,
                                    run_workload)

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with cluster("prefix", "prefix") as s:
        yield s


def prompt_tokens(text: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "llamacpp:prompt_tokens_total":
                return s.value
    raise AssertionError("no llamacpp:prompt_tokens_total")


def shared_head(url: str) -> int:
    """Prompt tokens every document's first request shares (as tokenized by the server)."""
    toks = []
    for _, body in requests()[:len(documents())]:
        prompt = httpx.post(url + "/apply-template", json={"messages": body["messages"]},
                            timeout=60).json()["prompt"]
        toks.append(httpx.post(url + "/tokenize", json={"content": prompt, "add_special": True},
                               timeout=60).json()["tokens"])
    return min(common_prefix(toks[0], t) for t in toks[1:])


def test_documents_stay_on_one_replica_and_compute_what_one_server_does(
        srv: ServerProcess, single_server_answers: list[Answer]) -> None:
    got = run_workload(srv.url)
    single = single_server_answers
    assert [a.content for a in got] == [a.content for a in single]  # every reply, both parties
    assert all(a.content for a in got)
    by_doc: dict[int, set[str | None]] = {}
    for a in got:
        by_doc.setdefault(a.doc, set()).add(a.replica)
    assert all(len(r) == 1 and None not in r for r in by_doc.values()), by_doc
    computed, alone = sum(a.prompt_n for a in got), sum(a.prompt_n for a in single)
    # exactly what one server computes: each document once, on its replica, as on one server;
    # only the head every document's prompt shares (template and first words) is computed once
    # per replica instead of once in all
    n_used = len({r for rs in by_doc.values() for r in rs})
    assert computed == alone + (n_used - 1) * shared_head(srv.url), (computed, alone)
    reused = [a.cache_n for a in got[len(documents()):]]  # every later question reuses
    assert min(reused) > 200, reused
    # /metrics sums the replicas', which count exactly what the replies said
    info = replicas(srv.url)
    assert info["policy"] == "prefix" and info["decisions"]["prefix"] >= 18
    per = [prompt_tokens(httpx.get(f"{srv.url}/replicas/{i}/metrics", timeout=60).text)
           for i in range(2)]
    total = prompt_tokens(httpx.get(srv.url + "/metrics", timeout=60).text)
    assert total == sum(per) == computed, (total, per, computed)


def test_streaming_through_the_ingress_equals_the_plain_reply(srv: ServerProcess) -> None:
    body = chat(documents()[0], "What does the document say first?", n_predict=24)
    plain = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()
    text, events, done = "", 0, False
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            events += 1
            for ch in json.loads(line[6:])["choices"]:
                text += ch["delta"].get("content") or ""
    assert done and events > 5
    assert text == plain["choices"][0]["message"]["content"] and text


def test_cache_salt_routes_within_its_namespace(srv: ServerProcess) -> None:
    doc = documents()[1]
    with httpx.Client(timeout=120) as c:
        def ask(q: str, salt: str) -> httpx.Response:
            r = c.post(srv.url + "/v1/chat/completions", json=chat(doc, q, cache_salt=salt))
            assert r.status_code == 200, r.text
            return r

        before = replicas(srv.url)["decisions"]
        first = ask("Who?", "tenant-a")
        again = [ask(q, "tenant-a") for q in ("What?", "Where?", "When?")]
        other = ask("Why?", "tenant-b")
        after = replicas(srv.url)["decisions"]
    homes = {r.headers["x-radixserve-replica"] for r in [first, *again]}
    assert len(homes) == 1  # one tenant's document stays on one replica
    assert all(r.json()["timings"]["cache_n"] > 200 for r in again)
    # tenant-a's prefix (and the unsalted one's) is no match for tenant-b: placed as a new
    # prompt, and its replica reuses nothing
    assert other.json()["timings"]["cache_n"] == 0
    assert after["prefix"] - before.get("prefix", 0) == 3
    assert after["new"] - before.get("new", 0) >= 2


def test_a_prompt_cache_key_keeps_a_user_on_one_replica(srv: ServerProcess) -> None:
    """OpenAI's `prompt_cache_key`: every request with the key goes where the first went,
    whatever document it asks about; the key's requests are answered as without it."""
    docs = documents()
    with httpx.Client(timeout=120) as c:
        def ask(d: int, **extra: object) -> httpx.Response:
            r = c.post(srv.url + "/v1/chat/completions", json=chat(docs[d], "Which?", **extra))
            assert r.status_code == 200, r.text
            return r

        keyed = [ask(d, prompt_cache_key="user-36") for d in (0, 1, 2, 3, 0)]
        plain = [ask(d) for d in (0, 1, 2, 3, 0)]
    homes = {r.headers["x-radixserve-replica"] for r in keyed}
    assert len(homes) == 1, homes
    assert ([r.json()["choices"][0]["message"] for r in keyed]
            == [r.json()["choices"][0]["message"] for r in plain])


def test_errors_come_back_in_the_openai_shape(srv: ServerProcess) -> None:
    with httpx.Client(timeout=60) as c:
        bad = c.post(srv.url + "/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        none = c.get(srv.url + "/replicas/7/health")
        assert none.status_code == 404 and "no replica 7" in none.json()["error"]["message"]
        assert c.get(srv.url + "/replicas/1/health").json() == {"status": "ok"}
        assert c.get(srv.url + "/no-such-route").status_code == 404
        assert c.get(srv.url + "/health").json() == {"status": "ok"}


def test_a_killed_replica_costs_only_its_own_requests(srv: ServerProcess) -> None:
    doc = documents()[2]
    url = srv.url + "/v1/chat/completions"
    holder = httpx.post(url, json=chat(doc, "Warm?"), timeout=120).headers["x-radixserve-replica"]
    routed0 = replicas(srv.url)["replicas"]
    victim = {r["id"]: r["pid"] for r in routed0}[holder]

    waiting: dict[str, httpx.Response] = {}
    long_body = chat(doc, "Tell me everything.", n_predict=160, ignore_eos=True)
    t = threading.Thread(target=lambda: waiting.update(
        r=httpx.post(url, json=long_body, timeout=300)))
    events: list[str] = []
    with httpx.stream("POST", url, timeout=120, json=chat(doc, "Stream it all.", n_predict=400,
                                                          ignore_eos=True, stream=True)) as r:
        assert r.headers["x-radixserve-replica"] == holder
        t.start()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 8:
                # both requests are on the holder (the router counts them) before it dies
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    now = {x["id"]: x["routed"] for x in replicas(srv.url)["replicas"]}
                    if now[holder] >= {x["id"]: x["routed"] for x in routed0}[holder] + 2:
                        break
                    time.sleep(0.1)
                else:
                    pytest.fail(f"the second request never reached {holder}")
                os.kill(victim, signal.SIGKILL)
    t.join(timeout=300)
    assert not t.is_alive()
    last = json.loads(events[-1])
    assert last["error"]["code"] == 503 and "stopped" in last["error"]["message"], last
    assert "[DONE]" not in events and len(events) < 400
    # the request that had no answer yet was sent again, to the other replica
    retried = waiting["r"]
    assert retried.status_code == 200, retried.text
    assert replicas(srv.url)["retried"] == 1
    assert retried.headers["x-radixserve-replica"] != holder
    fresh = httpx.post(url, json=long_body, timeout=300).json()
    assert retried.json()["choices"][0]["message"] == fresh["choices"][0]["message"]
    # new requests are answered meanwhile, and Ray starts a replica in the dead one's place
    for q in ("One?", "Two?", "Three?"):
        assert httpx.post(url, json=chat(documents()[3], q), timeout=120).status_code == 200
    # 15 s when run alone and beside another test worker here; CI once saw none in 180 s
    # (its log not kept): the controller's lines go into the failure message
    deadline = time.monotonic() + 300
    now: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            now = replicas(srv.url)["replicas"]
        except httpx.ConnectError:
            # seen once with another test worker loading both cores: Ray's proxy refused
            # for a moment while the controller replaced the replica. The requests above were
            # answered; the replacement must still come within the deadline
            time.sleep(1)
            continue
        if len(now) == 2 and all("pid" in x for x in now) and victim not in {
                x["pid"] for x in now}:
            break
        time.sleep(1)
    else:
        said = [ln for ln in srv.log_path.read_text(errors="replace").splitlines()
                if "controller" in ln or "raylet" in ln]
        pytest.fail(f"no replacement replica: {now}; Ray said:\n" + "\n".join(said[-25:]))
    assert holder not in {x["id"] for x in now}
    for i in range(2):
        assert httpx.get(f"{srv.url}/replicas/{i}/health", timeout=60).status_code == 200
