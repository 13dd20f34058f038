"""CORS and the public static paths, in process, against what llama-server does.

CORS: llama-server's pre-routing handler (tools/server/server-http.cpp) answers every OPTIONS
request 200 with an empty text/html body before its loading and API key checks, with
Access-Control-Allow-Credentials / -Methods / -Headers from --cors-*, and sets
Access-Control-Allow-Origin only for an allowed origin ('*' + credentials: the Origin echoed;
'localhost': local origins only); checked on its binary too: a preflight from a non-local
origin under --cors-origins localhost is `200 OK` without Access-Control-Allow-Origin.

Public paths: its API key middleware lets through /health, /v1/health and its page's files
(`frontend_paths`: "/" and every embedded asset, its service worker /sw.js among them, also
with --no-ui), which also load while the model does; every other route needs the key. Where
its page is not served it answers /sw.js with a worker that removes itself.
"""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.http.app import create_app
from radixserve.http.webui import SW_REMOVE_JS
from radixserve.model.loader import Model
from tests.http.test_app import ScriptedEngine, assert_error, client

PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type"}


def preflight(c: TestClient, origin: str, path: str = "/completion") -> dict[str, str]:
    r = c.options(path, headers={"Origin": origin, **PREFLIGHT})
    assert r.status_code == 200 and r.content == b"", (r.status_code, r.text)
    assert r.headers["content-type"] == "text/html"
    return {k.lower(): v for k, v in r.headers.items()}


def test_a_preflight_from_an_origin_not_allowed_is_200_without_allow_origin(model: Model
                                                                           ) -> None:
    for origins in ("localhost", "http://a.example,http://b.example"):
        c, _ = client(model, cors_origins=origins, cors_credentials=False,
                      cors_methods="GET, POST")
        h = preflight(c, "http://evil.example")
        assert "access-control-allow-origin" not in h
        assert h["access-control-allow-credentials"] == "false"
        assert h["access-control-allow-methods"] == "GET, POST"  # --cors-methods as given
        assert h["access-control-allow-headers"] == "*"
        assert "access-control-allow-origin" not in c.get(
            "/health", headers={"Origin": "http://evil.example"}).headers
    # allowed ones are echoed, on the preflight and the response
    assert preflight(c, "http://b.example")["access-control-allow-origin"] == "http://b.example"
    c, _ = client(model, cors_origins="localhost")
    assert preflight(c, "http://127.0.0.1:5173")["access-control-allow-origin"] == \
        "http://127.0.0.1:5173"
    assert "access-control-allow-origin" not in preflight(c, "http://localhost.evil.example")


def test_star_without_credentials_and_the_default(model: Model) -> None:
    c, _ = client(model, cors_credentials=False)  # '*' as given, on every response
    assert c.get("/health").headers["access-control-allow-origin"] == "*"
    assert preflight(c, "http://x.example")["access-control-allow-origin"] == "*"
    c, _ = client(model)  # '*' with credentials: any Origin echoed
    h = preflight(c, "http://x.example")
    assert (h["access-control-allow-origin"], h["access-control-allow-credentials"]) == (
        "http://x.example", "true")


def test_every_options_request_is_answered_before_the_key_and_the_loading_gate(
        model: Model) -> None:
    c, _ = client(model, api_key=["k"])
    h = preflight(c, "http://x.example", "/no-such-route")  # any path, no key
    assert h["access-control-allow-origin"] == "http://x.example"
    assert c.options("/v1/chat/completions").status_code == 200  # not even a CORS request
    release = threading.Event()
    app = create_app(lambda: (release.wait(10), ScriptedEngine(model, ServerConfig()))[1],
                     cfg=ServerConfig())
    with TestClient(app) as c:
        assert c.get("/props").status_code == 503  # still loading
        preflight(c, "http://x.example")
        release.set()


def test_the_service_worker_and_page_files_are_public_the_api_is_not(model: Model,
                                                                     tmp_path: Path) -> None:
    for cfg in ({}, {"webui": False}, {"static_path": str(tmp_path)},
                {"webui": False, "static_path": str(tmp_path)}):
        c, _ = client(model, api_key=["k"], **cfg)
        r = c.get("/sw.js")
        assert r.status_code == 200, (cfg, r.text)
        assert r.text == SW_REMOVE_JS and r.headers["cache-control"] == "no-cache"
        assert r.headers["content-type"].startswith("application/javascript")
        for method, path in (("GET", "/props"), ("GET", "/slots"), ("POST", "/completion"),
                             ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                             ("GET", "/v1/models"), ("GET", "/cache"), ("GET", "/metrics")):
            assert_error(c.request(method, path), 401, "authentication_error",
                         "Invalid API Key")
        assert c.get("/health").status_code == 200
    c, _ = client(model, api_key=["k"])
    assert c.get("/").status_code == 200 and c.get("/main.js").status_code == 200
    # --path's own sw.js wins (llama-server serves the directory first), still public
    (tmp_path / "sw.js").write_text("// mine\n")
    c, _ = client(model, api_key=["k"], static_path=str(tmp_path))
    assert c.get("/sw.js").text == "// mine\n"
    # with --api-prefix the worker moves with the page
    c, _ = client(model, api_key=["k"], api_prefix="/llm")
    assert c.get("/llm/sw.js").text == SW_REMOVE_JS
    assert_error(c.get("/llm/props"), 401, "authentication_error")


def test_the_service_worker_loads_while_the_model_does(model: Model) -> None:
    release = threading.Event()
    app = create_app(lambda: (release.wait(10), ScriptedEngine(model, ServerConfig()))[1],
                     cfg=ServerConfig(api_key=["k"]))
    with TestClient(app) as c:
        assert c.get("/sw.js").status_code == 200
        assert_error(c.get("/props"), 503, "unavailable_error", "Loading model")
        release.set()
