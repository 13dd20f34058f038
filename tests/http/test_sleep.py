"""--sleep-idle-seconds on the real engine over the tiny model, in process.

llama-server (tools/server/server-queue.cpp start_loop; server-context.cpp
handle_sleeping_state, create_response): after N seconds without a task the queue enters the
sleeping state and the context destroys the model and its context (weights, KV); GET /props
then says `"is_sleeping": true`, and /health, /props, /models and /metrics answer without
waking it; any other request waits until the model is loaded again and is then served.
radixserve does the same, and keeps the host cache tiers: the first request after waking
reuses its prompt from host RAM (timings.cache_n), though the slot and its KV pool are gone.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.http.app import create_app
from radixserve.model.loader import Model, load_model

PROMPT = ("The radix tree keeps every prompt prefix once, so a later request that starts "
          "with the same words is served from memory instead of being computed again. " * 3)


def props(c: TestClient) -> dict[str, Any]:
    r = c.get("/props")
    assert r.status_code == 200, r.text
    return r.json()


def until(cond: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def complete(c: TestClient) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": PROMPT, "n_predict": 3, "temperature": 0,
                                    "cache_prompt": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_idle_server_sleeps_and_wakes_with_its_host_cache(tiny_path: str) -> None:
    loads: list[Model] = []

    def load() -> Model:
        loads.append(load_model(tiny_path, dtype="f32"))
        return loads[-1]

    cfg = ServerConfig(model=tiny_path, ctx_size=512, n_parallel=1, sleep_idle_seconds=1,
                       metrics=True)
    with TestClient(create_app(lambda: Engine.boot(cfg, load), cfg)) as c:
        until(lambda: c.get("/health").status_code == 200)
        eng = c.app.state.radixserve.engine  # type: ignore[attr-defined]
        first = complete(c)
        assert first["timings"]["cache_n"] == 0
        assert props(c)["is_sleeping"] is False
        weights = weakref.ref(eng.model.transformer)
        pool = weakref.ref(eng.scheduler.pool)
        del loads[0]

        until(lambda: props(c)["is_sleeping"])  # after 1 s without a request
        # the weights and the KV pool are freed (nothing left that refers to them)
        until(lambda: gc.collect() >= 0 and weights() is None and pool() is None, 5)
        assert eng.sleeping and not loads
        # these answer asleep and do not wake it (llama-server: bypass_sleep)
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/v1/models").json()["data"][0]["meta"]["n_ctx"] == 512
        assert "llamacpp:requests_processing" in c.get("/metrics").text
        assert props(c)["is_sleeping"] is True and eng.sleeping and not loads

        again = complete(c)  # waits for the reload, then is served
        assert len(loads) == 1 and not eng.sleeping and props(c)["is_sleeping"] is False
        assert again["content"] == first["content"]
        # the slot and pool were released: the reuse comes from the host tier that stayed
        # (all of the prompt but its last token, which is always computed)
        assert again["timings"]["cache_n"] == first["timings"]["prompt_n"] - 1 > 0

        # requests arriving asleep all wait for one reload, none meets a half-loaded engine
        until(lambda: props(c)["is_sleeping"])
        results: list[Any] = []
        threads = [threading.Thread(target=lambda: results.append(complete(c)))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 3 and all(r["content"] == first["content"] for r in results)
        assert len(loads) == 2


def test_a_request_in_flight_keeps_it_awake(tiny_path: str) -> None:
    """A stream slower than the idle time: the server does not fall asleep under it."""
    cfg = ServerConfig(model=tiny_path, ctx_size=512, n_parallel=1, sleep_idle_seconds=1)
    with TestClient(create_app(lambda: Engine.boot(cfg, lambda: load_model(tiny_path,
                                                                           dtype="f32")),
                               cfg)) as c:
        until(lambda: c.get("/health").status_code == 200)
        eng = c.app.state.radixserve.engine  # type: ignore[attr-defined]
        seen = []
        with c.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 6,
                                                   "stream": True, "temperature": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(eng.sleeping)
                    time.sleep(0.3)  # the client reads slowly: 6 tokens take ~2 s
        assert len(seen) >= 6 and not any(seen)


def test_a_request_without_the_key_never_wakes_it_and_a_failed_reload_is_a_500(
        tiny_path: str) -> None:
    """llama-server checks the API key before a handler waits for the model; a reload that
    fails aborts llama-server, here it is logged and answered 500."""
    fail = threading.Event()

    def load() -> Model:
        if fail.is_set():
            raise OSError("model file gone")
        return load_model(tiny_path, dtype="f32")

    key = {"Authorization": "Bearer k"}
    cfg = ServerConfig(model=tiny_path, ctx_size=512, n_parallel=1, sleep_idle_seconds=1,
                       api_key=["k"])
    with TestClient(create_app(lambda: Engine.boot(cfg, load), cfg)) as c:
        until(lambda: c.get("/health").status_code == 200)
        eng = c.app.state.radixserve.engine  # type: ignore[attr-defined]
        until(lambda: c.get("/props", headers=key).json()["is_sleeping"])
        assert c.post("/completion", json={"prompt": "hi", "n_predict": 1}).status_code == 401
        assert c.get("/slots").status_code == 401
        assert eng.sleeping
        # a path no route takes is a 404 that needs no model: it does not wake it
        assert c.get("/api/tags", headers=key).status_code == 404 and eng.sleeping
        fail.set()
        r = c.post("/completion", json={"prompt": "hi", "n_predict": 1}, headers=key)
        assert r.status_code == 500 and "model file gone" in r.json()["error"]["message"]
        assert eng.sleeping
        r = c.post("/v1/messages", headers=key, json={"model": "m", "max_tokens": 1,
                                                      "messages": [{"role": "user",
                                                                    "content": "hi"}]})
        assert r.status_code == 500 and r.json()["type"] == "error"  # in its API's shape
        # the next request tries again; once loaded, the server sleeps again when idle
        fail.clear()
        assert c.post("/completion", json={"prompt": "hi", "n_predict": 1},
                      headers=key).status_code == 200
        assert not eng.sleeping
        until(lambda: eng.sleeping)
