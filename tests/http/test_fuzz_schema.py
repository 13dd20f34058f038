"""Schema fuzzing: every operation of the app's OpenAPI document (`app.openapi()`), fuzzed with
schemathesis against the real engine on the tiny random-weight model, in process.

Bounded and reproducible: a few examples per operation, derandomized, no coverage phase (its
case count grows with the number of fields, not with `max_examples`), and a time bound on each
request (a hang fails). The server caps generation (--n-predict), so no fuzzed `n_predict` runs
long. Checks: no 5xx; every 4xx in OpenAI's error shape; responses as documented (status,
media type, the error schema). Afterwards the engine must be as good as new: a fixed greedy
probe gives the same tokens as before the fuzz, every slot is idle and no task is deferred.

The document is not served (`openapi_url=None`, as llama-server has no such route), so the
schema is loaded from `app.openapi()` of an app with the same settings (the model plays no part
in the document; the test below checks both documents are equal).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.http import webui
from radixserve.http.app import create_app
from radixserve.model.loader import load_model
from tests.http.test_host_cache import parse_metrics
from tests.http.test_infill import MODELS as INFILL_MODELS
from tests.tiny_gguf import write_tiny_gguf

MAX_EXAMPLES = 20  # per operation (20 operations); operations without inputs run once
REQUEST_S = 30.0  # a request answering later than this is a hang (streams too)
N_PREDICT_CAP = 16  # --n-predict: no request generates more, whatever it asks for


def server_config(**kw: Any) -> ServerConfig:
    """The fuzzed server: small context, 2 slots, capped generation, and every optional route
    on (--metrics, --props, --embeddings; --slot-save-path in the fixture): their 501s, llama-server's "start
    it with --flag", are tested elsewhere. Packed weights with f32 activations: cached KV gives
    the same tokens as computed KV, to the bit (the probe below relies on it)."""
    return ServerConfig(dtype="f32", weights="native", ctx_size=512, n_parallel=2, metrics=True,
                        props_endpoint=True, n_predict=N_PREDICT_CAP, cache_ram_mib=64,
                        embeddings=True, pooling="mean", **kw)


DOC = create_app(lambda: None, server_config()).openapi()  # the engine plays no part in it
schema = schemathesis.openapi.from_dict(DOC, config=SchemathesisConfig.from_dict({
    "request-timeout": REQUEST_S,
    # examples (none declared) and fuzzing; coverage's case count is not bounded by
    # max_examples (hundreds a completion route: minutes), stateful needs links
    "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}},
}))

PROBE = {"prompt": "The quick brown fox", "n_predict": 16, "temperature": 0,
         "ignore_eos": True, "return_tokens": True, "cache_prompt": True}


@dataclass
class Served:
    app: FastAPI
    engine: Engine
    client: TestClient
    before: list[int]  # the probe's tokens before any fuzzing


def probe(c: TestClient) -> list[int]:
    r = c.post("/completion", json=PROBE)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert len(tokens) == PROBE["n_predict"]
    return tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    saves = tmp_path_factory.mktemp("fuzz-slots")
    # the tiny model with FIM tokens (test_infill.py's fim_meta): /infill is fuzzed past its 501
    tiny_path = write_tiny_gguf(str(tmp_path_factory.mktemp("fuzz-model") / "fim.gguf"),
                                **INFILL_MODELS["fim_meta"])
    cfg = server_config(model=tiny_path, slot_save_path=str(saves))
    engine = Engine(load_model(tiny_path, "f32", weights="native"), cfg)
    engine.start()
    try:
        app = create_app(engine, cfg)
        assert app.openapi() == DOC
        client = TestClient(app)  # no lifespan to run: the engine is given, started
        yield Served(app, engine, client, probe(client))
    finally:
        engine.stop()


def check_error_shape(response: Any) -> None:
    """A 4xx is OpenAI's error object, its code the status, or on Anthropic's routes its
    `{"type": "error", "error": {type, message}}` (response_schema_conformance checks the
    shape too, from the document; this does not depend on the document)."""
    if 400 <= response.status_code < 500:
        body = response.json()
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict), body
        if body.get("type") == "error":  # Anthropic's shape (/v1/messages): no code
            assert isinstance(err.get("message"), str) and err["message"], body
            assert isinstance(err.get("type"), str) and err["type"], body
            return
        assert err.get("code") == response.status_code, body
        assert isinstance(err.get("message"), str) and err["message"], body
        assert isinstance(err.get("type"), str) and err["type"], body


# negative_data_rejection is left out: the server takes some schema-violating requests on
# purpose, as llama-server (`erase` reads no body; an alias such as max_tokens is not looked at
# when n_predict is given), and positive_data_acceptance too (valid-looking requests can still be
# refused: id_slot past the slot count, token ids past the vocabulary, grammars that do not parse)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


# always a 501 here: no model radixserve loads has a reranker's head (test_rerank.py)
NOT_SUPPORTED_HERE = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))  # a bounded smoke fuzz: nothing to tune
def test_fuzz(case: Any, served: Served) -> None:
    t0 = time.perf_counter()
    response = case.call(app=served.app, timeout=REQUEST_S)  # a non-stream hang: ReadTimeout
    # a stream still open at the deadline comes back cut short rather than failing
    assert not response.stream_cut_short and time.perf_counter() - t0 < REQUEST_S
    if case.path in NOT_SUPPORTED_HERE:  # llama-server's 501 without --reranking, any body
        assert response.status_code == 501, response.text
        assert response.json()["error"]["type"] == "not_supported_error"
        return
    case.validate_response(response, checks=CHECKS)
    check_error_shape(response)


def test_engine_unharmed_after_fuzz(served: Served) -> None:
    """After the fuzz (module order; it holds without the fuzz too): the probe's tokens are
    unchanged, every slot is idle and no task waits."""
    c = served.client
    deadline = time.monotonic() + REQUEST_S  # a cancelled stream frees its slot on a next step
    while any(s["is_processing"] for s in c.get("/slots").json()):
        assert time.monotonic() < deadline, c.get("/slots").json()
        time.sleep(0.05)
    assert probe(c) == served.before
    slots = c.get("/slots").json()
    assert len(slots) == 2 and not any(s["is_processing"] for s in slots), slots
    m = parse_metrics(c.get("/metrics").text)  # gauges set as the probe was scheduled
    assert m["llamacpp:requests_deferred"] == 0 and m["llamacpp:requests_processing"] == 0, m


def served_routes(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, path) of every route, included routers walked (FastAPI >= 0.160 keeps them
    whole in `app.routes`, older versions flatten them)."""
    for r in routes:
        sub = getattr(r, "original_router", None)
        if sub is not None:
            yield from served_routes(sub.routes, prefix + r.include_context.prefix)
        elif isinstance(r, APIRoute):
            yield from ((m, prefix + r.path) for m in r.methods - {"HEAD"})


@pytest.mark.parametrize("api_prefix", ["", "/api"])
def test_every_route_is_documented(api_prefix: str) -> None:
    """Each route the app serves is in the document, but the page's static files; each route
    that reads a JSON body documents it, with its real fields."""
    app = create_app(lambda: None, server_config(api_prefix=api_prefix))
    page = {api_prefix + p for p in ["", *webui.ui_files()]}
    routes = {(m, p) for m, p in served_routes(app.routes) if p not in page}
    doc = app.openapi()
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented and len(routes) >= 20
    assert all(p.startswith(api_prefix + "/") for _, p in documented)
    if api_prefix:
        return
    assert ("GET", "/cache") in documented
    bodies = {p: ops["post"]["requestBody"]["content"]["application/json"]["schema"]
              for p, ops in DOC["paths"].items() if "requestBody" in ops.get("post", {})}
    assert set(bodies) == {"/completion", "/completions", "/v1/completions", "/chat/completions",
                           "/v1/chat/completions", "/tokenize", "/detokenize", "/apply-template",
                           "/slots/{id_slot}", "/embedding", "/embeddings", "/v1/embeddings",
                           "/infill", "/v1/responses", "/responses", "/v1/responses/input_tokens",
                           "/responses/input_tokens", "/v1/messages",
                           "/v1/messages/count_tokens", "/chat/completions/input_tokens",
                           "/v1/chat/completions/input_tokens"}
    fields = {p: set(s["properties"]) for p, s in bodies.items()}
    assert {"prompt", "n_predict", "max_tokens", "temperature", "stream", "cache_salt", "id_slot",
            "speculative.n_max", "logit_bias"} <= fields["/completion"]
    assert {"messages", "tools", "logprobs", "top_logprobs"} <= fields["/v1/chat/completions"]
    assert fields["/tokenize"] >= {"content", "with_pieces"} and fields["/detokenize"] == {
        "tokens"} and fields["/slots/{id_slot}"] == {"filename"}
    for p, s in bodies.items():  # each field typed (or said to be unused): the fuzzer needs shapes
        loose = [k for k, v in s["properties"].items()
                 if not {"type", "anyOf", "enum", "description"} & set(v)]
        assert not loose, (p, loose)


def test_page_files_stay_out_of_the_document() -> None:
    assert not any(p in DOC["paths"] for p in webui.ui_files())
