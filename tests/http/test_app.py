"""HTTP plumbing of app.py in-process: loading gate, API key, errors, routes, SSE, disconnects.

The engine here is a stand-in with the real Engine's interface, a real model (tiny GGUF) and
real ServerMetrics; its task streams replay scripted results. These tests check the HTTP
layer only (status codes, error shapes, framing, cancellation); generation itself is tested
against the real engine in test_api.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixserve.memory.tiers.base import stats_dict
from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.task import CompletionTask, FinalResult, PartialResult, Timings
from radixserve.errors import TaskError
from radixserve.http.app import create_app
from radixserve.model.loader import Model

HANG = object()  # script item: wait until cancelled (a long generation)


class ScriptedStream:
    def __init__(self, items: list[Any]) -> None:
        self.items, self.cancelled = list(items), threading.Event()

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, float):  # script item: the engine stays silent this many seconds
            await asyncio.sleep(item)
            item = self.items.pop(0)
        if item is HANG:
            await asyncio.Event().wait()
        if isinstance(item, TaskError):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled.set()


class ScriptedEngine:
    """A double of the engine API the app codes against (radixserve.engine.api.EngineAPI);
    its queries run on another thread, as the real engine's do."""

    def __init__(self, model: Model, cfg: ServerConfig, script: list[Any] | None = None) -> None:
        self.model, self.cfg = model, cfg
        self.n_ctx_slot, self.n_slots = 128, 2
        self.changes = 0
        self.metrics = ServerMetrics()
        self.script = script or []
        self.tasks: list[CompletionTask] = []
        self.streams: list[ScriptedStream] = []
        self.idle = True

    def submit(self, task: CompletionTask) -> ScriptedStream:
        self.tasks.append(task)
        self.streams.append(ScriptedStream(self.script))
        return self.streams[-1]

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.to_thread(fn)

    async def slots_json(self) -> list[dict]:
        return await self._call(lambda: [
            {"id": i, "n_ctx": self.n_ctx_slot, "speculative": False, "is_processing": False}
            for i in range(self.n_slots)
        ])

    async def has_idle_slot(self) -> bool:
        return await self._call(lambda: self.idle)

    async def cache_stats(self) -> dict[str, float]:
        return stats_dict(nodes=2)

    async def scrape(self) -> tuple[ServerMetrics, dict[str, float]]:
        return await self._call(lambda: (self.metrics.scrape(), stats_dict(nodes=2)))

    async def slot_action(self, id_slot: int, action: str, filename: str | None) -> dict:
        return await self._call(lambda: self.on_slot_action(id_slot, action, filename))

    async def cache_view(self) -> dict:
        """Token ids where the page shows text (the HTTP side decodes them)."""
        return await self._call(lambda: {"tree": {"roots": [
            {"namespace": "", "children": [{"text": [10, 11, 12], "children": []}]},
            {"namespace": "salted #1", "children": [{"text": None, "children": []}]}]}})

    def on_slot_action(self, id_slot: int, action: str, filename: str | None) -> dict:
        raise AssertionError("no slot action expected")

    def stop(self) -> None:
        pass


def final(content: str = "Hello", stop_type: str = "eos") -> FinalResult:
    return FinalResult(content, [10, 11], stop_type, "", False, 3, 5, 0, Timings(1, 2, 1.0, 2, 2.0))


GOOD = [PartialResult("Hel", [10]), PartialResult("lo", [11]), final()]


def client(model: Model, script: list[Any] | None = None, **cfg: Any) -> tuple[TestClient, Any]:
    engine = ScriptedEngine(model, ServerConfig(**cfg), script)
    return TestClient(create_app(engine, engine.cfg)), engine


def assert_error(r: Any, status: int, type_: str, message: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"]) == (status, type_)
    if message is not None:
        assert err["message"] == message


# ---- loading gate ---------------------------------------------------------------------------


def test_503_on_every_route_while_loading_then_ready(model: Model) -> None:
    release = threading.Event()

    def factory() -> ScriptedEngine:
        release.wait(10)
        return ScriptedEngine(model, ServerConfig())

    with TestClient(create_app(factory, cfg=ServerConfig())) as c:
        for method, path in [
            ("GET", "/health"),
            ("GET", "/v1/models"),
            ("POST", "/completion"),
            ("GET", "/no-such-route"),
        ]:
            r = c.request(method, path)
            assert r.status_code == 503
            assert r.json() == {
                "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}
            }
        release.set()
        deadline = time.monotonic() + 10
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.get("/health").json() == {"status": "ok"}


def test_failed_load_is_reported(model: Model) -> None:
    def factory() -> Any:
        raise RuntimeError("no such file")

    with TestClient(create_app(factory, cfg=ServerConfig())) as c:
        deadline = time.monotonic() + 10
        while c.get("/health").status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = c.get("/health")
        assert_error(r, 500, "server_error")
        assert "no such file" in r.json()["error"]["message"]


# ---- API key --------------------------------------------------------------------------------


def test_api_key(model: Model) -> None:
    c, _ = client(model, api_key=["k1", "k2"])
    assert c.get("/health").status_code == 200  # exempt
    assert c.get("/v1/health").status_code == 200
    for headers in [{}, {"Authorization": "Bearer nope"}, {"X-Api-Key": "nope"}]:
        assert_error(
            c.get("/props", headers=headers), 401, "authentication_error", "Invalid API Key"
        )
    assert c.get("/props", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert c.get("/props", headers={"Authorization": "k2"}).status_code == 200
    assert c.get("/props", headers={"X-Api-Key": "k2"}).status_code == 200


# ---- errors ---------------------------------------------------------------------------------


def test_unknown_route_is_404_not_found(model: Model) -> None:
    c, _ = client(model)
    assert_error(c.get("/nope"), 404, "not_found_error", "File Not Found")


def test_malformed_json_is_400(model: Model) -> None:
    c, _ = client(model)
    for path in ["/completion", "/v1/chat/completions", "/tokenize"]:
        r = c.post(path, content=b"{not json", headers={"Content-Type": "application/json"})
        assert_error(r, 400, "invalid_request_error")
        assert r.json()["error"]["message"].startswith("Invalid JSON")


def test_validation_errors_are_400_with_the_field(model: Model) -> None:
    c, engine = client(model, GOOD)
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "bot", "content": "x"}]})
    assert_error(r, 400, "invalid_request_error")
    assert "messages[0].role" in r.json()["error"]["message"]
    r = c.post("/completion", json={"prompt": "hi", "n_predict": "many"})
    assert_error(r, 400, "invalid_request_error")
    r = c.post("/completion", json={"prompt": [1] * 500})
    assert_error(r, 400, "exceed_context_size_error")
    assert (r.json()["error"]["n_prompt_tokens"], r.json()["error"]["n_ctx"]) == (500, 128)
    assert engine.tasks == []  # nothing reached the engine


def test_unexpected_exception_is_500_and_the_server_keeps_serving(model: Model) -> None:
    c, engine = client(model)

    def broken() -> list[dict]:
        raise RuntimeError("slot table on fire")

    engine.slots_json = broken
    r = c.get("/slots")
    assert_error(r, 500, "server_error")
    assert "slot table on fire" in r.json()["error"]["message"]
    assert c.get("/health").status_code == 200


# ---- info routes ----------------------------------------------------------------------------


def test_props_models_slots(model: Model) -> None:
    c, engine = client(model)
    props = c.get("/props").json()
    assert props["total_slots"] == 2
    assert props["prompt_cache"]["nodes"] == 2.0 and props["prompt_cache"]["backend"] == "radix"
    assert props["default_generation_settings"]["n_ctx"] == 128
    assert_error(c.post("/props"), 501, "not_supported_error")
    models = c.get("/v1/models").json()
    assert models["data"][0]["id"] == model.name and c.get("/models").json() == models
    assert c.get("/slots").json()[1]["id"] == 1
    engine.idle = False
    assert c.get("/slots").status_code == 200
    assert_error(c.get("/slots?fail_on_no_slot=1"), 503, "unavailable_error", "no slot available")
    c2, _ = client(model, slots_endpoint=False)
    assert_error(c2.get("/slots"), 501, "not_supported_error")


def test_metrics_route(model: Model) -> None:
    c, _ = client(model)
    assert_error(c.get("/metrics"), 501, "not_supported_error")
    c, engine = client(model, metrics=True)
    engine.metrics.on_prompt_done(5, 2, 0.1)
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "Process-Start-Time-Unix" in r.headers
    assert "llamacpp:prompt_tokens_total 5" in r.text and "radixserve:nodes 2" in r.text
    assert "llamacpp:prompt_tokens_seconds 0" in c.get("/metrics").text  # bucket was reset


def test_slot_action_route(model: Model, tmp_path: Any) -> None:
    c, engine = client(model)
    assert_error(c.post("/slots/0?action=save", json={"filename": "a"}), 501, "not_supported_error")
    c, engine = client(model, slot_save_path=str(tmp_path))
    calls: list[tuple] = []

    def slot_action(id_slot: int, action: str, filename: str | None) -> dict:
        calls.append((id_slot, action, filename))
        if filename == "busy":
            raise TaskError(409, "conflict_error", "slot busy")
        return {"id_slot": id_slot, "filename": filename, "n_saved": 3}

    engine.on_slot_action = slot_action  # type: ignore[method-assign]
    assert c.post("/slots/1?action=save", json={"filename": "a.bin"}).json()["n_saved"] == 3
    assert c.post("/slots/0?action=erase").status_code == 200
    assert calls == [(1, "save", "a.bin"), (0, "erase", None)]
    assert_error(
        c.post("/slots/x?action=save", json={}), 400, "invalid_request_error", "Invalid slot ID"
    )
    assert_error(c.post("/slots/0?action=fly"), 400, "invalid_request_error", "Invalid action")
    assert_error(c.post("/slots/0?action=save", json={}), 400, "invalid_request_error")
    assert_error(c.post("/slots/0?action=save", json={"filename": "busy"}), 409, "conflict_error")


def test_tokenize_detokenize_apply_template(model: Model) -> None:
    c, _ = client(model)
    tok = model.tokenizer
    assert c.post("/tokenize", json={"content": "Hello world"}).json() == {
        "tokens": tok.encode("Hello world", add_special=False)
    }
    assert c.post("/tokenize", json={}).json() == {"tokens": []}
    pieces = c.post("/tokenize", json={"content": "hi<|im_start|>", "with_pieces": True}).json()
    assert pieces["tokens"][-1] == {"id": 1, "piece": "<|im_start|>"}
    no_special = c.post("/tokenize", json={"content": "<|im_start|>", "parse_special": False})
    assert 1 not in no_special.json()["tokens"]
    ids = tok.encode("Hello world")
    assert c.post("/detokenize", json={"tokens": ids}).json() == {"content": "Hello world"}
    assert_error(c.post("/detokenize", json={"tokens": [10**9]}), 400, "invalid_request_error")
    r = c.post("/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.json()["prompt"].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# ---- completions: plumbing ------------------------------------------------------------------


def test_non_stream_routes_return_json(model: Model) -> None:
    c, engine = client(model, GOOD)
    assert c.post("/completion", json={"prompt": "hi"}).json()["content"] == "Hello"
    assert c.post("/completions", json={"prompt": "hi"}).json()["stop_type"] == "eos"
    assert c.post("/v1/completions", json={"prompt": "hi"}).json()["object"] == "text_completion"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for path in ["/chat/completions", "/v1/chat/completions"]:
        assert c.post(path, json=body).json()["choices"][0]["message"]["content"] == "Hello"
    assert not any(s.cancelled.is_set() for s in engine.streams)


def test_stream_content_type_and_done(model: Model) -> None:
    c, engine = client(model, GOOD)
    r = c.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    r = c.post("/completion", json={"prompt": "hi", "stream": True})
    assert "[DONE]" not in r.text and json.loads(r.text.split("data: ")[-1])["stop"] is True
    assert not any(s.cancelled.is_set() for s in engine.streams)


def test_error_before_first_result_is_a_plain_http_error(model: Model) -> None:
    c, _ = client(model, [TaskError(400, "invalid_request_error", "bad sampler")])
    r = c.post("/completion", json={"prompt": "hi", "stream": True})
    assert_error(r, 400, "invalid_request_error", "bad sampler")
    assert r.headers["content-type"].startswith("application/json")


def test_error_mid_stream_is_an_error_event(model: Model) -> None:
    err = TaskError(500, "server_error", "Compute error: boom")
    c, _ = client(model, [PartialResult("Hel", [10]), err])
    r = c.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    events = [e for e in r.text.split("\n\n") if e]
    assert json.loads(events[-1][len("data: ") :]) == err.to_json()
    assert "[DONE]" not in r.text


def test_engine_error_on_non_stream_request(model: Model) -> None:
    c, _ = client(model, [TaskError(500, "server_error", "Context size has been exceeded.")])
    assert_error(c.post("/completion", json={"prompt": "hi"}), 500, "server_error")


# ---- client disconnects (driven through ASGI directly: TestClient cannot hang up) ------------


async def _asgi_post(app: Any, path: str, body: dict, disconnect_after_chunks: int) -> list[dict]:
    """POST `body`; the client hangs up after receiving N body chunks (0: right away)."""
    gone = asyncio.Event()
    if disconnect_after_chunks == 0:
        gone.set()
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if request:
            return request.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if len(chunks) >= disconnect_after_chunks:
            gone.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions"])
def test_disconnect_mid_stream_cancels_the_task(model: Model, path: str) -> None:
    engine = ScriptedEngine(model, ServerConfig(), [PartialResult("Hel", [10]), HANG])
    app = create_app(engine, engine.cfg)
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    asyncio.run(_asgi_post(app, path, body, disconnect_after_chunks=1))
    assert engine.streams[0].cancelled.is_set()


def test_disconnect_while_waiting_for_first_token_cancels(model: Model) -> None:
    engine = ScriptedEngine(model, ServerConfig(), [HANG])
    app = create_app(engine, engine.cfg)
    asyncio.run(_asgi_post(app, "/completion", {"prompt": "hi", "stream": True}, 0))
    assert engine.streams[0].cancelled.is_set()


def test_disconnect_on_non_stream_request_cancels(model: Model) -> None:
    engine = ScriptedEngine(model, ServerConfig(), [PartialResult("Hel", [10]), HANG])
    app = create_app(engine, engine.cfg)
    asyncio.run(
        _asgi_post(
            app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 0
        )
    )
    assert engine.streams[0].cancelled.is_set()


def test_finished_stream_is_not_cancelled(model: Model) -> None:
    engine = ScriptedEngine(model, ServerConfig(), GOOD)
    app = create_app(engine, engine.cfg)
    sent = asyncio.run(_asgi_post(app, "/completion", {"prompt": "hi", "stream": True}, 100))
    assert sent[0]["status"] == 200
    assert not engine.streams[0].cancelled.is_set()
