"""Bad input gets the right status and the OpenAI error shape; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from starlette.requests import ClientDisconnect

from radixserve.http.errors import GuardedRoute, read_json
from tests.http.harness import running_server

KEY = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_path):
    log = str(tmp_path_factory.mktemp("srv") / "server.log")
    args = ["-m", tiny_path, "--dtype", "f32", "-np", "2", "-c", "256", "--api-key", "sekrit"]
    with running_server(args, log) as srv:
        yield srv


def call(srv, path: str, body=None, raw: bytes | None = None, headers=KEY) -> httpx.Response:
    if raw is not None:
        return httpx.post(srv.url + path, content=raw, headers={**headers,
                          "Content-Type": "application/json"}, timeout=60)
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def assert_error(r: httpx.Response, status: int, type_: str, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == type_ and isinstance(err["message"], str)
    for w in words:
        assert w in err["message"], err["message"]
    return err


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("path,body,raw,status,type_", [
    ("/completion", None, b"{not json", 400, "invalid_request_error"),
    (CHAT, None, b"[1, 2", 400, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "n_predict": "many"}, None, 400, "invalid_request_error"),
    ("/completion", {"prompt": 42}, None, 400, "invalid_request_error"),
    (CHAT, {"messages": "hello"}, None, 400, "invalid_request_error"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "invalid_request_error"),
    (CHAT, {"messages": []}, None, 400, "invalid_request_error"),
    ("/completion", {"prompt": ""}, None, 400, "invalid_request_error"),
    ("/completion", {"prompt": []}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, None, 400, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "id_slot": 7}, None, 400, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "id_slot": "first"}, None, 400, "invalid_request_error"),
    ("/completion", {"prompt": [1, 10 ** 9]}, None, 400, "invalid_request_error"),
])
def test_bad_requests(server, path, body, raw, status, type_):
    assert_error(call(server, path, body, raw), status, type_)
    assert httpx.get(server.url + "/health").status_code == 200


# bodies Python's json module decodes badly (found by tests/http/test_fuzz_schema.py's hunt):
# each was a 500 before read_json refused it
DEEP = b"[" * 100_000 + b"]" * 100_000  # RecursionError in the decoder
HUGE_INT = b'{"prompt": "hi", "n_predict": ' + b"9" * 5000 + b"}"  # int() digit limit
LONE_ESCAPE = rb'{"prompt": "hi", "stop": ["\ud800"]}'  # a surrogate: no UTF-8 text
LONE_UTF8 = b'{"prompt": "a\xed\xa0\x80"}'  # the same as raw bytes (json.loads: surrogatepass)


@pytest.mark.parametrize("path,raw,words", [
    ("/completion", DEEP, ["nested too deeply"]),
    (CHAT, b'{"messages": ' + DEEP + b"}", ["nested too deeply"]),
    ("/completion", HUGE_INT, ["4300 digits"]),
    ("/tokenize", b'{"content": [' + b"1" * 4301 + b"]}", ["4300 digits"]),
    ("/completion", LONE_ESCAPE, ["surrogate"]),
    ("/completion", LONE_UTF8, ["surrogate"]),
    ("/completion", rb'{"prompt": "\udfff"}', ["surrogate"]),
    (CHAT, rb'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "\ud800"}',
     ["surrogate"]),
    ("/tokenize", rb'{"content": "\ud800", "with_pieces": true}', ["surrogate"]),
    ("/apply-template", rb'{"messages": [{"role": "user", "content": "\udbff"}]}',
     ["surrogate"]),
])
def test_bodies_json_decodes_badly_are_400(server, path, raw, words):
    assert_error(call(server, path, raw=raw), 400, "invalid_request_error",
                 "Invalid JSON in request body", *words)
    assert httpx.get(server.url + "/health").status_code == 200


def test_surrogate_pairs_and_moderate_nesting_are_fine(server):
    """A pair escapes one character (json.dumps' default for emoji): text, accepted."""
    pair = rb'{"prompt": "hi \ud83d\ude00", "n_predict": 1, "stop": ["\uD83D\uDE00"]}'
    assert call(server, "/completion", raw=pair).status_code == 200
    r = call(server, "/tokenize", raw=rb'{"content": "\ud83d\ude00"}')
    assert r.status_code == 200 and r.json()["tokens"]
    nested = b'{"prompt": "hi", "n_predict": 1, "extra": ' + b"[" * 200 + b"]" * 200 + b"}"
    assert call(server, "/completion", raw=nested).status_code == 200


def test_prompt_longer_than_context_names_both_numbers(server):
    r = call(server, "/completion", {"prompt": list(range(1000, 1300))})
    err = assert_error(r, 400, "exceed_context_size_error", "300", "128")
    assert err["n_prompt_tokens"] == 300 and err["n_ctx"] == 128


def test_huge_max_tokens_stops_at_the_context(server):
    r = call(server, "/v1/completions", {"prompt": list(range(2000, 2100)), "max_tokens": 10 ** 9,
                                         "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 128 - 100 - 1 + 1  # fills the slot, minus one
    native = call(server, "/completion", {"prompt": list(range(2000, 2100)), "n_predict": 10 ** 9,
                                          "ignore_eos": True, "temperature": 0}).json()
    assert native["truncated"] is True and native["stop_type"] == "limit"


def test_api_key(server):
    assert_error(call(server, "/completion", {"prompt": "hi"}, headers={}), 401,
                 "authentication_error")
    assert_error(call(server, "/completion", {"prompt": "hi"},
                      headers={"Authorization": "Bearer wrong"}), 401, "authentication_error")
    assert call(server, "/completion", {"prompt": "hi", "n_predict": 2},
                headers={"X-Api-Key": "sekrit"}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # exempt
    assert_error(httpx.get(server.url + "/slots"), 401, "authentication_error")


def test_unknown_route_is_404(server):
    assert_error(httpx.get(server.url + "/nope", headers=KEY), 404, "not_found_error")


def test_server_still_serves_after_errors(server):
    r = call(server, "/completion", {"prompt": "hello", "n_predict": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 3


def test_model_that_fails_to_load_stops_the_server(tmp_path):
    import subprocess
    import sys

    from tests.http.harness import free_port

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    for model in (str(bad), str(tmp_path / "missing.gguf")):
        r = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "-m", model,
                            "--port", str(free_port())], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1 and "failed to load the model" in r.stderr


def test_a_client_gone_mid_body_is_a_499_not_a_logged_500(caplog) -> None:
    """starlette raises its own ClientDisconnect when the body stops coming (a client that left,
    broken chunked framing): the client's doing, so the 499 our ClientDisconnected gets, and
    no error logged."""
    app = FastAPI()
    app.router.route_class = GuardedRoute

    @app.post("/gone")
    async def gone(request: Request) -> dict:
        await read_json(request)
        raise ClientDisconnect()

    with caplog.at_level("INFO", logger="radixserve.http.errors"):
        r = TestClient(app).post("/gone", json={})
    assert r.status_code == 499
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"]
