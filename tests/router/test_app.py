"""The router's HTTP app in process, over fake children (no processes): its own routes and
their errors, the API key, ?reload=1, and a child that does not answer."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.router.app import create_router_app
from radixserve.router.registry import ModelEntry, Models
from tests.router.test_registry import FakeChild


def _entries(*names: str) -> dict[str, ModelEntry]:
    return {n: ModelEntry(name=n, path=f"/{n}.gguf", source="models_dir", args=["-c", "64"])
            for n in names}


def _client(cfg: ServerConfig, rescan: dict[str, ModelEntry] | None = None,
            ) -> tuple[TestClient, Models, list[str]]:
    log: list[str] = []
    models = Models(_entries("a", "b"), cfg.models_max, lambda e: FakeChild(e, log), poll_s=0.01)
    app = create_router_app(cfg, models, (lambda: rescan) if rescan is not None else None)
    return TestClient(app), models, log


def test_listing_load_unload_and_their_errors() -> None:
    client, models, log = _client(ServerConfig())
    with client as c:
        r = c.get("/v1/models")
        assert r.status_code == 200
        a = r.json()["data"][0]
        assert {k: a[k] for k in ("id", "object", "owned_by", "path", "status", "source",
                                  "can_remove")} == {
            "id": "a", "object": "model", "owned_by": "llamacpp", "path": "/a.gguf",
            "status": {"value": "unloaded"}, "source": "models_dir", "can_remove": False}
        assert c.post("/models/load", json={"model": "zz"}).json()["error"] == {
            "code": 404, "message": "model is not found", "type": "not_found_error"}
        assert c.post("/models/load", json={}).status_code == 404
        assert c.post("/models/unload", json={"model": "a"}).json()["error"]["message"] == \
            "model is not running"
        assert c.post("/models/load", json={"model": "a"}).json() == {"success": True}
        assert models.entries["a"].load_task is not None
        for _ in range(500):
            if c.get("/models").json()["data"][0]["status"]["value"] == "loaded":
                break
            time.sleep(0.01)
        st = c.get("/models").json()["data"][0]
        assert st["status"]["value"] == "loaded" and st["meta"] == {"n_params": 1}
        assert c.post("/models/load", json={"model": "a"}).json()["error"]["message"] == \
            "model is already running"
        assert c.post("/models/unload", json={"model": "a"}).json() == {"success": True}
        assert c.get("/models").json()["data"][0]["status"]["value"] == "unloaded"
        assert log == ["start a", "stop a"]
        # the model is loaded, but its server does not answer: 502, and the router stays up
        r = c.post("/completion", json={"model": "b", "prompt": "x"})
        assert r.status_code == 502 and "did not answer" in r.json()["error"]["message"]
        assert models.entries["b"].in_flight == 0
        assert c.get("/health").json() == {"status": "ok"}


def test_autoload_off_and_props() -> None:
    client, _, log = _client(ServerConfig(models_autoload=False, models_max=1))
    with client as c:
        r = c.post("/v1/chat/completions", json={"model": "a", "messages": []})
        assert (r.status_code, r.json()["error"]["message"]) == (400, "model is not loaded")
        assert c.get("/metrics?model=a").json()["error"]["message"] == "model is not loaded"
        assert log == []
        p = c.get("/props").json()
        assert (p["role"], p["max_instances"], p["models_autoload"]) == ("router", 1, False)


def test_api_key_guards_all_but_health() -> None:
    client, _, _ = _client(ServerConfig(api_key=["sk-x"]))
    with client as c:
        for method, path in (("GET", "/models"), ("POST", "/models/load"),
                             ("POST", "/v1/chat/completions"), ("GET", "/props")):
            r = c.request(method, path, json={"model": "a"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/health").status_code == 200
        r = c.get("/models", headers={"Authorization": "Bearer sk-x"})
        assert r.status_code == 200


def test_reload_adds_updates_and_removes(tmp_path: Path) -> None:
    fresh = _entries("b", "c")
    fresh["b"].args = ["-c", "128"]
    client, models, log = _client(ServerConfig(), rescan=fresh)
    with client as c:
        assert c.post("/models/load", json={"model": "a"}).status_code == 200
        for _ in range(500):
            if models.entries["a"].status == "loaded":
                break
            time.sleep(0.01)
        ids = [m["id"] for m in c.get("/models?reload=1").json()["data"]]
        assert ids == ["b", "c"]
        assert log == ["start a", "stop a"]  # a running model that was removed is unloaded
        assert models.entries["b"].args == ["-c", "128"]
