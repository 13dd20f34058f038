"""/infill (fill-in-the-middle) and the FIM token ids, against llama-server's behaviour.

The tiny models here have the default model's vocabulary with FIM tokens added: `fim_meta` names
them in its GGUF metadata (pre 7, suf 8, mid 9, pad 10, sep 5; `<reponame>` (4) is FIM_REP by
its text), `fim_text` renames tokens to `<fim_prefix>` (4), `<fim_suffix>` (7), `<fim_middle>`
(8), `<fim_pad>` (9) (found by text only; no REP, no SEP), `fim_text_bos` is `fim_text` with
`add_bos_token`. llama-server (the build at /tmp/llama-server-build) loaded the same files and
printed the same FIM ids, and its /infill prompts for them are in
fixtures/llama-server-infill/answers.json: every layout here (repo-level FIM_REP/FIM_SEP,
"--- snippet ---" chunks, --spm-infill, BOS, the batch/context truncation) gives the same
prompt, token for token count, as it did.

The default model (SmolLM2) has no FIM prefix/suffix/middle token: llama-server found only
FIM_REP = 4 `<reponame>` (also an end-of-generation token) and answered /infill with 501
"Infill is not supported by this model: prefix token is missing. suffix token is missing.
middle token is missing. " (checked: llama-server -m <default model>, POST /infill).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import gguf
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.flags import parse_serve
from radixserve.http.app import create_app
from radixserve.model.default_model import default_model_path
from radixserve.model.loader import Model, load_model
from radixserve.text.infill import ExtraChunk, format_prompt_infill
from radixserve.text.tokenizer import FimTokens, Tokenizer
from tests.http.harness import app_client
from tests.http.test_app import ScriptedEngine
from tests.tiny_gguf import write_tiny_gguf

K = gguf.Keys.Tokenizer
ANSWERS = json.loads((Path(__file__).parent / "fixtures" / "llama-server-infill" /
                      "answers.json").read_text())
TEXT_FIM = {4: "<fim_prefix>", 7: "<fim_suffix>", 8: "<fim_middle>", 9: "<fim_pad>"}
MODELS: dict[str, dict[str, Any]] = {
    "fim_meta": {"token_ids": {K.FIM_PRE_ID: 7, K.FIM_SUF_ID: 8, K.FIM_MID_ID: 9,
                               K.FIM_PAD_ID: 10, K.FIM_SEP_ID: 5}},
    "fim_text": {"rename_tokens": TEXT_FIM},
    "fim_text_bos": {"rename_tokens": TEXT_FIM, "add_bos": True},
    # the deprecated prefix key wins over fim_pre; an out-of-range fim_mid is ignored and the
    # text search finds `<fim-middle>` (llama-server: "bad special token ... using default id
    # -1", then FIM PRE 11, SUF 8, MID 9)
    "fim_depr": {"token_ids": {K.FIM_PRE_ID: 7, K.PREFIX_ID: 11, K.FIM_SUF_ID: 8,
                               K.FIM_MID_ID: 99_999_999}, "rename_tokens": {9: "<fim-middle>"}},
}
NO_FIM_501 = {"error": {
    "code": 501, "type": "not_supported_error",
    "message": "Infill is not supported by this model: prefix token is missing. suffix token "
               "is missing. middle token is missing. "}}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("fim")
    # n_ctx_train 8192: a -c 4096 slot is not capped to the training context
    return {name: write_tiny_gguf(str(d / f"{name}.gguf"), n_ctx_train=8192, **kw)
            for name, kw in MODELS.items()}


@pytest.fixture(scope="module")
def models(paths: dict[str, str]) -> dict[str, Model]:
    return {name: load_model(p, dtype="f32") for name, p in paths.items() if name != "fim_depr"}


def tokenizer(models: dict[str, Model], name: str) -> Tokenizer:
    return models[name].tokenizer


# ---- FIM token ids (llama-vocab.cpp) -------------------------------------------------------


def test_fim_ids_from_metadata_and_text(models: dict[str, Model], paths: dict[str, str]
                                        ) -> None:
    meta = tokenizer(models, "fim_meta")
    assert meta.fim == FimTokens(pre=7, suf=8, mid=9, pad=10, rep=4, sep=5)
    assert {4, 5, 10} <= meta.eog_ids  # pad, rep and sep end generation (llama-server too)
    text = tokenizer(models, "fim_text")
    assert text.fim == FimTokens(pre=4, suf=7, mid=8, pad=9)
    assert 9 in text.eog_ids and not {4, 7, 8} & text.eog_ids
    depr = Tokenizer.from_gguf(gguf.GGUFReader(paths["fim_depr"]))
    assert depr.fim == FimTokens(pre=11, suf=8, mid=9, rep=4)


def test_default_model_has_no_fim_prefix_suffix_middle() -> None:
    tok = Tokenizer.from_gguf(gguf.GGUFReader(default_model_path()))
    assert tok.fim == FimTokens(rep=4)  # `<reponame>`, as llama-server's "FIM REP token = 4"
    assert tok.eog_ids == {0, 2, 4}  # its EOG tokens: <|endoftext|>, <|im_end|>, <reponame>


# ---- the layout, token by token (server-common.cpp format_prompt_infill) -------------------


def enc(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special=False, parse_special=False)


def test_repo_level_layout(models: dict[str, Model]) -> None:
    tok = tokenizer(models, "fim_meta")
    pre, suf, prompt = enc(tok, "def f("), enc(tok, "):\n"), enc(tok, "x")
    extra = [ExtraChunk("a = 1\n", "a.py"), ExtraChunk("b = 2\n")]
    got = format_prompt_infill(tok, pre, suf, extra, 2048, -1, 4096, False, prompt)
    assert got == [4, *enc(tok, "myproject\n"),
                   5, *enc(tok, "a.py\n"), *enc(tok, "a = 1\n"),
                   5, *enc(tok, "tmp\n"), *enc(tok, "b = 2\n"),
                   5, *enc(tok, "filename\n"),
                   7, *pre, *prompt, 8, *suf, 9]


def test_snippet_layout_spm_and_bos(models: dict[str, Model]) -> None:
    tok = tokenizer(models, "fim_text")
    pre, suf = enc(tok, "def f("), enc(tok, "):\n")
    snippet = enc(tok, "\n\n--- snippet ---\n\n")
    extra = [ExtraChunk("a = 1\n", "a.py")]
    assert format_prompt_infill(tok, pre, suf, extra, 2048, -1, 4096, False, []) == [
        *snippet, *enc(tok, "a = 1\n"), 4, *pre, 7, *suf, 8]
    assert format_prompt_infill(tok, pre, suf, [], 2048, -1, 4096, True, []) == [
        7, *suf, 4, *pre, 8]
    bos = tokenizer(models, "fim_text_bos")
    assert bos.add_bos and bos.bos_id == 1
    # BOS after the extra context, before the first FIM part
    assert format_prompt_infill(bos, pre, suf, extra, 2048, -1, 4096, True, []) == [
        *snippet, *enc(tok, "a = 1\n"), 1, 7, *suf, 4, *pre, 8]


def test_truncation(models: dict[str, Model]) -> None:
    """Prefix: its last 3*(n_batch/4) tokens; suffix: its first n_batch/4 - 2 - len(prompt);
    extra: its last n_ctx - n_batch - 2*n_predict tokens."""
    tok = tokenizer(models, "fim_meta")
    pre, suf, prompt = list(range(100, 200)), list(range(300, 400)), [42]
    text = "".join(f"v{i} = {i}\n" for i in range(40))
    extra_tokens = [4, *enc(tok, "myproject\n"), 5, *enc(tok, "f.py\n"), *enc(tok, text),
                    5, *enc(tok, "filename\n")]
    n_extra = 256 - 64 - 2 * 8
    assert len(extra_tokens) > n_extra
    got = format_prompt_infill(tok, pre, suf, [ExtraChunk(text, "f.py")], 64, 8, 256, False,
                               prompt)
    assert got == [*extra_tokens[-n_extra:], 7, *pre[-48:], 42, 8, *suf[:16 - 2 - 1], 9]
    # a prompt longer than the suffix's share leaves no suffix; n_predict -1 adds 2 tokens
    base = [4, *enc(tok, "myproject\n"), 5, *enc(tok, "filename\n")]
    got = format_prompt_infill(tok, pre, suf, [], 64, -1, 64, False, list(range(20)))
    assert got == [*base[-2:], 7, *pre[-48:], *range(20), 8, 9]


# ---- /infill over HTTP, against llama-server's answers --------------------------------------


@pytest.fixture(scope="module")
def clients(paths: dict[str, str], models: dict[str, Model]) -> Iterator[dict[tuple[str, str],
                                                                             TestClient]]:
    """One app per (llama-server flags, model) of answers.json, started on first use."""
    with ExitStack() as stack:
        class Lazy(dict):  # type: ignore[type-arg]
            def __missing__(self, key: tuple[str, str]) -> TestClient:
                server, model = key
                args = [*ANSWERS["servers"][server], "-m", paths[model], "--dtype", "f32"]
                cfg = parse_serve(args, {}).cfg
                self[key] = stack.enter_context(app_client(Engine(models[model], cfg), cfg))
                return self[key]

        yield Lazy()


@pytest.mark.parametrize("case", ANSWERS["cases"], ids=lambda c: f"{c['server']}-{c['name']}")
def test_prompt_as_llama_server(case: dict[str, Any], clients: dict[Any, TestClient]) -> None:
    c = clients[(case["server"], case["model"])]
    r = c.post("/infill", json={**ANSWERS["common"], **case["body"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["prompt"], body["tokens_evaluated"]) == (case["prompt"], case["tokens_evaluated"])
    assert len(body["tokens"]) <= ANSWERS["common"]["n_predict"] and "timings" in body


def test_stream_is_the_completion_stream(clients: dict[Any, TestClient]) -> None:
    c = clients[("meta", "fim_meta")]
    req = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n",
           "n_predict": 4, "temperature": 0, "ignore_eos": True}
    whole = c.post("/infill", json=req).json()
    with c.stream("POST", "/infill", json={**req, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["stop"] and events[-1]["tokens_evaluated"] == whole["tokens_evaluated"]


XY = {"input_prefix": "x", "input_suffix": "y"}


@pytest.mark.parametrize(("body", "message"), [
    # llama-server's own messages and 400s
    ({**XY, "input_extra": {"text": "a"}},
     '"input_extra" must be an array of {"filename": string, "text": string}'),
    ({**XY, "input_extra": None},
     '"input_extra" must be an array of {"filename": string, "text": string}'),
    ({**XY, "input_extra": [{"filename": "a"}]},
     'extra_context chunk must contain a "text" field with a string value'),
    ({**XY, "input_extra": [{"text": 1}]},
     'extra_context chunk must contain a "text" field with a string value'),
    ({**XY, "input_extra": ["abc"]},
     'extra_context chunk must contain a "text" field with a string value'),
    ({**XY, "input_extra": [{"text": "a", "filename": 3}]},
     'extra_context chunk\'s "filename" field must be a string'),
    ({**XY, "input_extra": [{"text": "a", "filename": None}]},
     'extra_context chunk\'s "filename" field must be a string'),
    ({"input_prefix": [999_999], "input_suffix": "y"}, "Prompt contains invalid tokens"),
    # llama-server's messages, where its handler goes on after setting them: a missing prefix
    # or suffix then fails as a 500 ("[json.exception.out_of_range.403] key 'input_prefix' not
    # found"), a non-string prompt is ignored (200)
    ({"input_suffix": "y"}, '"input_prefix" is required'),
    ({"input_prefix": "x"}, '"input_suffix" is required'),
    ({**XY, "prompt": 5}, '"prompt" must be a string'),
    # llama-server: 500 "[json.exception.type_error.302] type must be string, but is number"
    ({"input_prefix": 5, "input_suffix": "y"},
     '"input_prefix" must be a string or an array of strings and token ids'),
    ({"input_prefix": "x", "input_suffix": ["a", {}]},
     '"input_suffix" must be a string or an array of strings and token ids'),
    # llama-server: 500 "cannot use operator[] with a string argument with array"
    ([1, 2], "request body must be a JSON object"),
    # the /completion fields are checked as /completion checks them
    ({**XY, "n_probs": 101}, "Field 'n_probs'"),
])
def test_validation_errors(body: Any, message: str, clients: dict[Any, TestClient]) -> None:
    r = clients[("meta", "fim_meta")].post("/infill", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith(message), err


def test_model_without_fim_tokens_is_501_before_the_body_is_read(model: Model) -> None:
    """The tiny test model has the default vocabulary: no FIM prefix/suffix/middle."""
    cfg = ServerConfig()
    with TestClient(create_app_over(model, cfg)) as c:
        for kw in ({"json": XY}, {"content": b"not json"}):
            r = c.post("/infill", **kw)  # type: ignore[arg-type]
            assert (r.status_code, r.json()) == (501, NO_FIM_501)


@pytest.mark.model
def test_default_model_infill_is_llama_servers_501(default_f32: Model) -> None:
    with TestClient(create_app_over(default_f32, ServerConfig())) as c:
        r = c.post("/infill", json={**XY, "n_predict": 8})
        assert (r.status_code, r.json()) == (501, NO_FIM_501)


def create_app_over(model: Model, cfg: ServerConfig) -> FastAPI:
    """The app over a stand-in engine (no scheduler): the 501 comes before any task."""
    return create_app(ScriptedEngine(model, cfg), cfg)


def test_spm_infill_flag_is_honored() -> None:
    assert parse_serve(["--spm-infill"], {}).cfg.spm_infill
    assert not parse_serve([], {}).cfg.spm_infill
