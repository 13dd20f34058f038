"""/rerank and its aliases: llama-server's 501 for a server without --reranking, and the flag's
refusal at start-up (radixserve loads no reranker classification head).

llama-server, checked on the default model: without --reranking, POST /rerank, /reranking,
/v1/rerank and /v1/reranking answer 501 {"code": 501, "message": "This server does not support
reranking. Start it with `--reranking`", "type": "not_supported_error"}, whatever the body. With
--reranking it starts on SmolLM2, which has no cls / cls.output tensors, and returns scores
taken from the last token's raw hidden state (e.g. 0.63 and -0.16 for two documents): not a
relevance score, so radixserve refuses the flag rather than serve that.
"""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.flags import parse_serve
from radixserve.flags.spec import FlagError
from radixserve.http.app import create_app
from radixserve.model.loader import Model
from tests.http.test_app import ScriptedEngine

ROUTES = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")
NOT_SUPPORTED = {"error": {
    "code": 501, "type": "not_supported_error",
    "message": "This server does not support reranking. Start it with `--reranking`"}}


def test_rerank_routes_answer_llama_servers_501(model: Model) -> None:
    cfg = ServerConfig()
    with TestClient(create_app(ScriptedEngine(model, cfg), cfg)) as c:
        for path in ROUTES:
            for kw in ({"json": {"query": "a", "documents": ["b", "c"]}}, {"content": b"{"}):
                r = c.post(path, **kw)  # type: ignore[arg-type]
                assert (r.status_code, r.json()) == (501, NOT_SUPPORTED), path


def test_rerank_routes_keep_the_api_prefix_and_key(model: Model) -> None:
    cfg = ServerConfig(api_prefix="/api", api_key=["k"])
    with TestClient(create_app(ScriptedEngine(model, cfg), cfg)) as c:
        assert c.post("/api/rerank", json={}).status_code == 401
        r = c.post("/api/v1/rerank", json={}, headers={"Authorization": "Bearer k"})
        assert (r.status_code, r.json()) == (501, NOT_SUPPORTED)


@pytest.mark.parametrize(("argv", "env"), [
    (["--rerank"], {}),
    (["--reranking"], {}),
    ([], {"LLAMA_ARG_RERANKING": "1"}),
])
def test_reranking_flag_is_refused_naming_the_missing_head(argv: list[str],
                                                           env: dict[str, str]) -> None:
    with pytest.raises(FlagError) as e:
        parse_serve(argv, env)
    msg = str(e.value)
    assert re.search(r"classification head \(its GGUF's cls / cls\.output tensors\)", msg), msg
    assert "radixserve does not load" in msg and "/rerank answers 501" in msg


def test_negative_env_value_refuses_nothing() -> None:
    assert parse_serve([], {"LLAMA_ARG_RERANKING": "0"}).cfg == ServerConfig()


def test_serve_with_reranking_exits_1_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    from radixserve.cli import main

    assert main(["serve", "--reranking", "-m", "/nonexistent.gguf"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("radixserve serve: error: --reranking: reranking needs a reranking "
                          "model's classification head"), err
