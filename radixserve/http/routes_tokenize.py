"""POST /tokenize, /detokenize, /apply-template and /chat/completions/input_tokens
(llama-server's tokenizer endpoints)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from radixserve.errors import invalid_request
from radixserve.http import openapi
from radixserve.http.errors import read_json
from radixserve.http.parse import ParseContext, chat_tokens, render_chat, tokenize_mixed
from radixserve.http.schemas import ChatRequest, DetokenizeRequest, TokenizeRequest, validate_body
from radixserve.http.state import AppState
from radixserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def piece_json(tok: Tokenizer, tid: int) -> str | list[int]:
    """A token's text, or its raw bytes when they are not valid UTF-8 on their own."""
    raw = tok.token_to_piece(tid)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _check_ids(tokens: list[int], tok: Tokenizer, field: str) -> None:
    bad = next((t for t in tokens if not 0 <= t < tok.n_vocab), None)
    if bad is not None:
        raise invalid_request(f"Field '{field}': invalid token id {bad} (n_vocab {tok.n_vocab})")


def tokenize(body: Any, tok: Tokenizer) -> dict[str, Any]:
    """`{content, add_special=false, parse_special=true, with_pieces=false}` -> `{tokens}`;
    with pieces each token is `{id, piece}`. No `content` gives no tokens (llama-server)."""
    req = validate_body(TokenizeRequest, body)
    if req.content is None:
        return {"tokens": []}
    parse_special = True if req.parse_special is None else req.parse_special
    tokens = tokenize_mixed(req.content, tok, bool(req.add_special), parse_special)
    if not req.with_pieces:
        return {"tokens": tokens}
    _check_ids(tokens, tok, "content")
    return {"tokens": [{"id": t, "piece": piece_json(tok, t)} for t in tokens]}


def detokenize(body: Any, tok: Tokenizer) -> dict[str, str]:
    """`{tokens}` -> `{content}` (special tokens rendered as their text)."""
    req = validate_body(DetokenizeRequest, body)
    tokens = req.tokens or []
    _check_ids(tokens, tok, "tokens")
    return {"content": tok.decode(tokens)}


def chat_input_tokens(body: Any, ctx: ParseContext) -> dict[str, Any]:
    """A chat request's prompt tokens, counted as the completion would tokenize them, without
    running it (llama-server's post_chat_completions_tok: no context-size check; its answer
    names the object as its /v1/responses/input_tokens does)."""
    n = len(chat_tokens(validate_body(ChatRequest, body), ctx)[1])
    return {"input_tokens": n, "object": "response.input_tokens"}


def add_routes(r: APIRouter, state: AppState) -> None:
    @r.post("/tokenize", openapi_extra=openapi.TOKENIZE)
    async def tokenize_route(request: Request) -> Response:
        body = await read_json(request)
        return JSONResponse(await run_in_threadpool(tokenize, body, state.model.tokenizer))

    @r.post("/detokenize", openapi_extra=openapi.DETOKENIZE)
    async def detokenize_route(request: Request) -> Response:
        body = await read_json(request)
        return JSONResponse(await run_in_threadpool(detokenize, body, state.model.tokenizer))

    @r.post("/apply-template", openapi_extra=openapi.APPLY_TEMPLATE)
    async def apply_template(request: Request) -> Response:
        req = validate_body(ChatRequest, await read_json(request))
        m = state.model
        prompt = await run_in_threadpool(render_chat, req, m.chat_template, m.tokenizer,
                                         state.parse_ctx)
        return JSONResponse({"prompt": prompt})

    @r.post("/chat/completions/input_tokens", openapi_extra=openapi.CHAT)
    @r.post("/v1/chat/completions/input_tokens", openapi_extra=openapi.CHAT)
    async def chat_input_tokens_route(request: Request) -> Response:
        body = await read_json(request)
        return JSONResponse(await run_in_threadpool(chat_input_tokens, body, state.parse_ctx))
