"""The page's routes and `GET /cache` in process: what is served where (--ui, --path,
--api-prefix), what the API key guards, the loading gate, and the view's text on the default
model. The page itself runs in Chromium in tests/webui/."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.http.app import create_app
from radixserve.http import webui
from radixserve.http.webui import UI_DIR, ui_files
from radixserve.model.loader import Model
from tests.http.harness import app_client
from tests.http.test_app import ScriptedEngine, assert_error, client

KEY = {"Authorization": "Bearer k"}


def page_assets(html: str) -> list[str]:
    """The files index.html loads (scripts and styles), as relative URLs."""
    return re.findall(r'(?:src|href)="([^":]+\.(?:js|css))"', html)


def test_the_page_and_its_files_are_public_the_api_is_not(model: Model) -> None:
    c, _ = client(model, api_key=["k"])
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert r.text == c.get("/index.html").text == (UI_DIR / "index.html").read_text()
    assets = page_assets(r.text)
    assert assets, "index.html loads no script or style"
    for rel in assets + [p.removeprefix("/") for p in ui_files()]:
        a = c.get("/" + rel)
        assert a.status_code == 200, rel
        assert a.headers["content-type"].split(";")[0] in ("text/javascript", "text/css",
                                                           "text/html")
    assert all(not re.search(r'(?:src|href)="(?:https?:)?//', (UI_DIR / p).read_text())
               for p in ("index.html",)), "the page must not load anything from another host"
    assert_error(c.get("/cache"), 401, "authentication_error", "Invalid API Key")
    assert_error(c.get("/props"), 401, "authentication_error")
    assert c.get("/cache", headers=KEY).status_code == 200
    assert_error(c.get("/index.htm"), 401, "authentication_error")  # only the page's names


def test_cache_view_decodes_token_ids_and_hides_salted_text(model: Model) -> None:
    c, _ = client(model)
    roots = c.get("/cache").json()["tree"]["roots"]
    assert roots[0]["children"][0]["text"] == model.tokenizer.decode([10, 11, 12])
    assert roots[1]["children"][0]["text"] == ""


def test_no_ui_serves_neither_the_page_nor_path(model: Model, tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<h1>mine</h1>")
    for cfg in ({"webui": False}, {"webui": False, "static_path": str(tmp_path)}):
        c, _ = client(model, **cfg)
        assert_error(c.get("/"), 404, "not_found_error", "File Not Found")
        assert_error(c.get("/main.js"), 404, "not_found_error")
        assert c.get("/cache").status_code == 200  # the JSON view stays (it is an API route)
        assert c.get("/props").json()["ui"] is False


def test_path_replaces_the_page(model: Model, tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<h1>mine</h1>")
    c, _ = client(model, static_path=str(tmp_path))
    assert c.get("/").text == "<h1>mine</h1>"
    assert c.get("/main.js").status_code == 404  # not the packaged page's files
    assert c.get("/props").json()["ui"] is True


def test_api_prefix_moves_the_page(model: Model) -> None:
    c, _ = client(model, api_prefix="/llm", api_key=["k"])
    assert c.get("/llm/").text == (UI_DIR / "index.html").read_text()
    r = c.get("/llm", follow_redirects=False)
    assert r.status_code == 308 and r.headers["location"] == "/llm/"
    assert c.get("/llm/main.js").status_code == 200
    assert c.get("/llm/cache", headers=KEY).status_code == 200
    assert_error(c.get("/llm/cache"), 401, "authentication_error")
    assert_error(c.get("/"), 404, "not_found_error")


def test_no_slots_turns_the_cache_view_off(model: Model) -> None:
    c, _ = client(model, slots_endpoint=False)
    assert_error(c.get("/cache"), 501, "not_supported_error")
    assert c.get("/").status_code == 200


def test_ui_settings_reach_props(model: Model) -> None:
    settings = {"systemMessage": "Be brief.", "temperature": 0.2, "max_tokens": 64}
    c, _ = client(model, ui_settings=settings)
    props = c.get("/props").json()
    assert props["ui"] is True and props["ui_settings"] == settings


def test_the_page_loads_while_the_model_does(model: Model) -> None:
    release = threading.Event()

    def factory() -> ScriptedEngine:
        release.wait(10)
        return ScriptedEngine(model, ServerConfig())

    with TestClient(create_app(factory, cfg=ServerConfig())) as c:
        assert c.get("/").status_code == 200 and c.get("/main.js").status_code == 200
        assert_error(c.get("/cache"), 503, "unavailable_error", "Loading model")
        release.set()
        deadline = time.monotonic() + 10
        while c.get("/cache").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.get("/cache").status_code == 200


@pytest.mark.model
def test_cache_view_on_the_default_model(default_path: str, default_f32_dequant: Model,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chats with one system prompt, then another: the view's totals and history are the
    responses' own timings, and the tree's node reads as the start of the conversation. Polls
    share a snapshot only while no task started or ended (however long it is kept)."""
    monkeypatch.setattr(webui, "FRESH_S", 3600.0)
    cfg = ServerConfig(model=default_path, dtype="f32", weights="dequant", n_parallel=2,
                       ctx_size=1024, slots_debug=True)  # LLAMA_SERVER_SLOTS_DEBUG=1: text
    system = ("You answer questions about the printing press, movable type and the book "
              "trade of fifteenth-century Europe, briefly and precisely.")
    timings: list[dict[str, Any]] = []
    with app_client(Engine(default_f32_dequant, cfg), cfg) as c:
        assert c.get("/cache").json()["totals"]["requests"] == 0
        chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                 for q in ("Who built the first press?", "When did printing reach Venice?")]
        for messages in chats + [[{"role": "user", "content": "Name three rivers."}]]:
            r = c.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 8, "temperature": 0})
            timings.append(r.json()["timings"])
        view = c.get("/cache").json()
        assert c.get("/cache").json()["time"] == view["time"]  # nothing changed: shared
        assert timings[1]["cache_n"] > 20  # the system prompt was reused
        assert view["totals"] == {
            "requests": 3, "prompt_tokens": sum(t["prompt_n"] for t in timings),
            "cached_tokens": sum(t["cache_n"] for t in timings)}
        assert [(h["prompt_n"], h["cache_n"]) for h in view["history"]] == [
            (t["prompt_n"], t["cache_n"]) for t in timings]
        assert [s["id"] for s in view["slots"]] == [0, 1]
        # the second chat took the first's slot; the third another slot, and the idle one
        # was saved to the tree (idle-slot caching): its text starts as the system prompt
        rendered = c.post("/apply-template", json={"messages": [
            {"role": "system", "content": system}]}).json()["prompt"]
        (root,) = view["tree"]["roots"]
        (node,) = root["children"]
        assert len(node["text"]) > 20 and rendered.startswith(node["text"])
        assert view["ram"]["prompts"] >= 1 and view["ram"]["bytes"] == root["bytes"] > 0
        assert view["text_shown"] is True


def test_the_cache_view_shows_no_prompt_text_by_default(default_path: str,
                                                        default_f32_dequant: Model) -> None:
    """As llama-server's /slots, which shows prompt text only with LLAMA_SERVER_SLOTS_DEBUG: a
    key holder sees sizes and reuse, never what another client asked (the real engine's view)."""
    cfg = ServerConfig(model=default_path, dtype="f32", weights="dequant", n_parallel=2,
                       ctx_size=1024)
    assert cfg.slots_debug is False
    with app_client(Engine(default_f32_dequant, cfg), cfg) as c:
        secret = ("My account number is 4417-2231 and my address is 12 Quay Street; write a "
                  "short letter to my bank asking them to close the account this month.")
        for q in (secret, "Name three rivers of Europe and the seas they flow into.",
                  "Say hello to the reader in three languages, one line each."):
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": q}], "max_tokens": 4,
                "temperature": 0})
            assert r.status_code == 200, r.text
        body = c.get("/cache")
        view = body.json()
        assert view["text_shown"] is False and view["ram"]["prompts"] >= 1

        def texts(v: Any) -> list[Any]:
            if isinstance(v, dict):
                return [x for k, w in v.items() for x in ([w] if k == "text" else texts(w))]
            return [x for w in v for x in texts(w)] if isinstance(v, list) else []

        assert texts(view["tree"]) and set(texts(view["tree"])) == {""}
        assert "4417" not in body.text and "rivers" not in body.text
