"""Response bodies and SSE chunks compared with captured llama-server output, no engine.

The results fed in are hand-built `FinalResult`/`PartialResult` records: these tests check
JSON shapes and arithmetic, not generation (the real-server tests do that).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest

from radixserve.config import RequestDefaults, ServerConfig
from radixserve.engine.task import FinalResult, PartialResult, Timings, TokenProbs
from radixserve.errors import TaskError
from radixserve.http import info
from radixserve.http.parse import ParseContext, ParsedRequest, parse_chat, parse_completion
from radixserve.http.responses import (
    LOGPROB_FLOOR,
    ResponseContext,
    chat_completion_json,
    completion_json,
    finish_reason,
    probs_json,
    random_id,
    text_completion_json,
    usage_json,
)
from radixserve.http.sse import SSE_DONE, ChatStream, NativeStream, TextStream, sse_event
from radixserve.model.loader import load_model
from radixserve.text.chat_template import ChatTemplate
from radixserve.text.tokenizer import Tokenizer

# captured from a real llama-server
SHAPES = Path(__file__).resolve().parent / "fixtures/llama-server-shapes"


def reference(name: str) -> str:
    path = SHAPES / name
    return path.read_text()


def sse_events(text: str) -> list[Any]:
    """Parse `data: ...` events; [DONE] stays a string."""
    assert text.endswith("\n\n")
    out = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def shape(v: Any) -> Any:
    """Keys and JSON value types, recursively (lists by their first element)."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(v[0])] if v else []
    if v is None:
        return None
    return type(v).__name__


@pytest.fixture
def pctx(tok_tmpl: tuple[Tokenizer, ChatTemplate]) -> ParseContext:
    return ParseContext(tok_tmpl[0], tok_tmpl[1], n_ctx_slot=4096, n_slots=4)


@pytest.fixture
def rctx(tok_tmpl: tuple[Tokenizer, ChatTemplate]) -> ResponseContext:
    return ResponseContext(
        "models/SmolLM2-135M-Instruct.Q4_1.gguf", tok_tmpl[0], 4096, id=random_id("chatcmpl-")
    )


def final(
    stop_type: str = "eos",
    content: str = "A color is a color.",
    n_gen: int = 7,
    probs: list[TokenProbs] | None = None,
) -> FinalResult:
    return FinalResult(
        content=content,
        tokens=list(range(100, 100 + n_gen)),
        stop_type=stop_type,
        stopping_word="",
        truncated=False,
        n_prompt_tokens=23,
        n_tokens_cached=29,
        id_slot=3,
        timings=Timings(
            cache_n=22, prompt_n=1, prompt_ms=10.774, predicted_n=n_gen, predicted_ms=61.744
        ),
        probs=probs or [],
    )


def chat_req(pctx: ParseContext, **kw: Any) -> ParsedRequest:
    return parse_chat({"messages": [{"role": "user", "content": "What is a color?"}], **kw}, pctx)


def tp(tid: int, p: float, tok: Tokenizer) -> TokenProbs:
    piece = tok.token_to_piece(tid, special=False)
    text = piece.decode("utf-8", "replace")
    return TokenProbs(tid, text, list(piece), p, [(tid, text, p), (tid + 1, "x", 1 - p)])


# ---- non-streamed ---------------------------------------------------------------------------


def test_chat_completion_matches_llama_server(pctx: ParseContext, rctx: ResponseContext) -> None:
    ref = json.loads(reference("chat_nonstream.json"))
    ours = chat_completion_json(final(), chat_req(pctx), rctx)
    assert shape(ours) == shape(ref)
    assert list(ours) == list(ref)  # same key order, too
    assert re.fullmatch(r"chatcmpl-[A-Za-z0-9]{32}", ours["id"])
    assert ours["system_fingerprint"].startswith("b")
    assert abs(ours["created"] - time.time()) < 60
    assert ours["usage"] == {
        "completion_tokens": 7,
        "prompt_tokens": 23,
        "total_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 22},
    }
    assert ours["choices"][0]["message"] == {"role": "assistant", "content": "A color is a color."}


def test_text_completion_shape(pctx: ParseContext, rctx: ResponseContext) -> None:
    req = parse_completion({"prompt": "Hi"}, pctx)
    out = text_completion_json(final(stop_type="limit"), req, rctx)
    assert list(out) == [
        "choices",
        "created",
        "model",
        "system_fingerprint",
        "object",
        "usage",
        "id",
        "timings",
    ]
    assert out["object"] == "text_completion"
    assert out["choices"] == [
        {"text": "A color is a color.", "index": 0, "logprobs": None, "finish_reason": "length"}
    ]
    ref_usage = json.loads(reference("chat_nonstream.json"))["usage"]
    assert shape(out["usage"]) == shape(ref_usage)


def test_native_completion_fields(pctx: ParseContext, rctx: ResponseContext) -> None:
    req = parse_completion({"prompt": "Hi", "n_predict": 7}, pctx)
    out = completion_json(final(stop_type="word"), req, rctx)
    assert set(out) == {
        "index",
        "content",
        "tokens",
        "id_slot",
        "stop",
        "model",
        "tokens_predicted",
        "tokens_evaluated",
        "generation_settings",
        "prompt",
        "has_new_line",
        "truncated",
        "stop_type",
        "stopping_word",
        "tokens_cached",
        "timings",
    }
    assert (out["content"], out["tokens"], out["stop"], out["stop_type"]) == (
        "A color is a color.",
        [],
        True,
        "word",
    )
    assert (out["tokens_predicted"], out["tokens_evaluated"], out["tokens_cached"]) == (7, 23, 29)
    assert out["prompt"] == "Hi" and out["id_slot"] == 3
    assert out["generation_settings"]["n_predict"] == 7
    assert out["generation_settings"]["n_ctx"] == 4096
    req = parse_completion({"prompt": "Hi", "return_tokens": True}, pctx)
    assert completion_json(final(), req, rctx)["tokens"] == list(range(100, 107))


def test_generation_settings_match_props_params(pctx: ParseContext, rctx: ResponseContext) -> None:
    ref = json.loads(reference("props.json"))["default_generation_settings"]["params"]
    ours = info.default_params_json(RequestDefaults.from_config(ServerConfig()))
    assert shape(ours) == shape(ref)
    settings = completion_json(final(), parse_completion({"prompt": "x"}, pctx), rctx)[
        "generation_settings"
    ]
    assert {k: shape(v) for k, v in settings.items() if k in ref} == shape(ref)


def test_finish_reason_mapping() -> None:
    assert finish_reason(final("eos")) == "stop"
    assert finish_reason(final("word")) == "stop"
    assert finish_reason(final("limit")) == "length"
    assert finish_reason(final("none")) == "length"


def test_usage_counts_cached_tokens() -> None:
    u = usage_json(final(n_gen=3))
    assert u == {
        "completion_tokens": 3,
        "prompt_tokens": 23,
        "total_tokens": 26,
        "prompt_tokens_details": {"cached_tokens": 22},
    }


# ---- timings --------------------------------------------------------------------------------


def test_timings_maths_matches_captured_values() -> None:
    ref = json.loads(reference("chat_nonstream.json"))["timings"]
    t = Timings(
        ref["cache_n"], ref["prompt_n"], ref["prompt_ms"], ref["predicted_n"], ref["predicted_ms"]
    ).to_json()
    assert list(t) == list(ref)
    for k, v in ref.items():
        assert t[k] == pytest.approx(v), k


def test_timings_first_token_is_free_and_no_division_by_zero() -> None:
    one = Timings(0, 0, 0.0, 1, 5.0).to_json()
    assert one["predicted_per_second"] == 0 and one["predicted_per_token_ms"] == 0
    assert one["prompt_per_token_ms"] == 0 and one["prompt_per_second"] == 0
    two = Timings(0, 4, 8.0, 3, 20.0).to_json()
    assert two["predicted_per_token_ms"] == pytest.approx(10.0)
    assert two["predicted_per_second"] == pytest.approx(100.0)
    assert two["prompt_per_token_ms"] == pytest.approx(2.0)
    assert two["prompt_per_second"] == pytest.approx(500.0)


# ---- probabilities --------------------------------------------------------------------------


def test_probs_json_logprob_and_post_sampling_forms(tok_tmpl: tuple[Tokenizer, Any]) -> None:
    tok = tok_tmpl[0]
    probs = [tp(6004, 0.25, tok)]
    [entry] = probs_json(probs, tok, post_sampling=False)
    assert set(entry) == {"id", "token", "bytes", "logprob", "top_logprobs"}
    assert entry["logprob"] == pytest.approx(math.log(0.25))
    top = entry["top_logprobs"][0]
    assert set(top) == {"id", "token", "bytes", "logprob"}
    assert top["bytes"] == list(tok.token_to_piece(6004, special=False))
    [entry] = probs_json(probs, tok, post_sampling=True)
    assert set(entry) == {"id", "token", "bytes", "prob", "top_probs"}
    assert entry["prob"] == 0.25 and entry["top_probs"][1]["prob"] == 0.75
    zero = TokenProbs(5, "a", [97], 0.0, [])
    assert probs_json([zero], tok, post_sampling=False)[0]["logprob"] == LOGPROB_FLOOR


def test_completion_probabilities_and_oai_logprobs(
    pctx: ParseContext, rctx: ResponseContext, tok_tmpl: tuple[Tokenizer, Any]
) -> None:
    f = final(probs=[tp(6004, 0.5, tok_tmpl[0])])
    native = completion_json(f, parse_completion({"prompt": "x", "n_probs": 2}, pctx), rctx)
    assert native["completion_probabilities"][0]["id"] == 6004
    chat = chat_completion_json(f, chat_req(pctx, logprobs=True, top_logprobs=2), rctx)
    assert chat["choices"][0]["logprobs"]["content"][0]["logprob"] == pytest.approx(math.log(0.5))
    assert "logprobs" not in chat_completion_json(f, chat_req(pctx), rctx)["choices"][0]


# ---- streaming ------------------------------------------------------------------------------


def run_stream(fmt: Any, partials: list[PartialResult], f: FinalResult) -> str:
    chunks = list(fmt.start())
    for p in partials:
        chunks += fmt.partial(p)
    chunks += fmt.final(f)
    body = b"".join(sse_event(c) for c in chunks) + (fmt.done or b"")
    return body.decode()


WORDS = ["A", " color", " is", " a", " color", "."]


def word_partials() -> list[PartialResult]:
    return [PartialResult(w, [100 + i]) for i, w in enumerate(WORDS)]


@pytest.mark.parametrize(
    ("ref_file", "usage"), [("chat_stream.sse", False), ("chat_stream_usage.sse", True)]
)
def test_chat_stream_matches_llama_server(
    pctx: ParseContext, rctx: ResponseContext, ref_file: str, usage: bool
) -> None:
    ref = sse_events(reference(ref_file))
    req = chat_req(pctx, stream=True, stream_options={"include_usage": usage})
    ours = sse_events(run_stream(ChatStream(req, rctx), word_partials(), final()))
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert shape(a) == shape(b)
    assert ours[-1] == "[DONE]"
    assert ours[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert "".join(c["choices"][0]["delta"]["content"] for c in ours[1:7]) == "A color is a color."
    assert ours[7]["choices"][0]["finish_reason"] == "stop"
    assert len({c["id"] for c in ours[:-1]}) == 1  # one id for the whole stream
    if usage:
        assert ours[8]["choices"] == [] and ours[8]["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 22
        }


def test_sse_framing() -> None:
    assert sse_event({"a": "é", "b": [1, 2]}) == 'data: {"a":"é","b":[1,2]}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_native_stream_has_partials_then_final_and_no_done(
    pctx: ParseContext, rctx: ResponseContext
) -> None:
    req = parse_completion({"prompt": "Hi", "stream": True}, pctx)
    events = sse_events(run_stream(NativeStream(req, rctx), word_partials(), final()))
    assert "[DONE]" not in events
    for i, e in enumerate(events[:-1]):
        assert e == {
            "index": 0,
            "content": WORDS[i],
            "tokens": [100 + i],
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": i + 1,
            "tokens_evaluated": 1,
        }
    last = events[-1]
    assert last["stop"] is True and last["content"] == "" and last["stop_type"] == "eos"
    assert last["timings"]["cache_n"] == 22 and last["generation_settings"]["stream"] is True


def test_text_stream(pctx: ParseContext, rctx: ResponseContext) -> None:
    req = parse_completion(
        {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}}, pctx
    )
    events = sse_events(run_stream(TextStream(req, rctx), word_partials(), final("limit")))
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert events[0]["choices"] == [
        {"text": "A", "index": 0, "logprobs": None, "finish_reason": None}
    ]
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and "usage" in events[-2] and "timings" in events[-2]


def test_stream_flushes_text_only_in_the_final_result(
    pctx: ParseContext, rctx: ResponseContext
) -> None:
    """A held-back stop-word prefix that was not a stop word arrives only in FinalResult."""
    fmt = ChatStream(chat_req(pctx, stream=True), rctx)
    fmt.start()
    assert fmt.partial(PartialResult("", [])) == []  # nothing new: no chunk
    fmt.partial(PartialResult("Hello wor", [1, 2]))
    chunks = fmt.final(final(content="Hello world"))
    assert chunks[0]["choices"][0]["delta"] == {"content": "ld"}
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_chunk_logprobs(
    pctx: ParseContext, rctx: ResponseContext, tok_tmpl: tuple[Tokenizer, Any]
) -> None:
    fmt = ChatStream(chat_req(pctx, stream=True, logprobs=True, top_logprobs=2), rctx)
    [chunk] = fmt.partial(PartialResult("hi", [6004], [tp(6004, 0.5, tok_tmpl[0])]))
    assert chunk["choices"][0]["logprobs"]["content"][0]["id"] == 6004


TRICKY = ["A", "", ' "quoted" \\ back', "tab\tnew\nline\r", "\x00\x1f\x7f", "é ü ß", "日本語",
          "😀 \U0001f600", "\u2028\u2029", "</script>", "\ufffd", " ", "{}[],:"]


@pytest.mark.parametrize("kind", ["chat", "text", "native"])
@pytest.mark.parametrize("fields", [{}, {"timings_per_token": True}, {"n": 1, "logprobs": True},
                                    {"n_probs": 2}])
def test_partial_bytes_are_the_chunks_bytes(
    pctx: ParseContext, rctx: ResponseContext, tok_tmpl: tuple[Tokenizer, Any], kind: str,
    fields: dict[str, Any],
) -> None:
    """The per-token event from the template (`partial_bytes`) is byte for byte what the chunk
    dicts give, and leaves the formatter in the same state, for any text; logprobs and
    per-token timings take the dict path."""
    if kind == "chat":
        fields = {k: v for k, v in fields.items() if k != "n_probs"}
        new = lambda: ChatStream(chat_req(pctx, stream=True, **fields), rctx)  # noqa: E731
    else:
        fields = {k: v for k, v in fields.items() if k not in ("n", "logprobs")}
        req = parse_completion({"prompt": "Hi", "stream": True, **fields}, pctx)
        new = lambda: (TextStream if kind == "text" else NativeStream)(req, rctx)  # noqa: E731
    fast, slow = new(), new()
    tm = Timings(0, 3, 1.0, 2, 2.0) if fields.get("timings_per_token") else None
    for i, text in enumerate(TRICKY):
        probs = [tp(6004, 0.5, tok_tmpl[0])] if fields.get("logprobs") or "n_probs" in fields \
            else []
        p = PartialResult(text, [100 + i, 7] if i % 3 else [100 + i], probs, tm)
        assert fast.partial_bytes(p) == b"".join(sse_event(c) for c in slow.partial(p))
        assert (fast.text_sent, fast.n_tokens, fast.n_probs_sent) == \
            (slow.text_sent, slow.n_tokens, slow.n_probs_sent)
    f = final(content="".join(TRICKY) + "!")
    assert fast.final(f) == slow.final(f)


def test_stream_error_event_shape() -> None:
    from radixserve.http.sse import sse_error

    body = sse_error(TaskError(500, "server_error", "boom")).decode()
    assert sse_events(body) == [{"error": {"code": 500, "message": "boom", "type": "server_error"}}]


# ---- informational routes -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_path: str) -> Any:
    return load_model(tiny_path, dtype="f32")


def test_props_shape(tiny_model: Any) -> None:
    ref = json.loads(reference("props.json"))
    facts = info.model_facts(tiny_model)
    ours = info.props_json(tiny_model, facts, ServerConfig(), 4096, 4, {"nodes": 1.0})
    assert set(ref) <= set(ours)
    for k in ref:
        if isinstance(ref[k], dict) and k != "chat_template_caps":
            assert shape(ours[k]) == shape(ref[k]), k
        elif k != "chat_template_caps":
            assert type(ours[k]) is type(ref[k]), k
    assert ours["prompt_cache"] == {
        "backend": "radix", "cache_ram_mib": 8192, "cache_idle_slots": True,
        "cache_radix_min_restore_tokens": 0, "cache_reuse": 0, "nodes": 1.0,
        "cache_disk": False, "cache_disk_mib": 10240, "cache_disk_block": 64,
        "context_shift": False, "recurrent_layers": 0,
    }
    assert ours["default_generation_settings"]["n_ctx"] == 4096
    assert ours["device"] == "cpu"  # ours: where the model runs (--device / -ngl)
    # the KV cache types (ours): the compute dtype unless -ctk / -ctv name one
    assert (ours["cache_type_k"], ours["cache_type_v"]) == ("f32", "f32")
    typed = info.props_json(tiny_model, facts, ServerConfig(cache_type_k="q8_0",
                                                            cache_type_v="q4_0"), 4096, 4, {})
    assert (typed["cache_type_k"], typed["cache_type_v"]) == ("q8_0", "q4_0")


def test_props_of_a_recurrent_model_refuse_shifts(tiny_lfm2_path: str) -> None:
    """LFM2's conv state exists only where it was computed: /props says the context shift and
    --cache-reuse asked for are off, and how many layers are recurrent."""
    from radixserve.model.loader import load_model
    m = load_model(tiny_lfm2_path, "f32")
    cfg = ServerConfig(context_shift=True, cache_reuse=256)
    pc = info.props_json(m, info.model_facts(m), cfg, 4096, 4, {})["prompt_cache"]
    assert (pc["context_shift"], pc["cache_reuse"], pc["recurrent_layers"]) == (False, 0, 4)


def test_models_shape(tiny_model: Any) -> None:
    ref = json.loads(reference("v1_models.json"))
    facts = info.model_facts(tiny_model)
    ours = info.models_json(tiny_model, facts, ServerConfig(alias="tiny"), 512, 1795956719)
    assert shape(ours) == shape(ref)
    assert ours["data"][0]["id"] == "tiny" and ours["data"][0]["meta"]["n_ctx"] == 512
    assert ours["data"][0]["meta"]["n_params"] > 0
    assert ours["data"][0]["meta"]["size"] == Path(tiny_model.path).stat().st_size


def test_facts_of_the_default_model() -> None:
    """llama.cpp's figures for SmolLM2-135M Q4_1 (v1_models.json): same count, same ftype."""
    model = load_model("default")
    facts = info.model_facts(model)
    assert facts.n_params == 134515008
    assert facts.ftype == "Q4_1"
