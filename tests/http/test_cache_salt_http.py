"""`cache_salt` over HTTP (vLLM's field): accepted on the completion routes, it keeps requests
of different salts from reusing each other's cached prompt (`timings.cache_n` 0) while one salt
(or none) hits as before; a malformed salt is a 400 in the OpenAI error shape, and the server
goes on serving. In-process, the default model with the real engine (one slot, no host cache:
the slot's own KV is the tier), greedy f32: every answer is compared with the first one, which
computed the whole prompt.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixserve.config import RequestDefaults, ServerConfig
from radixserve.engine.engine import Engine
from radixserve.http.parse import ParseContext, parse_chat, parse_completion
from radixserve.model.loader import Model
from tests.http.harness import app_client
from tests.http.test_app import assert_error

pytestmark = pytest.mark.model

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type "
        "changed how books were made, copied and sold across the cities of Europe. Question:")
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/completion", {"prompt": TEXT}),
    ("/v1/completions", {"prompt": TEXT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}]}),
]


@pytest.fixture(scope="module")
def client(default_path: str, default_f32_dequant: Model):
    cfg = ServerConfig(model=default_path, dtype="f32", weights="dequant", n_parallel=1,
                       ctx_size=512, cache_ram_mib=0)
    with app_client(Engine(default_f32_dequant, cfg), cfg) as c:
        yield c


def post(c: TestClient, path: str, body: dict[str, Any], salt: Any = None) -> tuple[int, str]:
    """(timings.cache_n, the answer's text) of a greedy request, `salt` unless None."""
    body = {**body, "temperature": 0, "n_predict": 6, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    j = r.json()
    if "content" in j:  # /completion
        return j["timings"]["cache_n"], j["content"]
    choice = j["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert j["usage"]["prompt_tokens_details"]["cached_tokens"] == j["timings"]["cache_n"]
    return j["timings"]["cache_n"], text


@pytest.mark.parametrize("path, body", ROUTES)
def test_salts_isolate_the_slot_and_one_salt_hits(client: TestClient, path: str,
                                                  body: dict[str, Any]) -> None:
    tenant = path.strip("/").replace("/", "-")  # salts of their own for each route
    a, b = f"{tenant}-a", f"{tenant}-b"
    n0, first = post(client, path, body, a)
    assert n0 == 0  # nothing of this salt was cached
    for salt, hit in ((b, False), (b, True), (None, False), (None, True), (a, False), (a, True)):
        n, text = post(client, path, body, salt)
        assert (n > 0) == hit and (n == 0 or n >= 20), (salt, n)
        assert text == first, salt


@pytest.mark.parametrize("path, body", ROUTES)
def test_malformed_salts_are_400_and_the_server_keeps_serving(client: TestClient, path: str,
                                                             body: dict[str, Any]) -> None:
    for bad in ("", 5, ["x"], {"a": 1}, True, "x" * 513, "x" * 600):
        r = client.post(path, json={**body, "n_predict": 1, "cache_salt": bad})
        assert_error(r, 400, "invalid_request_error")
        assert "'cache_salt'" in r.json()["error"]["message"], bad
    # a lone surrogate is valid JSON but no text: it could not name a namespace on disk
    raw = json.dumps({**body, "n_predict": 1})[:-1] + ', "cache_salt": "a\\ud800"}'
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_error(r, 400, "invalid_request_error")
    assert "UTF-8" in r.json()["error"]["message"]
    assert post(client, path, body, "x" * 512)[1]  # the longest salt allowed
    assert post(client, path, body, None)[1]  # null / absent: the shared namespace
    r = client.post(path, json={**body, "n_predict": 1, "cache_salt": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body", ROUTES)
def test_prompt_cache_fields_over_http(client: TestClient, path: str,
                                       body: dict[str, Any]) -> None:
    """Accepted or refused in the OpenAI error shape; this server has no host cache, so 24h
    cannot be kept: a 400 says so rather than a silent promise."""
    ok = client.post(path, json={**body, "n_predict": 1, "prompt_cache_key": "user-1",
                                 "prompt_cache_retention": "in_memory"})
    assert ok.status_code == 200, ok.text
    for bad, says in (("1h", "in_memory, 24h"), ("24h", "--cache-pin-mib")):
        r = client.post(path, json={**body, "n_predict": 1, "prompt_cache_retention": bad})
        assert_error(r, 400, "invalid_request_error")
        assert "'prompt_cache_retention'" in r.json()["error"]["message"]
        assert says in r.json()["error"]["message"]
    r = client.post(path, json={**body, "n_predict": 1, "prompt_cache_key": 5})
    assert_error(r, 400, "invalid_request_error")


def test_openai_prompt_cache_fields(tok_tmpl: Any) -> None:
    """`prompt_cache_key` (a routing hint: accepted by one server) and `prompt_cache_retention`
    (in_memory, or 24h pinned where the radix cache can pin; anything else a 400 naming it)."""
    tok, tmpl = tok_tmpl
    ctx = ParseContext(tok, tmpl, n_ctx_slot=512, n_slots=2)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat({**chat, "prompt_cache_key": "user-1"}, ctx).task.pin_s == 0
    for path_parse in (parse_chat, parse_completion):
        body = chat if path_parse is parse_chat else {"prompt": "hi"}
        assert path_parse({**body, "prompt_cache_retention": "in_memory"}, ctx).task.pin_s == 0
        req = path_parse({**body, "prompt_cache_retention": "24h", "n": 2}, ctx)
        assert [t.pin_s for t in req.tasks] == [86400.0] * 2
        for bad in ("1h", "forever", ""):
            with pytest.raises(Exception) as e:
                path_parse({**body, "prompt_cache_retention": bad}, ctx)
            assert "'prompt_cache_retention'" in str(e.value) and "in_memory, 24h" in str(e.value)
    legacy = RequestDefaults.from_config(ServerConfig(cache_radix_prompt=False))
    no_pins = ParseContext(tok, tmpl, n_ctx_slot=512, n_slots=2, defaults=legacy)
    with pytest.raises(Exception) as e:
        parse_chat({**chat, "prompt_cache_retention": "24h"}, no_pins)
    assert "--cache-pin-mib" in str(e.value)
    assert parse_chat({**chat, "prompt_cache_retention": "in_memory"}, no_pins).task.pin_s == 0


def test_prompt_arrays_and_extra_completions_inherit_the_salt(tok_tmpl: Any) -> None:
    tok, tmpl = tok_tmpl
    ctx = ParseContext(tok, tmpl, n_ctx_slot=512, n_slots=2)
    req = parse_completion({"prompt": ["one", "two"], "n": 2, "cache_salt": "t"}, ctx)
    assert [(t.cache_salt, t.parent is not None) for t in req.tasks] == [
        ("t", False), ("t", True), ("t", False), ("t", True)]
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "u"}, ctx)
    assert req.task.cache_salt == "u"
    assert parse_completion({"prompt": "x"}, ctx).task.cache_salt == ""
